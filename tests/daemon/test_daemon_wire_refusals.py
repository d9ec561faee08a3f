"""What reaches a daemon as bytes, not as the client library's messages (DESIGN §7): bytes that do
not parse are INVALID_ARGUMENT naming the method, on every method of both gRPC services and on
the peer socket; a status always fits gRPC's metadata limit; gRPC's own RESOURCE_EXHAUSTED is
never taken for kvd's CapacityError. Each refusal leaves the pool as it was and the daemon
serving the next caller. (The client-chosen strings' bounds per field are in
test_daemon_bad_inputs.py; the handle socket's refusals in tests/core/test_fdpass.py.)"""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import grpc
import pytest
from daemon_kit import Target, expect, expect_rpc, rid, start_inproc, stop_inproc
from google.protobuf.message import DecodeError

from kvd import errors as E
from kvd.client import AsyncClient, Client
from kvd.ipc.frames import MAX_FRAME, MAX_REQUEST
from kvd.records import SocketRoute, TransferRef
from kvd.server.peer_conns import PeerConnections
from kvd.server.peer_link import HEARTBEAT_REFS, DaemonPeerLink
from kvd.server.peer_socket import HELLO, METHODS, OK, REFUSED, frame, read_head
from kvd.rpc.status import from_rpc_error
from kvd.ipc.unix_socket import recv_exact
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import SESSION_KEY, status_from_pb

C = grpc.StatusCode
#: Bytes no request message parses from: a field tag whose wire type (7) does not exist.
JUNK = b"\xff\xff\xff\xff\x0f"
METHODS_OF = [(svc.name, m) for svc in pb.DESCRIPTOR.services_by_name.values() for m in svc.methods]


def _raw_call(t: Target, service: str, method: str, body: bytes, md=()):
    """``body`` as the request of ``/kvd.v1.<service>/<method>``, sent as it is (no serializer)."""
    with grpc.insecure_channel(t.tcp) as ch:
        return ch.unary_unary(f"/kvd.v1.{service}/{method}")(body, metadata=md, timeout=5)


@pytest.mark.parametrize("service,method", METHODS_OF, ids=[f"{s}.{m.name}" for s, m in METHODS_OF])
def test_bytes_that_do_not_parse_are_invalid_argument_naming_the_method(target, service, method):
    """Every method of Kvd and Peer (read from the descriptor: a method added later is covered):
    INVALID_ARGUMENT with kvd's error metadata, naming the method and its message type -- not
    gRPC's INTERNAL "Exception deserializing request!". Nothing changes."""
    with pytest.raises(DecodeError):
        getattr(pb, method.input_type.name).FromString(JUNK)  # the bytes really do not parse
    c = target.connect(name="junk")
    r = rid()
    c.allocate(r, 8)
    before = target.snapshot(c)
    phrase = f"{method.name}: the request did not parse as {method.input_type.full_name}"
    with expect_rpc(C.INVALID_ARGUMENT, phrase, "InvalidArgument") as info:
        _raw_call(target, service, method.name, JUNK, ((SESSION_KEY, c.session_id),))
    assert type(from_rpc_error(info.value)) is E.InvalidArgument
    assert target.snapshot(c) == before
    target.check()
    assert c.vectors(r).rid == r  # the daemon serves the next call


def test_a_session_id_over_its_bound_is_invalid_argument(inproc):
    c = inproc.connect(name="md")
    before = inproc.snapshot(c)
    with expect_rpc(C.INVALID_ARGUMENT, f"metadata {SESSION_KEY!r} is 4,000 bytes, over the limit of 256", "InvalidArgument"):
        _raw_call(inproc, "Kvd", "GetVectors", pb.GetVectorsRequest(rids=["x"]).SerializeToString(), ((SESSION_KEY, "s" * 4000),))
    assert inproc.snapshot(c) == before


# ---- the peer socket of a real daemon ---------------------------------------------------------


@pytest.fixture
def with_peer_socket(tmp_path):
    t = start_inproc(tmp_path, backend="local")
    assert t.daemon.peer_socket is not None
    yield t
    stop_inproc(t)


def _replies(s: socket.socket) -> list[tuple[int, bytes]]:
    """Every frame the daemon sends until it closes (or stops sending for a second)."""
    out = []
    s.settimeout(1.0)
    try:
        while (head := read_head(s)) is not None:
            out.append((head[1], recv_exact(s, head[0])))
    except (TimeoutError, ConnectionError):
        pass
    return out


def _hello(t: Target) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(t.daemon.peer_socket.path)
    s.sendall(frame(HELLO, pb.PeerHello(boot_id=t.node.pool.boot_id)))
    head = read_head(s)
    assert head is not None and head[1] == OK
    recv_exact(s, head[0])
    return s


def test_the_peer_socket_refuses_random_bytes_and_serves_the_next_caller(with_peer_socket):
    """The frame protocol (kvd/server/peer_socket.py): garbage gets an InvalidArgument refusal,
    and where the stream can no longer be followed the connection closes; a first frame that
    parses as a hello for another boot learns who answered, then closes. Never INTERNAL; the
    daemon serves the next caller over the socket."""
    t = with_peer_socket
    before = t.node.stats()
    rng = random.Random(7)
    for i in range(40):
        body = rng.randbytes(rng.randrange(1, 300))
        # A frame head that fits the body, or random bytes taken for a head.
        blob = struct.pack(">IB", len(body), rng.choice([0, 0, *METHODS])) + body if i % 2 else body
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(t.daemon.peer_socket.path)
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)  # a head that promises more than came: the daemon sees EOF
            for kind, reply in _replies(s):
                if kind == REFUSED:
                    exc = status_from_pb(pb.PeerStatus.FromString(reply))
                    assert type(exc) is E.InvalidArgument, (blob, exc)
                else:
                    assert pb.PeerHelloResponse.FromString(reply).boot_id == t.node.pool.boot_id
    # After a hello: a junk body of each method is that method's INVALID_ARGUMENT, the connection in step.
    s = _hello(t)
    for m in METHODS.values():
        s.sendall(struct.pack(">IB", len(JUNK), m.id) + JUNK)
        head = read_head(s)
        assert head is not None and head[1] == REFUSED
        exc = status_from_pb(pb.PeerStatus.FromString(recv_exact(s, head[0])))
        assert type(exc) is E.InvalidArgument and str(exc).startswith(f"{m.name}: the request did not parse as kvd.v1.{m.request.__name__}")
    s.close()
    assert t.node.stats() == before
    pc = PeerConnections(token=None, timeout=5.0)
    try:
        r = pc.call(pc.checkout(SocketRoute(t.daemon.peer_socket.path, t.node.pool.boot_id)), "Heartbeat", pb.HeartbeatRequest(sender="me"))
        assert list(r.dead_lease_ids) == []
    finally:
        pc.close()
    answered = t.daemon.peer_socket.answered()
    assert not any(code == "INTERNAL" for _, code in answered), answered


# ---- statuses that fit, and gRPC's own RESOURCE_EXHAUSTED -------------------------------------


def test_a_pinned_refusal_naming_a_non_ascii_request_reaches_the_client(target):
    """A Pinned error's holders ride in metadata, which gRPC allows only printable ASCII: a lease
    on 'é…' made the whole status INTERNAL "Invalid metadata". Now the label is escaped."""
    c = target.connect(name="compactor")
    rs = [rid(f"é{i}") for i in range(4)]
    vs = c.allocate_many([(r, 16) for r in rs])
    c.free(rs[0], rs[1])  # holes at every group's anchor end: rs[2] and rs[3] must move
    lease = c.acquire_lease(rs[2], "recv", ttl=60, vectors=vs[2])
    with expect(E.Pinned, C.FAILED_PRECONDITION, f"pinned by lease {lease.lease_id}") as info:
        c.compact()
    assert info.value.holders == (f"lease {lease.lease_id} (recv on {ascii(rs[2])})",)
    c.release_lease(lease.lease_id)


def test_refusals_quoting_long_strings_stay_under_the_metadata_limit(inproc):
    """The largest strings a caller may send (256-byte ids, 1 KiB reasons, of 2-byte characters)
    in the refusals that quote them: each arrives as its own kvd class, its message bounded."""
    c = inproc.connect(name="q")
    wide = "é" * 128  # 256 bytes
    c.allocate(wide, 8)
    for call, cls in [
        (lambda: c.allocate(wide, 8), E.AlreadyExists),
        (lambda: c.free("ü" * 128), E.NotFound),
        (lambda: c.abort(wide, "ß" * 512), E.NotFound),
        (lambda: c.extend_many([(wide, 4), (wide, 4)]), E.InvalidArgument),
    ]:
        with pytest.raises(E.KvdError) as info:
            call()
        assert type(info.value) is cls and len(str(info.value).encode()) < 400, info.value
    assert c.free(wide) == 1


def test_grpc_own_resource_exhausted_is_a_transport_error_not_capacity(tmp_path):
    """A request over the daemon's max_request_bytes (4 MiB by default) is refused by the daemon,
    unread, over both transports; one over what any daemon reads (MAX_FRAME) by the client before
    it is sent. All are RESOURCE_EXHAUSTED without kvd's metadata: a plain KvdError naming the
    code, never CapacityError (an engine would wait for memory). One at the limit is served; the
    daemon serves on."""
    inproc = start_inproc(tmp_path)
    try:
        _over_the_request_limit(inproc, inproc.connect(name="big", transport="grpc"), inproc.connect(name="big-fast", transport="fast"))
        asyncio.run(_over_the_request_limit_async(inproc))
        inproc.check()
    finally:
        stop_inproc(inproc)


def _echo_of(size: int) -> bytes:
    """An Echo payload whose request is ``size`` bytes on the wire."""
    req = pb.EchoRequest(payload=b"\1" * (size - 8))
    while req.ByteSize() < size:
        req.payload += b"\1"
    assert req.ByteSize() == size
    return req.payload


def _transport_limit(call) -> E.KvdError:
    with pytest.raises(E.KvdError) as info:
        call()
    assert type(info.value) is E.KvdError and str(info.value).startswith("RESOURCE_EXHAUSTED: "), info.value
    return info.value


def _over_the_request_limit(inproc: Target, c: Client, fast: Client) -> None:
    at = _echo_of(MAX_REQUEST)
    assert c.echo(at) == at and fast.echo(at) == at
    over = at + b"\1"
    assert "Received message larger than max" in str(_transport_limit(lambda: c.echo(over)))  # the daemon's gRPC server
    pooled = len(fast._fast._free)
    assert "max_request_bytes" in str(_transport_limit(lambda: fast.echo(over)))  # the engine socket, unread
    # The daemon closed that connection after its refusal: the client closed it too, not pooled
    # (a later call on it would meet the close: Unavailable, intermittently).
    assert len(fast._fast._free) == pooled - 1 and all(s.fileno() >= 0 for s, _ in fast._fast._free)
    huge = b"\1" * (MAX_FRAME + 1)
    for client in (c, fast):
        err = _transport_limit(lambda: client.echo(huge))  # refused by the client itself
    assert isinstance(err.__cause__, grpc.RpcError) or "send less per call" in str(err)
    with grpc.insecure_channel(inproc.tcp, options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
        echo = ch.unary_unary("/kvd.v1.Kvd/Echo", request_serializer=pb.EchoRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as raw:
            echo(pb.EchoRequest(payload=over), timeout=30)  # refused by the daemon's server
    err = raw.value
    assert err.code() == C.RESOURCE_EXHAUSTED and "kvd-error" not in dict(err.trailing_metadata() or ())
    back = from_rpc_error(err)
    assert type(back) is E.KvdError and not isinstance(back, E.CapacityError) and "not the pool's capacity" in str(back)
    assert c.echo(b"still here") == b"still here" and fast.echo(b"still here") == b"still here"


async def _over_the_request_limit_async(inproc: Target) -> None:
    for transport in ("grpc", "fast"):
        c = await AsyncClient.connect(inproc.unix, name=f"big-async-{transport}", transport=transport)
        try:
            pooled = len(c._fast._free) if c._fast is not None else 0
            with pytest.raises(E.KvdError) as info:
                await c.echo(_echo_of(MAX_REQUEST) + b"\1")
            assert type(info.value) is E.KvdError and str(info.value).startswith("RESOURCE_EXHAUSTED: "), info.value
            if c._fast is not None:  # the connection the daemon closed is not pooled (as above)
                assert len(c._fast._free) == pooled - 1
            assert await c.echo(b"still here") == b"still here"
        finally:
            await c.close()


def test_max_request_bytes_raised_lets_larger_requests_through_both_transports(tmp_path):
    """An operator whose tickets are larger (very long requests in small pages) raises
    max_request_bytes: the daemon then reads requests up to it, over gRPC and the engine socket."""
    inproc = start_inproc(tmp_path, max_request_bytes="8MiB")
    try:
        six = _echo_of(6 << 20)
        for transport in ("grpc", "fast"):
            assert inproc.connect(name=transport, transport=transport).echo(six) == six
        inproc.check()
    finally:
        stop_inproc(inproc)


def test_a_heartbeat_naming_more_transfers_than_one_request_holds_goes_in_parts(tmp_path):
    """A sender with many transfers to one receiver names them all in its heartbeat; past what
    one request may carry (MAX_REQUEST) the receiver would refuse the whole beat, and every
    transfer would look dead to it. The link sends them HEARTBEAT_REFS at a time, and the
    answer names the dead of them all (here every one: the receiver knows none)."""
    refs = [TransferRef("b" * 36, i, f"{i:0250d}") for i in range(1, 15_001)]
    whole = pb.HeartbeatRequest(sender="s" * 256, refs=[pb.TransferRef(boot_id=r.boot_id, lease_id=r.lease_id, rid=r.rid) for r in refs])
    assert whole.ByteSize() > MAX_REQUEST
    inproc = start_inproc(tmp_path)
    link = DaemonPeerLink(timeout=30.0)
    try:
        assert sorted(link.heartbeat(inproc.tcp, "s" * 256, refs)) == [r.lease_id for r in refs]
        assert link.calls() == {("Heartbeat", "grpc"): -(-len(refs) // HEARTBEAT_REFS)}
        assert link.heartbeat(inproc.tcp, "s", []) == []  # none: still one beat (the sender is alive)
        assert link.calls()[("Heartbeat", "grpc")] == -(-len(refs) // HEARTBEAT_REFS) + 1
        inproc.check()
    finally:
        link.close()
        stop_inproc(inproc)
