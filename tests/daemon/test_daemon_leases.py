"""Leases, compaction and dead clients against a real daemon (DESIGN §2 compaction, §7 safety).

* a lease expires after its TTL unless renewed; a killed client's requests and leases come back;
* compaction is refused while a lease pins a page it would move (the error names the lease),
  compacts around the pin when asked, and moves everything once the lease is released;
* vectors and tickets quoting an epoch from before their request moved are refused.
"""

from __future__ import annotations

import copy
import signal
import time

import grpc
import torch
from daemon_kit import child, expect, expect_rpc, rid, start_inproc, stop_inproc, wait_for

from kvd import errors as E
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

C = grpc.StatusCode


def same_pages(a, b) -> bool:
    return torch.equal(a.full, b.full) and torch.equal(a.swa, b.swa) and torch.equal(a.draft, b.draft) and a.state == b.state


def check_ticket(address: str, blob: bytes):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.PeerStub(ch).CheckTicket(pb.CheckTicketRequest(ticket=blob), timeout=5)


def test_lease_expires_unless_renewed(target):
    c = target.connect(name="slow-holder")
    r = rid()
    c.allocate(r, 8)
    before = target.snapshot(c)
    t0 = time.monotonic()
    lease = c.acquire_lease(r, "recv", ttl=0.6)
    assert target.snapshot(c).leases_live == before.leases_live + 1
    with expect(E.FailedPrecondition, C.FAILED_PRECONDITION, f"pinned by lease {lease.lease_id}"):
        c.free(r)

    def expired():
        if target.snapshot(c).leases_expired_total < before.leases_expired_total + 1:
            return False  # the sweep has counted no expiry yet
        return lease.lease_id not in {x.lease_id for x in c.activity(limit=1000).leases}

    # The shared subprocess daemon may hold other tests' leases (a RECV lease outlives its
    # session while a failed transfer's fence holds it), which can expire meanwhile: its counts
    # move by more than this lease, so only a fresh in-process daemon's are compared exactly.
    wait_for(expired, 10.0, "the unrenewed lease to expire")
    assert time.monotonic() - t0 >= 0.6  # not before its TTL (granted after t0)
    if target.node is not None:
        after = target.snapshot(c)
        assert (after.leases_live, after.leases_expired_total) == (before.leases_live, before.leases_expired_total + 1)
    with expect(E.NotFound, C.NOT_FOUND, f"lease {lease.lease_id} is not live"):
        c.renew_lease(lease.lease_id)
    with expect_rpc(C.NOT_FOUND, "is not live", "NotFound"):
        check_ticket(target.tcp, lease.ticket)
    assert c.free(r) == 1  # nothing pins it any more
    target.check()


def test_renew_extends_a_lease(inproc):
    c = inproc.connect()
    r = rid()
    c.allocate(r, 8)
    lease = c.acquire_lease(r, "send", ttl=1.5)
    time.sleep(0.9)
    renewed = c.renew_lease(lease.lease_id)  # same TTL, counted from now
    assert 0.6 < renewed.expires_in <= 1.5  # more than the 0.6 s the old grant had left
    time.sleep(0.9)  # 1.8 s after the grant: expired without the renewal
    assert inproc.node.stats().leases_live == 1
    assert c.renew_lease(lease.lease_id, ttl=0.2).expires_in <= 0.2  # a new TTL replaces the old one
    wait_for(lambda: inproc.node.stats().leases_expired_total == 1, 3.0, "the shortened lease to expire")
    assert inproc.node.stats().leases_live == 0
    inproc.node.check()


def test_expired_lease_on_a_freed_request_keeps_invariants(tmp_path):
    """Regression: between a lease's TTL and the next sweep the request may be freed; the node's
    invariants must still hold (``check()`` used to call the lingering lease a broken invariant)."""
    t = start_inproc(tmp_path, sweep_interval_s=10)  # no sweep during the test
    try:
        c = t.connect()
        r = rid()
        c.allocate(r, 8)
        c.acquire_lease(r, "recv", ttl=0.1)
        time.sleep(0.15)
        assert c.free(r) == 1
        t.node.check()
        expired, _ = t.node.sweep()
        assert [lease.rid for lease in expired] == [r]
        assert t.node.stats().leases_expired_total == 1
        t.node.check()
    finally:
        stop_inproc(t)


def test_close_session_frees_or_defers(tmp_path):
    """close() frees the session's requests now; close(free_requests=False) keeps them until the
    session's TTL runs out, then the sweeper frees them (regression: they used to be orphaned for
    good, owned by a session that no longer existed)."""
    t = start_inproc(tmp_path)
    try:
        a = t.connect(name="a")
        a.allocate(rid(), 8)
        a.close()
        assert t.node.stats().pool.requests_live == 0 and t.node.stats().sessions_live == 0
        b = t.connect(name="b", ttl=0.8)
        r = rid()
        b.allocate(r, 8)
        b.acquire_lease(r, "recv", ttl=60)
        b.close(free_requests=False)
        st = t.node.stats()
        assert (st.pool.requests_live, st.leases_live) == (1, 0)  # leases released, request kept
        t.node.check()
        wait_for(lambda: t.node.stats().pool.requests_live == 0, 3.0, "the kept request to be freed after the TTL")
        assert t.node.stats().sessions_expired_total == 1 and t.node.stats().sessions_live == 0
        t.node.check()
    finally:
        stop_inproc(t)


def test_compaction_refused_while_leased_then_allowed(target):
    c = target.connect(name="compactor")
    rs = [rid(f"k{i}") for i in range(4)]
    vs = c.allocate_many([(r, 16) for r in rs])
    c.free(rs[0], rs[1])  # holes at every group's anchor end: rs[2] and rs[3] must move
    lease = c.acquire_lease(rs[2], "recv", ttl=60, vectors=vs[2])
    label = f"lease {lease.lease_id} (recv on {rs[2]!r})"
    before = target.snapshot(c)
    with expect(E.Pinned, C.FAILED_PRECONDITION, f"pinned by lease {lease.lease_id}") as info:
        c.compact()
    assert info.value.holders == (label,)
    want = copy.deepcopy(before)
    want.pool.compactions_refused += 1
    assert target.snapshot(c) == want  # refused: nothing moved, only the refusal counted
    target.check()

    # Around the pin: the other requests move, the leased one stays byte-for-byte where it was.
    res = c.compact(around_pinned=True)
    assert res.pages_moved > 0 and res.epoch == before.pool.epoch + 1
    assert same_pages(c.vectors(rs[2]), vs[2])
    assert not same_pages(c.vectors(rs[3]), vs[3])
    assert check_ticket(target.tcp, lease.ticket).expires_in_seconds > 0  # its ticket is still good
    send = c.acquire_lease(rs[2], "send", vectors=vs[2])  # and so are its old vectors
    c.release_lease(send.lease_id)
    mid = target.snapshot(c)
    assert mid.pool.compactions_done == before.pool.compactions_done + 1
    target.check()

    c.release_lease(lease.lease_id)
    res = c.compact()
    assert res.pages_moved > 0 and res.epoch == mid.pool.epoch + 1
    now = c.vectors(rs[2])
    assert not same_pages(now, vs[2])
    after = target.snapshot(c)
    assert after.pool.compactions_done == mid.pool.compactions_done + 1
    assert after.pool.compactions_refused == want.pool.compactions_refused
    assert all(g.hole_pages == 0 for g in after.pool.groups)

    # Fencing: the pre-move vectors and ticket are refused, and counted.
    with expect(E.StaleEpoch, C.FAILED_PRECONDITION, f"its pages moved at epoch {res.epoch}"):
        c.acquire_lease(rs[2], "send", vectors=vs[2])
    with expect_rpc(C.NOT_FOUND, "is not live", "NotFound"):
        check_ticket(target.tcp, lease.ticket)
    fresh = c.acquire_lease(rs[2], "recv", vectors=now)
    # The live lease quoted at the old epoch: a rewritten ticket, refused at the seal (the epoch
    # check behind it: tests/handoff/test_handoff_ticket_seal.py).
    sealed = pb.SealedTicket.FromString(fresh.ticket)
    body = pb.Ticket.FromString(sealed.body)
    body.epoch = pb.Ticket.FromString(pb.SealedTicket.FromString(lease.ticket).body).epoch
    stale = pb.SealedTicket(body=body.SerializeToString(), seal=sealed.seal).SerializeToString()
    with expect_rpc(C.PERMISSION_DENIED, "does not carry this daemon's seal", "PermissionDenied"):
        check_ticket(target.tcp, stale)
    assert check_ticket(target.tcp, fresh.ticket).expires_in_seconds > 0
    assert target.snapshot(c).stale_refusals_total == before.stale_refusals_total + 1
    target.check()


_DOOMED = """
import sys, time
from kvd.client import Client
addr, r = sys.argv[1], sys.argv[2]
c = Client.connect(addr, name="doomed", ttl=1.0)
c.allocate_many([(r, 16), (r + "-b", 8, True)])
lease = c.acquire_lease(r, "recv", ttl=60)
print("ready", lease.lease_id, flush=True)
time.sleep(60)
"""


def test_killed_client_is_reaped(target):
    watcher = target.connect(name="watcher")
    before = target.snapshot(watcher)
    r = rid("doomed")
    with child(_DOOMED, target.unix, r) as p:
        line = p.stdout.readline()
        assert line.startswith("ready"), f"client did not start: {line!r} {p.stderr.read() if p.poll() is not None else ''}"
        st = target.snapshot(watcher)
        assert st.pool.requests_live == before.pool.requests_live + 2
        assert (st.leases_live, st.sessions_live) == (before.leases_live + 1, before.sessions_live + 1)
        p.send_signal(signal.SIGKILL)
        assert p.wait(5) == -signal.SIGKILL

        def reaped():
            s = target.snapshot(watcher)
            # leases_live: at most as before (the shared daemon may see another test's lease
            # expire meanwhile); the session's reaping is what the other counts show.
            return (
                s.pool.requests_live == before.pool.requests_live
                and s.leases_live <= before.leases_live
                and s.sessions_live == before.sessions_live
                and s.sessions_expired_total == before.sessions_expired_total + 1
            )

        # Reaped by the session TTL (1 s) -- the sweeper's path, which counts sessions_expired_total.
        wait_for(reaped, 1.0 + 4.0, "the killed client's requests and lease to come back")
    after = target.snapshot(watcher)
    assert [(g.name, g.used_pages) for g in after.pool.groups] == [(g.name, g.used_pages) for g in before.pool.groups]
    with expect(E.NotFound, C.NOT_FOUND, "not allocated"):
        watcher.vectors(r)
    target.check()


def test_one_request_holds_a_bounded_number_of_leases(target):
    """Leases taken on one request in a loop (a client leaking them, or one that means harm)
    stop at MAX_LEASES_PER_REQUEST: the next is refused LimitReached (RESOURCE_EXHAUSTED, not the
    pool's CapacityError) and nothing changes; a lease released makes room again. Before, they
    grew for their TTL, and every lease, free and Send of the request scanned them all."""
    from kvd.daemon.node import MAX_LEASES_PER_REQUEST

    c = target.connect(name="lease-hoarder")
    r = rid()
    c.allocate(r, 8)
    leases = [c.acquire_lease(r, "send", ttl=30) for _ in range(MAX_LEASES_PER_REQUEST)]
    before = target.snapshot(c)
    with expect(E.LimitReached, C.RESOURCE_EXHAUSTED, f"holds {MAX_LEASES_PER_REQUEST} leases"):
        c.acquire_lease(r, "send", ttl=30)
    after = target.snapshot(c)
    assert after.leases_live == before.leases_live and after.pool == before.pool
    target.check()
    c.release_lease(leases[0].lease_id)
    again = c.acquire_lease(r, "send", ttl=30)
    for lease in [*leases[1:], again]:
        c.release_lease(lease.lease_id)
    c.free(r)
    target.check()


def test_a_daemon_holds_a_bounded_number_of_sessions(tmp_path, monkeypatch):
    """Sessions opened in a loop stop at MAX_SESSIONS: the next OpenSession is refused
    LimitReached, naming what to do; a session closed makes room. (The bound is lowered here: the
    daemon's is 4,096.)"""
    from kvd.daemon import node as node_mod

    monkeypatch.setattr(node_mod, "MAX_SESSIONS", 8)
    t = start_inproc(tmp_path)
    try:
        clients = [t.connect(name=f"s{i}", transport="grpc") for i in range(8)]
        with expect(E.LimitReached, C.RESOURCE_EXHAUSTED, "holds 8 sessions, its limit"):
            t.connect(name="one-too-many", transport="grpc")
        assert t.node.stats().sessions_live == 8
        clients.pop().close()
        t.connect(name="room-again", transport="grpc").echo()
        t.check()
    finally:
        stop_inproc(t)
