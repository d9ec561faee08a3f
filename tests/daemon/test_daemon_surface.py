"""The whole client surface against a real daemon, in-process and as a subprocess.

Each test runs against both daemons (``target``); results are checked against what the daemon
reports elsewhere (info vs stats vs tickets vs vectors) and, in-process, against ``check()``.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from daemon_kit import ARENA_BYTES, expect, rid

import kvd
from kvd import errors as E
from kvd.client import AsyncClient
from kvd.records import AllocSpec, LeaseKind
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.handoff.ticket import TICKET_VERSION, read as read_ticket
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import envelope_from_pb, vectors_from_pb

GROUPS = {"full", "swa", "state", "draft"}
# tiny-hybrid: page_size 4, swa window 32, draft page 8; page bytes full/swa 2048, draft 1024, state slot 256.
PAGE_BYTES = {"full": 2048, "swa": 2048, "state": 256, "draft": 1024}


def occupancy(st) -> tuple:
    p = st.pool
    return (p.requests_live, p.requests_offloaded, p.compactions_done, st.leases_live,
            [(g.name, g.used_pages, g.free_pages, g.hole_pages) for g in p.groups])


def same_vectors(a, b) -> bool:
    return (
        (a.rid, a.boot_id, a.epoch, a.tokens, a.swa_first_page, a.state) == (b.rid, b.boot_id, b.epoch, b.tokens, b.swa_first_page, b.state)
        and torch.equal(a.full, b.full) and torch.equal(a.swa, b.swa) and torch.equal(a.draft, b.draft)
    )


def pages_of(v) -> dict[str, torch.Tensor]:
    state = torch.tensor([] if v.state is None else [v.state], dtype=torch.int64)
    return {"full": v.full.long(), "swa": v.swa.long(), "state": state, "draft": v.draft.long()}


def fill(att, v, seed: int) -> dict:
    """Write a distinct random pattern into every layer's K and V of ``v``'s pages, through the
    attachment's views. Returns what was written."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for group, idx in pages_of(v).items():
        for layer, kv in enumerate(att.views[group]):
            for name, t in (("k", kv.k), ("v", kv.v)):
                if t is None:
                    continue
                vals = torch.rand(t[idx].shape, generator=g, dtype=t.dtype)
                t[idx] = vals
                out[(group, layer, name)] = vals
    return out


def read(att, v) -> dict:
    out = {}
    for group, idx in pages_of(v).items():
        for layer, kv in enumerate(att.views[group]):
            for name, t in (("k", kv.k), ("v", kv.v)):
                if t is not None:
                    out[(group, layer, name)] = t[idx].clone()
    return out


def test_info_stats_echo(target):
    c = target.connect(name="surface")
    info = c.info()
    st = c.stats()
    assert info.boot_id == st.pool.boot_id and len(info.boot_id) == 16
    assert info.epoch == st.pool.epoch >= 1
    assert info.layout.name == st.layout_name == "tiny-hybrid"
    assert info.layout.fingerprint == kvd.preset("tiny-hybrid").fingerprint
    assert {e.group for e in info.envelopes} == GROUPS == {g.name for g in st.pool.groups}
    for e in info.envelopes:
        assert e.region_id == target.region_id
        assert e.backed_bytes == ARENA_BYTES and e.page_bytes == PAGE_BYTES[e.group]
        assert e.first_page * e.page_bytes >= st.pool.sink_bytes  # nothing inside the sink
        assert (e.last_page + 1) * e.page_bytes <= ARENA_BYTES  # nothing past the backing
    assert info.finalized and info.reserved_bytes == ARENA_BYTES == st.pool.reserved_bytes == st.pool.backed_bytes
    assert info.peer_address == target.tcp
    assert info.version == kvd.__version__ and info.backend == "none"
    assert {"offload", "post-capture"} <= set(info.capabilities)
    assert st.sessions_live >= 1 and st.leases_live == 0
    assert c.echo(b"ping" * 1000) == b"ping" * 1000
    assert c.echo(b"") == b""
    # The TCP listener serves the same daemon.
    assert target.connect(tcp=True).info().boot_id == info.boot_id


def test_allocate_extend_free_vectors(target):
    c = target.connect(name="surface")
    r1, r2, r3, r4, big = rid("a"), rid("b"), rid("c"), rid("d"), rid("big")
    before = target.snapshot(c)
    v1 = c.allocate(r1, 20)
    assert (v1.rid, v1.tokens, v1.boot_id, v1.epoch) == (r1, 20, before.pool.boot_id, before.pool.epoch)
    assert v1.full.numel() == 5 and v1.swa_first_page == 0 and v1.swa.numel() == 5  # fresh: SWA for every page
    assert v1.draft.numel() == 3 and v1.state is not None  # draft page: 8 tokens
    v2 = c.allocate(r2, 100, receive=True)  # received: only the window tail (32 tokens) gets SWA pages
    assert v2.full.numel() == 25 and v2.swa_first_page == (100 - 32) // 4 and v2.swa.numel() == 25 - 17
    v3, v4 = c.allocate_many([(r3, 8), AllocSpec(r4, 4, True)])
    assert (v3.rid, v3.full.numel(), v4.rid, v4.full.numel()) == (r3, 2, r4, 1)
    # physical pages are distinct across requests
    allfull = torch.cat([v.full for v in (v1, v2, v3, v4)])
    assert allfull.unique().numel() == allfull.numel()

    # shortfall: changes nothing, and agrees with the CapacityError of the same allocation.
    mid = target.snapshot(c)
    assert c.shortfall([(big, 8)]) == 0
    short = c.shortfall([(big, 100_000), (rid(), 4)])
    assert short > 0
    assert target.snapshot(c) == mid
    with expect(E.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED, "does not fit") as info:
        c.allocate_many([(big, 100_000), (rid(), 4)])
    assert info.value.shortfall_bytes == short
    assert target.snapshot(c) == mid

    e1 = c.extend(r1, 8)
    assert e1.tokens == 28 and e1.full.numel() == 7 and torch.equal(e1.full[:5], v1.full)  # the prefix stays put
    e1b, e2 = c.extend_many([(r1, 4), (r2, 40)])
    assert (e1b.tokens, e2.tokens) == (32, 140)
    # r2 grew from 100 to 140 tokens: SWA pages from the window before the step, (100 - 32) // 4, to the end
    assert e2.swa_first_page == 17 and e2.swa.numel() == 35 - 17
    e2b = c.extend(r2, 4)  # the next step releases SWA pages that left the window: (140 - 32) // 4 = 27
    assert e2b.swa_first_page == 27 and e2b.swa.numel() == 36 - 27 and torch.equal(e2b.swa[:-1], e2.swa[10:])
    e2 = e2b
    assert same_vectors(c.vectors(r1), e1b)
    got = c.vectors_many([r2, r3])
    assert [v.rid for v in got] == [r2, r3] and same_vectors(got[0], e2) and same_vectors(got[1], v3)

    st = target.snapshot(c)
    assert st.pool.requests_live == before.pool.requests_live + 4
    used = {g.name: g.used_pages for g in st.pool.groups}
    was = {g.name: g.used_pages for g in before.pool.groups}
    cur = [e1b, e2, v3, v4]
    assert used["full"] - was["full"] == sum(v.full.numel() for v in cur)
    assert used["swa"] - was["swa"] == sum(v.swa.numel() for v in cur)
    assert used["draft"] - was["draft"] == sum(v.draft.numel() for v in cur)
    assert used["state"] - was["state"] == 4
    target.check()

    assert c.free(r3, r4) == 2
    assert c.free(r1) == 1
    with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        c.vectors(r1)
    assert c.free(r2) == 1
    after = target.snapshot(c)
    # Every page back and no counter moved (an empty float group may keep its last position);
    # each free bumped the epoch (freed pages may be reused: vectors quoted before go stale).
    assert occupancy(after) == occupancy(before) and after.pool.gap_bytes == before.pool.gap_bytes
    assert after.pool.epoch == before.pool.epoch + 3
    target.check()


def test_second_request_fits_after_the_first(inproc):
    """Regression: the middle groups (state, swa) must not be boxed in by their neighbours once
    the first request has placed them (a second request used to fail with ~98% of the arena free)."""
    c = inproc.connect()
    c.allocate(rid(), 20)
    before = inproc.node.stats().pool
    assert before.gap_bytes > 0.95 * ARENA_BYTES
    v = c.allocate(rid(), 100, receive=True)  # 25 full + 8 swa pages + 1 slot + 13 draft pages: ~85 KiB
    assert v.full.numel() == 25


def test_leases_and_ticket(target):
    c = target.connect(name="decode")
    r = rid("recv")
    info = c.info()
    v = c.allocate(r, 24, receive=True)
    base = target.snapshot(c)
    lease = c.acquire_lease(r, "recv", ttl=5, vectors=v)
    assert (lease.rid, lease.kind, lease.boot_id, lease.epoch) == (r, LeaseKind.RECV, info.boot_id, v.epoch)
    assert 4.0 < lease.expires_in <= 5.0
    t = pb.Ticket.FromString(pb.SealedTicket.FromString(lease.ticket).body)
    assert (t.version, t.rid, t.lease_id, t.boot_id, t.epoch) == (TICKET_VERSION, r, lease.lease_id, info.boot_id, v.epoch)
    assert t.layout_fingerprint == info.layout.fingerprint
    assert t.peer_address == target.tcp and t.backend == "none"
    assert [envelope_from_pb(e) for e in t.envelopes] == info.envelopes
    assert same_vectors(vectors_from_pb(t.vectors), v)
    assert target.snapshot(c).leases_live == base.leases_live + 1

    # The Peer service on the advertised address accepts the ticket as issued.
    with grpc.insecure_channel(t.peer_address) as ch:
        ok = pb_grpc.PeerStub(ch).CheckTicket(pb.CheckTicketRequest(ticket=lease.ticket), timeout=5)
    assert 0 < ok.expires_in_seconds <= 5.0

    send = c.acquire_lease(r, LeaseKind.SEND)  # default TTL; SEND leases carry no ticket
    assert send.kind is LeaseKind.SEND and send.ticket == b"" and send.lease_id > lease.lease_id
    renewed = c.renew_lease(lease.lease_id, ttl=20)
    assert renewed.lease_id == lease.lease_id and 19.0 < renewed.expires_in <= 20.0
    assert 4.0 < c.renew_lease(send.lease_id).expires_in <= 5.0  # keeps the daemon default (5 s here)
    with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, f"pinned by lease {lease.lease_id}"):
        c.free(r)
    assert c.release_lease(lease.lease_id) is None
    c.release_lease(send.lease_id)
    with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, f"lease {lease.lease_id} is not live"):
        c.release_lease(lease.lease_id)
    assert target.snapshot(c).leases_live == base.leases_live
    target.check()
    assert c.free(r) == 1


def test_allocate_recv_many_leases_each_in_one_call_all_or_nothing(target):
    """The decode side admitting several requests in one Allocate: each allocated (receive) and
    RECV-leased, its ticket for its own request; a refusal of one (a duplicate id, a bad TTL)
    leaves none of them allocated or leased."""
    c = target.connect(name="decode-many")
    info = c.info()
    base = target.snapshot(c)
    rids = [rid("many-a"), rid("many-b"), rid("many-c")]
    got = c.allocate_recv_many([(rids[0], 8), (rids[1], 24), (rids[2], 40)], ttl=30)
    assert [(v.rid, le.rid, v.tokens) for v, le in got] == [(rids[0], rids[0], 8), (rids[1], rids[1], 24), (rids[2], rids[2], 40)]
    for v, le in got:
        assert le.kind is LeaseKind.RECV and 28.0 < le.expires_in <= 30.0 and (le.boot_id, le.epoch) == (info.boot_id, v.epoch)
        t = pb.Ticket.FromString(pb.SealedTicket.FromString(le.ticket).body)
        assert (t.rid, t.lease_id) == (v.rid, le.lease_id) and same_vectors(vectors_from_pb(t.vectors), v)
    assert len({le.lease_id for _, le in got}) == 3
    snap = target.snapshot(c)
    assert (snap.pool.requests_live, snap.leases_live) == (base.pool.requests_live + 3, base.leases_live + 3)
    target.check()
    before = occupancy(target.snapshot(c))
    with expect(E.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, rids[1]):
        c.allocate_recv_many([(rid("many-d"), 8), (rids[1], 8)])
    with expect(E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "lease ttl"):
        c.allocate_recv_many([(rid("many-e"), 8), (rid("many-f"), 8)], ttl=-1)
    assert occupancy(target.snapshot(c)) == before
    target.check()
    for _, le in got:
        c.release_lease(le.lease_id)
    assert c.free(*rids) == 3


def test_compact_moves_pages_and_bumps_epoch(target):
    c = target.connect(name="compact")
    rs = [rid(f"c{i}") for i in range(4)]
    vs = c.allocate_many([(r, 16) for r in rs])
    c.free(rs[0], rs[1])  # holes at the anchor ends of every group
    before = target.snapshot(c)
    res = c.compact()
    assert res.pages_moved > 0 and res.bytes_moved > 0 and res.gap_gained_bytes > 0
    assert res.epoch == before.pool.epoch + 1 == c.info().epoch
    after = target.snapshot(c)
    assert after.pool.compactions_done == before.pool.compactions_done + 1
    assert after.pool.pages_moved == before.pool.pages_moved + res.pages_moved
    assert after.pool.gap_bytes == before.pool.gap_bytes + res.gap_gained_bytes
    assert all(g.hole_pages == 0 for g in after.pool.groups)
    moved = c.vectors(rs[2])
    assert moved.epoch == res.epoch and not torch.equal(moved.full, vs[2].full)
    again = c.compact()  # nothing left to move: the epoch stays
    assert (again.pages_moved, again.epoch) == (0, res.epoch)
    target.check()


def test_offload_restore_keeps_bytes(target):
    c = target.connect(name="offload")
    r, filler = rid("off"), rid("fill")
    v = c.allocate(r, 20)
    att = c.attach()
    try:
        assert att.region_id == target.region_id and set(att.views) == GROUPS
        wrote = fill(att, v, seed=7)
        assert all(torch.equal(read(att, v)[k], x) for k, x in wrote.items())
        nbytes = c.offload(r)
        pages = pages_of(v)
        assert nbytes == sum(pages[g].numel() * PAGE_BYTES[g] for g in GROUPS)
        st = target.snapshot(c)
        assert st.pool.requests_offloaded >= 1
        with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "offloaded"):
            c.vectors(r)
        # A filler takes the freed pages and overwrites them: the restore must not depend on them.
        fv = c.allocate(filler, 20)
        for group, idx in pages_of(fv).items():
            for kv in att.views[group]:
                kv.k[idx] = 0
                if kv.v is not None:
                    kv.v[idx] = 0
        back = c.restore(r)
        assert back.epoch > v.epoch and back.tokens == 20
        assert not torch.equal(back.full, v.full)  # new pages...
        got = read(att, back)
        assert got.keys() == wrote.keys()
        assert all(torch.equal(got[k], wrote[k]) for k in wrote)  # ...same bytes
        assert same_vectors(c.vectors(r), back)
        c.free(r, filler)
        target.check()
    finally:
        att.close()


def mistakes(kv, own: str, leased: str, vec, theirs: str) -> list:
    """Calls that must fail, each with the class it must raise. ``kv`` owns ``own`` and ``leased``
    (which has a live lease); ``theirs`` belongs to another session."""
    return [
        (lambda: kv.vectors("no-such-request"), E.NotFound),
        (lambda: kv.allocate(own, 4), E.AlreadyExists),
        (lambda: kv.allocate(rid(), -1), E.InvalidArgument),
        (lambda: kv.allocate(rid(), 1 << 40), E.CapacityError),
        (lambda: kv.free(leased), E.FailedPrecondition),
        (lambda: kv.acquire_lease(own, "send", vectors=vec._replace(boot_id="0" * 16)), E.StaleEpoch),
        (lambda: kv.vectors(theirs), E.PermissionDenied),
        (lambda: kv.release_lease(10**9), E.NotFound),
    ]


def test_async_client_same_surface_same_errors(target):
    sync = target.connect(name="sync-twin")
    s_own, s_leased = rid("s-own"), rid("s-leased")
    s_vec = sync.allocate(s_own, 8)
    sync.allocate(s_leased, 8)
    sync.acquire_lease(s_leased, "recv")
    sync_errors = []
    a_own, a_leased = rid("a-own"), rid("a-leased")

    async def main() -> dict:
        out: dict = {"errors": []}
        async with await AsyncClient.connect(target.unix, name="async", transport=target.transport) as kv:
            info = await kv.info()
            st = await kv.stats()
            out["boot"] = (info.boot_id, st.pool.boot_id)
            assert await kv.echo(b"hi") == b"hi"
            v1 = await kv.allocate(a_own, 20)
            v2, v3 = await kv.allocate_many([(a_leased, 8), (rid("a3"), 4, True)])
            assert (v2.rid, v3.tokens) == (a_leased, 4)
            assert await kv.shortfall([(rid(), 4)]) == 0
            e1 = await kv.extend(a_own, 4)
            assert e1.tokens == 24 and torch.equal(e1.full[:5], v1.full)
            (e2,) = await kv.extend_many([(a_leased, 4)])
            assert e2.tokens == 12
            assert same_vectors(await kv.vectors(a_own), e1)
            assert [v.rid for v in await kv.vectors_many([a_leased, v3.rid])] == [a_leased, v3.rid]
            lease = await kv.acquire_lease(a_leased, "recv", vectors=e2)
            assert read_ticket(lease.ticket).lease_id == lease.lease_id
            assert (await kv.renew_lease(lease.lease_id, ttl=9)).expires_in > 8
            for call, cls in mistakes(kv, a_own, a_leased, e1, s_own):
                try:
                    await call()
                except E.KvdError as exc:
                    out["errors"].append((type(exc), cls, exc.__cause__.code()))
                else:
                    out["errors"].append((None, cls, None))
            # The sync client makes the same mistakes while the async client's requests exist.
            for call, cls in mistakes(sync, s_own, s_leased, s_vec, a_own):
                with pytest.raises(E.KvdError) as info:
                    call()
                sync_errors.append((type(info.value), cls, info.value.__cause__.code()))
            await kv.release_lease(lease.lease_id)
            # the decode side's one call, its lease as long as asked (all or nothing: a bad TTL leaves nothing)
            recv = rid("a-recv")
            rv, rl = await kv.allocate_recv(recv, 8, ttl=42)
            assert rv.rid == rl.rid == recv and rl.kind is LeaseKind.RECV and 40.0 < rl.expires_in <= 42.0, rl
            try:
                await kv.allocate_recv(rid("a-recv-bad"), 8, ttl=-1)
            except E.InvalidArgument as exc:
                assert "lease ttl" in str(exc), exc
            else:
                raise AssertionError("a negative lease TTL was accepted")
            await kv.release_lease(rl.lease_id)
            assert await kv.free(recv) == 1
            assert await kv.offload(v3.rid) == 1 * 2048 + 1 * 2048 + 256 + 1024
            back = await kv.restore(v3.rid)
            assert back.epoch > v3.epoch
            out["compact_epoch"] = (await kv.compact(around_pinned=True)).epoch  # the sync twin holds a lease
            assert await kv.free(a_own, a_leased, v3.rid) == 3
        return out

    out = asyncio.run(main())
    assert len(sync_errors) == len(out["errors"]) == 8
    assert out["boot"][0] == out["boot"][1] == sync.info().boot_id
    assert [(got, want) for got, want, _ in out["errors"]] == [(want, want) for _, want, _ in out["errors"]]
    assert [(got, want) for got, want, _ in sync_errors] == [(want, want) for _, want, _ in sync_errors]
    assert [code for *_, code in out["errors"]] == [code for *_, code in sync_errors]
    assert sync.info().epoch == out["compact_epoch"] + 1  # the async client's free came after
    target.check()
