"""Handle passing: hand an arena's memory fds to another process over a Unix socket (SCM_RIGHTS).

A CUDA arena cannot be mapped by path as a shm file can: the owner exports each physical chunk
as a POSIX fd, and the fds travel to the importer as ``SCM_RIGHTS`` ancillary data. This module
is the protocol only -- no gRPC, no CUDA -- so the daemon, the engine-side client and the
data-plane backends all use it, and CPU tests drive it with memfds.

One connection, one exchange::

    importer                                   owner (HandleServer thread)
    ── [u32 n][n bytes JSON request] ───────▶  read (bounded, timed), authorize(request)
                                               export(want_fds) -> (HandleHeader, fds)
    ◀── [u32 n][n bytes JSON header] + fds ──  one sendmsg; the owner closes its copies
    close                                      close

The request is ``{"op": "export" | "ping" | "watch", "session": ..., "token": ...}``: an engine
presents its session id on the daemon, a peer daemon the shared ``peer_token`` (empty when none is
configured; the owner's ``authorize`` decides). ``ping`` answers the header without fds: it is the
liveness probe of a peer (a restarted peer answers with another ``region_id``).

``watch`` answers the header like ``ping`` and then keeps the connection open, idle: no thread
serves it (the server keeps watched sockets in a set, not counted against ``max_clients``). The
watcher learns of the owner's death by EOF/HUP on it (the kernel closes a dead process's fds),
of :meth:`HandleServer.stop` the same way, and of a change of the owner's backing by one byte
the server sends (:meth:`HandleServer.notify`). Whatever arrives, the watcher stops trusting the
watch and asks again (ping, fetch): :meth:`Watch.quiet` is a zero-timeout poll, no round trip.

A refusal is a header ``{"ok": false, "code": <status code>, "message": ..., "metadata": {...}}``:
the status :func:`kvd.errors.to_status` gives the exception (the triple gRPC and the peer socket
carry), which :func:`fetch` raises again through :func:`kvd.errors.from_status`, so an importer
sees the same class, message and extras (shortfall, holders) as over gRPC.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

from kvd import errors as E
from kvd.errors import InternalError, InvalidArgument, KvdError, Unavailable
from kvd.limits import MAX_ID_BYTES, clip, quote, too_long
from kvd.ipc.unix_socket import MAX_PATH, UnixServer, check_path, stirred
from kvd.ipc.unix_socket import recv_exact as _recv_exact

__all__ = [
    "MAX_FDS", "MAX_PATH", "MAX_WATCHES", "HandleHeader", "HandleRequest", "HandleServer", "Handles", "Watch",
    "check_path", "fetch", "ping", "watch",
]

log = logging.getLogger("kvd.ipc.fdpass")

#: The kernel's limit of fds in one SCM_RIGHTS message (SCM_MAX_FD).
MAX_FDS = 253
#: A request larger than this is refused unread: a real one is well under 1 KiB.
MAX_REQUEST = 4096
#: A reply header larger than this is refused by the importer (253 sizes fit in ~4 KiB).
MAX_REPLY = 1 << 16
#: Open watches one server keeps; more are refused (Unavailable): a watcher holds one per peer.
MAX_WATCHES = 1024
#: The retry hint of a busy refusal: its slots free as soon as the exchanges in flight reply.
BUSY_RETRY_S = 0.05
_LEN = struct.Struct(">I")
_OPS = ("export", "ping", "watch")


@dataclass(frozen=True, slots=True)
class HandleRequest:
    """What an importer asks for, and with which credential."""

    op: str  # "export" (header + fds), "ping" (header only: liveness) or "watch" (header, then the connection stays open)
    session: str = ""  # an engine's session id on the owner's daemon
    token: str = ""  # a peer daemon's peer_token ("" when none is configured)


@dataclass(frozen=True, slots=True)
class HandleHeader:
    """What comes with the fds: how to map them, and which arena they belong to."""

    region_id: str  # the arena's stable name; a restarted owner has another one
    boot_id: str  # the owner pool's boot id
    backed: int  # bytes the importer may touch: map with nbytes=backed, never more
    sizes: tuple[int, ...]  # bytes of each chunk, in address order, one per fd (empty for ping)
    generation: int  # changes whenever the owner's chunks may have changed: re-import then
    device: int = -1  # the owner's CUDA device index in its own process (-1: not a GPU arena)
    gpu_uuid: str = ""  # that device's UUID ("" when unknown): importers pick their device by it

    def to_json(self) -> dict:
        d = asdict(self)
        d["sizes"] = list(self.sizes)
        return d

    @classmethod
    def from_json(cls, d: dict) -> HandleHeader:
        try:
            h = cls(
                region_id=str(d["region_id"]), boot_id=str(d["boot_id"]), backed=int(d["backed"]),
                sizes=tuple(int(s) for s in d["sizes"]), generation=int(d["generation"]),
                device=int(d.get("device", -1)), gpu_uuid=str(d.get("gpu_uuid", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise Unavailable(f"handle server sent a malformed header ({type(exc).__name__}: {exc})") from exc
        if h.backed < 0 or any(s <= 0 for s in h.sizes) or (h.sizes and sum(h.sizes) < h.backed):
            raise Unavailable(f"handle server sent an inconsistent header: backed={h.backed:,d}, chunk sizes {list(h.sizes)}")
        return h


class Handles(NamedTuple):
    """A received export: the header and the fds, which now belong to the caller (close them
    once mapped)."""

    header: HandleHeader
    fds: list[int]


#: ``export(want_fds) -> (header, fds)``. Called per request; the fds are new and are closed by
#: the server after sending. Raise a KvdError to refuse (it reaches the importer by name).
Exporter = Callable[[bool], "tuple[HandleHeader, list[int]]"]
#: ``authorize(request)`` raises a KvdError (PermissionDenied, NotFound, ...) to refuse.
Authorizer = Callable[[HandleRequest], None]


def _frame(obj: dict) -> bytes:
    """One message on the wire: a big-endian length, then that many bytes of JSON."""
    body = json.dumps(obj).encode()
    return _LEN.pack(len(body)) + body


class HandleServer(UnixServer):
    """A thread that answers handle requests on an ``AF_UNIX`` stream socket at ``path``.

    Each connection is served in its own short-lived thread (at most ``max_clients`` at once;
    more are refused with Unavailable) under a ``timeout`` for the whole exchange, so a slow or
    silent client cannot hold the others up. A client that sends garbage gets an InvalidArgument
    header; one that disconnects mid-request is dropped; neither stops the server.

    :meth:`start` binds (replacing a stale socket file left by a dead owner, refusing a live
    one); :meth:`stop` closes the socket, waits for the threads and unlinks the path."""

    def __init__(
        self,
        path: str,
        export: Exporter,
        *,
        authorize: Authorizer | None = None,
        timeout: float = 2.0,
        max_clients: int = 8,
        group: bool = False,
    ) -> None:
        super().__init__(path, "handle_socket", "handles", group=group)
        if timeout <= 0 or max_clients <= 0:
            raise InvalidArgument(f"handle server: timeout ({timeout}) and max_clients ({max_clients}) must be positive")
        self.timeout = timeout
        self._export = export
        self._authorize = authorize
        self._slots = threading.BoundedSemaphore(max_clients)
        self._workers: set[threading.Thread] = set()
        self._watched: set[socket.socket] = set()  # open watches: no thread, no slot (see the module docstring)
        self._lock = threading.Lock()
        # held by notify() and by a watch's header + joining the set (never inside self._lock)
        self._notify_lock = threading.Lock()
        #: exchanges answered with a header (``served``: ok; ``refused``: an error header) and
        #: connections dropped without an answer (client gone or too slow).
        self.served = self.refused = self.dropped = 0

    # -- serving -----------------------------------------------------------------------------

    def _end(self) -> None:
        """Wait for exchanges in flight (each bounded by ``timeout``); close every watch."""
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.join(self.timeout + 1.0)
        with self._lock:
            watched, self._watched = list(self._watched), set()
        for c in watched:
            c.close()  # every watcher sees EOF: this server no longer vouches for its arena

    def _tick(self) -> None:
        self._reap_watches()

    def _accepted(self, conn: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            self._answer_error(conn, Unavailable(f"handle server {self.path} is busy; retry", retry_after_s=BUSY_RETRY_S), busy=True)
            conn.close()
            return
        t = threading.Thread(target=self._serve_one, args=(conn,), name="kvd-handles-conn", daemon=True)
        with self._lock:
            self._workers.add(t)
        try:
            t.start()
        except RuntimeError as exc:  # "can't start new thread": the process's thread or memory limit
            with self._lock:
                self._workers.discard(t)
            self._slots.release()
            log.error("handle server %s: could not start a thread for a new connection: %s", self.path, exc)
            self._answer_error(conn, Unavailable(
                f"handle server {self.path} could not start a thread for this connection ({exc}): the daemon is at its "
                "thread or memory limit (a container's pids limit?); ask again, or raise the limit", retry_after_s=BUSY_RETRY_S), busy=True)
            conn.close()

    @property
    def watching(self) -> int:
        """Watches open now."""
        with self._lock:
            return len(self._watched)

    def notify(self) -> None:
        """Tell every watcher that the arena's backing changed (one byte each): a watcher that
        sees it asks again before trusting its mapping. Call after ``generation`` changed."""
        with self._notify_lock:
            with self._lock:
                watched = list(self._watched)
            for c in watched:
                try:
                    c.send(b"!", socket.MSG_DONTWAIT)
                except OSError:
                    self._unwatch(c)  # gone, or a full buffer: closing says the same (EOF)

    def _unwatch(self, c: socket.socket) -> None:
        with self._lock:
            self._watched.discard(c)
        c.close()

    def _reap_watches(self) -> None:
        """Close watches whose watcher hung up (or sent anything: a watcher never does)."""
        with self._lock:
            if not self._watched:
                return
            watched = list(self._watched)
        by_fd = {c.fileno(): c for c in watched if c.fileno() >= 0}
        for fd in stirred(list(by_fd)):
            self._unwatch(by_fd[fd])

    def _keep_watch(self, conn: socket.socket) -> bool:
        """Move an answered watch into the set; False (refused, the caller closes) when stopping."""
        with self._lock:
            if self._stop.is_set():
                return False
            self._watched.add(conn)
            return True

    def _serve_one(self, conn: socket.socket) -> None:
        kept = False
        try:
            conn.settimeout(self.timeout)
            try:
                req = self._read_request(conn)
                if self._authorize is not None:
                    self._authorize(req)
                header, fds = self._export(req.op == "export")
            except KvdError as exc:  # first: DeadlineExceeded is an OSError too
                self._answer_error(conn, exc)
                return
            except OSError as exc:  # gone or too slow (ConnectionError, TimeoutError)
                with self._lock:
                    self.dropped += 1
                log.info("handle server: dropped a client: %s", exc)
                return
            except Exception as exc:
                log.exception("handle server: export failed")
                self._answer_error(conn, InternalError(f"handle export failed (a bug in kvd): {type(exc).__name__}: {exc}"))
                return
            try:
                if req.op == "export" and len(fds) != len(header.sizes):
                    raise InternalError(f"handle export produced {len(fds)} fds for {len(header.sizes)} chunks (a bug in kvd)")
                if req.op == "watch" and self.watching >= MAX_WATCHES:
                    raise Unavailable(f"handle server {self.path} keeps {MAX_WATCHES} watches already; ping instead")
                if req.op == "watch":
                    # The header and the watch joining the set are one step for notify(): a
                    # watcher that has its header is told of every change after it (a change
                    # before it is in the header, read again here). Sent first and joined after,
                    # a notify in between missed a watcher that was already trusting its mapping.
                    with self._notify_lock:
                        header, _ = self._export(False)
                        self._send(conn, {"ok": True, **header.to_json()}, [])
                        conn.settimeout(None)
                        kept = self._keep_watch(conn)
                else:
                    self._send(conn, {"ok": True, **header.to_json()}, fds)
                with self._lock:
                    self.served += 1
            except KvdError as exc:
                self._answer_error(conn, exc)
            except OSError as exc:
                with self._lock:
                    self.dropped += 1
                log.info("handle server: client left before the reply: %s", exc)
            finally:
                for fd in fds:
                    os.close(fd)  # the importer has its own copies now (or never will)
        finally:
            if not kept:
                conn.close()  # a kept watch is the server's to close (stop(), or its watcher hung up)
            self._slots.release()
            with self._lock:
                self._workers.discard(threading.current_thread())

    def _read_request(self, conn: socket.socket) -> HandleRequest:
        (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        if n > MAX_REQUEST:
            raise InvalidArgument(f"handle request of {n:,d} bytes exceeds the {MAX_REQUEST:,d}-byte limit")
        raw = _recv_exact(conn, n)
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: "[[[[..."
            raise InvalidArgument(f"handle request is not JSON: {clip(str(exc), 200)}") from exc
        if not isinstance(d, dict):
            raise InvalidArgument("handle request must be a JSON object with op, session and token")
        op, session, token = d.get("op"), d.get("session", ""), d.get("token", "")
        if op not in _OPS:
            shown = quote(op) if isinstance(op, str) else f"of type {type(op).__name__}"
            raise InvalidArgument(f"handle request op {shown} is unknown; use one of {list(_OPS)}")
        if not isinstance(session, str) or not isinstance(token, str):
            raise InvalidArgument("handle request session and token must be strings")
        if n := too_long(session, MAX_ID_BYTES):
            raise InvalidArgument(f"handle request session is {n:,d} bytes, over the limit of {MAX_ID_BYTES}: send the id OpenSession returned")
        return HandleRequest(op, session, token)

    @staticmethod
    def _send(conn: socket.socket, header: dict, fds: list[int]) -> None:
        msg = _frame(header)
        # The fds ride on the first byte of the message; the rest goes out as ordinary data.
        sent = socket.send_fds(conn, [msg], fds) if fds else conn.send(msg)
        if sent < len(msg):
            conn.sendall(msg[sent:])

    def _answer_error(self, conn: socket.socket, exc: KvdError, *, busy: bool = False) -> None:
        with self._lock:
            self.refused += 1
        code, message, metadata = E.to_status(exc)
        try:
            conn.settimeout(self.timeout)
            self._send(conn, {"ok": False, "code": code, "message": message, "metadata": dict(metadata), "busy": busy}, [])
        except OSError:
            pass  # the client is gone; nothing else to do


# ---- the importer's side -----------------------------------------------------------------------


def _refusal(path: str, d: dict) -> KvdError:
    """The exception a refusal header stands for (:func:`kvd.errors.from_status`)."""
    code, message, metadata = d.get("code"), d.get("message"), d.get("metadata", {})
    if not (isinstance(code, int) and isinstance(message, str) and isinstance(metadata, dict)):
        return Unavailable(f"handle server at {path} sent a malformed refusal: {json.dumps(d)[:200]}")
    return E.from_status(code, message, {str(k): str(v) for k, v in metadata.items()})


class _Busy(Unavailable):
    """Every worker slot of the server was taken when we connected: worth another try."""


def _request(path: str, req: HandleRequest, timeout: float, keep: list[socket.socket] | None = None) -> Handles:
    """One exchange, tried again while the server answers "busy" (its slots free up as soon as
    the exchanges in flight have replied: a burst of clients must not fail for that), until
    ``timeout``; then the last "busy" is raised as Unavailable."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            return _exchange(path, req, max(deadline - time.monotonic(), 0.001), keep)
        except _Busy as exc:
            if time.monotonic() + pause >= deadline:  # the daemon is up: say when to try again
                raise Unavailable(str(exc), retry_after_s=exc.retry_after_s or BUSY_RETRY_S) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _exchange(path: str, req: HandleRequest, timeout: float, keep: list[socket.socket] | None = None) -> Handles:
    """One exchange; with ``keep`` (a watch), the open socket is appended to it instead of closed."""
    check_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    fds: list[int] = []
    kept = False
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise Unavailable(f"no handle server at {path} ({exc.strerror}): the daemon is not running or has restarted") from exc
        msg = _frame(asdict(req))
        try:
            s.sendall(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a busy server answers without reading the request: its reply says why
        buf = bytearray()
        need = _LEN.size
        while len(buf) < need:
            data, got, flags, _ = socket.recv_fds(s, max(need - len(buf), 4096), MAX_FDS)
            fds += got
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                raise Unavailable(f"handle server at {path} sent more fds than fit in one message ({MAX_FDS})")
            if not data:
                raise Unavailable(f"handle server at {path} closed the connection before its reply was complete")
            buf += data
            if need == _LEN.size and len(buf) >= _LEN.size:
                (n,) = _LEN.unpack(buf[: _LEN.size])
                if n > MAX_REPLY:
                    raise Unavailable(f"handle server at {path} announced a {n:,d}-byte header; the limit is {MAX_REPLY:,d}")
                need = _LEN.size + n
        try:
            d = json.loads(bytes(buf[_LEN.size : need]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Unavailable(f"handle server at {path} sent a reply that is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise Unavailable(f"handle server at {path} sent a reply that is not a JSON object")
        if not d.get("ok"):
            if d.get("busy"):
                raise _Busy(str(d.get("message", "busy")), getattr(_refusal(path, d), "retry_after_s", None))
            raise _refusal(path, d)
        header = HandleHeader.from_json(d)
        if req.op == "export" and len(fds) != len(header.sizes):
            raise Unavailable(f"handle server at {path} sent {len(fds)} fds for {len(header.sizes)} chunks")
        if fds and req.op != "export":
            raise Unavailable(f"handle server at {path} sent {len(fds)} fds with a {req.op} reply")
        if keep is not None:
            if len(buf) != need:
                raise Unavailable(f"handle server at {path} sent {len(buf) - need} bytes past its watch reply")
            keep.append(s)
            kept = True
        return Handles(header, fds)
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, TimeoutError) and not isinstance(exc, KvdError):
            raise Unavailable(f"handle server at {path} did not answer within {timeout:g}s") from exc
        if isinstance(exc, OSError) and not isinstance(exc, KvdError):
            raise Unavailable(f"handle server at {path} failed: {exc}") from exc
        raise
    finally:
        if not kept:
            s.close()


def fetch(path: str, *, session: str = "", token: str | None = None, timeout: float = 5.0) -> Handles:
    """Ask the handle server at ``path`` for its arena's chunk fds.

    Credentials: an engine passes its ``session`` id on that daemon; a peer daemon passes the
    shared ``token`` (None or "" when none is configured). Returns the header and the fds, which
    belong to the caller (close them after mapping). Raises the server's refusal as its kvd
    class (NotFound for an unknown session, PermissionDenied for a wrong token, ...), and
    Unavailable when nobody serves ``path`` or the reply is malformed or late."""
    return _request(path, HandleRequest("export", session, token or ""), timeout)


def ping(path: str, *, session: str = "", token: str | None = None, timeout: float = 5.0) -> HandleHeader:
    """The header of the arena served at ``path``, without fds: a liveness probe (Unavailable
    when nobody serves it; a new ``region_id`` when its owner restarted)."""
    return _request(path, HandleRequest("ping", session, token or ""), timeout).header


class Watch:
    """An open watch of the handle server at ``path`` (see the module docstring).

    ``header`` is what the server answered when the watch opened; :meth:`quiet` is True while
    nothing happened on the connection since (no EOF, no hang-up, no byte). Once not quiet, it
    stays not quiet: open a new watch. Thread-safe (each check polls with its own poll object);
    closing it while another thread checks makes that check report not quiet."""

    __slots__ = ("path", "header", "_sock", "_fd", "_fired")

    def __init__(self, path: str, header: HandleHeader, sock: socket.socket) -> None:
        self.path = path
        self.header = header
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._fired = False

    def quiet(self) -> bool:
        """Zero-timeout poll: True while the owner is alive and nothing changed (no round trip)."""
        if self._fired or self._sock is None:
            return False
        # The owner is gone, stopped, changed its backing, or misbehaves.
        if stirred([self._fd]):
            self._fired = True
            return False
        return True

    def close(self) -> None:
        self._fired = True
        s, self._sock = self._sock, None
        if s is not None:
            s.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def watch(path: str, *, session: str = "", token: str | None = None, timeout: float = 5.0) -> Watch:
    """Open a watch of the handle server at ``path``: its header now, and a :class:`Watch` whose
    :meth:`~Watch.quiet` says, without a round trip, whether the owner is still there unchanged.
    Raises as :func:`ping` does (a server without the ``watch`` op refuses with InvalidArgument)."""
    keep: list[socket.socket] = []
    header = _request(path, HandleRequest("watch", session, token or ""), timeout, keep).header
    return Watch(path, header, keep[0])
