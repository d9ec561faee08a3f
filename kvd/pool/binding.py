"""Bindings: which request owns which virtual id, and binding a planned step's pages to it.

The id owners (full, shared with swa; state; draft) each mint their own ids from a ring; a table
per owner names the request (by handle) that holds each id; every step a request takes draws it a
new mapping version. The pool owns the requests; this binds and releases their pages over the
pool's allocators as planned by :class:`~kvd.pool.planner.Planner`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from kvd.errors import InternalError
from kvd.pool.allocator import IDX, GroupAllocator, IdRing
from kvd.pool.layout import GroupKind
from kvd.pool.planner import Placement, Step
from kvd.pool.request import Request

__all__ = ["Bindings"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT


class Bindings:
    """Id rings, id -> request tables, request handles and versions over ``groups`` (the pool's
    allocators, shared, not copied)."""

    def __init__(self, groups: Mapping[GroupKind, GroupAllocator]) -> None:
        self.groups = groups
        # Id owners: full (shared with swa), state and draft each mint their own ids.
        self.rings: dict[GroupKind, IdRing] = {k: IdRing(a.v2p.numel()) for k, a in groups.items() if k is not SWA}
        self.vid_req: dict[GroupKind, torch.Tensor] = {
            k: torch.full((r.size,), -1, dtype=IDX) for k, r in self.rings.items()
        }
        self.by_handle: dict[int, Request] = {}
        self._next_handle = 0
        self.versions = itertools.count(1)  # request mapping versions: never reused within a boot

    def new_handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def bind_step(self, r: Request, step: Step, plan: Placement) -> None:
        """Bind the pages of one planned step. Each group's plan is consumed by the first
        bindings that need new pages; holes are used before growth."""
        r.version = next(self.versions)  # every step changes the request's vectors (tokens at least)
        n_full = step.need.get(FULL, 0)
        if n_full:
            vids = self.rings[FULL].take(n_full)
            self._bind(FULL, vids, plan)
            self.vid_req[FULL][vids] = r.handle
            r.full = torch.cat([r.full, vids])
        if step.need.get(SWA, 0):
            self._bind(SWA, r.full[r.full.numel() - step.need[SWA] :], plan)
        if step.need.get(STATE, 0):
            vid = self.rings[STATE].take(1)
            self._bind(STATE, vid, plan)
            self.vid_req[STATE][vid] = r.handle
            r.state = int(vid)
        if step.need.get(DRAFT, 0):
            vids = self.rings[DRAFT].take(step.need[DRAFT])
            self._bind(DRAFT, vids, plan)
            self.vid_req[DRAFT][vids] = r.handle
            r.draft = torch.cat([r.draft, vids])

    def _bind(self, kind: GroupKind, vids: torch.Tensor, plan: Placement) -> None:
        a = self.groups[kind]
        g_lo, g_hi, new_lo = plan.get(kind, (0, 0, None))
        n = vids.numel()
        from_holes = min(n, a.n_holes)
        take_lo = min(g_lo, n - from_holes)
        take_hi = min(g_hi, n - from_holes - take_lo)
        if from_holes + take_lo + take_hi != n:
            raise InternalError(f"{kind.value}: plan covers {from_holes + take_lo + take_hi} of {n} pages")
        a.bind(vids, take_lo, take_hi, new_lo if a.empty else None)
        plan[kind] = (g_lo - take_lo, g_hi - take_hi, None)

    def release(self, r: Request) -> int:
        """Unbind every page and id of ``r`` (dropped from the tables); returns its tokens."""
        if SWA in self.groups:
            self.groups[SWA].unbind(r.full[r.swa_first :])
        self.groups[FULL].unbind(r.full)
        self.vid_req[FULL][r.full] = -1
        self.rings[FULL].give(r.full)
        if r.state >= 0:
            vid = torch.tensor([r.state], dtype=IDX)
            self.groups[STATE].unbind(vid)
            self.vid_req[STATE][vid] = -1
            self.rings[STATE].give(vid)
        if r.draft.numel():
            self.groups[DRAFT].unbind(r.draft)
            self.vid_req[DRAFT][r.draft] = -1
            self.rings[DRAFT].give(r.draft)
        del self.by_handle[r.handle]
        return r.tokens

    def owner_handles(self, kind: GroupKind, vids: torch.Tensor) -> set[int]:
        """Handles of the requests that own ``vids`` of group ``kind`` (SWA ids are the full group's)."""
        table = self.vid_req[FULL if kind is SWA else kind]
        return set(torch.unique(table[vids]).tolist())
