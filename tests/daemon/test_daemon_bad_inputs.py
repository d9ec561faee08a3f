"""Bad input gets its precise status code and leaves the pool unchanged (DESIGN §7).

Every case runs against a small "world" of requests in known states (live, leased, offloaded,
freed) and asserts: the kvd exception class, the gRPC status code behind it, a key phrase of
the message, and that the node's stats (and, in-process, ``check()``) are identical before and
after -- except for the refusal counters a case is expected to bump.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from daemon_kit import Target, expect, expect_rpc, rid, start_inproc, stop_inproc

from kvd import errors as E
from kvd.client import Client
from kvd.rpc.status import from_rpc_error
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.handoff.ticket import read as read_ticket
from kvd.rpc.convert import SESSION_KEY

C = grpc.StatusCode
HUGE = 2**62  # fits the wire's int64, far beyond any arena


@dataclass
class World:
    t: Target
    c: Client  # owns everything below
    other: Client  # another session
    live: str
    vec: Any  # live's vectors
    leased: str
    lease: Any  # a live RECV lease on `leased`
    offloaded: str
    freed: str
    released: int  # a lease id that was released

    def snapshot(self):
        return self.t.snapshot(self.c)


@pytest.fixture
def world(target) -> World:
    c = target.connect(name="owner")
    other = target.connect(name="intruder")
    live, leased, offloaded, freed = rid("live"), rid("leased"), rid("off"), rid("freed")
    vec, *_ = c.allocate_many([(live, 20), (leased, 8, True), (offloaded, 8), (freed, 4)])
    lease = c.acquire_lease(leased, "recv", ttl=60)
    released = c.acquire_lease(live, "send").lease_id
    c.release_lease(released)
    c.offload(offloaded)
    c.free(freed)
    return World(target, c, other, live, vec, leased, lease, offloaded, freed, released)


def unchanged(w: World, before, **bumped: int) -> None:
    """Stats equal ``before`` except counters in ``bumped`` (name -> increment); invariants hold."""
    want = copy.deepcopy(before)
    for name, inc in bumped.items():
        holder = want.pool if hasattr(want.pool, name) else want
        setattr(holder, name, getattr(holder, name) + inc)
    assert w.snapshot() == want
    w.t.check()


# (id, call, class, status code, phrase, counters the refusal bumps)
CASES = [
    ("alloc-negative", lambda w: w.c.allocate(rid(), -5), E.InvalidArgument, C.INVALID_ARGUMENT, "must be positive, got -5", {}),
    ("alloc-zero", lambda w: w.c.allocate(rid(), 0), E.InvalidArgument, C.INVALID_ARGUMENT, "must be positive, got 0", {}),
    ("alloc-huge", lambda w: w.c.allocate(rid(), HUGE), E.CapacityError, C.RESOURCE_EXHAUSTED, "does not fit", {}),
    ("alloc-empty-id", lambda w: w.c.allocate("", 8), E.InvalidArgument, C.INVALID_ARGUMENT, "non-empty string", {}),
    ("alloc-existing", lambda w: w.c.allocate(w.live, 8), E.AlreadyExists, C.ALREADY_EXISTS, "already exists", {}),
    ("alloc-offloaded-id", lambda w: w.c.allocate(w.offloaded, 8), E.AlreadyExists, C.ALREADY_EXISTS, "already exists", {}),
    ("alloc-twice-in-batch", lambda w: w.c.allocate_many([("dup", 4), ("dup", 4)]), E.AlreadyExists, C.ALREADY_EXISTS, "'dup' already", {}),
    ("alloc-batch-one-bad", lambda w: w.c.allocate_many([(rid(), 4), (rid(), -1)]), E.InvalidArgument, C.INVALID_ARGUMENT, "positive", {}),
    ("alloc-batch-too-big", lambda w: w.c.allocate_many([(rid(), 4), (rid(), HUGE)]), E.CapacityError, C.RESOURCE_EXHAUSTED, "2 request(s)", {}),
    ("alloc-empty-batch", lambda w: w.c.allocate_many([]), E.InvalidArgument, C.INVALID_ARGUMENT, "no requests given", {}),
    ("shortfall-negative", lambda w: w.c.shortfall([(rid(), -1)]), E.InvalidArgument, C.INVALID_ARGUMENT, "positive", {}),
    ("extend-unknown", lambda w: w.c.extend("no-such", 4), E.NotFound, C.NOT_FOUND, "'no-such' is not allocated", {}),
    ("extend-freed", lambda w: w.c.extend(w.freed, 4), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("extend-zero", lambda w: w.c.extend(w.live, 0), E.InvalidArgument, C.INVALID_ARGUMENT, "positive, got 0", {}),
    ("extend-negative", lambda w: w.c.extend(w.live, -4), E.InvalidArgument, C.INVALID_ARGUMENT, "positive, got -4", {}),
    ("extend-huge", lambda w: w.c.extend(w.live, HUGE), E.CapacityError, C.RESOURCE_EXHAUSTED, "does not fit", {}),
    ("extend-twice-in-batch", lambda w: w.c.extend_many([(w.live, 4), (w.live, 4)]), E.InvalidArgument, C.INVALID_ARGUMENT, "appears twice", {}),
    ("extend-batch-one-unknown", lambda w: w.c.extend_many([(w.live, 4), ("nope", 4)]), E.NotFound, C.NOT_FOUND, "'nope'", {}),
    ("extend-offloaded", lambda w: w.c.extend(w.offloaded, 4), E.FailedPrecondition, C.FAILED_PRECONDITION, "restore it first", {}),
    ("free-unknown", lambda w: w.c.free("no-such"), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("double-free", lambda w: w.c.free(w.freed), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("free-twice-in-batch", lambda w: w.c.free(w.live, w.live), E.InvalidArgument, C.INVALID_ARGUMENT, "appears twice", {}),
    ("free-batch-one-unknown", lambda w: w.c.free(w.live, "nope"), E.NotFound, C.NOT_FOUND, "'nope'", {}),
    ("free-leased", lambda w: w.c.free(w.leased), E.FailedPrecondition, C.FAILED_PRECONDITION, "pinned by lease", {}),
    ("vectors-unknown", lambda w: w.c.vectors("no-such"), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("vectors-offloaded", lambda w: w.c.vectors(w.offloaded), E.FailedPrecondition, C.FAILED_PRECONDITION, "offloaded", {}),
    ("vectors-many-one-freed", lambda w: w.c.vectors_many([w.live, w.freed]), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("lease-unknown", lambda w: w.c.acquire_lease("no-such", "recv"), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("lease-negative-ttl", lambda w: w.c.acquire_lease(w.live, "recv", ttl=-1), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    ("lease-huge-ttl", lambda w: w.c.acquire_lease(w.live, "recv", ttl=1e9), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    ("lease-offloaded", lambda w: w.c.acquire_lease(w.offloaded, "send"), E.FailedPrecondition, C.FAILED_PRECONDITION, "offloaded", {}),
    ("lease-other-boot", lambda w: w.c.acquire_lease(w.live, "recv", vectors=w.vec._replace(boot_id="f" * 16)),
     E.StaleEpoch, C.FAILED_PRECONDITION, "daemon restarted", {"stale_refusals_total": 1}),
    ("lease-future-epoch", lambda w: w.c.acquire_lease(w.live, "recv", vectors=w.vec._replace(epoch=w.vec.epoch + 100)),
     E.StaleEpoch, C.FAILED_PRECONDITION, "is stale", {"stale_refusals_total": 1}),
    # allocate_recv's lease TTL is refused as acquire_lease's, before anything is allocated
    ("alloc-recv-negative-ttl", lambda w: w.c.allocate_recv(rid(), 8, ttl=-1), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    ("alloc-recv-huge-ttl", lambda w: w.c.allocate_recv(rid(), 8, ttl=1e9), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    ("alloc-recv-nan-ttl", lambda w: w.c.allocate_recv(rid(), 8, ttl=float("nan")), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    # chunk_tokens sizes the transfer a ticket begins: without one it is refused, not ignored
    ("alloc-chunk-no-ticket", lambda w: w.c.allocate(rid(), 8, chunk_tokens=4), E.InvalidArgument, C.INVALID_ARGUMENT,
     "pass the decode daemon's ticket too, or leave it 0", {}),
    ("alloc-recv-chunk-no-ticket", lambda w: w.c.allocate(rid(), 8, receive=True, chunk_tokens=4), E.InvalidArgument,
     C.INVALID_ARGUMENT, "chunk_tokens is the prefill chunk of the transfer a ticket begins", {}),
    ("renew-unknown", lambda w: w.c.renew_lease(10**9), E.NotFound, C.NOT_FOUND, "is not live", {}),
    ("renew-released", lambda w: w.c.renew_lease(w.released), E.NotFound, C.NOT_FOUND, "is not live", {}),
    ("renew-negative-ttl", lambda w: w.c.renew_lease(w.lease.lease_id, ttl=-3), E.InvalidArgument, C.INVALID_ARGUMENT, "lease ttl", {}),
    ("double-release", lambda w: w.c.release_lease(w.released), E.NotFound, C.NOT_FOUND, "is not live", {}),
    ("offload-unknown", lambda w: w.c.offload("no-such"), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("offload-leased", lambda w: w.c.offload(w.leased), E.FailedPrecondition, C.FAILED_PRECONDITION, "pinned by lease", {}),
    ("offload-twice", lambda w: w.c.offload(w.offloaded), E.FailedPrecondition, C.FAILED_PRECONDITION, "offloaded", {}),
    ("restore-live", lambda w: w.c.restore(w.live), E.FailedPrecondition, C.FAILED_PRECONDITION, "it is live", {}),
    ("restore-unknown", lambda w: w.c.restore("no-such"), E.NotFound, C.NOT_FOUND, "not allocated", {}),
    ("finalize-eager", lambda w: w.c.finalize(1 << 20), E.FailedPrecondition, C.FAILED_PRECONDITION, "built eagerly", {}),
    ("finalize-no-bytes", lambda w: w.c.finalize(None), E.FailedPrecondition, C.FAILED_PRECONDITION, "built eagerly", {}),
    ("resize-eager", lambda w: w.c.resize(1 << 20), E.FailedPrecondition, C.FAILED_PRECONDITION, "post_capture=True", {}),
]

# Client-chosen strings are bounded on every RPC (kvd.limits, checked by kvd.rpc.convert.parse_request
# before any handler runs): a 1 MiB request id used to be allocated, and a refusal quoting it
# overflowed gRPC's metadata limit (a bare RESOURCE_EXHAUSTED the client took for CapacityError).
MiB_ID, LONG_ID = "m" * (1 << 20), "x" * 257
WIDE_ID = "é" * 128 + "x"  # 129 characters, 257 bytes of UTF-8: the bound counts bytes


def _over(method: str, field: str, n: int = 1 << 20, limit: int = 256) -> str:
    return f"{method}: {field} is {n:,d} bytes of UTF-8, over the limit of {limit:,d}"


BOUNDS = [
    ("alloc-1MiB-id", lambda w: w.c.allocate(MiB_ID, 8), _over("Allocate", "requests[0].rid")),
    ("alloc-257-id", lambda w: w.c.allocate(LONG_ID, 8), _over("Allocate", "requests[0].rid", 257)),
    ("alloc-257-byte-wide-id", lambda w: w.c.allocate(WIDE_ID, 8), _over("Allocate", "requests[0].rid", 257)),
    ("alloc-many-second-id", lambda w: w.c.allocate_many([(rid(), 4), (MiB_ID, 4)]), _over("Allocate", "requests[1].rid")),
    ("shortfall-id", lambda w: w.c.shortfall([(MiB_ID, 4)]), _over("CanAllocate", "requests[0].rid")),
    ("extend-id", lambda w: w.c.extend_many([(w.live, 4), (MiB_ID, 4)]), _over("Extend", "items[1].rid")),
    ("free-id", lambda w: w.c.free(w.live, MiB_ID), _over("Free", "rids[1]")),
    ("vectors-id", lambda w: w.c.vectors_many([w.live, MiB_ID]), _over("GetVectors", "rids[1]")),
    ("lease-id", lambda w: w.c.acquire_lease(MiB_ID, "recv"), _over("AcquireLease", "rid")),
    ("lease-boot-id", lambda w: w.c.acquire_lease(w.live, "recv", vectors=w.vec._replace(boot_id=LONG_ID)),
     _over("AcquireLease", "boot_id", 257)),
    ("offload-id", lambda w: w.c.offload(MiB_ID), _over("Offload", "rid")),
    ("restore-id", lambda w: w.c.restore(MiB_ID), _over("Restore", "rid")),
    ("begin-send-id", lambda w: w.c.begin_send(MiB_ID, w.lease.ticket), _over("BeginSend", "rid")),
    ("send-id", lambda w: w.c.send(MiB_ID, w.lease.ticket), _over("Send", "rid")),
    ("send-many-id", lambda w: w.c.send_many([(w.live, w.lease.ticket), (MiB_ID, w.lease.ticket)]), _over("SendMany", "items[1].rid")),
    ("wait-id", lambda w: w.c.wait_ready(MiB_ID, timeout=0), _over("WaitReady", "rid")),
    ("abort-id", lambda w: w.c.abort(MiB_ID), _over("Abort", "rid")),
    ("abort-reason", lambda w: w.c.abort(w.leased, "y" * 1025), _over("Abort", "reason", 1025, 1024)),
    ("session-name", lambda w: w.t.connect(name=MiB_ID), _over("OpenSession", "name")),
]


@pytest.mark.parametrize("call,phrase", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_client_strings_are_bounded_on_every_rpc(world, call, phrase):
    """Over its bound, a string is INVALID_ARGUMENT naming the method, the field, its length and
    the limit, quoting a bounded prefix of it; nothing changes."""
    before = world.snapshot()
    with expect(E.InvalidArgument, C.INVALID_ARGUMENT, phrase) as info:
        call(world)
    assert len(str(info.value)) < 300, "the refusal quotes a bounded prefix, not the string"
    unchanged(world, before)


def test_strings_at_their_bound_are_accepted(world):
    """256 bytes of UTF-8 is a request id (wide characters count as their bytes), a session name;
    1024 bytes a reason. A refusal naming such an id quotes 64 characters of it."""
    c = world.c
    for r in ("a" * 256, "é" * 128):
        assert c.allocate(r, 8).rid == r
        assert c.vectors(r).rid == r
        assert c.free(r) == 1
        with expect(E.NotFound, C.NOT_FOUND, f"{r[:64]!r}…(256 bytes) is not allocated") as info:
            c.extend(r, 4)
        assert len(str(info.value)) < 200
    named = world.t.connect(name="n" * 256)
    assert named.allocate(rid(), 4)
    with expect(E.NotFound, C.NOT_FOUND, "has no transfer in progress"):
        c.abort(world.live, "z" * 1024)  # the reason passed its bound: the request has no transfer


@pytest.mark.parametrize("call,cls,code,phrase,bumped", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_refused_pool_unchanged(world, call, cls, code, phrase, bumped):
    before = world.snapshot()
    with expect(cls, code, phrase):
        call(world)
    unchanged(world, before, **bumped)


# Another session may not touch the owner's requests or leases.
DENIED = [
    ("extend", lambda w: w.other.extend(w.live, 4)),
    ("extend-many", lambda w: w.other.extend_many([(w.live, 4)])),
    ("free", lambda w: w.other.free(w.live)),
    ("free-offloaded", lambda w: w.other.free(w.offloaded)),
    ("vectors", lambda w: w.other.vectors(w.live)),
    ("lease", lambda w: w.other.acquire_lease(w.live, "send")),
    ("renew", lambda w: w.other.renew_lease(w.lease.lease_id)),
    ("release", lambda w: w.other.release_lease(w.lease.lease_id)),
    ("offload", lambda w: w.other.offload(w.live)),
    ("restore", lambda w: w.other.restore(w.offloaded)),
]


@pytest.mark.parametrize("call", [d[1] for d in DENIED], ids=[d[0] for d in DENIED])
def test_permission_denied_across_sessions(world, call):
    before = world.snapshot()
    with expect(E.PermissionDenied, C.PERMISSION_DENIED, "another client session"):
        call(world)
    unchanged(world, before)
    # The owner still can.
    assert world.c.vectors(world.live).rid == world.live


def test_raw_stub_codes_and_metadata(world):
    """The wire itself: status codes and the kvd-error trailing metadata, without the client."""
    ch = grpc.insecure_channel(world.t.tcp)
    stub = pb_grpc.KvdStub(ch)
    md = ((SESSION_KEY, world.c.session_id),)
    before = world.snapshot()
    try:
        with expect_rpc(C.INVALID_ARGUMENT, "call OpenSession first", "InvalidArgument"):
            stub.GetVectors(pb.GetVectorsRequest(rids=[world.live]), timeout=5)
        with expect_rpc(C.NOT_FOUND, "unknown or expired", "SessionGone"):
            stub.GetVectors(pb.GetVectorsRequest(rids=[world.live]), metadata=((SESSION_KEY, "0" * 32),), timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "session ttl must be in [0, 3600]", "InvalidArgument"):
            stub.OpenSession(pb.OpenSessionRequest(name="x", ttl_seconds=-1), timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "would keep a dead client's pages", "InvalidArgument"):
            stub.OpenSession(pb.OpenSessionRequest(name="x", ttl_seconds=1e9), timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "must be positive, got -3", "InvalidArgument"):
            stub.Allocate(pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=-3)]), metadata=md, timeout=5)
        with expect_rpc(C.RESOURCE_EXHAUSTED, "does not fit", "CapacityError") as info:
            stub.Allocate(pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=2**63 - 1)]), metadata=md, timeout=5)
        shortfall = int(dict(info.value.trailing_metadata())["kvd-shortfall-bytes"])
        assert shortfall > 2**63  # bytes, not pages: the metadata carries what uint64 cannot
        exc = from_rpc_error(info.value)
        assert type(exc) is E.CapacityError and exc.shortfall_bytes == shortfall
        with expect_rpc(C.INVALID_ARGUMENT, "set lease=true too", "InvalidArgument"):
            stub.Allocate(pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=8, receive=True, lease_ttl_seconds=30)]),
                          metadata=md, timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "a request with a ticket takes none", "InvalidArgument"):
            stub.Allocate(pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=8, ticket=b"t", lease_ttl_seconds=30)]),
                          metadata=md, timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "pass the decode daemon's ticket too", "InvalidArgument"):
            stub.Allocate(pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=8, receive=True, lease=True, chunk_tokens=4)]),
                          metadata=md, timeout=5)
        with expect_rpc(C.INVALID_ARGUMENT, "lease kind must be SEND or RECV", "InvalidArgument"):
            stub.AcquireLease(pb.AcquireLeaseRequest(rid=world.live, kind=pb.LEASE_KIND_UNSPECIFIED), metadata=md, timeout=5)
        with expect_rpc(C.FAILED_PRECONDITION, "built eagerly", "FailedPrecondition"):
            stub.Finalize(pb.FinalizeRequest(has_bytes=False), metadata=md, timeout=5)
        with expect_rpc(C.NOT_FOUND, "lease 0 is not live", "NotFound"):
            stub.RenewLease(pb.RenewLeaseRequest(lease_id=0), metadata=md, timeout=5)
        with expect_rpc(C.FAILED_PRECONDITION, "stale", "StaleEpoch"):
            stub.AcquireLease(
                pb.AcquireLeaseRequest(rid=world.live, kind=pb.SEND, boot_id=world.vec.boot_id, epoch=world.vec.epoch + 7),
                metadata=md, timeout=5,
            )
        unchanged(world, before, stale_refusals_total=1)
        # A huge request is a question with a (huge) answer, not an error: it must not be INTERNAL.
        r = stub.CanAllocate(pb.CanAllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=2**63 - 1)]), metadata=md, timeout=5)
        assert not r.fits and r.shortfall_bytes == 2**64 - 1  # saturated: the true shortfall exceeds uint64
        assert world.c.shortfall([(rid(), HUGE)]) == 2**64 - 1
        unchanged(world, before, stale_refusals_total=1)
    finally:
        ch.close()


# ---- tickets: the Peer service --------------------------------------------------------------


def _check(stub, blob: bytes):
    return stub.CheckTicket(pb.CheckTicketRequest(ticket=blob), timeout=5)


def _edit(t: pb.Ticket, fields: dict) -> pb.Ticket:
    for k, v in fields.items():
        if k == "clear":
            t.ClearField(v)
        else:
            setattr(t, k, v)
    return t


def _tampered(blob: bytes, **fields) -> bytes:
    """The ticket's body edited, under its old seal (what a carrier that rewrote it sends)."""
    sealed = pb.SealedTicket.FromString(blob)
    body = _edit(pb.Ticket.FromString(sealed.body), fields).SerializeToString()
    return pb.SealedTicket(body=body, seal=sealed.seal).SerializeToString()


def _edited(w: World, blob: bytes, **fields) -> bytes:
    """The ticket's body edited and sealed again with the daemon's own key (in-process only: the
    key never leaves it), so that the checks behind the seal are reached."""
    if w.t.daemon is None:
        pytest.skip("a ticket edited under a valid seal can be made only in the daemon's process")
    return w.t.daemon.tickets.seal(_edit(read_body(blob), fields))


def read_body(blob: bytes) -> pb.Ticket:
    return pb.Ticket.FromString(pb.SealedTicket.FromString(blob).body)


TICKETS = [
    # (id, make ticket bytes from the world, code, kvd class, phrase, bumped)
    ("empty", lambda w: b"", C.INVALID_ARGUMENT, E.InvalidArgument, "ticket is empty", {}),
    ("garbage", lambda w: b"\xff\xfe garbage \x00\x01", C.INVALID_ARGUMENT, E.InvalidArgument, "do not parse", {}),
    ("truncated", lambda w: w.lease.ticket[: len(w.lease.ticket) // 2], C.INVALID_ARGUMENT, E.InvalidArgument, "do not parse", {}),
    ("other-message", lambda w: pb.Stats(boot_id="x", epoch=3).SerializeToString(), C.INVALID_ARGUMENT, E.InvalidArgument, "ticket", {}),
    ("bare-body", lambda w: pb.SealedTicket.FromString(w.lease.ticket).body, C.INVALID_ARGUMENT, E.InvalidArgument, "ticket", {}),
    ("other-boot", lambda w: _tampered(w.lease.ticket, boot_id="b" * 16), C.FAILED_PRECONDITION, E.StaleEpoch, "it restarted",
     {"stale_refusals_total": 1}),
    ("tampered-lease", lambda w: _tampered(w.lease.ticket, lease_id=w.released), C.PERMISSION_DENIED, E.PermissionDenied,
     "does not carry this daemon's seal", {}),
    ("tampered-layout", lambda w: _tampered(w.lease.ticket, layout_fingerprint="0123456789abcdef"), C.PERMISSION_DENIED,
     E.PermissionDenied, "does not carry this daemon's seal", {}),
    ("tampered-seal", lambda w: w.lease.ticket[:-1] + bytes([w.lease.ticket[-1] ^ 1]), C.PERMISSION_DENIED, E.PermissionDenied,
     "does not carry this daemon's seal", {}),
    # Behind a valid seal (the daemon's own key, in-process): the field checks.
    ("future-version", lambda w: _edited(w, w.lease.ticket, version=3), C.INVALID_ARGUMENT, E.InvalidArgument, "version 3 is not supported", {}),
    ("no-vectors", lambda w: _edited(w, w.lease.ticket, clear="vectors"), C.INVALID_ARGUMENT, E.InvalidArgument, "incomplete", {}),
    ("no-rid", lambda w: _edited(w, w.lease.ticket, rid=""), C.INVALID_ARGUMENT, E.InvalidArgument, "incomplete (missing ['rid'])", {}),
    ("wrong-layout", lambda w: _edited(w, w.lease.ticket, layout_fingerprint="0123456789abcdef"),
     C.INVALID_ARGUMENT, E.LayoutMismatch, "layout fingerprint '0123456789abcdef' does not match", {}),
    ("released-lease", lambda w: _edited(w, w.lease.ticket, lease_id=w.released), C.NOT_FOUND, E.NotFound, "is not live", {}),
    ("unknown-lease", lambda w: _edited(w, w.lease.ticket, lease_id=10**9), C.NOT_FOUND, E.NotFound, "is not live", {}),
    ("lease-for-other-request", lambda w: _edited(w, w.lease.ticket, rid=w.live), C.INVALID_ARGUMENT, E.InvalidArgument,
     "recv lease on", {}),
]


@pytest.mark.parametrize("make,code,cls,phrase,bumped", [t[1:] for t in TICKETS], ids=[t[0] for t in TICKETS])
def test_bad_ticket_refused_pool_unchanged(world, make, code, cls, phrase, bumped):
    blob = make(world)
    with grpc.insecure_channel(world.t.tcp) as ch:
        stub = pb_grpc.PeerStub(ch)
        assert _check(stub, world.lease.ticket).expires_in_seconds > 0  # the real one passes
        before = world.snapshot()
        with expect_rpc(code, phrase, cls.__name__) as info:
            _check(stub, blob)
        assert type(from_rpc_error(info.value)) is cls
        unchanged(world, before, **bumped)


def test_send_lease_is_not_a_ticket(world):
    send = world.c.acquire_lease(world.live, "send")
    forged = _edited(world, world.lease.ticket, lease_id=send.lease_id, rid=world.live)
    with grpc.insecure_channel(world.t.tcp) as ch:
        before = world.snapshot()
        with expect_rpc(C.INVALID_ARGUMENT, "is a send lease", "InvalidArgument"):
            _check(pb_grpc.PeerStub(ch), forged)
    unchanged(world, before)


def test_stale_ticket_after_restore(world):
    """A ticket quoting an epoch from before the request moved is refused even when it names a
    live lease; the ticket of a released lease is NOT_FOUND."""
    c, r = world.c, world.live
    old = c.acquire_lease(r, "recv")
    c.release_lease(old.lease_id)
    c.offload(r)
    moved = c.restore(r)  # new pages, new epoch for r
    assert moved.epoch > read_ticket(old.ticket).epoch
    new = c.acquire_lease(r, "recv", vectors=moved)
    with grpc.insecure_channel(world.t.tcp) as ch:
        stub = pb_grpc.PeerStub(ch)
        assert _check(stub, new.ticket).expires_in_seconds > 0
        before = world.snapshot()
        with expect_rpc(C.NOT_FOUND, f"lease {old.lease_id} is not live", "NotFound"):
            _check(stub, old.ticket)
        unchanged(world, before)
        with expect_rpc(C.FAILED_PRECONDITION, "is stale", "StaleEpoch"):
            _check(stub, _edited(world, old.ticket, lease_id=new.lease_id))  # live lease, pre-move epoch
        unchanged(world, before, stale_refusals_total=1)


def test_peer_token_required_when_configured(tmp_path):
    t = start_inproc(tmp_path, peer_token="s3cret")
    try:
        c = t.connect()
        r = rid()
        c.allocate(r, 8)
        lease = c.acquire_lease(r, "recv")
        with grpc.insecure_channel(t.tcp) as ch:
            stub = pb_grpc.PeerStub(ch)
            before = t.node.stats()
            with expect_rpc(C.PERMISSION_DENIED, "kvd-token", "PermissionDenied"):
                _check(stub, lease.ticket)
            with expect_rpc(C.PERMISSION_DENIED, "kvd-token", "PermissionDenied"):
                stub.CheckTicket(pb.CheckTicketRequest(ticket=lease.ticket), metadata=(("kvd-token", "wrong"),), timeout=5)
            ok = stub.CheckTicket(pb.CheckTicketRequest(ticket=lease.ticket), metadata=(("kvd-token", "s3cret"),), timeout=5)
            assert ok.expires_in_seconds > 0
            assert t.node.stats() == before
    finally:
        stop_inproc(t)


@pytest.mark.parametrize("bad", ["12", 1.5, True, 2**64])
def test_client_refuses_token_counts_the_wire_cannot_carry(inproc: Target, bad: object) -> None:
    """A token count that is not a 64-bit int is the caller's mistake: InvalidArgument from the
    client (not a TypeError from protobuf), nothing sent, the pool unchanged."""
    c = inproc.connect(name="types")
    before = inproc.snapshot(c)
    with pytest.raises(E.InvalidArgument, match="token count"):
        c.allocate(rid(), bad)  # type: ignore[arg-type]
    with pytest.raises(E.InvalidArgument, match="token count"):
        c.allocate_many([(rid(), 4), (rid(), bad)])  # type: ignore[list-item]
    assert inproc.snapshot(c) == before
    inproc.check()
