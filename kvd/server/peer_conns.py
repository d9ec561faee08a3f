"""The caller's side of the peer socket (:mod:`kvd.server.peer_socket`): this daemon's
connections to other daemons' peer sockets, a few held per daemon.

:meth:`PeerConnections.checkout` hands out a connection to the daemon a
:class:`~kvd.records.SocketRoute` names -- one that answered the hello as the route's boot --
or None when the route cannot be used now: nothing listens on the path, the daemon there is
another one (another host's ticket, another container, this daemon itself), or it is full. The
caller then uses gRPC. A route that failed is not tried again for ``retry_s``, so a Send to a
daemon on another host does not pay a connect attempt each time -- except one whose hello timed
out (the daemon there busy, or hung): hellos sent from a thread of its own, one at a time, bring
it back as soon as one is answered, and no call waits for them. A refused token is raised
(PermissionDenied): that daemon refuses it over gRPC too.

:meth:`PeerConnections.call` sends one request and reads its reply, within ``timeout``. The
daemon's refusal is raised as the kvd class gRPC would raise, with the same message. A connection
that breaks or goes silent during a call is closed and the call raises Unavailable or
DeadlineExceeded: it is never tried again, on this connection or another (a Commit must not be
sent twice). Several threads call at once, each on its own connection; at most ``keep`` idle
ones are kept per route.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError, Message

from kvd.errors import DeadlineExceeded, KvdError, PermissionDenied, Unavailable
from kvd.records import SocketRoute
from kvd.server.peer_socket import HELLO, MAX_FRAME, METHOD_IDS, METHODS, OK, REFUSED, frame, read_head
from kvd.ipc.unix_socket import recv_exact, stirred
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import status_from_pb

__all__ = ["PeerConnections", "KEEP", "RETRY_S"]

log = logging.getLogger("kvd.peer_socket")

#: Idle connections kept per route (about the Sends this daemon runs at once to one daemon).
KEEP = 8
#: Seconds a route that could not be used is left alone before it is tried again.
RETRY_S = 10.0


class _Unusable(Exception):
    """This route cannot be used now: the caller uses gRPC, for ``retry_after_s`` when its daemon
    was full and said so (every call would otherwise pay a refused connect + hello before going
    over gRPC anyway), else for RETRY_S. ``slow``: no answer within the timeout (a daemon that is
    there, busy or hung): probed meanwhile (:meth:`PeerConnections._probe`)."""

    def __init__(self, why: str, *, retry_after_s: float | None = None, slow: bool = False) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s
        self.slow = slow


class _Conn:
    """One held connection, answered by ``route.boot_id``."""

    __slots__ = ("sock", "route")

    def __init__(self, sock: socket.socket, route: SocketRoute) -> None:
        self.sock = sock
        self.route = route

    def quiet(self) -> bool:
        """Zero-timeout poll: False once the daemon closed its end (stopped, died)."""
        return not stirred([self.sock.fileno()])  # the daemon never writes unasked: any event is an EOF

    def reply(self, deadline: float) -> tuple[int, bytes]:
        """Read one reply frame by ``deadline`` (monotonic): ``(status, body)``."""
        s = self.sock
        s.settimeout(max(deadline - time.monotonic(), 1e-4))
        head = read_head(s)
        if head is None:
            raise ConnectionError("the daemon closed the connection before replying")
        n, status = head
        if n > MAX_FRAME or status not in (OK, REFUSED):
            raise ConnectionError(f"the daemon sent a malformed reply (kind {status}, {n:,d} bytes)")
        s.settimeout(max(deadline - time.monotonic(), 1e-4))
        return status, recv_exact(s, n)

    def close(self) -> None:
        self.sock.close()


def _refusal(body: bytes) -> KvdError:
    return status_from_pb(pb.PeerStatus.FromString(body))


class PeerConnections:
    """Pooled peer-socket connections of one daemon. ``token``: this daemon's ``peer_token``;
    ``timeout``: the bound of a connect + hello and of each call (the peer link's timeout)."""

    def __init__(self, *, token: str | None, timeout: float, keep: int = KEEP, retry_s: float = RETRY_S) -> None:
        self.token = token or ""
        self.timeout = timeout
        self.keep = keep
        self.retry_s = retry_s
        self._idle: dict[SocketRoute, list[_Conn]] = {}
        self._failed: dict[SocketRoute, float] = {}  # route -> monotonic time it may be tried again
        self._probing: set[SocketRoute] = set()  # failed routes whose daemon a thread is saying hello to
        self._lock = threading.Lock()
        self._closed = False

    def checkout(self, via: SocketRoute) -> _Conn | None:
        """A connection to ``via``'s daemon for one call, or None: use gRPC (see the module doc).
        Raises PermissionDenied when that daemon refuses this daemon's token."""
        with self._lock:
            if self._closed or self._failed.get(via, 0.0) > time.monotonic():
                return None
            idle = self._idle.get(via, [])
            while idle:
                c = idle.pop()
                if c.quiet():
                    return c
                c.close()  # its daemon closed it meanwhile; a new hello says whether it is still there
            # Opening is rare (a new daemon, a failed route, more Sends at once): tidy up then, not
            # on every call (it polls every idle connection: a syscall each, on a Send's path).
            self._prune()
        try:
            return self._open(via)
        except _Unusable as exc:
            log.info("peer socket %s (boot %s) not used, calling over gRPC: %s", via.path, via.boot_id, exc)
            self._fail(via, exc)
            return None

    def _fail(self, via: SocketRoute, exc: _Unusable) -> None:
        """``via`` could not be used: a full server is tried again soon; a wrong daemon or
        nothing listening after ``retry_s``; a daemon that did not answer in time is probed
        until it does (a busy host's one slow hello must not send every call over gRPC, ~4x
        slower, for ``retry_s``)."""
        with self._lock:
            self._failed[via] = self._retry_at(exc)
            if not exc.slow or via in self._probing or self._closed:
                return
            self._probing.add(via)
        try:
            threading.Thread(target=self._probe, args=(via,), name="kvd-peer-probe", daemon=True).start()
        except RuntimeError as e:  # at the thread limit: no probe; the route is tried again after its failure
            with self._lock:
                self._probing.discard(via)
            log.warning("peer socket %s: could not start its probe (%s); calls go over gRPC until it is tried again", via.path, e)

    def _probe(self, via: SocketRoute) -> None:
        """On a thread of its own: hellos to ``via``'s daemon, one at a time, a quarter of
        ``timeout`` apart, until one is answered -- its connection is kept and the route serves
        calls again at once -- or the route's failure runs out (its next call then says hello
        itself) or becomes another kind (the daemon went away or is another one)."""
        try:
            while True:
                time.sleep(self.timeout / 4)
                with self._lock:
                    if self._closed or self._failed.get(via, 0.0) <= time.monotonic():
                        return
                try:
                    conn = self._open(via)
                except PermissionDenied:
                    return  # the calls over gRPC are refused alike and say so
                except _Unusable as exc:
                    if exc.slow:
                        continue
                    with self._lock:
                        self._failed[via] = self._retry_at(exc)
                    return
                with self._lock:
                    self._failed.pop(via, None)
                log.info("peer socket %s (boot %s) answers again: calls use it", via.path, via.boot_id)
                self._checkin(conn)
                return
        finally:
            with self._lock:
                self._probing.discard(via)

    def _retry_at(self, exc: _Unusable) -> float:
        """When a route that failed with ``exc`` may be tried again (monotonic)."""
        return time.monotonic() + (self.retry_s if exc.retry_after_s is None else min(self.retry_s, exc.retry_after_s))

    def call(self, conn: _Conn, name: str, request: Message) -> Message:
        """Call Peer rpc ``name`` on a checked-out connection, which this returns to the pool (or
        closes, when the call failed it). Raises the daemon's refusal as its kvd class."""
        return self.start(conn, name, request)()

    def start(self, conn: _Conn, name: str, request: Message) -> Callable[[], Message]:
        """Send the request of :meth:`call` now (raising at once when the connection fails); the
        returned function waits for the reply (the same outcomes as :meth:`call`). Call it
        exactly once: it returns the connection."""
        m = METHODS[METHOD_IDS[name]]
        deadline = time.monotonic() + self.timeout
        try:
            conn.sock.settimeout(self.timeout)
            conn.sock.sendall(frame(m.id, request))
        except BaseException as exc:
            failure = self._failed_call(conn, name, exc)
            if failure is exc:
                raise
            raise failure from exc

        def wait() -> Message:
            try:
                status, body = conn.reply(deadline)
                reply = m.response.FromString(body) if status == OK else _refusal(body)
            except BaseException as exc:
                failure = self._failed_call(conn, name, exc)
                if failure is exc:
                    raise
                raise failure from exc
            self._checkin(conn)
            if isinstance(reply, KvdError):
                raise reply
            return reply

        return wait

    def _failed_call(self, conn: _Conn, name: str, exc: BaseException) -> BaseException:
        """Close a connection a call failed on (the stream may hold half a frame) and say why."""
        conn.close()
        path = conn.route.path
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(
                f"peer socket {path}: no reply to {name} within {self.timeout:g} s (peer_timeout_s): "
                "the daemon there is hung or overloaded"
            )
        if isinstance(exc, (OSError, DecodeError)):
            return Unavailable(f"peer socket {path} failed during {name} (the daemon is gone or restarted): {exc}")
        return exc  # interrupted mid-call

    def close(self) -> None:
        """Close every idle connection; those checked out close when they come back."""
        with self._lock:
            self._closed = True
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()

    @property
    def idle(self) -> int:
        """Idle connections held now."""
        with self._lock:
            return sum(len(cs) for cs in self._idle.values())

    # -- inside --------------------------------------------------------------------------------
    def _open(self, via: SocketRoute) -> _Conn:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = _Conn(s, via)
        try:
            s.settimeout(self.timeout)
            try:
                s.connect(via.path)
            except OSError as exc:  # ENOENT, ECONNREFUSED, EACCES, a path too long, a full backlog ...
                raise _Unusable(f"cannot connect: {exc.strerror or exc}", slow=isinstance(exc, TimeoutError)) from exc
            try:
                deadline = time.monotonic() + self.timeout
                try:
                    s.sendall(frame(HELLO, pb.PeerHello(token=self.token, boot_id=via.boot_id)))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a full daemon refuses without reading the hello: its reply says why
                status, body = conn.reply(deadline)
                if status == REFUSED:
                    err = _refusal(body)
                else:
                    answered = pb.PeerHelloResponse.FromString(body).boot_id
            except (OSError, DecodeError) as exc:
                raise _Unusable(f"the hello failed: {exc or type(exc).__name__}", slow=isinstance(exc, TimeoutError)) from exc
            if status == REFUSED:
                if isinstance(err, PermissionDenied):
                    raise err
                raise _Unusable(f"the hello was refused: {type(err).__name__}: {err}",
                                retry_after_s=err.retry_after_s if isinstance(err, Unavailable) else None)
            if answered != via.boot_id:
                raise _Unusable(f"it is served by boot {answered!r}, not the ticket's {via.boot_id!r}: another daemon's socket")
        except BaseException:
            conn.close()
            raise
        return conn

    def _checkin(self, conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.route, [])
            if not self._closed and len(idle) < self.keep:
                idle.append(conn)
                return
        conn.close()

    def _prune(self) -> None:
        """Under the lock: forget failures past their time and idle connections of daemons that
        went away (a restarted daemon is a new route: its old boot's list would stay forever)."""
        now = time.monotonic()
        for via in [v for v, t in self._failed.items() if t <= now]:
            del self._failed[via]
        for via, cs in list(self._idle.items()):
            live = [c for c in cs if c.quiet()]
            for c in cs:
                if c not in live:
                    c.close()
            if live:
                self._idle[via] = live
            else:
                del self._idle[via]
