"""Issue 16: the handoff in fewer calls -- the decode side's allocate + RECV lease in one
(``allocate_recv``), the prefill side's last Send that also frees (``send(free=True)``) -- moves
the same bytes as the long flow, and refuses what it must before anything changes."""

from __future__ import annotations

import daemon_kit as dk
import grpc
import handoff_kit as hk

from kvd import errors as E
from kvd.client import SendSpec, TransferState
from kvd.records import LeaseKind


def test_short_flow_lands_the_same_bytes_and_frees_the_prefill_request(hp):
    rid = dk.rid("fused")
    hp.p.scatter(hp.rnd, dk.rid("pf"))
    hp.d.scatter(hp.rnd, dk.rid("df"))
    src = hp.p.alloc(rid, 70)
    dst, lease = hp.d.c.allocate_recv(rid, 70)
    hp.d.live.add(rid)
    assert lease.kind is LeaseKind.RECV and lease.rid == rid and lease.ticket
    assert hp.d.c.vectors(rid).full.tolist() == dst.full.tolist()  # the vectors the ticket names
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()

    r = hp.p.c.send(rid, lease.ticket, free=True)
    assert "free" in r.phases, r.phases  # freed by the daemon: no Free call
    hp.p.live.discard(rid)
    with dk.expect(E.NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        hp.p.c.vectors(rid)
    assert hp.d.c.wait_ready(rid, 5).state is TransferState.READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    assert hp.d.free(rid) == 1
    hp.check()


def test_free_without_last_is_refused_before_anything_moves(hp):
    rid, src, dst, lease = hp.setup_request(40, prefix="fused-nolast")
    with dk.expect(E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "free=true needs last=true"):
        hp.p.c.send(rid, lease.ticket, end=16, last=False, free=True)
    assert hp.d.c.wait_ready(rid, 0).state is TransferState.WAITING  # the receiver never heard
    assert hp.p.c.vectors(rid).tokens == 40  # still allocated
    hp.p.c.send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is TransferState.READY
    hp.p.free(rid)
    hp.d.free(rid)
    hp.check()


def test_allocate_recv_takes_the_lease_ttl_asked_for(hp):
    """A ticket that waits for its prompt longer than the daemon's lease TTL asks for more in the
    same call, and its bytes land exactly; without one the lease takes the daemon's TTL."""
    asked, default = dk.rid("fused-ttl"), dk.rid("fused-ttl-default")
    src = hp.p.alloc(asked, 24)
    dst, lease = hp.d.c.allocate_recv(asked, 24, ttl=123.0)
    hp.d.live.add(asked)
    assert 120.0 < lease.expires_in <= 123.0, lease
    hp.p.c.allocate(default, 8)
    hp.p.live.add(default)
    _, plain = hp.d.c.allocate_recv(default, 8)
    hp.d.live.add(default)
    assert 0 < plain.expires_in <= hk.DAEMON_OPTS["lease_ttl_s"], plain  # the pair's daemons' TTL
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    r = hp.p.c.send(asked, lease.ticket, free=True)
    assert "free" in r.phases, r.phases
    hp.p.live.discard(asked)
    assert hp.d.c.wait_ready(asked, 5).state is TransferState.READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    hp.d.c.release_lease(plain.lease_id)
    for rid in (asked, default):
        assert hp.d.free(rid) == 1
    assert hp.p.free(default) == 1
    hp.check()


def test_allocate_recv_of_a_taken_id_changes_nothing(hp):
    rid = dk.rid("fused-dup")
    hp.d.alloc(rid, 32, receive=True)
    before = hp.d.c.stats()
    with dk.expect(E.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, rid):
        hp.d.c.allocate_recv(rid, 32)
    after = hp.d.c.stats()
    assert after.leases_live == before.leases_live and after.pool.requests_live == before.pool.requests_live
    hp.d.free(rid)
    hp.check()


def test_send_many_items_with_free_are_freed_once_sent_and_the_others_stay(hp):
    a, src_a, dst_a, lease_a = hp.setup_request(40, prefix="fused-many-a")
    b, src_b, dst_b, lease_b = hp.setup_request(24, scatter=False, prefix="fused-many-b")
    out = hp.p.c.send_many([SendSpec(a, lease_a.ticket, free=True), SendSpec(b, lease_b.ticket)])
    assert "free" in out[0].phases and "free" not in out[1].phases, (out[0].phases, out[1].phases)
    hp.p.live.discard(a)
    with dk.expect(E.NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        hp.p.c.vectors(a)
    assert hp.p.c.vectors(b).tokens == 24  # not asked to: still allocated
    for rid in (a, b):
        assert hp.d.c.wait_ready(rid, 5).state is TransferState.READY
    assert hp.p.free(b) == 1 and hp.d.free(a) == 1 and hp.d.free(b) == 1
    hp.check()


def test_a_send_many_item_with_free_but_not_last_fails_alone(hp):
    a, _, _, lease_a = hp.setup_request(40, prefix="fused-many-nolast")
    b, _, _, lease_b = hp.setup_request(24, scatter=False, prefix="fused-many-ok")
    out = hp.p.c.send_many([SendSpec(a, lease_a.ticket, end=16, last=False, free=True), SendSpec(b, lease_b.ticket)])
    assert isinstance(out[0], E.InvalidArgument) and "free=true needs last=true" in str(out[0]), out[0]
    assert hp.d.c.wait_ready(a, 0).state is TransferState.WAITING  # its receiver never heard
    assert hp.p.c.vectors(a).tokens == 40
    assert hp.d.c.wait_ready(b, 5).state is TransferState.READY
    hp.p.c.send(a, lease_a.ticket)  # the whole request, now: it lands as any other
    assert hp.d.c.wait_ready(a, 5).state is TransferState.READY
    for rid in (a, b):
        hp.p.free(rid)
        hp.d.free(rid)
    hp.check()
