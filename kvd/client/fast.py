"""The client's side of the engine socket (:mod:`kvd.server.engine_socket`): Kvd calls framed on
held Unix-socket connections, for :class:`kvd.client.Client` and :class:`kvd.client.AsyncClient`.

Same messages as gRPC, same errors: a refusal comes back as the kvd exception
:func:`kvd.errors.from_status` makes of its status, raised from a :class:`FastRpcError` (a
``grpc.RpcError`` with ``code()``, ``details()`` and ``trailing_metadata()``), so code that
looks at the cause of a kvd error sees the same thing over either transport. A connection that
breaks mid-call is UNAVAILABLE, as a gRPC call to a stopped daemon is.

A blocking call looks for its reply for up to :data:`SPIN_US` before it sleeps (a wait at once);
the asyncio channel never spins (it would hold the event loop).

A call blocks its connection until the reply (WaitReady until the transfer is ready), so each
client keeps a small pool: a call takes a free connection or opens one (its hello names the
client's session) and puts it back after the reply. A full daemon may evict an idle connection
(:class:`kvd.server.framed.FramedServer`); a call that meets one -- a write refused, the EVICTED
answer -- sends its request again on another connection (the daemon never read it, or cut short
a WaitReady, which only reads: sent with what is left of its timeout), up to :data:`RESENDS` times.

Where the socket is. A client of ``unix:/p`` looks for ``/p.fast`` first (:func:`pick`: a stat, no
round trip). Where there is none it opens its session over gRPC, and the reply's
``Session.engine_socket`` says where the daemon serves its engine socket, if it does; the client
then moves the session there (:func:`advertised`, then ``adopt``): the hello names the session,
so only the daemon that opened it answers (another daemon's socket at that path refuses it and
the client stays on gRPC).
"""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from kvd import errors as E
from kvd.ipc.frames import EVICTED, HEAD, HELLO, MAX_FRAME, OK, REFUSED, frame, read_frame
from kvd.ipc.unix_socket import recv_exact
from kvd.memory.doorbells import DoorbellView
from kvd.rpc.engine_wire import DOORBELLS, METHOD_IDS, METHODS, WAITS, fast_path
from kvd.rpc.status import code_from_int
from kvd.v1 import kvd_pb2 as pb

__all__ = [
    "FastRpcError", "FastChannel", "AsyncFastChannel", "fast_socket_of", "pick", "advertised", "bounded", "fetch_doorbells",
]

_RESPONSES: dict[str, type[Message]] = {m.name: m.response for m in METHODS.values()}
#: Idle connections a client keeps (more are closed after their call).
KEEP = 8
#: Times a call is sent again after its connection was evicted unread (then its Unavailable is raised).
RESENDS = 3
#: Microseconds a blocking call looks for its reply before it sleeps, by default (``Client.connect(spin_us=)``):
#: most engine calls are answered within it, and a thread asleep in recv is woken across virtual
#: CPUs, which on the VMs measured cost 30-50 us a call (docs/benchmarks.md, the twenty-fifth round).
SPIN_US = 200.0
# What a call whose write the daemon refused (EPIPE: it closed the connection, idle in the pool,
# before the request went out) gets in place of a reply: sent again, as after EVICTED.
_UNSENT = pb.PeerStatus(code=grpc.StatusCode.UNAVAILABLE.value[0], message=(
    "the daemon closed the connection before the request was written (an idle connection evicted, or the daemon "
    "stopped)")).SerializeToString()


class FastRpcError(grpc.RpcError):
    """A refusal (or a broken connection) on the engine socket, shaped as a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: Mapping[str, str]) -> None:
        super().__init__(details)
        self._code, self._details, self._md = code, details, tuple(metadata.items())

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    # grpc-stubs types this as a tuple of _Metadatum objects; grpc's own errors (and the callers,
    # kvd.rpc.status) hold (key, value) pairs, as this one does.
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
        return self._md


def _raise(code: int, message: str, md: Mapping[str, str]) -> NoReturn:
    """Raise the kvd exception of a status, from a FastRpcError carrying it."""
    raise E.from_status(code, message, md) from FastRpcError(code_from_int(code), message, md)


def _broken(path: str, method: str, exc: BaseException, timeout: float | None) -> NoReturn:
    """A call whose connection broke or timed out: DEADLINE_EXCEEDED or UNAVAILABLE, as over gRPC."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        _raise(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], f"{method}: no reply on engine socket {path} within {timeout}s", {})
    _raise(grpc.StatusCode.UNAVAILABLE.value[0], f"{method}: engine socket {path}: {exc or type(exc).__name__}; is the daemon running?", {})


def fast_socket_of(address: str) -> str | None:
    """The engine socket of a daemon address (``unix:/p`` or ``/p``: ``/p.fast``), when a socket
    file is there; None otherwise (TCP, or a daemon that serves none)."""
    path = address.removeprefix("unix:") if address.startswith(("unix:", "/")) else None
    if not path or path.startswith("//"):
        return None
    p = fast_path(os.path.abspath(path))
    try:
        return p if stat.S_ISSOCK(os.stat(p).st_mode) else None
    except OSError:
        return None


def _again(method: str, request: Message, data: bytes, t0: float) -> bytes:
    """The frame of a call sent again after EVICTED (call begun at ``t0``, monotonic): the same
    bytes, but a wait (WaitReady, WaitEnded) -- which the daemon may have cut short to make room --
    waits only what is left of its timeout."""
    if method not in WAITS:
        return data
    assert isinstance(request, (pb.WaitRequest, pb.WaitEndedRequest))
    again = copy.copy(request)
    again.timeout_seconds = max(0.0, again.timeout_seconds - (time.monotonic() - t0))
    body = again.SerializeToString()
    return HEAD.pack(len(body), METHOD_IDS[method]) + body


def _last_words(s: socket.socket) -> tuple[int, bytes]:
    """The reply kind and body a daemon sent before it closed a connection whose request it did
    not read: a refusal (a request over its max_request_bytes, refused from its head) or
    EVICTED; else nothing of the request was read (:data:`_UNSENT`, sent again as after EVICTED)."""
    try:
        s.settimeout(0.1)  # written before the close, so already here
        kind, body = read_frame(s, MAX_FRAME)
    except (OSError, ConnectionError):
        return EVICTED, _UNSENT
    return (kind, body) if kind in (REFUSED, EVICTED) else (EVICTED, _UNSENT)


def _body(method: str, request: Message) -> bytes:
    """The request serialised; RESOURCE_EXHAUSTED (without kvd's metadata: a transport limit, as a
    gRPC channel refuses it) when it is over what any daemon reads, before anything is sent (the
    daemon refuses one over its own ``max_request_bytes`` the same way, unread)."""
    body = request.SerializeToString()
    if len(body) > MAX_FRAME:
        _raise(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
               f"{method}: a request of {len(body):,d} bytes exceeds the {MAX_FRAME:,d}-byte limit of any daemon; send less per call", {})
    return body


def _decode(method: str, kind: int, body: bytes) -> Any:
    if kind == OK:
        return _RESPONSES[method].FromString(body)
    st = pb.PeerStatus.FromString(body)
    _raise(st.code, st.message, dict(st.metadata))


def _closed_after(kind: int, body: bytes) -> bool:
    """Whether the daemon closes the connection after this reply: a refusal at the transport's
    limit (RESOURCE_EXHAUSTED without kvd's metadata, ``server/framed.py: exhausted``), whose
    request was left unread, so the stream cannot be followed past it. Such a connection is
    closed here, never pooled: the next call on it would meet the close."""
    if kind != REFUSED:
        return False
    st = pb.PeerStatus.FromString(body)
    return st.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and E.ERROR_KEY not in st.metadata


def _between_sessions(method: str) -> NoReturn:
    """A call while the client opens a new session (:meth:`FastChannel.reset` forgot the old
    one): the old session is gone, as the call would have heard from the daemon."""
    _raise(grpc.StatusCode.NOT_FOUND.value[0], f"{method}: this client's session is gone and a new one is being opened; call again",
           {E.ERROR_KEY: E.SessionGone.__name__})


def _hello(s: socket.socket, session_id: str) -> None:
    """Say which session ``s`` acts for; raises the daemon's refusal (as the peer socket's
    hello, ``server/peer_conns.py``)."""
    try:
        s.sendall(frame(HELLO, pb.Session(session_id=session_id)))
    except (BrokenPipeError, ConnectionResetError):
        pass  # a full daemon refuses without reading the hello: its reply says why (and when to retry)
    _decode("OpenSession", *read_frame(s))


class FastChannel:
    """Blocking calls on ``path``, for :class:`kvd.client.Client` (thread-safe).

    A connection acts for the session its hello named (or its OpenSession opened); the pool keeps
    each with that session, and only those of the current one (:attr:`session_id`) are used again:
    a connection of a session the daemon forgot is closed, never pooled (:meth:`reset`)."""

    def __init__(self, path: str, spin_s: float = SPIN_US / 1e6) -> None:
        self.path = path
        self.session_id = ""
        #: How long a call looks for its reply before it sleeps (:func:`kvd.ipc.frames.read_frame`);
        #: a wait (WaitReady, WaitEnded) sleeps at once.
        self.spin_s = spin_s
        self._free: list[tuple[socket.socket, str]] = []  # (idle connection, the session it acts for)
        self._lock = threading.Lock()
        self._closed = False

    def _open(self) -> tuple[socket.socket, str]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sid = self.session_id
        try:
            s.connect(self.path)
            if sid:
                _hello(s, sid)
        except BaseException:
            s.close()
            raise
        return s, sid

    def adopt(self, session_id: str, timeout: float | None) -> None:
        """Act for ``session_id`` (opened over gRPC): open a connection, whose hello the daemon
        answers only for a session of its own, and keep it. Raises the refusal (NotFound for a
        session this daemon does not know) or OSError (nobody serves the path)."""
        self.session_id = session_id
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(self.path)
            _hello(s, session_id)
        except BaseException:
            s.close()
            raise
        with self._lock:
            self._free.append((s, session_id))

    def reset(self) -> None:
        """Forget the session (its daemon no longer knows it): close the idle connections, all of
        which act for it; a connection opened from now on sends no hello, so the next call must be
        OpenSession (which names the new session). Connections in a call are closed after it."""
        with self._lock:
            free, self._free = self._free, []
            self.session_id = ""
        for c, _ in free:
            c.close()

    def call(self, method: str, request: Message, timeout: float | None) -> Any:
        body = _body(method, request)
        data = HEAD.pack(len(body), METHOD_IDS[method]) + body
        t0 = time.monotonic()
        s, sid, kind, reply = self._exchange(method, data, timeout)
        for resend in range(RESENDS + 1):
            if kind != EVICTED:
                break
            s.close()  # evicted (the request unread, or a wait cut short): again on another connection
            if resend == RESENDS:
                _decode(method, kind, reply)  # evicted every time: its Unavailable
            s, sid, kind, reply = self._exchange(method, _again(method, request, data, t0), timeout)
        try:
            got = _decode(method, kind, reply)
        except E.SessionGone:
            s.close()  # it acts for a session its daemon no longer knows
            raise
        except BaseException:
            if _closed_after(kind, reply):
                s.close()
            else:
                self._put(s, sid)
            raise
        if method == "OpenSession":
            with self._lock:
                sid = self.session_id = got.session_id
        self._put(s, sid)
        return got

    def _put(self, s: socket.socket, sid: str) -> None:
        """Back to the pool after its call: only a connection of the current session, up to KEEP."""
        with self._lock:
            if self._closed or len(self._free) >= KEEP or sid != self.session_id or s.fileno() < 0:
                s.close()
            else:
                self._free.append((s, sid))

    def _exchange(self, method: str, data: bytes, timeout: float | None) -> tuple[socket.socket, str, int, bytes]:
        """One request frame out on a free (or new) connection: the connection, the session it
        acts for, and the reply frame's kind and body."""
        with self._lock:
            got = self._free.pop() if self._free else None
        if got is None and not self.session_id and method != "OpenSession":
            _between_sessions(method)
        s = None
        try:
            s, sid = self._open() if got is None else got
            s.settimeout(timeout)
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):  # closed by the daemon before it read this write
                kind, reply = _last_words(s)
                s.close()
                return s, sid, kind, reply
            kind, reply = read_frame(s, MAX_FRAME, 0.0 if method in WAITS else self.spin_s)
        except E.KvdError:
            raise
        except OSError as exc:  # broken, closed or timed out mid-call: this connection is done
            if s is not None:
                s.close()
            _broken(self.path, method, exc, timeout)
        return s, sid, kind, reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for s, _ in free:
            s.close()


class AsyncFastChannel:
    """The same calls for :class:`kvd.client.AsyncClient`, on asyncio streams (the same pool of
    connections by session as :class:`FastChannel`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.session_id = ""
        self._free: list[tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], str]] = []
        self._closed = False

    async def _open(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], str]:
        r, w = await asyncio.open_unix_connection(self.path, limit=MAX_FRAME)
        sid = self.session_id
        if sid:
            w.write(frame(HELLO, pb.Session(session_id=sid)))
            try:
                _decode("OpenSession", *await self._read(r))
            except BaseException:
                w.close()
                raise
        return (r, w), sid

    @staticmethod
    async def _read(r: asyncio.StreamReader) -> tuple[int, bytes]:
        n, kind = HEAD.unpack(await r.readexactly(HEAD.size))
        if n > MAX_FRAME:
            raise ConnectionError(f"a frame of {n:,d} bytes exceeds the {MAX_FRAME:,d}-byte limit")
        return kind, await r.readexactly(n)

    async def adopt(self, session_id: str, timeout: float | None) -> None:
        """As :meth:`FastChannel.adopt`."""
        self.session_id = session_id
        conn, _ = await asyncio.wait_for(self._open(), timeout)
        self._free.append((conn, session_id))

    def reset(self) -> None:
        """As :meth:`FastChannel.reset`."""
        free, self._free = self._free, []
        self.session_id = ""
        for (_, w), _ in free:
            w.close()

    async def call(self, method: str, request: Message, timeout: float | None) -> Any:
        body = _body(method, request)
        data = HEAD.pack(len(body), METHOD_IDS[method]) + body
        t0 = time.monotonic()
        conn, sid, kind, reply = await self._exchange(method, data, timeout)
        for resend in range(RESENDS + 1):
            if kind != EVICTED:
                break
            conn[1].close()  # evicted (the request unread, or a wait cut short): again on another connection
            if resend == RESENDS:
                _decode(method, kind, reply)  # evicted every time: its Unavailable
            conn, sid, kind, reply = await self._exchange(method, _again(method, request, data, t0), timeout)
        try:
            got = _decode(method, kind, reply)
        except E.SessionGone:
            conn[1].close()  # it acts for a session its daemon no longer knows
            raise
        except BaseException:
            if _closed_after(kind, reply):
                conn[1].close()
            else:
                self._put(conn, sid)
            raise
        if method == "OpenSession":
            sid = self.session_id = got.session_id
        self._put(conn, sid)
        return got

    def _put(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], sid: str) -> None:
        if self._closed or len(self._free) >= KEEP or sid != self.session_id:
            conn[1].close()
        else:
            self._free.append((conn, sid))

    async def _exchange(
        self, method: str, data: bytes, timeout: float | None,
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], str, int, bytes]:
        """As :meth:`FastChannel._exchange`."""
        got = self._free.pop() if self._free else None
        if got is None and not self.session_id and method != "OpenSession":
            _between_sessions(method)
        conn = None
        try:
            conn, sid = await self._open() if got is None else got
            conn[1].write(data)  # a refused write fails the read that follows (BrokenPipeError)
            kind, reply = await asyncio.wait_for(self._read(conn[0]), timeout)
        except E.KvdError:
            raise
        except BrokenPipeError as exc:  # closed by the daemon before this write: nothing of it was read
            if conn is None:  # a new connection's hello: broken as any other
                _broken(self.path, method, exc, timeout)
            conn[1].close()
            return conn, sid, EVICTED, _UNSENT
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            if conn is not None:
                conn[1].close()
            _broken(self.path, method, exc, timeout)
        except BaseException:  # cancelled mid-call: the reply would arrive on a reused connection
            if conn is not None:
                conn[1].close()
            raise
        return conn, sid, kind, reply

    async def close(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for (_, w), _ in free:
            w.close()


def fetch_doorbells(path: str, session_id: str, timeout: float | None) -> tuple[DoorbellView, str]:
    """Map the doorbell board of the daemon serving engine socket ``path``, as session
    ``session_id``: the view and the daemon's boot id. On a connection of its own (it carries a
    descriptor, SCM_RIGHTS), closed after. Raises the daemon's refusal (FailedPrecondition: it
    keeps no board; InvalidArgument: a daemon that predates doorbells) or OSError."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(frame(HELLO, pb.Session(session_id=session_id)))
        _decode("OpenSession", *read_frame(s))
        s.sendall(HEAD.pack(0, DOORBELLS))  # after the hello's reply: a plain read must not take the descriptor
        data, fds, _, _ = socket.recv_fds(s, 4096, 1)
        if len(data) < HEAD.size:
            data += recv_exact(s, HEAD.size - len(data))
        n, kind = HEAD.unpack_from(data)
        if n > MAX_FRAME:
            raise ConnectionError(f"a frame of {n:,d} bytes exceeds the {MAX_FRAME:,d}-byte limit")
        body = data[HEAD.size:] + recv_exact(s, n - (len(data) - HEAD.size))
        if kind != OK:
            _decode("Doorbells", kind, body)  # raises the refusal
        board = pb.Doorbells.FromString(body)
        if len(fds) != 1:
            raise ConnectionError(f"the doorbells reply carried {len(fds)} descriptors, not 1")
        view = DoorbellView(fds.pop(), board.slots, board.slot_bytes)
        return view, board.boot_id
    finally:
        for fd in fds:
            os.close(fd)
        s.close()


TRANSPORTS = ("auto", "grpc", "fast")


def pick(address: str, transport: str) -> str | None:
    """The engine socket a client of ``address`` uses, or None for gRPC. ``transport``: "auto"
    (the engine socket when the daemon serves one beside its ``unix:`` listener, else gRPC),
    "grpc", or "fast" (InvalidArgument when there is none)."""
    if transport not in TRANSPORTS:
        raise E.InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "grpc":
        return None
    path = fast_socket_of(address)
    if path is None and transport == "fast":
        raise E.InvalidArgument(
            f"transport='fast': {address!r} has no engine socket beside it (a unix: address whose daemon runs "
            "with fast_socket on serves one at <path>.fast); use transport='auto' or 'grpc'"
        )
    return path


def advertised(address: str, transport: str, engine_socket: str) -> str | None:
    """The engine socket a session opened over gRPC at ``address`` moves to: ``engine_socket``, as
    the daemon's OpenSession reply advertised it, for a ``unix:`` address under ``transport``
    "auto" when a socket file is there; None otherwise (TCP stays on gRPC: the path is the
    daemon host's; an old daemon advertises none)."""
    if transport != "auto" or not engine_socket or not address.startswith(("unix:", "/")):
        return None
    try:
        return engine_socket if stat.S_ISSOCK(os.stat(engine_socket).st_mode) else None
    except OSError:
        return None


def bounded(method: str, request: Message, timeout: float | None) -> Message:
    """The request as the engine socket sends it: a wait (WaitReady, WaitEnded) waits no longer than
    the call's own ``timeout`` (as gRPC's deadline bounds it on the daemon's side)."""
    if method in WAITS and timeout is not None:
        assert isinstance(request, (pb.WaitRequest, pb.WaitEndedRequest))
        request.timeout_seconds = min(request.timeout_seconds, max(0.0, timeout - 0.05))
    return request
