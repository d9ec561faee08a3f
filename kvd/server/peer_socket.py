"""The peer socket: a sender's calls to a receiving daemon of the same host, without gRPC.

Every Send makes two calls to the receiving daemon on its critical path, CheckTicket before the
first byte and Commit after the last. A Python gRPC unary round trip costs about 0.6 ms even over
a Unix socket; a request and reply on a held Unix socket between two Python processes about
10 us. The ``local`` backend only ever runs between daemons of one host, so a decode daemon also
serves those calls on a Unix stream socket (``peer_socket``, named in its tickets) and a prefill
daemon that can reach it calls them there (:class:`~kvd.server.peer_conns.PeerConnections`, used
by :class:`kvd.server.peer_link.DaemonPeerLink`). The sender's Heartbeat and AbortReceive go the
same way: liveness is judged on the path the transfer uses (a gRPC channel that the hot calls no
longer warm may still be backing off from a restart of the receiver, and a heartbeat failing
there would stop a healthy transfer). gRPC stays the fallback and the only path across hosts;
AbortSend, from the receiver to the sender, stays on gRPC.

Frames, both ways, carry the v1 protobuf messages of the Peer service -- no serialisation of
their own::

    [u32 n][u8 kind][n bytes: one protobuf message]          (n: big-endian, a request at most the daemon's max_request_bytes)

    caller                                              daemon (a thread per connection)
    ── kind 0: PeerHello {token, boot_id} ──────────▶  boot_id not ours: answer, close
    ◀── kind 0: PeerHelloResponse {boot_id} ───────── (or 1: PeerStatus, then close)
    ── kind 1: CheckTicketRequest ──────────────────▶  PeerCalls.check_ticket
    ◀── kind 0: CheckTicketResponse | 1: PeerStatus ─
    ── kind 2: CommitRequest ───────────────────────▶  PeerCalls.commit
    ◀── kind 0: CommitResponse | 1: PeerStatus ──────
    ... kind 3: Heartbeat, kind 4: AbortReceive ...     (the connection stays open, pooled)

A request's kind is its method id (:data:`METHODS`: the Peer rpc of that name and its request
and response types, read from the service descriptor); a reply's kind is its status, 0 (the
rpc's response) or 1 (a :class:`PeerStatus`: the status code, message and metadata
:func:`kvd.errors.to_status` gives the exception, raised again by the caller through
:func:`kvd.errors.from_status`: the one table gRPC and the handle socket use too). The handlers are :class:`~kvd.server.peer_calls.PeerCalls`, the
same ones the gRPC servicer runs.

Identity: the same path names another daemon on another host, in another container, or this
very daemon (a ticket of a remote decode daemon names ``/tmp/kvd.sock.peer``, which may be the
caller's own). The hello names the boot the caller expects (the ticket's); the daemon answers
its own and closes unless they match, and the caller drops a connection answered by another
boot, so no other daemon ever sees a call meant for this one. The hello also carries the peer
token (checked as the gRPC service checks ``kvd-token``); it goes only where the ticket points,
as it already does over gRPC (``peer_address``).

This module holds the wire and the server; the caller's side is
:mod:`kvd.server.peer_conns`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError, Message

from kvd.errors import InvalidArgument, KvdError
from kvd.records import PeerSocketStats
from kvd.server.framed import Close, FramedServer, refusal
from kvd.server.peer_calls import PeerCalls
from kvd.rpc.status import code_from_int
from kvd.ipc.frames import HELLO, MAX_FRAME, MAX_REQUEST, OK, REFUSED, frame, read_head
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import parse_request, status_to_pb

__all__ = [
    "HELLO", "OK", "REFUSED", "MAX_FRAME", "MAX_REQUEST", "MAX_HELLO", "MAX_CONNECTIONS", "METHODS", "METHOD_IDS", "Method",
    "PeerSocketServer", "frame", "read_head",
]

log = logging.getLogger("kvd.peer_socket")

#: The largest hello the server reads from a caller that has not authenticated yet.
MAX_HELLO = 4096
#: Connections one daemon serves at once (a thread each); more are refused, and their callers
#: use gRPC. A prefill daemon holds about as many as it runs Sends at once to this daemon.
MAX_CONNECTIONS = 64


#: What a handler may return: the response, or the response and what to run once it was sent.
Answer = Message | tuple[Message, Callable[[], None]]


class Method(NamedTuple):
    """One Peer rpc the socket serves: its frame kind, name, message types and handler."""

    id: int
    name: str
    request: type[Message]
    response: type[Message]
    handler: Callable[[PeerCalls, Message], Answer]


def _nothing() -> None:
    pass


def _method(mid: int, name: str, handler: Callable) -> Method:
    d = pb.DESCRIPTOR.services_by_name["Peer"].methods_by_name[name]
    return Method(mid, name, getattr(pb, d.input_type.name), getattr(pb, d.output_type.name), handler)


#: What the socket serves, by frame kind. Ids are part of the wire: never reuse one.
METHODS: dict[int, Method] = {
    m.id: m
    for m in (
        _method(1, "CheckTicket", lambda calls, request: calls.check_ticket(request)),
        # The decode engine's WaitReady is woken once the sender's reply is sent (PeerCalls.commit_then).
        _method(2, "Commit", lambda calls, request: calls.commit_then(request)),
        _method(3, "Heartbeat", lambda calls, request: calls.heartbeat(request)),
        _method(4, "AbortReceive", lambda calls, request: calls.abort_receive(request)),
    )
}
METHOD_IDS: dict[str, int] = {m.name: m.id for m in METHODS.values()}


class PeerSocketServer(FramedServer[None]):
    """Serves :data:`METHODS` of ``calls`` on a Unix stream socket at ``path`` for boot ``boot_id``.

    A thread per connection (at most ``max_connections``; more get an Unavailable refusal). A
    connection is authenticated once, by its hello, then serves calls until the caller closes
    it; it may idle without limit (callers pool them), but a frame once begun must arrive within
    ``timeout``. A caller that sends garbage gets an InvalidArgument refusal, a frame over
    ``max_request`` a RESOURCE_EXHAUSTED one, as over gRPC (and, when the stream can no longer be
    followed, the connection closes); one that vanishes mid-frame is dropped; neither stops the
    server (:class:`~kvd.server.framed.FramedServer`).

    :meth:`start` binds (replacing a stale socket file, refusing a live one); :meth:`stop`
    closes every connection (callers see EOF), waits for their threads and unlinks the path."""

    label = "peer socket"
    thread_name = "kvd-peer-conn"
    busy_hint = "use gRPC"
    log = log

    def __init__(self, path: str, calls: PeerCalls, boot_id: str, *, timeout: float = 2.0, max_connections: int = MAX_CONNECTIONS,
                 max_request: int = MAX_REQUEST) -> None:
        super().__init__(path, "peer_socket", "peer calls", timeout=timeout, max_connections=max_connections, max_request=max_request)
        self.calls = calls
        self.boot_id = boot_id

    # -- what it did ---------------------------------------------------------------------------
    def stats(self) -> PeerSocketStats:
        """What it served and the connections open, as one picture (what the exporter reads)."""
        with self._lock:
            return PeerSocketStats(dict(self._answered), len(self._conns))

    # -- serving -------------------------------------------------------------------------------
    def _opened(self, conn: socket.socket) -> None:
        """Read the hello; answer it, or raise Close (wrong daemon, wrong token, not a hello)."""
        head = read_head(conn, self.timeout)  # the first bytes wait ``timeout`` too (set by _serve)
        if head is None:
            raise ConnectionError("the caller closed before its hello")
        n, kind = head
        try:
            if kind != HELLO or n > MAX_HELLO:
                raise InvalidArgument(
                    f"peer socket: the first frame must be a hello (kind {HELLO}, at most {MAX_HELLO} bytes), "
                    f"got kind {kind} of {n:,d} bytes"
                )
            try:
                hello = pb.PeerHello.FromString(self._body(conn, n))
            except DecodeError as exc:
                raise InvalidArgument(f"peer socket: the hello does not parse as PeerHello ({exc})") from exc
            me = frame(OK, pb.PeerHelloResponse(boot_id=self.boot_id))
            if hello.boot_id != self.boot_id:
                raise Close(me)  # the caller wants another daemon: it learns who answered, nothing more
            self.calls.authorize(hello.token)
        except KvdError as exc:
            raise Close(refusal(exc)) from exc
        conn.sendall(me)

    def _frame(self, conn: socket.socket, n: int, kind: int, state: None) -> None:
        reply, then = self._answer(conn, n, kind)
        try:
            conn.sendall(reply)
        finally:
            then()  # a commit's wake runs even when the caller went away

    def _answer(self, conn: socket.socket, n: int, kind: int) -> tuple[bytes, Callable[[], None]]:
        """The reply frame to one call frame whose head was read (its body is read here), and
        what to run once it is sent."""
        body = self._body(conn, n)  # Close for a body over max_request
        m = METHODS.get(kind)
        name = m.name if m is not None else f"kind-{kind}"
        then = _nothing
        try:
            if m is None:
                served = ", ".join(f"{x.id} ({x.name})" for x in METHODS.values())
                raise InvalidArgument(f"peer socket: unknown method id {kind}; this daemon serves {served} (and {HELLO}: hello)")
            request = parse_request(m.name, m.request, body)  # the words gRPC refuses it in
            out = m.handler(self.calls, request)
            if isinstance(out, tuple):
                out, then = out
            reply, code = frame(OK, out), "OK"
        except Exception as exc:  # noqa: BLE001 -- mapped to a status in one place
            st = status_to_pb(exc)
            reply, status = frame(REFUSED, st), code_from_int(st.code)
            code = status.name
            if status == grpc.StatusCode.INTERNAL:
                log.exception("peer socket: internal error in %s", name)
        self._count(name, code)
        return reply, then
