"""Compaction: pack each group's live pages toward its anchor end, slide the floats so the free
bytes between the ends are shared, copy the bytes, rewrite the tables and bump the epoch.

:func:`compact` is :meth:`kvd.pool.pool.Pool.compact`'s body (its docstring is the contract); it
changes the pool's tables, epoch, request versions and counters, and nothing when refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from kvd.copy.pages import copy_runs
from kvd.copy.runs import coalesce
from kvd.errors import NotFound, Pinned
from kvd.limits import quote
from kvd.pool.allocator import IDX, GroupAllocator
from kvd.pool.layout import GroupKind
from kvd.pool.request import Request, request_vids
from kvd.records import CompactionResult

if TYPE_CHECKING:
    from kvd.pool.pool import Pool

__all__ = ["compact", "pinned_mask", "plan_slides"]

def compact(pool: Pool, pinned: Mapping[str, str] | Iterable[str] = (), *, around_pinned: bool = False) -> CompactionResult:
    """:meth:`Pool.compact <kvd.pool.pool.Pool.compact>` of ``pool``: see its contract."""
    labels = dict(pinned) if isinstance(pinned, Mapping) else {rid: rid for rid in pinned}
    for rid in labels:
        if rid not in pool._requests and rid not in pool._offloaded:
            raise NotFound(f"compact: pinned request {quote(rid)} is not allocated in this pool")
    pinned_reqs = [pool._requests[r] for r in labels if r in pool._requests]
    moves: dict[GroupKind, tuple[torch.Tensor, torch.Tensor]] = {}
    blockers: set[str] = set()
    for k, a in pool.groups.items():
        fixed = pinned_mask(pool.groups, k, pinned_reqs)
        src, dst = a.plan_compaction(fixed if around_pinned else None)
        if not around_pinned and fixed is not None and src.numel():
            hit = fixed[(src - a.lo).to(torch.int64)]
            if bool(hit.any()):
                handles = pool._bindings.owner_handles(k, a.p2v[src[hit]])
                blockers.update(labels[pool._bindings.by_handle[h].rid] for h in handles)
        moves[k] = (src, dst)
    if blockers:
        pool.compactions_refused += 1
        names = ", ".join(sorted(blockers))
        raise Pinned(f"compaction refused: it would move pages pinned by {names}; release them or retry later", tuple(sorted(blockers)))
    gap_before = pool.gap_bytes()
    moved_bytes = 0
    # What moved is read off the tables afterwards: a page packed and then slid counts once,
    # and not at all if it came back to where it was.
    before = {k: a.v2p.clone() for k, a in pool.groups.items()}
    for k, (src, dst) in moves.items():
        a = pool.groups[k]
        if src.numel():
            view = pool.page_view(k)
            copy_runs(view, view, coalesce(src, dst))
            moved_bytes += src.numel() * a.pb
        a.apply_moves(src, dst)
    slides = plan_slides(pool.groups, pinned_reqs, pool.sink_bytes, pool.arena.backed)
    # A float moving up may land where the float above it sits now, so up-movers go top
    # first and down-movers bottom first; a slide may overlap its own source, so each one
    # gathers before it scatters.
    up = [k for k in reversed(list(slides)) if int(slides[k][1][0]) > int(slides[k][0][0])]
    down = [k for k in slides if k not in up]
    for k in up + down:
        src, dst = slides[k]
        view = pool.page_view(k)
        d, sr = dst.long().to(view.device), src.long().to(view.device)  # tables live on the host
        view.index_copy_(0, d, view.index_select(0, sr))
        moved_bytes += src.numel() * pool.groups[k].pb
        pool.groups[k].apply_slide(src, dst)
    changed = {k: (a.v2p != before[k]).nonzero().flatten() for k, a in pool.groups.items()}
    moved_pages = sum(c.numel() for c in changed.values())
    moved_handles = set().union(*(pool._bindings.owner_handles(k, c) for k, c in changed.items() if c.numel()))
    if moved_bytes:
        pool._settle()
    if moved_pages:
        pool.epoch += 1
        for h in moved_handles:
            pool._bindings.by_handle[h].moved_epoch = pool.epoch
            pool._bindings.by_handle[h].version = next(pool._bindings.versions)
    pool.compactions_done += 1
    pool.pages_moved += moved_pages
    pool.bytes_moved += moved_bytes
    return CompactionResult(moved_pages, moved_bytes, pool.gap_bytes() - gap_before, pool.epoch)


def plan_slides(
    groups: Mapping[GroupKind, GroupAllocator], pinned_reqs: list[Request], sink_bytes: int, backed: int
) -> dict[GroupKind, tuple[torch.Tensor, torch.Tensor]]:
    """After packing: place the floats so the free bytes between the two ends are shared by
    the groups in proportion to the bytes each holds now (an end group's share goes to the
    gap beside it, a float's is split between its two gaps). Positions depend only on the
    ends and the groups' sizes, so a second compaction moves nothing. A float boxed in by a
    neighbour gets room back. If any float holds pinned pages or holes, floats stay put.
    Returns per-group moves, to be applied in arena order."""
    kinds = list(groups)
    g = groups
    if len(kinds) < 3:
        return {}
    floats = kinds[1:-1]
    for k in floats:
        mask = pinned_mask(groups, k, pinned_reqs)
        if g[k].n_holes or (mask is not None and bool(mask.any())):
            return {}
    first, last = g[kinds[0]], g[kinds[-1]]
    start = max(sink_bytes, first.hi * first.pb)
    end = backed if last.empty else last.lo * last.pb
    size = {k: g[k].used * g[k].pb for k in kinds}
    total = float(sum(size.values()))
    free = end - start - sum(size[k] for k in floats)
    if total == 0 or free <= 0:
        return {}

    def half(k: GroupKind, side: str) -> float:
        share = size[k] / total
        end_group = (k is kinds[0] and side == "up") or (k is kinds[-1] and side == "down")
        return share if end_group else share / 2

    out: dict[GroupKind, tuple[torch.Tensor, torch.Tensor]] = {}
    targets: dict[GroupKind, int] = {}
    cursor, prev = float(start), kinds[0]
    for k in floats:
        a = g[k]
        if a.used == 0:
            continue
        cursor += free * (half(prev, "up") + half(k, "down"))
        lo = -(-int(cursor) // a.pb)
        targets[k] = lo
        cursor = float((lo + a.used) * a.pb)
        prev = k
    if cursor + free * (half(prev, "up") + half(kinds[-1], "down")) > end + sum(g[k].pb for k in floats) or cursor > end:
        return {}  # rounding pushed a float past the top end: leave them where they are
    for k, lo in targets.items():
        if lo != g[k].lo and g[k].p_min <= lo and lo + g[k].used <= g[k].p_max:
            out[k] = g[k].plan_slide(lo)
    return out


def pinned_mask(groups: Mapping[GroupKind, GroupAllocator], kind: GroupKind, reqs: list[Request]) -> torch.Tensor | None:
    """Which pages of group ``kind``'s region (from its ``lo``) hold ``reqs``' ids; None when no request is pinned."""
    if not reqs:
        return None
    a = groups[kind]
    mask = torch.zeros(a.hi - a.lo, dtype=torch.bool)
    vids = [request_vids(kind, r) for r in reqs]
    v = torch.cat(vids) if vids else torch.empty(0, dtype=IDX)
    if v.numel():
        mask[(a.v2p[v] - a.lo).to(torch.int64)] = True
    return mask
