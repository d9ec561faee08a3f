"""Post-capture sizing: finalize backs the arena in place, re-derives capacities exactly as an
eager build of the same size would, and the result can be filled to its capacity."""

from __future__ import annotations

import pytest
import torch

from kvd.errors import CapacityError
from kvd.pool.layout import Layout
from kvd.records import AllocSpec
from kvd.pool.pool import Pool
from kvd.pool.presets import preset
from pool_testkit import FULL, SWA, full_only_layout, two_group_layout

LAYOUTS: dict[str, Layout] = {
    "tiny-hybrid": preset("tiny-hybrid"),
    "gemma-4-31b-it-tp2": preset("gemma-4-31b-it-tp2"),
    "gpt-oss-20b": preset("gpt-oss-20b"),
    "qwen3.5-0.8b": preset("qwen3.5-0.8b"),
    "two-group": two_group_layout(swa_ratio=3),
    "full-only": full_only_layout(),
}


def _floor(layout: Layout, kvd_arena_factory) -> int:
    """The one-request floor of ``layout`` (a property of the layout, not of the arena size)."""
    return Pool(layout, kvd_arena_factory(64 * layout.max_page_bytes, 64 * layout.max_page_bytes)).floor_bytes()


def _budgets(layout: Layout, floor: int) -> tuple[int, list[int]]:
    """A reservation and a few budgets inside it: the floor, an odd byte count, everything."""
    reserved = 6 * floor + 3 * layout.max_page_bytes
    return reserved, [floor, 3 * floor + layout.max_page_bytes // 3 + 5, reserved]


def _shape(pool: Pool) -> tuple:
    """A pool's capacities and envelopes, without what names one arena (base, region id)."""
    groups = [(g.name, g.direction, g.page_bytes, g.capacity_pages, g.used_pages, g.free_pages, g.hole_pages,
               g.region_lo_bytes, g.region_hi_bytes) for g in pool.stats().groups]
    envs = [(e.group, e.backed_bytes, e.page_bytes, e.first_page, e.last_page) for e in pool.envelopes()]
    return pool.arena.backed, groups, envs


def _storage(pool: Pool) -> dict[str, int]:
    out = {"base": pool.arena.base}
    for k, a in pool.groups.items():
        out[f"{k.value}.v2p"] = a.v2p.data_ptr()
        out[f"{k.value}.p2v"] = a.p2v.data_ptr()
        out[f"{k.value}.holes"] = a._holes.data_ptr()
    return out


def _envelopes_inside_backing(pool: Pool) -> None:
    for e in pool.envelopes():
        assert e.backed_bytes == pool.arena.backed
        assert e.base == pool.arena.base
        if e.last_page >= e.first_page:  # an empty range names no page at all
            assert (e.last_page + 1) * e.page_bytes <= e.backed_bytes, e
            assert e.first_page * e.page_bytes >= pool.sink_bytes, e


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_finalize_is_in_place_and_equals_an_eager_build(name: str, kvd_arena_factory) -> None:
    layout = LAYOUTS[name]
    floor = _floor(layout, kvd_arena_factory)
    reserved, budgets = _budgets(layout, floor)
    for nbytes in budgets:
        arena = kvd_arena_factory(reserved, 0)
        pool = Pool(layout, arena, post_capture=True)
        # Before finalize: only the sink is backed, nothing can be handed out, and no envelope
        # reaches past the backed prefix.
        assert arena.backed == layout.max_page_bytes == pool.sink_bytes
        assert not pool.finalized
        assert all(g.capacity_pages == 0 and g.free_pages == 0 for g in pool.stats().groups)
        _envelopes_inside_backing(pool)
        assert all(e.last_page < e.first_page for e in pool.envelopes())  # no valid page yet
        before, epoch = _storage(pool), pool.epoch

        pool.finalize(nbytes)

        assert pool.finalized and arena.backed == nbytes and pool.epoch == epoch + 1
        assert _storage(pool) == before, "finalize moved the arena or a table"
        _envelopes_inside_backing(pool)
        eager = Pool(layout, kvd_arena_factory(reserved, nbytes))
        assert _shape(pool) == _shape(eager)
        assert pool.floor_bytes() == eager.floor_bytes() == floor
        pool.check()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resize_is_in_place_and_equals_an_eager_build(name: str, kvd_arena_factory) -> None:
    layout = LAYOUTS[name]
    floor = _floor(layout, kvd_arena_factory)
    reserved, (small, mid, big) = _budgets(layout, floor)
    pool = Pool(layout, kvd_arena_factory(reserved, 0), post_capture=True)
    pool.finalize(mid)
    pool.allocate("a", layout.page_size)
    pool.offload("a")  # an offloaded request holds no pages: resize is allowed
    storage = _storage(pool)
    for nbytes in (big, small, mid):
        epoch = pool.epoch
        pool.resize(nbytes)
        assert pool.epoch == epoch + 1 and pool.arena.backed == nbytes
        assert _storage(pool) == storage
        assert _shape(pool) == _shape(Pool(layout, kvd_arena_factory(reserved, nbytes)))
        pool.check()
    pool.restore("a")
    pool.check()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_floor_admits_one_floor_request(name: str, kvd_arena_factory) -> None:
    layout = LAYOUTS[name]
    floor = _floor(layout, kvd_arena_factory)
    for post_capture in (True, False):
        arena = kvd_arena_factory(2 * floor, 0 if post_capture else floor)
        pool = Pool(layout, arena, post_capture=post_capture)
        if post_capture:
            pool.finalize(floor)
        assert pool.can_allocate(AllocSpec("one", pool.floor_tokens))
        pool.allocate("one", pool.floor_tokens)
        pool.check()


def test_full_only_pool_allocates_exactly_its_capacity(kvd_arena_factory) -> None:
    layout = full_only_layout()
    pb = layout.page_bytes(layout.group("full"))
    pool = Pool(layout, kvd_arena_factory(pb * 1000, 0), post_capture=True)
    pool.finalize(pb * 300 + 17)
    cap = pool.stats().groups[0].capacity_pages
    assert cap == 300 - 1  # everything but the sink page
    tokens = cap * layout.page_size
    with pytest.raises(CapacityError) as info:
        pool.allocate("over", tokens + 1)
    assert info.value.shortfall_bytes == pb
    pool.allocate("all", tokens)
    st = pool.stats()
    assert st.gap_bytes == 17 and st.groups[0].free_pages == 0
    pool.check()


def test_equal_page_pair_allocates_exactly_its_capacity(kvd_arena_factory) -> None:
    """gpt-oss: full and swa pages are the same size; a fresh request of n pages takes 2n."""
    layout = preset("gpt-oss-20b")
    pb = layout.page_bytes(layout.group("full"))
    pool = Pool(layout, kvd_arena_factory(pb * 200, 0), post_capture=True)
    pool.finalize(pb * 101)  # sink + 100 pages
    n = 50
    assert not pool.can_allocate(AllocSpec("x", (n + 1) * layout.page_size))
    pool.allocate("x", n * layout.page_size)
    assert pool.stats().gap_bytes == 0
    pool.free("x")
    # A received request needs SWA pages for its window tail only: 128 tokens = 8 pages.
    window_pages = layout.group("swa").window // layout.page_size
    pool.allocate("rx", (100 - window_pages) * layout.page_size, receive=True)
    assert pool.stats().gap_bytes == 0 and pool.vectors("rx").swa.numel() == window_pages
    pool.check()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_finalized_pool_fills_to_capacity(name: str, kvd_arena_factory) -> None:
    """Requests of one page per group fit until the free bytes could not hold another one
    (allowing one page of alignment slack per group boundary). In tiny-hybrid this once failed:
    the swa float sat where a 4k-token request's share of state slots would end and grew down
    into that room, so one-page requests were refused with 94% of the arena free."""
    layout = LAYOUTS[name]
    floor = _floor(layout, kvd_arena_factory)
    per_request = floor - layout.max_page_bytes
    nbytes = layout.max_page_bytes + 60 * per_request + layout.max_page_bytes // 3
    pool = Pool(layout, kvd_arena_factory(2 * nbytes, 0), post_capture=True)
    pool.finalize(nbytes)
    step = layout.page_size
    n = 0
    while pool.can_allocate(AllocSpec(f"r{n}", step)):
        pool.allocate(f"r{n}", step)
        n += 1
    with pytest.raises(CapacityError):
        pool.allocate(f"r{n}", step)
    st = pool.stats()
    slack = sum(g.page_bytes for g in st.groups)
    assert sum(g.hole_pages for g in st.groups) == 0
    assert sum(g.used_bytes for g in st.groups) + st.gap_bytes + st.sink_bytes == nbytes
    assert st.gap_bytes < per_request + slack, (n, st)
    assert n >= 55
    pool.check()


def test_seed004_table_width_spans_owner_ids(kvd_arena_factory) -> None:
    """The swa group's v2p is as long as the full group's id space, whatever the page ratio."""
    for ratio in (1, 3, 10):
        layout = two_group_layout(swa_ratio=ratio)
        pool = Pool(layout, kvd_arena_factory(256 * 1000, 256 * 100))
        assert pool.groups[SWA].v2p.numel() == pool.groups[FULL].v2p.numel() == 1000
        assert pool.groups[SWA].p2v.numel() == 1000 // ratio


def test_shrinking_resize_below_an_empty_float_keeps_invariants(kvd_arena_factory) -> None:
    """An empty float remembers where it last sat; a resize that ends below that spot must
    re-derive it (it used to stay outside the new backing: check() failed on the draft group)."""
    layout = preset("tiny-hybrid")
    pb = layout.page_bytes(layout.group("full"))
    pool = Pool(layout, kvd_arena_factory(1000 * pb, 0), post_capture=True)
    pool.finalize(800 * pb)
    pool.allocate("a", 8)
    draft = next(g for g in pool.stats().groups if g.name == "draft")
    assert draft.region_lo_bytes > 20 * pb  # the draft float sits high up in the big arena
    pool.free("a")
    pool.resize(20 * pb)
    pool.check()
    eager = Pool(layout, kvd_arena_factory(1000 * pb, 20 * pb))
    assert _shape(pool) == _shape(eager)
    pool.allocate("b", 8)
    pool.check()


def test_compaction_unboxes_a_float(kvd_arena_factory) -> None:
    """When a float is boxed in by its neighbours, allocation is refused with free bytes elsewhere;
    compaction slides the float so the free bytes are shared again, keeping every page's bytes.
    Boxed in here by the workload changing under a placed float: the first request is long, so
    the swa float leaves the state group room for a few long requests' slots; then come short
    ones, a slot each per page of tokens."""
    layout = preset("tiny-hybrid")
    pb = layout.page_bytes(layout.group("full"))
    pool = Pool(layout, kvd_arena_factory(400 * pb, 400 * pb))
    pool.allocate("long", 160)
    n = 0
    while pool.can_allocate(AllocSpec(f"r{n}", layout.page_size)):
        pool.allocate(f"r{n}", layout.page_size)
        n += 1
    boxed_gap = pool.stats().gap_bytes
    assert boxed_gap > 50 * pb  # refused although most of the arena is free: boxed in
    with pytest.raises(CapacityError, match=r"free bytes lie between groups that cannot grow into them: compact\(\)"):
        pool.allocate(f"r{n}", layout.page_size)  # the refusal says what helps
    patterns = {}
    for rid in pool.request_ids:
        v = pool.vectors(rid)
        patterns[rid] = {g: pool.page_view(g)[ids.long()].clone() for g, ids in (("full", v.full), ("swa", v.swa), ("draft", v.draft))}
        patterns[rid]["state"] = pool.page_view("state")[v.state].clone()
    res = pool.compact()
    pool.check()
    assert res.pages_moved > 0
    for rid, pats in patterns.items():
        v = pool.vectors(rid)
        for g, ids in (("full", v.full), ("swa", v.swa), ("draft", v.draft)):
            assert torch.equal(pool.page_view(g)[ids.long()], pats[g]), (rid, g)
        assert torch.equal(pool.page_view("state")[v.state], pats["state"])
    m = n
    while pool.can_allocate(AllocSpec(f"r{m}", layout.page_size)):
        pool.allocate(f"r{m}", layout.page_size)
        m += 1
    assert m > n + 10, (n, m)
    pool.check()
