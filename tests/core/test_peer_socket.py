"""The peer socket (``kvd/server/peer_socket.py``: wire and server; ``kvd/server/peer_conns.py``:
the caller's pooled connections) against one in-process node: the framing and its refusals,
the hello (identity, token), the pool and its fallbacks, a connection that breaks mid-call.
Handoffs over it between real daemons are in ``tests/handoff/test_handoff_peer_socket.py``."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pool_testkit as pk
import proc_kit
from kvd import errors as E
from kvd.records import AllocSpec, LeaseKind, SocketRoute, TransferRef, TransferState
from kvd.daemon.node import Node
from kvd.handoff.inbox import Inbox
from kvd.pool.pool import Pool
from kvd.server.peer_calls import PeerCalls
from kvd.server.framed import BUSY_RETRY_S
from kvd.server import peer_conns
from kvd.server.peer_conns import PeerConnections
from kvd.server.peer_socket import HELLO, MAX_HELLO, MAX_REQUEST, METHOD_IDS, OK, REFUSED, PeerSocketServer, frame, read_head
from kvd.ipc.unix_socket import recv_exact
from kvd.v1 import kvd_pb2 as pb
import weakref

from kvd.handoff.ticket import Issuer, Tickets
from kvd.rpc.convert import ref_to_pb, status_from_pb

TOKEN = "tok"
CHECK, COMMIT = METHOD_IDS["CheckTicket"], METHOD_IDS["Commit"]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="kvd-ps-")  # pytest's tmp_path can outgrow the 107 bytes of a socket path
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    s = pk.sizings()["two-group"]
    arena = pk.arena_for(s)
    n = Node(Pool(s.layout, arena))
    Inbox.attach(n)
    yield n
    n.check()
    arena.close()


@pytest.fixture
def server(node: Node, sock_dir: Path) -> Iterator[PeerSocketServer]:
    srv = PeerSocketServer(str(sock_dir / "p.sock"), _calls(node, TOKEN), node.pool.boot_id, timeout=1.0).start()
    yield srv
    srv.stop()


_TICKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tickets(node: Node) -> Tickets:
    """The node's tickets (one key per node, as one daemon has): what its PeerCalls check with."""
    if node not in _TICKETS:
        _TICKETS[node] = Tickets(node, Issuer("decode", "", "local"))
    return _TICKETS[node]


def _calls(node: Node, token: str | None = None) -> PeerCalls:
    return PeerCalls(node, token, tickets=_tickets(node))


def _ticket(node: Node, rid: str = "r1") -> tuple[bytes, TransferRef]:
    """A RECV lease on ``node`` for a fresh request, and its ticket bytes and reference."""
    sid = node.open_session("decode").session_id
    node.allocate(sid, [AllocSpec(rid, 12, receive=True)])
    lease, vec = node.acquire_lease(sid, rid, LeaseKind.RECV)
    with node.lock:
        raw = _tickets(node).mint(lease, vec)
    return raw, TransferRef(node.pool.boot_id, lease.lease_id, rid)


def _raw(srv: PeerSocketServer, *, boot: str | None = None, token: str = TOKEN) -> tuple[socket.socket, int, bytes]:
    """A bare connection that sent its hello; returns it and the hello's reply (status, body)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(srv.path)
    s.sendall(frame(HELLO, pb.PeerHello(token=token, boot_id=srv.boot_id if boot is None else boot)))
    status, body = _reply(s)
    return s, status, body


def _reply(s: socket.socket) -> tuple[int, bytes]:
    head = read_head(s)
    assert head is not None, "the server closed without a reply"
    n, status = head
    return status, recv_exact(s, n)


def _refusal(body: bytes) -> E.KvdError:
    return status_from_pb(pb.PeerStatus.FromString(body))


def _closed(s: socket.socket) -> bool:
    """The server closed its end (a reset: it closed without reading everything we sent)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _conns(token: str = TOKEN, **kw) -> PeerConnections:
    return PeerConnections(token=token, timeout=kw.pop("timeout", 2.0), **kw)


# ---- calls ---------------------------------------------------------------------------------------


def test_check_ticket_and_commit_over_the_socket(node, server):
    raw, ref = _ticket(node)
    pc = _conns()
    via = SocketRoute(server.path, node.pool.boot_id)
    r = pc.call(pc.checkout(via), "CheckTicket", pb.CheckTicketRequest(ticket=raw, sender="prefill"))
    assert r.expires_in_seconds > 0
    assert node.inbox.status("r1").state is TransferState.RECEIVING
    pc.call(pc.checkout(via), "Commit", pb.CommitRequest(ref=ref_to_pb(ref), last=True, bytes=123, sender="prefill"))
    st = node.inbox.status("r1")
    assert (st.state, st.nbytes) == (TransferState.READY, 123)
    # One connection served both calls, and is held for the next.
    assert pc.idle == 1 and server.connections == 1
    assert server.answered() == {("CheckTicket", "OK"): 1, ("Commit", "OK"): 1}
    pc.close()


@pytest.mark.parametrize(
    "edit, cls, sealed",
    [({"lease_id": 999}, E.NotFound, True), ({"epoch": 12345}, E.StaleEpoch, True), ({"rid": "nope"}, E.InvalidArgument, True),
     ({"lease_id": 999}, E.PermissionDenied, False), ({"boot_id": "another"}, E.StaleEpoch, False)],
)
def test_a_refusal_is_the_class_and_message_grpc_gives(node, server, edit, cls, sealed):
    raw, _ = _ticket(node)
    envelope = pb.SealedTicket.FromString(raw)
    t = pb.Ticket.FromString(envelope.body)
    for k, v in edit.items():
        setattr(t, k, v)
    # sealed: edited under the daemon's own key (the checks behind the seal); else under the old seal
    blob = _tickets(node).seal(t) if sealed else pb.SealedTicket(body=t.SerializeToString(), seal=envelope.seal).SerializeToString()
    forged = pb.CheckTicketRequest(ticket=blob, sender="prefill")
    # What the gRPC servicer raises: the same PeerCalls, before the status mapping.
    with pytest.raises(cls) as direct:
        _calls(node, TOKEN).check_ticket(forged)
    before = node.stats()
    pc = _conns()
    with pytest.raises(E.KvdError) as over:
        pc.call(pc.checkout(SocketRoute(server.path, node.pool.boot_id)), "CheckTicket", forged)
    assert type(over.value) is cls and str(over.value) == str(direct.value)
    # The refusal changed nothing (the stale counter counts the socket's refusal, as over gRPC).
    stale = int(cls is E.StaleEpoch)
    assert node.stats() == dataclasses.replace(before, stale_refusals_total=before.stale_refusals_total + stale)
    assert node.inbox.status("r1").state is TransferState.WAITING
    assert pc.idle == 1, "a refusal keeps the connection in step: it goes back to the pool"
    pc.close()


def test_unknown_method_is_refused_and_the_connection_goes_on(node, server):
    s, status, _ = _raw(server)
    assert status == OK
    s.sendall(struct.pack(">IB", 0, 9))
    status, body = _reply(s)
    exc = _refusal(body)
    assert status == REFUSED and type(exc) is E.InvalidArgument
    assert "unknown method id 9" in str(exc) and "1 (CheckTicket), 2 (Commit)" in str(exc)
    raw, _ = _ticket(node)
    s.sendall(frame(CHECK, pb.CheckTicketRequest(ticket=raw)))
    status, body = _reply(s)
    assert status == OK and pb.CheckTicketResponse.FromString(body).expires_in_seconds > 0
    assert server.answered() == {("kind-9", "INVALID_ARGUMENT"): 1, ("CheckTicket", "OK"): 1}
    s.close()


def test_a_body_that_does_not_parse_is_refused(node, server):
    """In the words gRPC refuses it in (kvd.rpc.convert.parse_request), and the connection stays in step."""
    s, _, _ = _raw(server)
    s.sendall(struct.pack(">IB", 3, COMMIT) + b"\xff\xff\xff")
    status, body = _reply(s)
    exc = _refusal(body)
    assert status == REFUSED and type(exc) is E.InvalidArgument
    assert "Commit: the request did not parse as kvd.v1.CommitRequest" in str(exc)
    raw, _ = _ticket(node)
    s.sendall(frame(CHECK, pb.CheckTicketRequest(ticket=raw)))
    status, body = _reply(s)
    assert status == OK and pb.CheckTicketResponse.FromString(body).expires_in_seconds > 0
    s.close()


@pytest.mark.parametrize("request_", [
    pb.CheckTicketRequest(ticket=b"x", sender="s" * 257),
    pb.CommitRequest(ref=pb.TransferRef(boot_id="b", lease_id=1, rid="r" * (1 << 20))),
    pb.HeartbeatRequest(sender="s", refs=[pb.TransferRef(boot_id="b" * 300, lease_id=1, rid="r")]),
    pb.PeerAbortRequest(ref=pb.TransferRef(boot_id="b", lease_id=1, rid="r"), reason="x" * 1025),
], ids=["check-sender", "commit-rid", "heartbeat-boot", "abort-reason"])
def test_a_string_over_its_bound_is_refused_before_the_handler(node, server, request_):
    """The bounds of kvd.limits hold on the peer socket as on gRPC: INVALID_ARGUMENT naming the
    method and the field, nothing changed, the connection still in step."""
    method = {pb.CheckTicketRequest: "CheckTicket", pb.CommitRequest: "Commit", pb.HeartbeatRequest: "Heartbeat",
              pb.PeerAbortRequest: "AbortReceive"}[type(request_)]
    before = node.stats()
    s, _, _ = _raw(server)
    s.sendall(frame(METHOD_IDS[method], request_))
    status, body = _reply(s)
    exc = _refusal(body)
    assert status == REFUSED and type(exc) is E.InvalidArgument and str(exc).startswith(f"{method}: ") and "over the limit of" in str(exc)
    assert len(str(exc)) < 400, "the refusal quotes a bounded prefix"
    assert node.stats() == before
    s.sendall(frame(METHOD_IDS["Heartbeat"], pb.HeartbeatRequest(sender="s")))
    assert _reply(s)[0] == OK
    s.close()


def test_an_oversized_frame_is_refused_and_the_connection_closed(server):
    s, _, _ = _raw(server)
    s.sendall(struct.pack(">IB", MAX_REQUEST + 1, COMMIT))
    status, body = _reply(s)
    exc = _refusal(body)
    # RESOURCE_EXHAUSTED without kvd's error class: a transport's limit, as gRPC refuses a message
    # over its limit (a plain KvdError, never CapacityError: the pool's memory is not the problem)
    assert status == REFUSED and type(exc) is E.KvdError and f"exceeds this daemon's {MAX_REQUEST:,d}-byte limit" in str(exc)
    assert str(exc).startswith("RESOURCE_EXHAUSTED: ") and "send less per call" in str(exc), exc
    assert _closed(s), "the rest of the stream cannot be followed: the server closes"
    s.close()


def test_a_truncated_frame_drops_the_connection_not_the_server(node, server):
    s, _, _ = _raw(server)
    (served,) = list(server._conns.values())  # the thread serving this connection (its hello answered)
    s.sendall(struct.pack(">IB", 100, COMMIT) + b"\x0a" * 10)
    s.close()  # gone mid-frame
    served.join(5)  # it counts the drop as it ends (asserting at once raced it: seen on a fresh clone)
    assert not served.is_alive()
    pc = _conns()
    raw, _ = _ticket(node)
    pc.call(pc.checkout(SocketRoute(server.path, node.pool.boot_id)), "CheckTicket", pb.CheckTicketRequest(ticket=raw))
    assert server.dropped == 1 and server.answered() == {("CheckTicket", "OK"): 1}
    pc.close()


def test_a_frame_dripped_byte_by_byte_is_cut_off_within_its_deadline(server):
    """A byte every 0.3 s beats the server's per-recv timeout (1 s) for ever; a frame's parts
    each have one deadline, so the connection is dropped: a hello or a call, however split."""
    for hello in (True, False):
        if hello:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.path)
            s.sendall(struct.pack(">IB", 100, HELLO))
        else:
            s, _, _ = _raw(server)
            s.sendall(struct.pack(">IB", 100, COMMIT))
        dropped = server.dropped
        end = time.monotonic() + 6.0  # the body's bound is 2 x timeout (2 s) from the head
        cut = False
        while not cut and time.monotonic() < end:
            try:
                s.sendall(b"\x0a")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
            time.sleep(0.3)
        s.close()
        assert cut and server.dropped == dropped + 1, f"a {'hello' if hello else 'call'} dripped byte by byte was never cut off"


def test_the_first_frame_must_be_a_small_hello(node, server):
    raw, _ = _ticket(node)
    for first in (frame(CHECK, pb.CheckTicketRequest(ticket=raw)), struct.pack(">IB", MAX_HELLO + 1, HELLO)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(server.path)
        s.sendall(first)
        status, body = _reply(s)
        exc = _refusal(body)
        assert status == REFUSED and type(exc) is E.InvalidArgument and "the first frame must be a hello" in str(exc)
        assert _closed(s)
        s.close()
    assert server.answered() == {} and node.inbox.status("r1").state is TransferState.WAITING


# ---- the hello: identity and token -----------------------------------------------------------------


def test_a_hello_for_another_boot_learns_who_answered_and_nothing_more(node, server):
    s, status, body = _raw(server, boot="some-other-boot")
    assert status == OK and pb.PeerHelloResponse.FromString(body).boot_id == node.pool.boot_id
    assert _closed(s), "a connection that expected another daemon is closed at once"
    s.close()
    pc = _conns()
    assert pc.checkout(SocketRoute(server.path, "some-other-boot")) is None  # the caller uses gRPC
    refused = server.refused
    assert pc.checkout(SocketRoute(server.path, "some-other-boot")) is None
    assert server.refused == refused, "a route that failed is not tried again at once"
    assert pc.checkout(SocketRoute(server.path, node.pool.boot_id)) is not None, "the right boot on the same path is another route"
    assert server.answered() == {}


def test_a_wrong_token_is_refused_as_over_grpc(node, server):
    s, status, body = _raw(server, token="wrong")
    exc = _refusal(body)
    assert status == REFUSED and type(exc) is E.PermissionDenied
    assert _closed(s)
    s.close()
    with pytest.raises(E.PermissionDenied) as direct:
        _calls(node, TOKEN).authorize("wrong")  # what the gRPC servicer raises for the wrong kvd-token
    assert str(exc) == str(direct.value) and "kvd-token" in str(exc)
    with pytest.raises(E.PermissionDenied, match="configure the same peer_token"):
        _conns(token="wrong").checkout(SocketRoute(server.path, node.pool.boot_id))
    with pytest.raises(E.PermissionDenied):
        _conns(token="").checkout(SocketRoute(server.path, node.pool.boot_id))
    assert server.answered() == {}


def test_no_token_configured_lets_any_peer_in(node, sock_dir):
    with PeerSocketServer(str(sock_dir / "open.sock"), _calls(node), node.pool.boot_id) as srv:
        assert _conns(token="whatever").checkout(SocketRoute(srv.path, node.pool.boot_id)) is not None


# ---- the caller's pool ---------------------------------------------------------------------------


def test_nothing_listening_means_grpc_for_a_while(node, sock_dir):
    path = str(sock_dir / "later.sock")
    via = SocketRoute(path, node.pool.boot_id)
    patient, eager = _conns(retry_s=3600), _conns(retry_s=0)
    assert patient.checkout(via) is None and eager.checkout(via) is None
    with PeerSocketServer(path, _calls(node, TOKEN), node.pool.boot_id) as srv:
        assert patient.checkout(via) is None, "remembered: no connect attempt per Send"
        assert eager.checkout(via) is not None
        assert srv.refused == 0


def test_a_full_server_refuses_and_the_caller_waits_only_briefly(node, sock_dir):
    with PeerSocketServer(str(sock_dir / "full.sock"), _calls(node, TOKEN), node.pool.boot_id, max_connections=1) as srv:
        via = SocketRoute(srv.path, node.pool.boot_id)
        pc = _conns()
        held = pc.checkout(via)
        assert held is not None
        assert pc.checkout(via) is None  # busy: this call goes over gRPC
        assert srv.refused == 1
        held.close()
        # Busy is remembered for the refusal's retry hint only (framed.BUSY_RETRY_S): the next calls go over gRPC without a
        # refused connect each, then the route is tried again (long before RETRY_S).
        assert pc.checkout(via) is None and srv.refused == 1
        got = None
        for _ in range(int(BUSY_RETRY_S * 100) + 300):
            got = pc.checkout(via)
            if got is not None:
                break
            threading.Event().wait(0.01)
        assert got is not None and srv.refused == 1


def test_concurrent_calls_each_get_a_connection_and_a_few_are_kept(node, server):
    raw, _ = _ticket(node)
    pc = _conns(keep=2)
    via = SocketRoute(server.path, node.pool.boot_id)
    conns = [pc.checkout(via) for _ in range(4)]
    assert len({id(c) for c in conns}) == 4 and server.connections == 4
    errors: list[BaseException] = []

    def call(c) -> None:
        try:
            pc.call(c, "CheckTicket", pb.CheckTicketRequest(ticket=raw))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and server.answered() == {("CheckTicket", "OK"): 4}
    assert pc.idle == 2, "at most `keep` idle connections per route; the others are closed"
    pc.close()
    assert pc.idle == 0


def test_stop_ends_pooled_connections(node, sock_dir):
    srv = PeerSocketServer(str(sock_dir / "s.sock"), _calls(node, TOKEN), node.pool.boot_id).start()
    raw, _ = _ticket(node)
    pc = _conns()
    via = SocketRoute(srv.path, node.pool.boot_id)
    pc.call(pc.checkout(via), "CheckTicket", pb.CheckTicketRequest(ticket=raw))
    assert pc.idle == 1
    srv.stop()
    assert not Path(srv.path).exists()
    assert pc.checkout(via) is None and pc.idle == 0  # the held connection saw EOF; nothing listens now


def test_a_live_socket_is_not_taken_over(node, server):
    with pytest.raises(E.Unavailable, match="another process serves peer calls on"):
        PeerSocketServer(server.path, _calls(node), node.pool.boot_id).start()


def test_a_path_too_long_is_refused_naming_the_setting(node):
    with pytest.raises(E.InvalidArgument, match="set peer_socket .or listen_unix. to a shorter path"):
        PeerSocketServer("/tmp/" + "x" * 120, _calls(node), node.pool.boot_id)


# ---- a daemon that breaks mid-call -----------------------------------------------------------------


class BareDaemon:
    """A bare Unix socket server at ``path`` that claims boot ``boot``: each connection it
    accepts goes to :meth:`serve` (on the accepting thread); :meth:`close` ends them all."""

    def __init__(self, path: str, boot: str, backlog: int = 8) -> None:
        self.path, self.boot = path, boot
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(backlog)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            self.serve(c)

    def serve(self, c: socket.socket) -> None:
        raise NotImplementedError

    def hello(self, c: socket.socket, delay: float = 0.0) -> None:
        """Read the caller's hello and answer it as ``boot``, ``delay`` seconds later."""
        n, _ = read_head(c)  # type: ignore[misc]
        recv_exact(c, n)
        time.sleep(delay)
        c.sendall(frame(OK, pb.PeerHelloResponse(boot_id=self.boot)))

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class FakeDaemon(BareDaemon):
    """Answers hellos and then does ``after(conn)`` with each connection; counts the call frames
    it received over all connections."""

    def __init__(self, path: str, boot: str, after: Callable[[socket.socket], None]) -> None:
        self.after = after
        self.frames = 0
        super().__init__(path, boot)

    def serve(self, c: socket.socket) -> None:
        self.hello(c)
        head = read_head(c)
        if head is None:
            return
        recv_exact(c, head[0])
        self.frames += 1
        self.after(c)


@pytest.mark.parametrize(
    "after, cls, phrase",
    [
        (lambda c: c.close(), E.Unavailable, "failed during Commit"),
        (lambda c: c.sendall(struct.pack(">IB", 0, 7)), E.Unavailable, "malformed reply"),
        (lambda c: c.sendall(struct.pack(">IB", 50, OK) + b"\x08"), E.DeadlineExceeded, "no reply to Commit"),
        (lambda c: None, E.DeadlineExceeded, "no reply to Commit within 0.3 s"),
    ],
    ids=["closed", "malformed", "truncated", "silent"],
)
def test_a_call_that_breaks_raises_and_is_never_sent_again(sock_dir, after, cls, phrase):
    fake = FakeDaemon(str(sock_dir / "fake.sock"), "b1", after)
    try:
        pc = _conns(timeout=0.3)
        via = SocketRoute(fake.path, "b1")
        req = pb.CommitRequest(ref=ref_to_pb(TransferRef("b1", 1, "r")), last=True, bytes=1)
        with pytest.raises(E.KvdError) as info:
            pc.call(pc.checkout(via), "Commit", req)
        assert type(info.value) is cls and phrase in str(info.value), info.value
        assert fake.frames == 1, "the commit reached the daemon once: no retry on this or another connection"
        assert pc.idle == 0, "a connection in an unknown state never goes back to the pool"
    finally:
        fake.close()


# ---- a daemon slow to say hello ---------------------------------------------------------------------


class SlowHello(BareDaemon):
    """Answers each hello after the next of ``delays`` (seconds; none left: at once), each
    connection on a thread of its own, then holds the connection until the caller closes it.
    Counts the connections it accepted."""

    def __init__(self, path: str, boot: str, delays: list[float]) -> None:
        self.delays = list(delays)
        self.accepted = 0
        super().__init__(path, boot, backlog=64)

    def serve(self, c: socket.socket) -> None:
        self.accepted += 1
        delay = self.delays.pop(0) if self.delays else 0.0
        threading.Thread(target=self._answer, args=(c, delay), daemon=True).start()

    def _answer(self, c: socket.socket, delay: float) -> None:
        try:
            self.hello(c, delay)
            c.recv(1)  # held until the caller closes it
        except OSError:
            pass


def _checkout_within(pc: PeerConnections, via: SocketRoute, seconds: float) -> tuple[object, float]:
    """Check out until a connection comes or ``seconds`` pass, as a Send's calls would; returns
    it (or None) and the longest a single checkout took."""
    end, longest = time.monotonic() + seconds, 0.0
    while True:
        t0 = time.monotonic()
        got = pc.checkout(via)
        longest = max(longest, time.monotonic() - t0)
        if got is not None or time.monotonic() > end:
            return got, longest
        time.sleep(0.01)


def test_a_slow_hello_sends_calls_over_grpc_only_until_the_daemon_answers_again(sock_dir):
    """One hello unanswered within the timeout (a busy host) makes that call go over gRPC; the
    route is not left for ``retry_s`` (set to an hour here): a probe says hello meanwhile and the
    route serves calls again once it is answered. No checkout waits for the probe."""
    fake = SlowHello(str(sock_dir / "slow.sock"), "b1", [0.6])
    pc = _conns(timeout=0.3, retry_s=3600)
    try:
        via = SocketRoute(fake.path, "b1")
        t0 = time.monotonic()
        assert pc.checkout(via) is None  # its hello unanswered within 0.3 s
        assert 0.25 < time.monotonic() - t0 < 0.6
        got, longest = _checkout_within(pc, via, 5.0)
        assert got is not None, "the route stayed on gRPC although its daemon answers hellos again"
        assert longest < 0.1, f"a checkout waited {longest:.3f} s for a hello: only the probe may"
        assert fake.accepted == 2  # the caller's hello, then one probe's (answered at once)
    finally:
        pc.close()
        fake.close()


def test_a_daemon_that_never_says_hello_is_probed_one_hello_at_a_time(sock_dir):
    """A hung daemon (its socket accepting, no hello answered): every checkout returns None at
    once, one probe at a time says hello (about one per timeout), and it stops with the route's
    failure (``retry_s``) and when the pool closes."""
    fake = SlowHello(str(sock_dir / "hung.sock"), "b1", [3600.0] * 100)
    pc = _conns(timeout=0.5, retry_s=2.0)
    try:
        via = SocketRoute(fake.path, "b1")
        t0 = time.monotonic()
        assert pc.checkout(via) is None  # failed from ~t0 + 0.5 to ~t0 + 2.5
        got, longest = _checkout_within(pc, via, 1.0)
        assert got is None and longest < 0.25, f"a checkout waited {longest:.3f} s: a hello of its own (0.5 s)"
        time.sleep(max(0.0, t0 + 3.2 - time.monotonic()))  # the failure ran out; the last probe's hello too
        seen = fake.accepted
        # ~2 s of failure / (0.5 s a hello + 0.125 s apart): the caller's hello and at most 4 probes (5 with a slow start).
        assert 2 <= seen <= 6, seen
        time.sleep(0.8)
        assert fake.accepted == seen, "the probe went on after the route's failure ran out"
        assert pc.checkout(via) is None and fake.accepted >= seen + 1  # the next call's own hello: probing again
        pc.close()
        time.sleep(0.7)  # a probe's hello in progress ends within its timeout
        seen = fake.accepted
        time.sleep(0.8)
        assert fake.accepted == seen, "probes after the pool closed"
    finally:
        pc.close()
        fake.close()


def test_a_probe_that_cannot_start_leaves_the_route_to_be_tried_again(sock_dir, monkeypatch, caplog):
    """At the process's thread limit the probe of a slow route cannot start: the checkout still
    answers None (the call goes over gRPC) instead of raising into the Send, and the route is
    not left marked as probed -- once its failure runs out, a hello is said again and a probe
    starts when one can."""
    fake = SlowHello(str(sock_dir / "slow.sock"), "b1", [0.6, 0.6])
    pc = _conns(timeout=0.3, retry_s=0.5)
    failures = proc_kit.failing_thread_starts(monkeypatch, peer_conns)
    try:
        via = SocketRoute(fake.path, "b1")
        with caplog.at_level(logging.WARNING, "kvd.peer_socket"):
            assert pc.checkout(via) is None  # its hello unanswered; no probe could start
        assert "could not start its probe" in caplog.text
        assert not failures and not pc._probing
        time.sleep(0.6)  # the route's failure ran out: the next checkout says hello again (slow again: a probe now)
        assert pc.checkout(via) is None
        got, _ = _checkout_within(pc, via, 5.0)
        assert got is not None, "the route never served calls again"
        assert fake.accepted == 3  # two slow hellos, then the probe's, answered at once
    finally:
        pc.close()
        fake.close()
