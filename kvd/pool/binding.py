"""Bindings: which request owns which virtual id, and binding a planned step's pages to it.

The id owners (full, shared with swa; state; draft) each mint their own ids from a ring; a table
per owner names the request (by handle) that holds each id; every step a request takes draws it a
new mapping version. The pool owns the requests; this binds and releases their pages over the
pool's allocators as planned by :class:`~kvd.pool.planner.Planner`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvd.errors import InternalError
from kvd.pool.allocator import IDX, GroupAllocator, IdRing
from kvd.pool.layout import GroupKind
from kvd.pool.planner import Placement, Step
from kvd.pool.request import Request

__all__ = ["Bindings"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT
_NO_GROWTH = (0, 0, None)  # a group's plan when it grows nowhere


class Bindings:
    """Id rings, id -> request tables, request handles and versions over ``groups`` (the pool's
    allocators, shared, not copied).

    Several requests' steps bind (:meth:`bind_steps`) and release (:meth:`release_many`) in one
    allocator call per group, with exactly the pages, ids, hole stacks and versions that binding
    or releasing them one by one, in order, gives."""

    def __init__(self, groups: Mapping[GroupKind, GroupAllocator]) -> None:
        self.groups = groups
        # Id owners: full (shared with swa), state and draft each mint their own ids.
        self.rings: dict[GroupKind, IdRing] = {k: IdRing(a.v2p.numel()) for k, a in groups.items() if k is not SWA}
        self.vid_req: dict[GroupKind, torch.Tensor] = {
            k: torch.full((r.size,), -1, dtype=IDX) for k, r in self.rings.items()
        }
        self._vid_req = {k: t.numpy() for k, t in self.vid_req.items()}  # the same memory
        # (kind, allocator, (id ring, id -> request table)) per group, full first: swa binds its
        # ids, and has neither ring nor table of its own (None)
        self._slots = [(k, groups[k], (self.rings[k], self._vid_req[k]) if k is not SWA else None)
                       for k in (FULL, SWA, STATE, DRAFT) if k in groups]
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
        self.bind_steps([r], [step], plan)

    def bind_steps(self, reqs: Sequence[Request], steps: Sequence[Step], plan: Placement) -> None:
        """Bind the planned steps of ``reqs`` (``steps[i]`` is ``reqs[i]``'s) as :meth:`bind_step`
        of each in order would, one allocator call per group. Every split of the plan is checked
        before anything is bound."""
        for r in reqs:
            r.version = next(self.versions)  # every step changes the request's vectors (tokens at least)
        if len(reqs) == 1:
            self._bind_one(reqs[0], steps[0].need, plan)
        else:
            self._bind_split(reqs, steps, plan)

    def _bind_split(self, reqs: Sequence[Request], steps: Sequence[Step], plan: Placement) -> None:
        """:meth:`bind_steps` without versions: each group's ids taken at once, split among ``reqs``."""
        for kind, a, owner in self._slots:
            counts = [s.need.get(kind, 0) for s in steps]
            total = sum(counts)
            if not total:
                continue
            if owner is None:  # swa: the window tail of each request's (already extended) full ids
                tails = [r.full[len(r.full) - c :] for r, c in zip(reqs, counts) if c]
                _bind(kind, a, tails[0] if len(tails) == 1 else np.concatenate(tails), counts, plan)
                continue
            ring, owners = owner
            vids = ring.take_np(total)
            _bind(kind, a, vids, counts, plan)
            owners.put(vids, np.repeat(np.array([r.handle for r in reqs], dtype=np.int32), counts))
            at = 0
            for r, c in zip(reqs, counts):
                if not c:
                    continue
                if kind is STATE:
                    r.state = int(vids[at])
                else:
                    mine = vids[at : at + c]
                    if kind is FULL:
                        r.full = np.concatenate((r.full, mine)) if len(r.full) else mine
                    else:
                        r.draft = np.concatenate((r.draft, mine)) if len(r.draft) else mine
                at += c

    def _bind_one(self, r: Request, need: dict[GroupKind, int], plan: Placement) -> None:
        """:meth:`_bind_split` of one request (the common call), with nothing to split: each
        group's ids take holes first, then the plan's growth below, then above."""
        for kind, a, owner in self._slots:
            n = need.get(kind, 0)
            if not n:
                continue
            g_lo, g_hi, new_lo = plan.get(kind, _NO_GROWTH)
            rest = n - a.n_holes if n > a.n_holes else 0
            take_lo = g_lo if g_lo < rest else rest
            take_hi = rest - take_lo
            if take_hi > g_hi:
                raise InternalError(f"{kind.value}: plan covers {n - rest + take_lo + g_hi} of {n} pages")
            plan[kind] = (g_lo - take_lo, g_hi - take_hi, None)
            if owner is None:  # swa: the window tail of the (already extended) full ids
                a.bind(r.full[len(r.full) - n :], take_lo, take_hi, new_lo if a.hi == a.lo else None)
                continue
            vids = owner[0].take_np(n)
            a.bind(vids, take_lo, take_hi, new_lo if a.hi == a.lo else None)
            if n == 1:  # a state slot, a decode step's page: a scalar write
                owner[1][vids.item(0)] = r.handle
            else:
                owner[1].put(vids, r.handle)
            if kind is STATE:
                r.state = vids.item(0)
            elif kind is FULL:
                r.full = np.concatenate((r.full, vids)) if len(r.full) else vids
            else:
                r.draft = np.concatenate((r.draft, vids)) if len(r.draft) else vids

    def release(self, r: Request) -> int:
        """Unbind every page and id of ``r`` (dropped from the tables); returns its tokens."""
        return self.release_many([r])

    def release_many(self, reqs: Sequence[Request]) -> int:
        """:meth:`release` of each of ``reqs`` in order, one allocator call per group; returns
        their tokens."""
        if not reqs:
            return 0
        return self._release_one(reqs[0]) if len(reqs) == 1 else self._release_split(reqs)

    def _release_one(self, r: Request) -> int:
        """:meth:`_release_split` of one request (the common call), with nothing to join."""
        for kind, a, owner in self._slots:
            if owner is None:  # swa: the window tail of the full ids
                a.unbind(r.full[r.swa_first :])
                continue
            if kind is FULL:
                vids = r.full
            elif kind is STATE:
                if r.state < 0:
                    continue
                vids = np.array((r.state,), dtype=np.int32)
                a.unbind(vids)
                owner[1][r.state] = -1  # one slot: a scalar write
                owner[0].give(vids)
                continue
            else:
                vids = r.draft
            a.unbind(vids)
            owner[1].put(vids, -1)
            owner[0].give(vids)
        del self.by_handle[r.handle]
        return r.tokens

    def _release_split(self, reqs: Sequence[Request]) -> int:
        """:meth:`release_many`: each group's ids of ``reqs`` joined into one unbind."""
        g = self.groups
        full, full_n = _joined([r.full for r in reqs])
        if SWA in g:
            g[SWA].unbind(*_joined([r.full[r.swa_first :] for r in reqs]))
        self._release(FULL, full, full_n)
        states = [r.state for r in reqs if r.state >= 0]
        if states:
            # one slot each: several are pushed as several one-page requests
            self._release(STATE, np.array(states, dtype=np.int32), np.ones(len(states), dtype=np.int64) if len(states) > 1 else None)
        drafts = [r.draft for r in reqs if len(r.draft)]
        if drafts:
            self._release(DRAFT, *_joined(drafts))
        for r in reqs:
            del self.by_handle[r.handle]
        return sum(r.tokens for r in reqs)

    def _release(self, kind: GroupKind, vids: np.ndarray, counts: np.ndarray | None) -> None:
        self.groups[kind].unbind(vids, counts)
        self._vid_req[kind].put(vids, -1)
        self.rings[kind].give(vids)

    def owner_handles(self, kind: GroupKind, vids: torch.Tensor) -> set[int]:
        """Handles of the requests that own ``vids`` of group ``kind`` (SWA ids are the full group's)."""
        table = self.vid_req[FULL if kind is SWA else kind]
        return set(torch.unique(table[vids]).tolist())


def _joined(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Several requests' ids as one array, and their counts (None for one request)."""
    if len(parts) == 1:
        return parts[0], None
    return np.concatenate(parts), np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))


def _bind(kind: GroupKind, a: GroupAllocator, vids: np.ndarray, counts: list[int], plan: Placement) -> None:
    """Bind ``vids`` (requests' ids, ``counts`` each, in order) in ``a`` as one-by-one binds would:
    each takes holes first, then the plan's growth below, then above. Consumes ``plan[kind]``."""
    g_lo, g_hi, new_lo = plan.get(kind, (0, 0, None))
    holes, left_lo, left_hi = a.n_holes, g_lo, g_hi
    lo_parts = []
    for n in counts:
        if not n:
            continue
        from_holes = min(n, holes)
        take_lo = min(left_lo, n - from_holes)
        take_hi = min(left_hi, n - from_holes - take_lo)
        if from_holes + take_lo + take_hi != n:
            raise InternalError(f"{kind.value}: plan covers {from_holes + take_lo + take_hi} of {n} pages")
        holes, left_lo, left_hi = holes - from_holes, left_lo - take_lo, left_hi - take_hi
        if take_lo:
            lo_parts.append(take_lo)
    a.bind(vids, g_lo - left_lo, g_hi - left_hi, new_lo if a.hi == a.lo else None,
           np.array(lo_parts, dtype=np.int64) if len(lo_parts) > 1 else None)
    plan[kind] = (left_lo, left_hi, None)
