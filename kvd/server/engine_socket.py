"""The engine socket: an engine's calls to its own daemon without gRPC.

Every request an engine serves makes a handful of calls to its daemon (allocate, lease, send,
wait, free). A Python gRPC unary call costs 0.6-1.3 ms even over a Unix socket; a request and
reply framed on a held Unix socket between two Python processes costs tens of microseconds. So
beside its gRPC listener on ``listen_unix`` a daemon serves the engine-facing Kvd service on
``<listen_unix>.fast`` (``fast_socket``), and :class:`kvd.client.Client` uses it when it
connects to a ``unix:`` address that has one. gRPC stays the public API: TCP, tooling (grpcurl,
health, reflection), remote callers.

The same messages, the same handlers, the same errors: frames (:mod:`kvd.ipc.frames`) carry the
v1 Kvd request and response messages; every request is parsed by
:func:`kvd.rpc.convert.parse_request` (junk is INVALID_ARGUMENT naming the method, as over gRPC);
the handler is the gRPC servicer's own method (:class:`~kvd.server.service.KvdService`), given a
small context (:class:`_Context`) in place of gRPC's: its session metadata, and an ``abort`` that
ends the call with the status ``_run`` mapped (:func:`kvd.errors.to_status`), sent as a
``PeerStatus`` frame that the client raises again through :func:`kvd.errors.from_status`::

    engine (a connection per call in flight)             daemon (a thread per connection)
    ── kind 1: OpenSessionRequest ──────────────────▶  KvdService.OpenSession; the connection
    ◀── kind 0: Session | 1: PeerStatus ─────────────  now acts for that session
    ── kind 0: Session {session_id} ────────────────▶  (another connection of the same client)
    ◀── kind 0: Session | 1: PeerStatus, close ──────  acts for it once the daemon knows it
    ── kind 7: AllocateRequest ─────────────────────▶  KvdService.Allocate(request, context)
    ◀── kind 0: AllocateResponse | 1: PeerStatus ────
    ── kind 255: (empty) ───────────────────────────▶  the doorbell board (a session's connection)
    ◀── kind 0: Doorbells + a read-only fd | 1: PeerStatus

A connection acts for one session, the one it opened or named in its hello (kind 0, a
``Session`` message), so it carries no metadata per call; a session id is the same capability
the ``kvd-session`` metadata is over gRPC. A call blocks its connection (WaitReady until the
transfer is ready: pushed, not polled), so a client holds a few connections and uses a free one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvd.errors import FailedPrecondition, InvalidArgument, KvdError
from kvd.ipc.frames import HELLO, MAX_REQUEST, OK, REFUSED, frame
from kvd.ipc.unix_socket import hung_up
from kvd.memory.doorbells import SLOT_BYTES, Doorbells
from kvd.rpc.convert import IDS_KEY, IDS_LE, SESSION_KEY, parse_request, status_to_pb
from kvd.rpc.engine_wire import DOORBELLS, METHOD_IDS, METHODS, WAITS, Method, fast_path
from kvd.rpc.status import code_from_int
from kvd.server.framed import Close, FramedServer, refusal
from kvd.server.service import KvdService
from kvd.v1 import kvd_pb2 as pb

__all__ = ["EngineSocketServer", "METHODS", "METHOD_IDS", "Method", "MAX_CONNECTIONS", "fast_path", "session_md"]

log = logging.getLogger("kvd.engine_socket")

#: Connections one daemon serves at once (a thread each); a new one evicts the one idle longest
#: (else cuts the longest WaitReady short), and is refused only while every one runs a handler.
#: An engine holds one per call it has in flight.
MAX_CONNECTIONS = 256
#: The largest hello the server reads.
MAX_HELLO = 4096


class _Aborted(Exception):
    """``_Context.abort``: the call ends with this status (what gRPC's abort raises, here)."""

    def __init__(self, status: pb.PeerStatus) -> None:
        super().__init__(status.message)
        self.status = status


class _Context:
    """What :class:`KvdService`'s handlers use of a ``grpc.ServicerContext``: the session's
    metadata, trailing metadata and abort (both filled by ``_run``), whether the call is still
    wanted (``is_active``), and no deadline (the client bounds WaitReady by its own timeout
    before it sends)."""

    __slots__ = ("_md", "_trailing", "after", "_conn", "_stop", "cut_off")

    def __init__(self, md: tuple[tuple[str, str], ...], conn: socket.socket, stop: threading.Event) -> None:
        self._md = md
        self._trailing: Sequence[tuple[str, str]] = ()
        self.after: list[Callable[[], None]] = []  # run once the reply is out (defer)
        self._conn = conn
        self._stop = stop  # the server's: set once it stops
        self.cut_off = False  # the server cut this call's wait short to make room (FramedServer._park)

    def cut(self) -> None:
        self.cut_off = True

    def is_active(self) -> bool:
        """False once the server stops, cut the wait short, or the caller hung up (a zero-timeout
        poll of the connection, nothing read): nobody will hear the reply. A system call: for a
        handler that blocks (WaitReady asks it at each wake-up), never per call."""
        return not self._stop.is_set() and not self.cut_off and not hung_up(self._conn.fileno())

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this connection's thread once the caller has its reply, before its next
        frame is read (work the reply does not depend on; its failure is logged)."""
        self.after.append(fn)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    def set_trailing_metadata(self, md: Sequence[tuple[str, str]]) -> None:
        self._trailing = md

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(pb.PeerStatus(code=code.value[0], message=details, metadata=dict(self._trailing)))

    def time_remaining(self) -> float | None:
        return None


class EngineSocketServer(FramedServer[tuple[tuple[str, str], ...]]):
    """Serves :data:`METHODS` of ``service`` on a Unix stream socket at ``path``.

    A thread per connection (at most ``max_connections``). A new connection beyond that evicts
    the connection idle longest (its client sends the call it may have sent there again: the
    EVICTED answer, :class:`~kvd.server.framed.FramedServer`), so idle connections, leaked or
    hoarded, never lock engines out; with none idle, the WaitReady parked longest is cut short
    (EVICTED: its client asks again), so waits do not either; only when every connection runs a
    handler is a new one refused (Unavailable, with a retry hint). A connection that acts for a session idles without limit between calls; one that
    acts for none yet (before its hello or OpenSession) is closed after ``timeout`` without a
    frame; a frame once begun must arrive within ``timeout`` (the bound:
    :class:`~kvd.server.framed.FramedServer`). A caller that sends garbage gets an
    INVALID_ARGUMENT refusal, a request over ``max_request`` a RESOURCE_EXHAUSTED one, as over gRPC (and,
    when the stream can no longer be followed, the connection closes); neither stops the server.
    ``group``: the socket file group-writable (``group_access``), as the gRPC one
    (:class:`~kvd.server.framed.FramedServer`). A connection's state is the session it acts for."""

    label = "engine socket"
    thread_name = "kvd-engine-conn"
    busy_hint = "every one is in a call; retry, or use gRPC"
    evicts = True
    log = log

    def __init__(self, path: str, service: KvdService, *, timeout: float = 5.0, max_connections: int = MAX_CONNECTIONS,
                 group: bool = False, observe: Callable[[str, str, float], None] | None = None,
                 doorbells: Doorbells | None = None, max_request: int = MAX_REQUEST) -> None:
        super().__init__(path, "fast_socket", "engine calls", timeout=timeout, max_connections=max_connections, group=group,
                         max_request=max_request)
        self.service = service
        self.doorbells = doorbells  # handed out read-only (kind DOORBELLS); None: refused
        #: called with (method, status code name, seconds) after each call: the daemon's RPC latency histogram
        self.observe = observe
        # the bound handlers, by frame kind: one dict lookup per call
        self._handlers: dict[int, Any] = {k: getattr(service, m.name) for k, m in METHODS.items()}

    def _opened(self, conn: socket.socket) -> tuple[tuple[str, str], ...]:
        return ()  # no session until a hello names one or an OpenSession opens one

    def _idle(self, md: tuple[tuple[str, str], ...]) -> float | None:
        """A connection that acts for a session idles without limit (a client pools them); one
        that acts for none yet waits ``timeout`` for its next frame, so connections opened and
        left silent cannot hold every connection thread."""
        return None if md else self.timeout

    def _frame(self, conn: socket.socket, n: int, kind: int, md: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        if kind == HELLO:
            return self._hello(conn, n)
        if kind == DOORBELLS:
            self._doorbells(conn, n, md)
            return md
        t0 = time.perf_counter()
        reply, sid, name, code, after = self._answer(conn, n, kind, md)
        self._count(name, code)  # counted before the caller hears (a counter bump: what it saw is counted)
        conn.sendall(reply)
        # The latency histogram after the reply is out: the caller is not kept waiting for it
        # (~20 us; a Send's reply is on the critical path of every handoff).
        if self.observe is not None:
            self.observe(name, code, time.perf_counter() - t0)
        for fn in after:
            try:
                fn()
            except Exception:  # noqa: BLE001 -- the caller has its reply; the work says how it ended itself
                self.log.exception("%s: work deferred past the reply of %s failed", self.label, name)
        return session_md(sid) if sid else md

    def _hello(self, conn: socket.socket, n: int) -> tuple[tuple[str, str], ...]:
        """A hello names the session this connection acts for: answered with it, or refused
        and closed (not a Session message, an unknown session)."""
        try:
            if n > MAX_HELLO:
                raise InvalidArgument(f"engine socket: a hello of {n:,d} bytes exceeds {MAX_HELLO}; send the Session OpenSession returned")
            try:
                hello = pb.Session.FromString(self._body(conn, n))
            except DecodeError as exc:
                raise InvalidArgument(f"engine socket: the hello does not parse as Session ({exc})") from exc
            s = self.service.node.touch(hello.session_id)
        except KvdError as exc:
            raise Close(refusal(exc)) from exc
        conn.sendall(frame(OK, pb.Session(session_id=s.session_id, ttl_seconds=s.ttl, boot_id=self.service.node.pool.boot_id)))
        return session_md(s.session_id)

    def _doorbells(self, conn: socket.socket, n: int, md: tuple[tuple[str, str], ...]) -> None:
        """Hand this connection's engine a read-only descriptor of the doorbell board, or refuse:
        a connection that acts for no session yet, a body (the request is empty), no board."""
        try:
            if n:
                raise Close(refusal(InvalidArgument(f"engine socket: a doorbells request has no body, got {n:,d} bytes")))
            if not md:
                raise InvalidArgument("engine socket: doorbells need a session: open one (OpenSession) or name it (hello) first")
            self.service.node.touch(md[0][1])
            if self.doorbells is None:
                raise FailedPrecondition("this daemon keeps no doorbell board (it runs no handoff backend): use WaitReady")
        except KvdError as exc:
            self._count("Doorbells", code_from_int(status_to_pb(exc).code).name)
            conn.sendall(refusal(exc))
            return
        board = self.doorbells
        fd = board.reader_fd()
        try:
            msg = pb.Doorbells(boot_id=self.service.node.pool.boot_id, slots=board.slots, slot_bytes=SLOT_BYTES)
            socket.send_fds(conn, [frame(OK, msg)], [fd])
        finally:
            os.close(fd)
        self._count("Doorbells", "OK")

    def _answer(
        self, conn: socket.socket, n: int, kind: int, md: tuple[tuple[str, str], ...]
    ) -> tuple[bytes, str, str, str, list[Callable[[], None]]]:
        """The reply frame to one call whose head was read (its body is read here), the
        session id an OpenSession opened ("" otherwise), the method's name and status code
        name for the books, and the work the handler deferred past the reply."""
        body = self._body(conn, n)  # Close for a body over max_request
        m = METHODS.get(kind)
        name = m.name if m is not None else f"kind-{kind}"
        sid = ""
        after: list[Callable[[], None]] = []
        try:
            if m is None:
                raise InvalidArgument(
                    f"engine socket: unknown method id {kind}; this daemon serves 1 to {len(METHODS)} (and {HELLO}: hello, {DOORBELLS}: doorbells)"
                )
            request = parse_request(m.name, m.request, body)  # the words gRPC refuses it in
            ctx = _Context(md, conn, self._stop)
            after = ctx.after
            try:
                if kind in _WAITS:  # a wait only reads: cut short when every slot is taken and none idles
                    self._park(conn, ctx.cut)
                    try:
                        response = self._handlers[kind](request, ctx)
                    finally:
                        if self._unpark(conn):
                            self._count(name, "UNAVAILABLE")
                            raise self._cut_short()
                else:
                    response = self._handlers[kind](request, ctx)
            except _Aborted as a:
                reply, code = frame(REFUSED, a.status), code_from_int(a.status.code).name
            else:
                if kind == _OPEN:
                    sid = response.session_id
                reply, code = frame(OK, response), "OK"
        except Close:
            raise  # a wait cut short: EVICTED, and the connection closes
        except Exception as exc:  # noqa: BLE001 -- mapped to a status in one place (a refusal before the handler)
            st = status_to_pb(exc)
            reply, code = frame(REFUSED, st), code_from_int(st.code).name
        return reply, sid, name, code, after


_OPEN = METHOD_IDS["OpenSession"]
_WAITS = frozenset(METHOD_IDS[m] for m in WAITS)


def session_md(sid: str) -> tuple[tuple[str, str], ...]:
    """A connection's metadata once it acts for session ``sid``: the session, and packed ids
    (the engine socket's replies always carry IndexVectors as bytes)."""
    return ((SESSION_KEY, sid), (IDS_KEY, IDS_LE))
