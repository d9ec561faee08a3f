"""The pool's invariant checker: tables, accounting, placement and requests, read and never changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvd.errors import InternalError
from kvd.pool.layout import GroupKind
from kvd.pool.request import request_vids

if TYPE_CHECKING:
    from kvd.pool.pool import Pool

__all__ = ["check"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT


def check(pool: Pool) -> None:
    """:meth:`Pool.check <kvd.pool.pool.Pool.check>` of ``pool``: raise :class:`InternalError`
    naming the first broken invariant (the list is that method's contract)."""
    def fail(msg: str) -> None:
        raise InternalError(f"pool invariant broken: {msg}")

    live_tokens = sum(r.tokens for r in pool._requests.values())
    if live_tokens != pool._live_tokens:
        fail(f"live requests hold {live_tokens} tokens but the running count says {pool._live_tokens}")
    prev_hi, prev_name = pool.sink_bytes, "sink"
    for k, a in pool.groups.items():
        bound_p = (a.p2v != -1).nonzero().flatten()
        bound_v = (a.v2p != -1).nonzero().flatten()
        if bound_p.numel() != a.used or bound_v.numel() != a.used:
            fail(f"{k.value}: used={a.used} but {bound_p.numel()} pages / {bound_v.numel()} ids bound")
        if a.used and not torch.equal(a.v2p[a.p2v[bound_p].long()].long(), bound_p):
            fail(f"{k.value}: v2p is not the inverse of p2v")
        if a.used and (int(bound_p.min()) < a.lo or int(bound_p.max()) >= a.hi):
            fail(f"{k.value}: a bound page lies outside the region [{a.lo}, {a.hi})")
        if a.lo < a.p_min or a.hi > a.p_max or a.lo > a.hi:
            fail(f"{k.value}: region [{a.lo}, {a.hi}) outside [{a.p_min}, {a.p_max})")
        holes = a.holes()
        if holes.numel() != (a.hi - a.lo) - a.used:
            fail(f"{k.value}: {holes.numel()} holes but region {a.hi - a.lo} - used {a.used}")
        if holes.numel():
            if torch.unique(holes).numel() != holes.numel():
                fail(f"{k.value}: a hole is listed twice")
            if bool((a.p2v[holes.long()] != -1).any()) or int(holes.min()) < a.lo or int(holes.max()) >= a.hi:
                fail(f"{k.value}: a listed hole is bound or outside the region")
        if a.used > a.capacity:
            fail(f"{k.value}: used {a.used} exceeds capacity {a.capacity}")
        lo_b, hi_b = a.bytes_range()
        if hi_b > lo_b:
            if lo_b < prev_hi:
                fail(f"{k.value}: region starts at byte {lo_b} inside {prev_name} (ends {prev_hi})")
            if hi_b > pool.arena.backed:
                fail(f"{k.value}: region ends at byte {hi_b} past the backing {pool.arena.backed}")
            prev_hi, prev_name = hi_b, k.value
    # requests
    counts = {k: 0 for k in pool.groups}
    for r in pool._requests.values():
        n = pool._planner.pages(FULL, r.tokens)
        if len(r.full) != n:
            fail(f"request {r.rid}: {len(r.full)} full pages for {r.tokens} tokens (want {n})")
        if r.base_tokens > r.tokens:
            fail(f"request {r.rid}: base_tokens {r.base_tokens} > tokens {r.tokens}")
        for k in pool.groups:
            vids = request_vids(k, r)
            counts[k] += vids.numel()
            if vids.numel() and bool((pool.groups[k].v2p[vids] < 0).any()):
                fail(f"request {r.rid}: a {k.value} id is unbound")
            if k is not SWA and vids.numel():
                if bool((pool._bindings.vid_req[k][vids] != r.handle).any()):
                    fail(f"request {r.rid}: {k.value} ids not recorded as its own")
        if SWA in pool.groups:
            if r.swa_first != pool._planner.swa_first(r.base_tokens):
                fail(f"request {r.rid}: SWA pages start at page {r.swa_first}, window says {pool._planner.swa_first(r.base_tokens)}")
            if r.swa_first > 0 and bool((pool.groups[SWA].v2p[torch.from_numpy(r.full[: r.swa_first])] != -1).any()):
                fail(f"request {r.rid}: an SWA page outside the window is still bound")
        if DRAFT in pool.groups and len(r.draft) != pool._planner.pages(DRAFT, r.tokens):
            fail(f"request {r.rid}: {len(r.draft)} draft pages for {r.tokens} tokens")
        if STATE in pool.groups and r.state < 0:
            fail(f"request {r.rid}: no state slot")
    for k, a in pool.groups.items():
        if counts[k] != a.used:
            fail(f"{k.value}: requests hold {counts[k]} pages but {a.used} are bound (leak or double bind)")
    for k, ring in pool._bindings.rings.items():
        if ring.count + pool.groups[k].used != ring.size:
            fail(f"{k.value}: {ring.count} free ids + {pool.groups[k].used} bound != {ring.size}")
