"""Seed 004: the swa group binds the full group's virtual ids, so its v2p must span the owner's
id space. When full pages are ~10x as many as swa pages, churn eventually hands out a full id
above the swa group's own page count; a v2p sized by that page count then indexes out of range.

Both layouts below have the gemma-4-31b-it shape (swa pages cost 10x full pages): the preset
itself on a small arena, and a float32 miniature with 256-byte full pages that runs fast."""

from __future__ import annotations

import pytest
import torch

from kvd.pool.layout import Layout
from kvd.records import AllocSpec
from kvd.pool.pool import Pool
from kvd.pool.presets import preset
from pool_testkit import FULL, SWA, two_group_layout

GEMMA = preset("gemma-4-31b-it-tp2")
MINI = two_group_layout(swa_ratio=10, window=16, name="mini-gemma")


def _arena_sizes(layout: Layout) -> tuple[int, int]:
    """Reserve 30 swa pages (300 full ids), back the sink plus room for ~4 requests of 2 pages."""
    pb_swa = layout.page_bytes(layout.group("swa"))
    pb_full = layout.page_bytes(layout.group("full"))
    return 30 * pb_swa, pb_swa + 8 * (pb_swa + pb_full) + pb_swa


def _churn(pool: Pool, rounds: int, seen: list[int]) -> None:
    """Allocate three 2-page requests (one received, so it binds its window tail only), check
    that every swa id translates to the request's swa pages, free them; ``rounds`` times."""
    ps = pool.layout.page_size
    for i in range(rounds):
        specs = [AllocSpec(f"a{i}", 2 * ps), AllocSpec(f"b{i}", 2 * ps - 1), AllocSpec(f"c{i}", 2 * ps, receive=True)]
        out = pool.allocate_many(specs)
        for v in out:
            vids = pool.virtual_ids(v.rid)["full"]
            swa_vids = vids[v.swa_first_page :]
            assert torch.equal(pool.translate(SWA, swa_vids), v.swa)
            assert bool((pool.groups[SWA].v2p[swa_vids.long()] >= 0).all())
            seen.extend(swa_vids.tolist())
        pool.check()
        pool.free_many([s.rid for s in specs])
        pool.check()


@pytest.mark.parametrize("layout", [MINI, GEMMA], ids=["mini-gemma", "gemma-4-31b-it-tp2"])
def test_churn_binds_full_ids_past_the_swa_page_count(layout: Layout, kvd_arena_factory) -> None:
    reserved, backed = _arena_sizes(layout)
    pool = Pool(layout, kvd_arena_factory(reserved, backed))
    st = {g.name: g for g in pool.stats().groups}
    assert st["full"].capacity_pages >= 9 * st["swa"].capacity_pages  # the seed's ~10:1 shape
    swa_own = pool.groups[SWA].p2v.numel()  # the swa group's own page count (its table height)
    full_ids = pool.groups[FULL].v2p.numel()
    assert full_ids == 10 * swa_own and pool.groups[SWA].v2p.numel() == full_ids

    seen: list[int] = []
    # Each round takes 6 full ids; 120 rounds walk the owner's 300 ids more than twice.
    _churn(pool, 120, seen)
    assert len(seen) > 2 * full_ids
    high = [v for v in seen if v >= swa_own]
    assert high, "churn never bound a full id above the swa group's own page count on the swa side"
    assert max(seen) == full_ids - 1  # the id ring wrapped through the whole owner space
    assert pool.stats().requests_live == 0 and all(g.used_pages == 0 for g in pool.stats().groups)


@pytest.mark.parametrize("layout", [MINI, GEMMA], ids=["mini-gemma", "gemma-4-31b-it-tp2"])
def test_v2p_sized_by_own_pages_breaks_under_the_same_churn(layout: Layout, kvd_arena_factory) -> None:
    """The seed's bug, re-created: the first rounds pass (a fresh server survives its first
    eval), then a full id past the swa table's height is bound on the swa side and fails."""
    reserved, backed = _arena_sizes(layout)
    pool = Pool(layout, kvd_arena_factory(reserved, backed))
    # Re-create the seed's sizing on an empty pool: the swa v2p as tall as the swa group's own
    # page table (what SGLang did), not the full group's id space that kvd gives it.
    swa = pool.groups[SWA]
    swa.v2p = torch.full((swa.p2v.numel(),), -1, dtype=swa.v2p.dtype)
    swa_own = swa.v2p.numel()
    assert swa_own == pool.groups[SWA].p2v.numel() < pool.groups[FULL].v2p.numel()
    seen: list[int] = []
    _churn(pool, 2, seen)  # ids 0..11: nothing wrong yet
    assert max(seen) < swa_own
    with pytest.raises((IndexError, RuntimeError), match="out of bounds|index"):
        _churn(pool, 120, seen)
    # It failed only once churn reached the swa table's end, not before.
    assert max(seen) >= swa_own - 6
