"""Placement planning: what each operation needs per group (a step), and whether and where a set of
steps fits the shared arena.

Groups sit in arena order (state, swa, draft, full); the ends grow inward, the floats in between
grow into either neighbouring gap. Free bytes between two groups serve both, shared by their byte
weights per token (a state slot over the requests' mean length). A plan changes nothing:
:meth:`Planner.fit` at most trims edges (which frees no page and moves no byte), and the pool binds
the pages it planned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvd.errors import CapacityError
from kvd.memory.arena import Arena
from kvd.pool.allocator import Direction, GroupAllocator, IdRing
from kvd.pool.layout import GroupKind, GroupSpec, Layout
from kvd.pool.request import Request

__all__ = ["Live", "Placement", "Planner", "Step", "TYPICAL_TOKENS"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT
UP, DOWN, FLOAT = Direction.UP, Direction.DOWN, Direction.FLOAT
#: The longest request length the planner assumes when it shares free bytes with the state group.
TYPICAL_TOKENS = 4096

#: A plan: group kind -> ``(grow_lo, grow_hi, new_lo)``, the pages each group grows by below and
#: above its region and, for an empty group, where it re-anchors (None: it stays).
Placement = dict[GroupKind, tuple[int, int, int | None]]


@dataclass(slots=True)
class Step:
    """Pages one request needs per group for one step, and SWA pages the step releases first."""

    need: dict[GroupKind, int]
    swa_release: int = 0
    tokens: int = 0  # the request's length after the step


class Live(NamedTuple):
    """The live requests the planner weighs the state group by: how many, and their tokens."""

    requests: int
    tokens: int


class Planner:
    """Plans steps over the pool's allocators (read, and trimmed by :meth:`fit`; never bound here).

    ``groups`` (arena order) and ``rings`` are the pool's own, shared, not copied; ``arena`` is
    read for its backed size only."""

    def __init__(
        self,
        layout: Layout,
        groups: Mapping[GroupKind, GroupAllocator],
        rings: Mapping[GroupKind, IdRing],
        arena: Arena,
        sink_bytes: int,
    ) -> None:
        self.layout = layout
        self.groups = groups
        self._rings = rings
        self.arena = arena
        self.sink_bytes = sink_bytes
        order = layout.arena_order()
        self._specs: dict[GroupKind, GroupSpec] = {g.kind: g for g in order}
        self._ps = {g.kind: layout.page_size_of(g) for g in order}
        # Bytes per token each group tends to consume: how the planner shares a gap between
        # neighbouring groups. A state slot is spread over a typical request's tokens, which
        # :meth:`weights` takes from the requests at hand (at most TYPICAL_TOKENS).
        self._weight = [layout.entry_bytes(g) / (TYPICAL_TOKENS if g.kind is STATE else 1) for g in order]
        # What every step asks of the layout: the window (None: no swa group), page sizes (0: no
        # draft group), whether there is a state group and a slot's bytes.
        self._window = self._specs[SWA].window if SWA in self._specs else None
        self._ps_full = self._ps[FULL]
        self._ps_draft = self._ps.get(DRAFT, 0)
        self._has_state = STATE in self._specs
        self._slot_bytes = layout.entry_bytes(self._specs[STATE]) if self._has_state else 0
        # The groups by position in arena order, for the plan's walk along the arena.
        self._kinds = list(groups)
        self._allocs = list(groups.values())
        self._dirs = [a.direction for a in self._allocs]
        self._pbs = [a.pb for a in self._allocs]
        self._ring_at = [rings.get(k) for k in self._kinds]
        self._state_at = self._kinds.index(STATE) if self._has_state else -1
        # (position, kind, allocator, direction, page bytes, id ring) per group, for plan()'s walk
        self._walk = list(zip(range(len(self._kinds)), self._kinds, self._allocs, self._dirs, self._pbs, self._ring_at))
        self._down_from = list(range(len(self._kinds) - 1, -1, -1))

    # =========================================================================================
    # steps: what each operation needs
    # =========================================================================================
    def pages(self, kind: GroupKind, tokens: int) -> int:
        return -(-tokens // self._ps[kind])

    def swa_first(self, base_tokens: int) -> int:
        if self._window is None:
            return 0
        return max(0, base_tokens - self._window) // self._ps_full

    def alloc_step(self, tokens: int, receive: bool, base_tokens: int | None = None) -> Step:
        n = -(-tokens // self._ps_full)
        need = {FULL: n}
        if self._window is not None:
            base = (tokens if receive else 0) if base_tokens is None else base_tokens
            need[SWA] = n - max(0, base - self._window) // self._ps_full
        if self._has_state:
            need[STATE] = 1
        if self._ps_draft:
            need[DRAFT] = -(-tokens // self._ps_draft)
        return Step(need, 0, tokens)

    def extend_step(self, r: Request, add: int) -> Step:
        new = r.tokens + add
        n_old, n_new = len(r.full), self.pages(FULL, new)
        need = {FULL: n_new - n_old}
        release = 0
        if SWA in self.groups:
            need[SWA] = n_new - n_old
            release = self.swa_first(r.tokens) - r.swa_first
        if DRAFT in self.groups:
            need[DRAFT] = self.pages(DRAFT, new) - len(r.draft)
        return Step(need, release, new)

    # =========================================================================================
    # planning: does a set of steps fit the shared arena, and where does each group grow?
    # =========================================================================================
    def plan(self, steps: Sequence[Step], live: Live, trimmed: bool, balanced: bool = False) -> tuple[Placement, int]:
        """Greedy placement along the arena, low address to high.

        Each group first uses its holes (plus SWA pages released by the same steps), then grows
        into the gap below it (down/float groups), then the gap above it (up/float groups), up
        to the next non-empty group. Using the lower gap first fits the most into this one plan:
        no group further up can reach that gap. ``balanced``: a float grows first into whichever
        of its two gaps has more room for the neighbour it shares it with (room per byte weight
        of that neighbour), so it does not eat the only gap of the group below (the state group
        grows up alone) while the gap above stays empty. Returns ``(plan, shortfall_bytes)``;
        plan maps kind -> ``(grow_lo, grow_hi, new_lo)``."""
        total, credit = _totals(steps)
        allocs, pbs = self._allocs, self._pbs
        bounds = [a.trimmed_bounds() for a in allocs] if trimmed else [(a.lo, a.hi) for a in allocs]
        # nxt[i]: the first non-empty group above group i (None: the top of the backing)
        nxt: list[int | None] = [None] * len(allocs)
        j = None
        for i in self._down_from:
            nxt[i] = j
            lo, hi = bounds[i]
            if hi > lo:
                j = i
        backed = self.arena.backed
        w: list[float] = []  # the weights by position, computed when a float first needs them
        plan: Placement = {}
        short = 0
        prev_hi_bytes = self.sink_bytes
        for i, k, a, d, pb, ring in self._walk:
            lo, hi = bounds[i]
            need = total.get(k, 0)
            if not need:  # grows nowhere; only its region bounds the groups above
                if hi > lo and hi * pb > prev_hi_bytes:
                    prev_hi_bytes = hi * pb
                continue
            used = a.used
            extra = need - ((hi - lo) - used + (credit if k is SWA else 0))
            if extra < 0:
                extra = 0
            new_lo = None
            up = nxt[i]
            top = (backed if up is None else bounds[up][0] * pbs[up]) // pb  # this group's pages end below it
            if a.p_max < top:
                top = a.p_max
            floor = -(-prev_hi_bytes // pb)  # the first page above the groups below
            floats = extra > 0 and d is FLOAT  # grows, and may grow either way
            if floats:
                if not w:
                    w = self.weights(steps, live)
                if used == 0:
                    # An empty float re-anchors inside the gap it sits in, leaving the group below
                    # it room in proportion to their byte weights, so neighbours do not box each
                    # other in.
                    last = top - extra
                    below = w[i - 1]
                    above = sum(w[i + 1 : len(allocs) if up is None else up + 1])
                    target = floor + int((last + extra - floor) * below / (below + w[i] + above))
                    new_lo = lo = hi = max(floor, min(target, last))
            down_room = lo - floor if d is not UP else 0
            up_room = top - hi if d is not DOWN else 0
            if down_room < 0:
                down_room = 0
            if up_room < 0:
                up_room = 0
            if balanced and floats and self._up_first(i, up, down_room, up_room, w):
                g_hi = extra if extra < up_room else up_room
                g_lo = extra - g_hi if extra - g_hi < down_room else down_room
            else:
                g_lo = extra if extra < down_room else down_room
                g_hi = extra - g_lo if extra - g_lo < up_room else up_room
            missing = extra - g_lo - g_hi
            if ring is not None and need - ring.count > missing:
                missing = need - ring.count
            short += missing * pb
            plan[k] = (g_lo, g_hi, new_lo)
            if hi + g_hi > lo - g_lo and (hi + g_hi) * pb > prev_hi_bytes:
                prev_hi_bytes = (hi + g_hi) * pb
        return plan, short

    def _up_first(self, i: int, up: int | None, down_room: int, up_room: int, w: list[float]) -> bool:
        """Whether float ``i`` (a position in arena order) should grow into the gap above it
        first: that gap leaves more room per byte weight of the neighbour it shares it with than
        the gap below does. A neighbour that cannot grow into the gap (the top group's gap below
        the float is the float's alone, and so on) weighs nothing there. ``up``: the first
        non-empty group above (None: none); ``w``: :meth:`weights` of the plan, by position."""
        w_below = w[i - 1] if i > 0 and self._dirs[i - 1] is not DOWN else 0.0
        w_above = w[up] if up is not None and self._dirs[up] is not UP else 0.0
        if w_above == 0.0:
            return up_room > 0 and w_below > 0.0
        if w_below == 0.0:
            return False
        pb = self._pbs[i]
        return up_room * pb / w_above > down_room * pb / w_below

    def weights(self, steps: Sequence[Step], live: Live) -> list[float]:
        """Per-token byte weights of the groups (by position in arena order), a state slot spread
        over the mean length of the live requests and those being placed (at least a page, at
        most TYPICAL_TOKENS): short requests need a slot per few tokens, and a state group weighed
        as if every request were 4k tokens long got only page-alignment room below a float
        (tiny-hybrid's short requests were refused with 94% of the arena free until compaction)."""
        if not self._has_state:
            return self._weight
        new = [s.tokens for s in steps if s.need.get(STATE)]
        count = live.requests + len(new)
        if not count:
            return self._weight
        typical = min(TYPICAL_TOKENS, max(self._ps_full, (live.tokens + sum(new)) // count))
        w = self._weight.copy()
        w[self._state_at] = self._slot_bytes / typical
        return w

    def attempt(self, steps: Sequence[Step], live: Live) -> tuple[Placement, int, bool]:
        """The first plan of ``steps`` that fits, trying balanced growth before lower-gap-first
        and both before trimming edges: ``(plan, 0, trimmed)``; else ``(plan, shortfall, True)``
        with the smallest shortfall seen. Changes nothing."""
        quick = self._in_holes(steps)
        if quick is not None:
            return quick, 0, False
        short = None
        plan: Placement = {}
        for trimmed in (False, True):
            for balanced in (True, False):
                p, s = self.plan(steps, live, trimmed, balanced)
                if s == 0:
                    return p, 0, trimmed
                if short is None or s < short:
                    plan, short = p, s
        return plan, int(short or 0), True

    def _in_holes(self, steps: Sequence[Step]) -> Placement | None:
        """The plan of ``steps`` when every group's holes (and SWA pages the steps release) and
        id ring cover them: no group grows, which is what :meth:`plan` would say at greater
        cost (churn in a busy pool, the common case). None when some group must grow."""
        total, credit = _totals(steps)
        plan: Placement = {}
        for k, need in total.items():
            if not need:
                continue
            a = self.groups[k]
            ring = self._rings.get(k)
            if need > (a.hi - a.lo) - a.used + (credit if k is SWA else 0) or (ring is not None and need > ring.count):
                return None
            plan[k] = (0, 0, None)
        return plan

    def fit(self, steps: Sequence[Step], what: str, live: Live) -> Placement:
        """Plan ``steps`` (:meth:`attempt`); raise CapacityError when nothing fits. Mutates
        only by trimming (which frees no page and moves no byte)."""
        plan, short, trimmed = self.attempt(steps, live)
        if not trimmed:
            return plan
        if short:
            holes = sum(a.n_holes * a.pb for a in self.groups.values())
            gap = self.gap_bytes()
            if gap >= short + self.layout.max_page_bytes * len(self.groups):
                # Free bytes exist, but between the wrong neighbours (a float boxed in): only
                # moving pages makes them usable, which the engine must allow (a safe point).
                hint = (f"; {gap:,d} free bytes lie between groups that cannot grow into them: compact() slides the "
                        "groups to share them (then retry), or free or offload requests")
            else:
                hint = "; free or offload requests" + (f", or compact ({holes:,d} bytes sit in holes)" if holes else "")
            raise CapacityError(f"{what} does not fit: {short:,d} bytes short ({self._free_summary()}){hint}", shortfall_bytes=short)
        for a in self.groups.values():
            a.trim()
        return plan

    def _free_summary(self) -> str:
        return f"gap {self.gap_bytes():,d} B of {self.arena.backed:,d} B backed"

    def gap_bytes(self) -> int:
        """Free bytes between the groups' regions (not counting holes inside regions)."""
        used = sum((a.hi - a.lo) * a.pb for a in self.groups.values())
        return self.arena.backed - self.sink_bytes - used


def _totals(steps: Sequence[Step]) -> tuple[dict[GroupKind, int], int]:
    """Pages ``steps`` need per group, and the SWA pages they release first (holes for them all)."""
    if len(steps) == 1:
        s = steps[0]
        return s.need, s.swa_release
    total: dict[GroupKind, int] = {}
    credit = 0
    for s in steps:
        for k, n in s.need.items():
            total[k] = total.get(k, 0) + n
        credit += s.swa_release
    return total, credit
