"""Allocate with a ticket (issue 16) between two real daemons (every variant of ``pair``), over
both engine transports: the prefill engine's Allocate also begins the transfer, the decode
daemon's check runs without being waited for, and the first Send collects its answer -- skipping
the check and the planning when it was accepted, raising the refusal before any byte when not.
Whatever the ticket shows on its own is refused by the Allocate itself, nothing allocated; a
request freed or aborted before its Send tells the receiver, nothing written; an Allocate refused
at a later ticket tells no receiver of the earlier ones."""

from __future__ import annotations

import threading

import daemon_kit as dk
import grpc
import handoff_kit as hk
import pytest

from kvd.client import TransferState
from kvd.errors import Aborted, InvalidArgument, NotFound
from kvd.v1 import kvd_pb2 as pb

READY, WAITING, RECEIVING, FAILED = TransferState.READY, TransferState.WAITING, TransferState.RECEIVING, TransferState.FAILED

TRANSPORTS = ("fast", "grpc")


@pytest.fixture(params=TRANSPORTS)
def prefill(hp, request):
    """A prefill engine's client over each engine transport (its own session)."""
    c = hp.pair.prefill.connect(f"prefill-{request.param}", transport=request.param)
    yield c
    c.close()


def _checks(hp) -> float:
    return sum(hp.pair.prefill.counter("kvd_peer_calls_total", method="CheckTicket", path=p) for p in ("socket", "grpc"))


def _hold_check(monkeypatch, outbox, raw: bytes) -> threading.Event:
    """The check of ticket ``raw`` goes out as ever, but collecting its answer waits (at most
    10 s) for the returned event: a slow receiver, or a collector caught mid-way."""
    release = threading.Event()
    start_check = outbox.link.start_check

    def held(address, ticket, sender, via=None):
        wait = start_check(address, ticket, sender, via)
        if ticket != raw:
            return wait

        def late():
            release.wait(10)
            return wait()

        return late

    monkeypatch.setattr(outbox.link, "start_check", held)
    return release


def _decode_side(hp, tokens: int, prefix: str):
    """The decode engine's half: ``rid`` allocated receive=True with its RECV lease. Returns
    ``(rid, dst vectors, lease)``."""
    rid = dk.rid(prefix)
    dst = hp.d.alloc(rid, tokens, receive=True)
    lease = hp.d.c.acquire_lease(rid, "recv")
    return rid, dst, lease


def test_allocate_with_a_ticket_begins_the_transfer_and_the_send_only_writes(hp, prefill):
    c = prefill
    rid, dst, lease = _decode_side(hp, 70, "alloc-ticket")
    checks0, ahead0 = _checks(hp), hp.pair.prefill.counter("kvd_send_planned_ahead_total")
    src = c.allocate(rid, 70, ticket=lease.ticket)
    assert src.tokens == 70 and len(src.full) == len(dst.full)
    # The check runs on its own: the decode daemon accepts the ticket without a Send.
    dk.wait_for(lambda: hp.d.c.wait_ready(rid, 0).state is RECEIVING, 5, "the decode daemon accepted the ticket")
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    res = c.send(rid, lease.ticket)
    assert "check" not in res.phases and "plan" in res.phases, res.phases
    assert _checks(hp) == checks0 + 1  # the Allocate's, and only that one
    assert hp.pair.prefill.counter("kvd_send_planned_ahead_total") == ahead0 + 1  # planned while the check ran
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    assert c.free(rid) == 1
    assert c.stats().leases_live == 0
    hp.check()


def test_what_the_ticket_shows_is_refused_by_the_allocate_and_nothing_is_allocated(hp, prefill):
    c = prefill
    rid, _, lease = _decode_side(hp, 20, "alloc-ticket-bad")
    before = c.stats().pool
    cases = [
        (dict(rid="another-request", ticket=lease.ticket), "ticket is for request"),
        (dict(rid=rid, ticket=b"not a ticket"), "do not parse as a kvd ticket"),
        (dict(rid=rid, ticket=lease.ticket, receive=True), "cannot be allocated with receive or lease"),
    ]
    for kw, words in cases:
        name = kw.pop("rid")
        with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, words):
            c.allocate(name, 20, **kw)
        assert c.stats().pool == before, kw
    with pytest.raises(InvalidArgument, match="ticket must be the bytes"):
        c.allocate(rid, 20, ticket="a string")  # type: ignore[arg-type]  # refused by the client
    assert hp.d.c.wait_ready(rid, 0).state is WAITING  # the decode daemon never heard of any of them
    c.allocate(rid, 20, ticket=lease.ticket)
    c.send(rid, lease.ticket, free=True)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.check()


def test_a_ticket_the_receiver_refuses_fails_the_first_send_before_any_byte(hp, prefill):
    c = prefill
    rid, _, lease = _decode_side(hp, 30, "alloc-ticket-stale")
    hp.d.c.release_lease(lease.lease_id)  # the ticket names a lease that is gone
    c.allocate(rid, 30, ticket=lease.ticket)  # what the ticket shows holds: allocated
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d = hp.d.arena.clone()
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "is not live"):
        c.send(rid, lease.ticket, free=True)
    assert hp.d.arena.equal(before_d), "a refused ticket wrote into the decode arena"
    assert c.stats().leases_live == 0
    assert c.free(rid) == 1  # not freed by the failed Send: the engine may send elsewhere
    hp.check()


@pytest.mark.parametrize("end", ["free", "abort"])
def test_a_request_that_ends_before_its_send_tells_the_receiver(hp, end):
    rid, _, lease = _decode_side(hp, 30, f"alloc-ticket-{end}")
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d = hp.d.arena.clone()
    hp.p.c.allocate(rid, 30, ticket=lease.ticket)
    if end == "free":
        assert hp.p.c.free(rid) == 1
    else:
        hp.p.c.abort(rid, "the prompt failed")
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is FAILED, st
    assert hp.d.arena.equal(before_d), "nothing was sent, yet the decode arena changed"
    dk.wait_for(lambda: hp.pair.prefill.counter("kvd_transfers_open", direction="out") == 0, 5, "the sender's transfer ended")
    if end == "abort":
        hp.p.c.free(rid)
    assert hp.d.free(rid) == 1
    hp.check()


def test_the_heartbeat_collects_an_answer_no_send_came_for(hp):
    """Left alone, a begun transfer is collected by the sender's heartbeat and kept alive by it
    (not forgotten, not failed): the Send that comes later writes at once."""
    if hp.p.side.node is None:
        pytest.skip("drives the sender's heartbeat by hand: in-process pair only")
    rid, dst, lease = _decode_side(hp, 30, "alloc-ticket-hb")
    src = hp.p.c.allocate(rid, 30, ticket=lease.ticket)
    outbox = hp.pair.prefill.t.daemon.outbox
    outbox.heartbeat_once()
    (ob,) = [o for o in outbox._open.values() if o.rid == rid]
    assert ob.pending is None and ob.began and ob.active == 0 and not ob.aborted, ob
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING
    hk.randomize(hp.p.arena, hp.seed)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    res = hp.p.c.send(rid, lease.ticket, free=True)
    assert "check" not in res.phases
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    hp.check()


@pytest.mark.parametrize("end", ["free", "abort", "receiver-abort"])
def test_a_transfer_that_ends_while_the_heartbeat_collects_its_check_still_tells_the_receiver(hp, end, monkeypatch):
    """The heartbeat is collecting an accepted check (its answer late) when the request is
    freed or aborted by the prefill engine, or its receiver aborts: once the answer is in, the
    receiver is told -- FAILED at once for the free and the abort, the receiver's abort
    acknowledged -- and the sender's end forgets the transfer, not left listed until
    ``lease_ttl`` (made long here, so that its sweep cannot stand in)."""
    if hp.p.side.node is None:
        pytest.skip("holds the sender's collection of a check by hand: in-process pair only")
    rid, _, lease = _decode_side(hp, 16, f"alloc-ticket-hb-{end}")
    outbox = hp.pair.prefill.t.daemon.outbox
    monkeypatch.setattr(outbox, "lease_ttl", 600.0)
    release = _hold_check(monkeypatch, outbox, lease.ticket)

    def acks() -> float:  # AbortReceive calls of the prefill daemon, either path
        return sum(hp.pair.prefill.counter("kvd_peer_calls_total", method="AbortReceive", path=p) for p in ("socket", "grpc"))

    acks0 = acks()
    hp.p.c.allocate(rid, 16, ticket=lease.ticket)
    (ob,) = [o for o in outbox._open.values() if o.rid == rid]
    beat = threading.Thread(target=outbox.heartbeat_once)
    try:
        beat.start()  # (or the daemon's own heartbeat thread got there first: held all the same)
        dk.wait_for(lambda: not ob.parked and ob.settling.locked(), 5, "a heartbeat collecting the check")
        assert not ob.began
        if end == "free":
            assert hp.p.c.free(rid) == 1
        elif end == "abort":  # waits for the collection (released below, from another thread)
            threading.Timer(0.3, release.set).start()
            hp.p.c.abort(rid, "the prompt failed")
        else:
            dk.wait_for(lambda: hp.d.c.wait_ready(rid, 0).state is RECEIVING, 5, "the decode daemon accepted the ticket")
            assert hp.d.c.abort(rid, "engine preempted it") is True
            dk.wait_for(lambda: ob.aborted, 5, "the receiver's abort reached the sender")
    finally:
        release.set()
        beat.join(10)
    if end in ("free", "abort"):
        assert hp.d.c.wait_ready(rid, 5).state is FAILED
        dk.wait_for(lambda: ob not in outbox._open.values(), 10, "the ended transfer forgotten")
        if end == "abort":
            assert hp.p.c.free(rid) == 1
    else:
        dk.wait_for(lambda: acks() == acks0 + 1, 10, "the prefill daemon acknowledged the abort")
        with dk.expect(Aborted, grpc.StatusCode.ABORTED, "receiver aborted: engine preempted it"):
            hp.p.c.send(rid, lease.ticket, free=True)
        assert hp.p.c.free(rid) == 1
    assert hp.d.free(rid) == 1
    hp.check()


def test_a_send_that_comes_before_the_deferred_check_sends_it_itself(hp, monkeypatch):
    """Over the engine socket the check is sent once the Allocate's reply is out; a Send on
    another connection can come first: it sends the check itself, and the deferred work that
    runs later sends nothing more."""
    if hp.p.side.node is None:
        pytest.skip("holds the engine socket's deferred work by hand: in-process pair only")
    rid, dst, lease = _decode_side(hp, 30, "alloc-ticket-defer")
    src = hp.p.alloc(rid, 30)
    outbox = hp.pair.prefill.t.daemon.outbox
    settle = outbox._settle

    def not_by_the_heartbeat(ob):  # its loop collects a parked check too, sending one left unsent:
        # on a loaded machine a tick between begin and the Send would send this one first
        if ob.rid == rid and threading.current_thread().name == "kvd-heartbeat":
            return False
        return settle(ob)

    monkeypatch.setattr(outbox, "_settle", not_by_the_heartbeat)
    held: list = []
    checks0 = _checks(hp)
    assert outbox.begin(hp.p.c.session_id, rid, outbox.read_ticket(lease.ticket), lease.ticket, wait=False, defer=held.append)
    assert len(held) == 1 and _checks(hp) == checks0  # nothing sent yet
    assert hp.d.c.wait_ready(rid, 0).state is WAITING
    hk.randomize(hp.p.arena, hp.seed)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    res = hp.p.c.send(rid, lease.ticket, last=True)
    assert "check" not in res.phases and _checks(hp) == checks0 + 1
    held[0]()  # the deferred work, late: the check went already
    assert _checks(hp) == checks0 + 1
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    hp.check()


def test_a_receiver_abort_before_the_send_is_acknowledged_and_heard_by_the_send(hp, prefill):
    """The decode engine aborts while the prefill's check is still uncollected: the prefill
    daemon collects it and tells the receiver nothing is in flight (AbortReceive), and the
    prefill engine's Send hears the receiver's reason, writing nothing."""
    c = prefill
    rid, _, lease = _decode_side(hp, 30, "alloc-ticket-dabort")
    c.allocate(rid, 30, ticket=lease.ticket)
    dk.wait_for(lambda: hp.d.c.wait_ready(rid, 0).state is RECEIVING, 5, "the decode daemon accepted the ticket")
    def told() -> float:  # AbortReceive calls of the prefill daemon, either path
        return sum(hp.pair.prefill.counter("kvd_peer_calls_total", method="AbortReceive", path=p) for p in ("socket", "grpc"))

    told0 = told()
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d = hp.d.arena.clone()
    assert hp.d.c.abort(rid, "engine preempted it") is True
    dk.wait_for(lambda: told() == told0 + 1, 5, "the prefill daemon acknowledged the abort")
    with dk.expect(Aborted, grpc.StatusCode.ABORTED, "receiver aborted: engine preempted it"):
        c.send(rid, lease.ticket, free=True)
    assert hp.d.arena.equal(before_d)
    assert c.free(rid) == 1
    assert hp.d.free(rid) == 1
    hp.check()


def _held(c) -> tuple[int, list[int]]:
    """What a pool holds: requests live, pages used per group."""
    pool = c.stats().pool
    return pool.requests_live, [g.used_pages for g in pool.groups]


def test_an_allocate_refused_at_a_later_ticket_leaves_the_earlier_receivers_untouched(hp, prefill, monkeypatch):
    """Allocate([B with its ticket, A with its ticket]) where A's ticket belongs to a transfer
    still listed here (A freed a moment ago, its check not collected yet): the call is refused
    and changes nothing on either side -- B's receiver never hears of it (not FAILED, its RECV
    lease live), and B's handoff then goes as any other."""
    if hp.p.side.node is None:
        pytest.skip("holds the sender's collection of a check by hand: in-process pair only")
    c = prefill
    a, _, lease_a = _decode_side(hp, 16, "alloc-ticket-held")
    b, dst_b, lease_b = _decode_side(hp, 16, "alloc-ticket-innocent")
    outbox = hp.pair.prefill.t.daemon.outbox
    release = _hold_check(monkeypatch, outbox, lease_a.ticket)
    try:
        c.allocate(a, 16, ticket=lease_a.ticket)
        assert c.free(a) == 1  # A's transfer stays listed, aborted, until its check's answer is in
        with outbox._lock:
            assert [ob.aborted != "" for ob in outbox._open.values() if ob.rid == a] == [True]
        before = _held(c)
        req = pb.AllocateRequest(requests=[pb.AllocSpec(rid=b, tokens=16, ticket=lease_b.ticket), pb.AllocSpec(rid=a, tokens=16, ticket=lease_a.ticket)])
        with dk.expect(Aborted, grpc.StatusCode.ABORTED, f"transfer of '{a}' was aborted"):
            c._call("Allocate", req, lambda r: r)
        assert _held(c) == before  # (its epoch moved, and an empty region may: allocated, then freed)
    finally:
        release.set()
    # Whatever the refused call left to run has run once the sender lists nothing: A's receiver
    # was told (its request was freed), B's must not have been.
    def nothing_listed() -> bool:
        with outbox._lock:
            return not outbox._open

    dk.wait_for(nothing_listed, 5, "the sender's transfers all ended")
    assert hp.d.c.wait_ready(a, 5).state is FAILED
    st = hp.d.c.wait_ready(b, 0)
    assert st.state is WAITING, st
    hp.d.c.renew_lease(lease_b.lease_id)  # still live
    hp.check()
    # B's handoff goes as it would have without the refused call.
    src = c.allocate(b, 16, ticket=lease_b.ticket)
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    c.send(b, lease_b.ticket, free=True)
    assert hp.d.c.wait_ready(b, 5).state is READY
    hp.assert_landed(src, dst_b, before_d, before_p, dst_b.tokens, state=True)
    assert hp.d.free(a) == 1 and hp.d.free(b) == 1
    hp.check()


def test_a_step_of_requests_is_allocated_and_begun_in_one_call(hp, prefill):
    """``allocate_many(specs, tickets=)``: a prefill step's new requests in one Allocate, each
    transfer begun as the single call begins it (one check each, the Send skipping it), and a
    request without a ticket beside them only allocated; then every Send lands."""
    c = prefill
    sides = [_decode_side(hp, n, f"alloc-many-{i}") for i, n in enumerate((16, 40, 70))]
    plain = dk.rid("alloc-many-plain")
    checks0 = _checks(hp)
    calls0 = hp.pair.prefill.counter("kvd_rpc_duration_seconds_count", method="Allocate", code="OK")
    srcs = c.allocate_many(
        [(rid, dst.tokens) for rid, dst, _ in sides] + [(plain, 24)], tickets=[le.ticket for *_, le in sides] + [None]
    )
    # The engine socket observes the latency histogram after the reply is out: wait for it.
    allocs = lambda: hp.pair.prefill.counter("kvd_rpc_duration_seconds_count", method="Allocate", code="OK")  # noqa: E731
    dk.wait_for(lambda: allocs() >= calls0 + 1, 5, "the Allocate was observed")
    assert allocs() == calls0 + 1
    assert [s.tokens for s in srcs] == [16, 40, 70, 24]
    for rid, _, _ in sides:
        dk.wait_for(lambda rid=rid: hp.d.c.wait_ready(rid, 0).state is RECEIVING, 5, f"the decode daemon accepted {rid}'s ticket")
    assert _checks(hp) == checks0 + 3
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_p = hp.p.arena.clone()
    for src, (rid, dst, lease) in zip(srcs, sides):
        before_d = hp.d.arena.clone()
        res = c.send(rid, lease.ticket, free=True)
        assert "check" not in res.phases, res.phases
        assert hp.d.c.wait_ready(rid, 5).state is READY
        hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    assert _checks(hp) == checks0 + 3
    assert c.free(plain) == 1
    for rid, _, _ in sides:
        assert hp.d.free(rid) == 1
    hp.check()


def test_a_step_with_one_bad_ticket_is_refused_whole_and_tells_no_receiver(hp, prefill):
    c = prefill
    good, _, lease = _decode_side(hp, 20, "alloc-many-good")
    other, _, lease_o = _decode_side(hp, 20, "alloc-many-other")
    before = c.stats().pool
    with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "ticket is for request"):
        c.allocate_many([(good, 20), ("not-its-request", 20)], tickets=[lease.ticket, lease_o.ticket])
    assert c.stats().pool == before
    with pytest.raises(InvalidArgument, match="one ticket .or None. per spec, 2 in all"):
        c.allocate_many([(good, 20), (other, 20)], tickets=[lease.ticket])
    with pytest.raises(InvalidArgument, match="one ticket .or None. per spec"):
        c.allocate_many([(good, 20)], tickets=lease.ticket)  # type: ignore[arg-type]  # bytes, not a list of them
    with pytest.raises(InvalidArgument, match="pass tickets too"):
        c.allocate_many([(good, 20)], chunk_tokens=8)
    assert c.stats().pool == before
    # Neither receiver heard of the refused call; each ticket still opens its transfer.
    assert hp.d.c.wait_ready(good, 0).state is WAITING and hp.d.c.wait_ready(other, 0).state is WAITING
    c.allocate_many([(good, 20), (other, 20)], tickets=[lease.ticket, lease_o.ticket])
    for rid, le in ((good, lease), (other, lease_o)):
        c.send(rid, le.ticket, free=True)
        assert hp.d.c.wait_ready(rid, 5).state is READY
        assert hp.d.free(rid) == 1
    hp.check()
