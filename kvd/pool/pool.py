"""The unified KV pool: one arena shared by every group of a layout, with requests on top.

The pool is the in-process core of kvd. It is not thread-safe: the daemon serialises calls.
Every public method either completes or raises a :class:`~kvd.errors.KvdError` having changed
nothing (it plans first and commits only a plan that fits).

Requests
    A request ``rid`` of ``tokens`` tokens holds, per group of the layout:

    * ``full``: one virtual id per page, ``ceil(tokens / page_size)`` of them (the id owner);
    * ``swa``: the *same* virtual ids, bound only for pages ``[swa_first, n_pages)``: the
      window tail. ``swa_first = max(0, base_tokens - window) // page_size`` where
      ``base_tokens`` is the length before the last step (0 for a freshly computed request:
      a prefill chunk needs SWA pages for every token it computes; the request's length for a
      received request: only the tail arrives). Growing a request releases older SWA pages.
    * ``state``: one slot (its own virtual id);
    * ``draft``: ``ceil(tokens / draft_page_size)`` ids of the draft group's own id space.

Epochs
    ``epoch`` changes whenever physical addresses may change meaning (compaction, free,
    offload, restore, resize). Each request remembers the epoch at which its pages last moved; index
    vectors quote the epoch they were made at, and :meth:`Pool.require_fresh` refuses a vector
    older than its request's last move or from another boot. Virtual ids stay valid until the
    request is freed or offloaded.

Versions
    Each request also has a mapping version, drawn from a pool-wide sequence whenever any of its
    pages is bound, released or moved, and its vectors carry it: :meth:`Pool.unchanged` tells
    whether vectors still are the request's without gathering them again (a Send planned at
    BeginSend checks its plan that way).

Placement
    Groups sit in arena order (state, swa, draft, full); the ends grow inward, the floats in
    between grow into either neighbouring gap. Free bytes between two groups serve both, shared
    by their byte weights per token (a state slot over the requests' mean length); a float that
    ends up between the wrong neighbours is moved only by :meth:`Pool.compact`, which a refusal
    names when it would help.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kvd.pool.allocator import IDX, Direction, GroupAllocator, IdRing
from kvd.memory.arena import Arena
from kvd.errors import (
    AlreadyExists,
    CapacityError,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFinalized,
    NotFound,
    Pinned,
    StaleEpoch,
)
from kvd.pool.layout import GroupKind, GroupSpec, Layout
from kvd.limits import quote
from kvd.copy.runs import coalesce, copy_runs
from kvd.records import GroupStats, PoolStats
from kvd.records import IndexVectors, Envelope, CompactionResult, AllocSpec

__all__ = ["Pool"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT
#: The longest request length the planner assumes when it shares free bytes with the state group.
TYPICAL_TOKENS = 4096


def _take(table: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """``table[ids]`` as a new tensor (a copy), gathered in numpy."""
    return torch.from_numpy(table.numpy()[ids])


@dataclass(slots=True)
class _Request:
    rid: str
    handle: int  # small int naming the request in the vid -> request tables
    tokens: int
    base_tokens: int  # length before the last allocate/extend step: anchors the SWA tail
    full: torch.Tensor  # virtual ids, one per page (int32)
    swa_first: int  # first request page with an SWA page bound
    state: int  # state slot virtual id, -1 when the layout has no state group
    draft: torch.Tensor  # draft virtual ids (int32)
    moved_epoch: int  # epoch at which this request's physical pages last changed
    version: int = 0  # bumped (pool-wide sequence) whenever any of its pages is bound, released or moved


@dataclass(slots=True)
class _Offloaded:
    rid: str
    tokens: int
    base_tokens: int
    host: dict[GroupKind, torch.Tensor] = field(default_factory=dict)  # page bytes in vector order


@dataclass(slots=True)
class _Step:
    """Pages one request needs per group for one step, and SWA pages the step releases first."""

    need: dict[GroupKind, int]
    swa_release: int = 0
    tokens: int = 0  # the request's length after the step


class Pool:
    """The unified KV pool over one :class:`~kvd.memory.arena.Arena`.

    ``post_capture=True`` starts with only the sink backed; allocation is refused until
    :meth:`finalize`. Otherwise the arena's current backing is the pool's size.
    """

    def __init__(
        self,
        layout: Layout,
        arena: Arena,
        *,
        post_capture: bool = False,
        floor_tokens: int | None = None,
    ) -> None:
        self.layout = layout
        self.arena = arena
        self.boot_id = uuid.uuid4().hex[:16]
        self.epoch = 1
        self.sink_bytes = layout.max_page_bytes
        self.floor_tokens = floor_tokens or layout.page_size
        self.post_capture = post_capture
        self.finalized = not post_capture
        order = layout.arena_order()
        self._specs: dict[GroupKind, GroupSpec] = {g.kind: g for g in order}
        self._ps = {g.kind: layout.page_size_of(g) for g in order}
        # Bytes per token each group tends to consume: how the planner shares a gap between
        # neighbouring groups. A state slot is spread over a typical request's tokens, which
        # :meth:`_weights` takes from the requests at hand (at most TYPICAL_TOKENS).
        self._weight = {g.kind: layout.entry_bytes(g) / (TYPICAL_TOKENS if g.kind is STATE else 1) for g in order}
        self.groups: dict[GroupKind, GroupAllocator] = {}
        full_ids = arena.reserved // layout.page_bytes(layout.group(FULL))
        for i, g in enumerate(order):
            d = Direction.UP if i == 0 else Direction.DOWN if i == len(order) - 1 else Direction.FLOAT
            pb = layout.page_bytes(g)
            table = arena.reserved // pb
            # The swa group binds the full group's ids, so its v2p spans the owner's id space
            # (seed 004: sizing it by the swa group's own page count breaks under churn).
            ids = full_ids if g.kind is SWA else table
            self.groups[g.kind] = GroupAllocator(g.name, pb, d, sink_bytes=self.sink_bytes, table_pages=table, id_space=ids)
        # Id owners: full (shared with swa), state and draft each mint their own ids.
        self._rings: dict[GroupKind, IdRing] = {k: IdRing(a.v2p.numel()) for k, a in self.groups.items() if k is not SWA}
        self._vid_req: dict[GroupKind, torch.Tensor] = {
            k: torch.full((r.size,), -1, dtype=IDX) for k, r in self._rings.items()
        }
        self._requests: dict[str, _Request] = {}
        self._live_tokens = 0  # sum of the live requests' tokens (their mean weighs the state group)
        self._by_handle: dict[int, _Request] = {}
        self._next_handle = 0
        self._versions = itertools.count(1)  # request mapping versions: never reused within a boot
        self._offloaded: dict[str, _Offloaded] = {}
        self.compactions_done = 0
        self.compactions_refused = 0
        self.pages_moved = 0
        self.bytes_moved = 0
        if post_capture:
            arena.set_backed(max(arena.backed, min(self.sink_bytes, arena.reserved)))
            self._set_capacity(0)
        else:
            if arena.backed < self.floor_bytes():
                raise InvalidArgument(
                    f"arena backs {arena.backed:,d} bytes, below the one-request floor of {self.floor_bytes():,d} "
                    f"bytes for layout {layout.name!r}; give the pool more memory"
                )
            self._set_capacity(arena.backed)

    # =========================================================================================
    # sizing
    # =========================================================================================
    def floor_bytes(self, tokens: int | None = None) -> int:
        """Smallest backing that admits one request of ``tokens`` (default ``floor_tokens``)."""
        step = self._alloc_step(tokens or self.floor_tokens, receive=False)
        cursor = self.sink_bytes
        for k, a in self.groups.items():
            n = step.need.get(k, 0)
            cursor = (-(-cursor // a.pb) + n) * a.pb
        return cursor

    def _set_capacity(self, backed: int) -> None:
        for a in self.groups.values():
            a.set_capacity(backed)

    def finalize(self, nbytes: int | None) -> None:
        """Post-capture sizing: back ``nbytes`` in place and re-derive every group's capacity.

        The arena base address and the tables' storage do not move. Refused on an eager pool,
        twice, without a byte count, above the reservation or below the one-request floor."""
        if not self.post_capture:
            raise FailedPrecondition("finalize: this pool was built eagerly (post_capture=False); it has nothing to finalize")
        if self.finalized:
            raise FailedPrecondition("finalize: the pool is already finalized; use resize(bytes) to change its size")
        self._check_budget("finalize", nbytes)
        self.arena.set_backed(nbytes)
        self._set_capacity(nbytes)
        self.finalized = True
        self.epoch += 1

    def resize(self, nbytes: int | None) -> None:
        """Change the backed size of a finalized, empty pool (grow or release the tail)."""
        if self.post_capture and not self.finalized:
            raise NotFinalized("resize before finalize: call finalize(bytes) once the engine has captured its graphs")
        if not self.post_capture:
            raise FailedPrecondition("resize: this pool was built eagerly (post_capture=False); build it with post_capture=True")
        if self._requests:
            raise FailedPrecondition(
                f"resize with {len(self._requests)} live allocations: free them (or offload them) first"
            )
        self._check_budget("resize", nbytes)
        self.arena.set_backed(nbytes)
        self._set_capacity(nbytes)
        self.epoch += 1

    def _check_budget(self, what: str, nbytes: int | None) -> None:
        if nbytes is None:
            raise InvalidArgument(f"{what}: no byte count given; pass the final KV budget in bytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidArgument(f"{what}: byte count must be a positive int, got {nbytes!r}")
        if nbytes > self.arena.reserved:
            raise InvalidArgument(
                f"{what}: {nbytes:,d} bytes is more than the {self.arena.reserved:,d} reserved; "
                "reserve more at start-up or ask for less"
            )
        floor = self.floor_bytes()
        if nbytes < floor:
            raise InvalidArgument(
                f"{what}: {nbytes:,d} bytes is below the one-request floor of {floor:,d} bytes "
                f"({self.floor_tokens} tokens in every group plus the sink); give the pool more memory"
            )

    # =========================================================================================
    # steps: what each operation needs
    # =========================================================================================
    def _pages(self, kind: GroupKind, tokens: int) -> int:
        return -(-tokens // self._ps[kind])

    def _swa_first(self, base_tokens: int) -> int:
        if SWA not in self._specs:
            return 0
        return max(0, base_tokens - (self._specs[SWA].window or 0)) // self._ps[FULL]

    def _alloc_step(self, tokens: int, receive: bool, base_tokens: int | None = None) -> _Step:
        n = self._pages(FULL, tokens)
        need = {FULL: n}
        if SWA in self.groups:
            base = (tokens if receive else 0) if base_tokens is None else base_tokens
            need[SWA] = n - self._swa_first(base)
        if STATE in self.groups:
            need[STATE] = 1
        if DRAFT in self.groups:
            need[DRAFT] = self._pages(DRAFT, tokens)
        return _Step(need, tokens=tokens)

    def _extend_step(self, r: _Request, add: int) -> _Step:
        new = r.tokens + add
        n_old, n_new = r.full.numel(), self._pages(FULL, new)
        need = {FULL: n_new - n_old}
        release = 0
        if SWA in self.groups:
            need[SWA] = n_new - n_old
            release = self._swa_first(r.tokens) - r.swa_first
        if DRAFT in self.groups:
            need[DRAFT] = self._pages(DRAFT, new) - r.draft.numel()
        return _Step(need, release, new)

    # =========================================================================================
    # planning: does a set of steps fit the shared arena, and where does each group grow?
    # =========================================================================================
    def _plan(self, steps: Sequence[_Step], trimmed: bool, balanced: bool = False) -> tuple[dict, int]:
        """Greedy placement along the arena, low address to high.

        Each group first uses its holes (plus SWA pages released by the same steps), then grows
        into the gap below it (down/float groups), then the gap above it (up/float groups), up
        to the next non-empty group. Using the lower gap first fits the most into this one plan:
        no group further up can reach that gap. ``balanced``: a float grows first into whichever
        of its two gaps has more room for the neighbour it shares it with (room per byte weight
        of that neighbour), so it does not eat the only gap of the group below (the state group
        grows up alone) while the gap above stays empty. Returns ``(plan, shortfall_bytes)``;
        plan maps kind -> ``(grow_lo, grow_hi, new_lo)``."""
        total: dict[GroupKind, int] = {}
        credit: dict[GroupKind, int] = {}
        for s in steps:
            for k, n in s.need.items():
                total[k] = total.get(k, 0) + n
            if s.swa_release:
                credit[SWA] = credit.get(SWA, 0) + s.swa_release
        bounds = {k: (a.trimmed_bounds() if trimmed else (a.lo, a.hi)) for k, a in self.groups.items()}
        kinds = list(self.groups)
        weight: dict[GroupKind, float] | None = None  # computed when a float first needs it
        plan: dict[GroupKind, tuple[int, int, int | None]] = {}
        short = 0
        prev_hi_bytes = self.sink_bytes
        for i, k in enumerate(kinds):
            a = self.groups[k]
            lo, hi = bounds[k]
            need = total.get(k, 0)
            holes = (hi - lo) - a.used + credit.get(k, 0)
            extra = max(0, need - holes)
            new_lo = None
            nxt = next((j for j in kinds[i + 1 :] if bounds[j][1] > bounds[j][0]), None)
            upper = self.arena.backed if nxt is None else bounds[nxt][0] * self.groups[nxt].pb
            floats = bool(extra) and a.direction is Direction.FLOAT  # grows, and may grow either way
            if floats:
                weight = weight or self._weights(steps)
            if floats and a.used == 0:
                # An empty float re-anchors inside the gap it sits in, leaving the group below it
                # room in proportion to their byte weights, so neighbours do not box each other in.
                first, last = -(-prev_hi_bytes // a.pb), min(upper // a.pb, a.p_max) - extra
                below = weight[kinds[i - 1]]
                above = sum(weight[j] for j in kinds[i + 1 : None if nxt is None else kinds.index(nxt) + 1])
                target = first + int((last + extra - first) * below / (below + weight[k] + above))
                new_lo = lo = hi = max(first, min(target, last))
            down_room = lo - -(-prev_hi_bytes // a.pb) if a.direction is not Direction.UP else 0
            up_room = min(upper // a.pb, a.p_max) - hi if a.direction is not Direction.DOWN else 0
            if balanced and floats and self._up_first(kinds, i, nxt, down_room, up_room, weight):
                g_hi = min(extra, max(0, up_room))
                g_lo = min(extra - g_hi, max(0, down_room))
            else:
                g_lo = min(extra, max(0, down_room))
                g_hi = min(extra - g_lo, max(0, up_room))
            missing = extra - g_lo - g_hi
            ring = self._rings.get(k)
            if ring is not None and need > ring.count:
                missing = max(missing, need - ring.count)
            short += missing * a.pb
            if need or new_lo is not None:
                plan[k] = (g_lo, g_hi, new_lo)
            prev_hi_bytes = max(prev_hi_bytes, (hi + g_hi) * a.pb) if (hi + g_hi) > lo - g_lo else prev_hi_bytes
        return plan, short

    def _up_first(self, kinds: list[GroupKind], i: int, nxt: GroupKind | None, down_room: int, up_room: int,
                  w: dict[GroupKind, float]) -> bool:
        """Whether float ``kinds[i]`` should grow into the gap above it first: that gap leaves
        more room per byte weight of the neighbour it shares it with than the gap below does.
        A neighbour that cannot grow into the gap (the top group's gap below the float is the
        float's alone, and so on) weighs nothing there. ``w``: :meth:`_weights` of the plan."""
        a = self.groups[kinds[i]]
        below = self.groups[kinds[i - 1]] if i > 0 else None
        w_below = w[kinds[i - 1]] if below is not None and below.direction is not Direction.DOWN else 0.0
        w_above = w[nxt] if nxt is not None and self.groups[nxt].direction is not Direction.UP else 0.0
        if w_above == 0.0:
            return up_room > 0 and w_below > 0.0
        if w_below == 0.0:
            return False
        return max(0, up_room) * a.pb / w_above > max(0, down_room) * a.pb / w_below

    def _weights(self, steps: Sequence[_Step]) -> dict[GroupKind, float]:
        """Per-token byte weights of the groups, a state slot spread over the mean length of the
        live requests and those being placed (at least a page, at most TYPICAL_TOKENS): short
        requests need a slot per few tokens, and a state group weighed as if every request were
        4k tokens long got only page-alignment room below a float (tiny-hybrid's short
        requests were refused with 94% of the arena free until compaction)."""
        if STATE not in self.groups:
            return self._weight
        new = [s.tokens for s in steps if s.need.get(STATE)]
        count = len(self._requests) + len(new)
        if not count:
            return self._weight
        typical = min(TYPICAL_TOKENS, max(self._ps[FULL], (self._live_tokens + sum(new)) // count))
        return {**self._weight, STATE: self.layout.entry_bytes(self._specs[STATE]) / typical}

    def _attempt(self, steps: Sequence[_Step]) -> tuple[dict, int, bool]:
        """The first plan of ``steps`` that fits, trying balanced growth before lower-gap-first
        and both before trimming edges: ``(plan, 0, trimmed)``; else ``(plan, shortfall, True)``
        with the smallest shortfall seen. Changes nothing."""
        short = None
        plan: dict = {}
        for trimmed in (False, True):
            for balanced in (True, False):
                p, s = self._plan(steps, trimmed, balanced)
                if s == 0:
                    return p, 0, trimmed
                if short is None or s < short:
                    plan, short = p, s
        return plan, int(short or 0), True

    def _fit(self, steps: Sequence[_Step], what: str) -> dict:
        """Plan ``steps`` (:meth:`_attempt`); raise CapacityError when nothing fits. Mutates
        only by trimming (which frees no page and moves no byte)."""
        plan, short, trimmed = self._attempt(steps)
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

    # =========================================================================================
    # requests
    # =========================================================================================
    def can_allocate(self, specs: Sequence[AllocSpec] | AllocSpec) -> bool:
        """Whether :meth:`allocate_many` of ``specs`` would succeed now. Changes nothing."""
        return self.shortfall_bytes(specs) == 0

    def shortfall_bytes(self, specs: Sequence[AllocSpec] | AllocSpec) -> int:
        """Bytes missing for :meth:`allocate_many` of ``specs`` (0 when it fits). Changes nothing."""
        specs = [specs] if isinstance(specs, AllocSpec) else list(specs)
        self._validate_new(specs)
        steps = [self._alloc_step(s.tokens, s.receive) for s in specs]
        return self._attempt(steps)[1]

    def allocate(self, rid: str, tokens: int, *, receive: bool = False) -> IndexVectors:
        """Allocate ``tokens`` tokens for new request ``rid``; see :class:`AllocSpec`."""
        return self.allocate_many([AllocSpec(rid, tokens, receive)])[0]

    def allocate_many(self, specs: Sequence[AllocSpec]) -> list[IndexVectors]:
        """Allocate several requests atomically: all fit and are bound, or none is."""
        specs = list(specs)
        self._validate_new(specs)
        steps = [self._alloc_step(s.tokens, s.receive) for s in specs]
        plan = self._fit(steps, f"allocation of {len(specs)} request(s)")
        out = []
        for s, step in zip(specs, steps):
            r = _Request(
                rid=s.rid,
                handle=self._new_handle(),
                tokens=s.tokens,
                base_tokens=s.tokens if s.receive else 0,
                full=torch.empty(0, dtype=IDX),
                swa_first=self._swa_first(s.tokens if s.receive else 0),
                state=-1,
                draft=torch.empty(0, dtype=IDX),
                moved_epoch=self.epoch,
            )
            self._bind_step(r, step, plan)
            self._requests[s.rid] = r
            self._live_tokens += r.tokens
            self._by_handle[r.handle] = r
            out.append(self._vectors(r))
        return out

    def extend(self, rid: str, tokens: int) -> IndexVectors:
        """Grow request ``rid`` by ``tokens`` tokens; releases SWA pages that left the window."""
        return self.extend_many([(rid, tokens)])[0]

    def extend_many(self, items: Sequence[tuple[str, int]]) -> list[IndexVectors]:
        """Grow several requests atomically."""
        items = list(items)
        seen = set()
        for rid, add in items:
            self._live(rid)
            _check_tokens("extend", add)
            if rid in seen:
                raise InvalidArgument(f"extend: request {quote(rid)} appears twice in one batch; merge the token counts")
            seen.add(rid)
        steps = [self._extend_step(self._requests[rid], add) for rid, add in items]
        plan = self._fit(steps, f"extension of {len(items)} request(s)")
        # Release every step's old SWA pages before binding any: the plan counts them as holes
        # for the whole batch, so an earlier request may bind pages a later one releases.
        for (rid, _), step in zip(items, steps):
            r = self._requests[rid]
            if step.swa_release:
                old = r.full[r.swa_first : r.swa_first + step.swa_release]
                self.groups[SWA].unbind(old)
                r.swa_first += step.swa_release
        out = []
        for (rid, add), step in zip(items, steps):
            r = self._requests[rid]
            r.base_tokens = r.tokens
            r.tokens += add
            self._live_tokens += add
            self._bind_step(r, step, plan)
            out.append(self._vectors(r))
        return out

    def _bind_step(self, r: _Request, step: _Step, plan: dict) -> None:
        """Bind the pages of one planned step. Each group's plan is consumed by the first
        bindings that need new pages; holes are used before growth."""
        r.version = next(self._versions)  # every step changes the request's vectors (tokens at least)
        n_full = step.need.get(FULL, 0)
        if n_full:
            vids = self._rings[FULL].take(n_full)
            self._bind(FULL, vids, plan)
            self._vid_req[FULL][vids] = r.handle
            r.full = torch.cat([r.full, vids])
        if step.need.get(SWA, 0):
            self._bind(SWA, r.full[r.full.numel() - step.need[SWA] :], plan)
        if step.need.get(STATE, 0):
            vid = self._rings[STATE].take(1)
            self._bind(STATE, vid, plan)
            self._vid_req[STATE][vid] = r.handle
            r.state = int(vid)
        if step.need.get(DRAFT, 0):
            vids = self._rings[DRAFT].take(step.need[DRAFT])
            self._bind(DRAFT, vids, plan)
            self._vid_req[DRAFT][vids] = r.handle
            r.draft = torch.cat([r.draft, vids])

    def _bind(self, kind: GroupKind, vids: torch.Tensor, plan: dict) -> None:
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

    def free(self, rid: str) -> None:
        """Free request ``rid``: every page and id it holds goes back. Its ids are invalid after."""
        self.free_many([rid])

    def free_many(self, rids: Sequence[str]) -> None:
        """Free several requests atomically (all ids are checked before anything is freed)."""
        rids = list(rids)
        if len(set(rids)) != len(rids):
            raise InvalidArgument("free: a request id appears twice in one batch")
        for rid in rids:
            if rid in self._offloaded:
                continue
            self._live(rid)
        for rid in rids:
            if self._offloaded.pop(rid, None) is None:
                self._live_tokens -= self._release(self._requests.pop(rid))
        # Freed pages may be bound to another request (possibly under the same id) next: vectors
        # quoted before this point must not pass require_fresh for whatever comes next.
        self.epoch += 1

    def _release(self, r: _Request) -> int:
        """Unbind every page and id of ``r`` (dropped from the tables); returns its tokens."""
        if SWA in self.groups:
            self.groups[SWA].unbind(r.full[r.swa_first :])
        self.groups[FULL].unbind(r.full)
        self._vid_req[FULL][r.full] = -1
        self._rings[FULL].give(r.full)
        if r.state >= 0:
            vid = torch.tensor([r.state], dtype=IDX)
            self.groups[STATE].unbind(vid)
            self._vid_req[STATE][vid] = -1
            self._rings[STATE].give(vid)
        if r.draft.numel():
            self.groups[DRAFT].unbind(r.draft)
            self._vid_req[DRAFT][r.draft] = -1
            self._rings[DRAFT].give(r.draft)
        del self._by_handle[r.handle]
        return r.tokens

    def _new_handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def _validate_new(self, specs: Sequence[AllocSpec]) -> None:
        if not specs:
            raise InvalidArgument("allocate: no requests given")
        seen = set()
        for s in specs:
            if not isinstance(s.rid, str) or not s.rid:
                raise InvalidArgument(f"allocate: request id must be a non-empty string, got {s.rid!r}")
            _check_tokens("allocate", s.tokens)
            if s.rid in self._requests or s.rid in self._offloaded or s.rid in seen:
                raise AlreadyExists(f"allocate: request {quote(s.rid)} already exists; free it first or pick a new id")
            seen.add(s.rid)
        if not self.finalized:
            raise NotFinalized("allocate before finalize: this pool uses post-capture sizing; call finalize(bytes) first")

    def _live(self, rid: str) -> _Request:
        r = self._requests.get(rid)
        if r is None:
            if rid in self._offloaded:
                raise FailedPrecondition(f"request {quote(rid)} is offloaded to host memory; restore it first")
            raise NotFound(f"request {quote(rid)} is not allocated in this pool (freed, or never allocated)")
        return r

    # =========================================================================================
    # translation
    # =========================================================================================
    def vectors(self, rid: str) -> IndexVectors:
        """Physical index vectors of ``rid`` (copies), tagged with the current epoch."""
        return self._vectors(self._live(rid))

    def _vectors(self, r: _Request) -> IndexVectors:
        # Gathers through numpy views of the (CPU) tables: a SEND lease takes these on every
        # Send's critical path, and a small torch index op costs several times a numpy one.
        g = self.groups
        full = r.full.numpy()
        swa = _take(g[SWA].v2p, full[r.swa_first :]) if SWA in g else torch.empty(0, dtype=IDX)
        draft = _take(g[DRAFT].v2p, r.draft.numpy()) if DRAFT in g else torch.empty(0, dtype=IDX)
        state = int(g[STATE].v2p[r.state]) if r.state >= 0 else None
        return IndexVectors(
            r.rid, self.boot_id, self.epoch, r.tokens, _take(g[FULL].v2p, full), r.swa_first, swa, state, draft, r.version
        )

    def unchanged(self, vec: IndexVectors) -> bool:
        """Whether ``vec`` still is ``vec.rid``'s vectors here: same boot, the request live and
        none of its pages bound, released or moved since ``vec`` was made. Costs a lookup, not a
        gather: a Send planned ahead (BeginSend) checks its plan's vectors with it."""
        r = self._requests.get(vec.rid)
        return bool(vec.version) and vec.boot_id == self.boot_id and r is not None and r.version == vec.version

    def translate(self, kind: GroupKind | str, vids: torch.Tensor) -> torch.Tensor:
        """Vectorised virtual -> physical lookup for any number of ids of one group (-1 unbound)."""
        a = self.groups[GroupKind(kind)]
        if vids.numel() and (int(vids.min()) < 0 or int(vids.max()) >= a.v2p.numel()):
            raise InvalidArgument(f"translate: virtual ids must lie in [0, {a.v2p.numel()}) for group {a.name}")
        return a.v2p.index_select(0, vids.to(torch.int64).flatten())

    def virtual_ids(self, rid: str) -> dict[str, torch.Tensor]:
        """The request's virtual ids per id owner (full, state, draft); stable until free/offload."""
        r = self._live(rid)
        out = {"full": r.full.clone(), "draft": r.draft.clone()}
        out["state"] = torch.tensor([r.state] if r.state >= 0 else [], dtype=IDX)
        return out

    def require_fresh(self, rid: str, epoch: int, boot_id: str) -> _Request:
        """Refuse (StaleEpoch) vectors of ``rid`` quoted at ``epoch`` of boot ``boot_id`` if the
        request's pages moved since, or the pool is another boot."""
        if boot_id != self.boot_id:
            raise StaleEpoch(f"boot id {quote(boot_id)} is not this pool's ({quote(self.boot_id)}): the daemon restarted; fetch new vectors")
        r = self._live(rid)
        if epoch < r.moved_epoch or epoch > self.epoch:
            raise StaleEpoch(
                f"request {quote(rid)}: epoch {epoch} is stale (its pages moved at epoch {r.moved_epoch}, pool is at "
                f"{self.epoch}); fetch new vectors"
            )
        return r

    def envelopes(self) -> list[Envelope]:
        """One envelope per group, arena order. Only the backed prefix is ever reported."""
        return [
            Envelope(k.value, self.arena.region_id, self.arena.base, self.arena.backed, a.pb, a.p_min, a.p_max - 1)
            for k, a in self.groups.items()
        ]

    def page_view(self, kind: GroupKind | str) -> torch.Tensor:
        """``uint8`` view ``[pages, page_bytes]`` of one group's pages in the backed arena (no copy)."""
        a = self.groups[GroupKind(kind)]
        return self.arena.tensor()[: a.p_max * a.pb].view(a.p_max, a.pb)

    # =========================================================================================
    # compaction
    # =========================================================================================
    def compact(self, pinned: Mapping[str, str] | Iterable[str] = (), *, around_pinned: bool = False) -> CompactionResult:
        """Move live pages toward their group's anchor end (real byte copies), rewrite the tables,
        trim the regions, and bump the epoch if anything moved.

        ``pinned`` names requests whose pages must not move (a mapping's values label them in the
        error, e.g. lease ids). By default the call is refused with :class:`Pinned` naming them if
        any page it would move is pinned; ``around_pinned=True`` compacts around them instead.
        Virtual ids and the bytes behind them never change."""
        labels = dict(pinned) if isinstance(pinned, Mapping) else {rid: rid for rid in pinned}
        for rid in labels:
            if rid not in self._requests and rid not in self._offloaded:
                raise NotFound(f"compact: pinned request {quote(rid)} is not allocated in this pool")
        pinned_reqs = [self._requests[r] for r in labels if r in self._requests]
        moves: dict[GroupKind, tuple[torch.Tensor, torch.Tensor]] = {}
        blockers: set[str] = set()
        for k, a in self.groups.items():
            fixed = self._pinned_mask(k, pinned_reqs)
            src, dst = a.plan_compaction(fixed if around_pinned else None)
            if not around_pinned and fixed is not None and src.numel():
                hit = fixed[(src - a.lo).to(torch.int64)]
                if bool(hit.any()):
                    handles = self._owner_handles(k, a.p2v[src[hit]])
                    blockers.update(labels[self._by_handle[h].rid] for h in handles)
            moves[k] = (src, dst)
        if blockers:
            self.compactions_refused += 1
            names = ", ".join(sorted(blockers))
            raise Pinned(f"compaction refused: it would move pages pinned by {names}; release them or retry later", tuple(sorted(blockers)))
        gap_before = self.gap_bytes()
        moved_bytes = 0
        # What moved is read off the tables afterwards: a page packed and then slid counts once,
        # and not at all if it came back to where it was.
        before = {k: a.v2p.clone() for k, a in self.groups.items()}
        for k, (src, dst) in moves.items():
            a = self.groups[k]
            if src.numel():
                view = self.page_view(k)
                copy_runs(view, view, coalesce(src, dst))
                moved_bytes += src.numel() * a.pb
            a.apply_moves(src, dst)
        slides = self._plan_slides(pinned_reqs)
        # A float moving up may land where the float above it sits now, so up-movers go top
        # first and down-movers bottom first; a slide may overlap its own source, so each one
        # gathers before it scatters.
        up = [k for k in reversed(list(slides)) if int(slides[k][1][0]) > int(slides[k][0][0])]
        down = [k for k in slides if k not in up]
        for k in up + down:
            src, dst = slides[k]
            view = self.page_view(k)
            d, sr = dst.long().to(view.device), src.long().to(view.device)  # tables live on the host
            view.index_copy_(0, d, view.index_select(0, sr))
            moved_bytes += src.numel() * self.groups[k].pb
            self.groups[k].apply_slide(src, dst)
        changed = {k: (a.v2p != before[k]).nonzero().flatten() for k, a in self.groups.items()}
        moved_pages = sum(c.numel() for c in changed.values())
        moved_handles = set().union(*(self._owner_handles(k, c) for k, c in changed.items() if c.numel()))
        if moved_bytes:
            self._settle()
        if moved_pages:
            self.epoch += 1
            for h in moved_handles:
                self._by_handle[h].moved_epoch = self.epoch
                self._by_handle[h].version = next(self._versions)
        self.compactions_done += 1
        self.pages_moved += moved_pages
        self.bytes_moved += moved_bytes
        return CompactionResult(moved_pages, moved_bytes, self.gap_bytes() - gap_before, self.epoch)

    def _plan_slides(self, pinned_reqs: list[_Request]) -> dict[GroupKind, tuple[torch.Tensor, torch.Tensor]]:
        """After packing: place the floats so the free bytes between the two ends are shared by
        the groups in proportion to the bytes each holds now (an end group's share goes to the
        gap beside it, a float's is split between its two gaps). Positions depend only on the
        ends and the groups' sizes, so a second compaction moves nothing. A float boxed in by a
        neighbour gets room back. If any float holds pinned pages or holes, floats stay put.
        Returns per-group moves, to be applied in arena order."""
        kinds = list(self.groups)
        g = self.groups
        if len(kinds) < 3:
            return {}
        floats = kinds[1:-1]
        for k in floats:
            mask = self._pinned_mask(k, pinned_reqs)
            if g[k].n_holes or (mask is not None and bool(mask.any())):
                return {}
        first, last = g[kinds[0]], g[kinds[-1]]
        start = max(self.sink_bytes, first.hi * first.pb)
        end = self.arena.backed if last.empty else last.lo * last.pb
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

    def _pinned_mask(self, kind: GroupKind, reqs: list[_Request]) -> torch.Tensor | None:
        if not reqs:
            return None
        a = self.groups[kind]
        mask = torch.zeros(a.hi - a.lo, dtype=torch.bool)
        vids = [self._request_vids(kind, r) for r in reqs]
        v = torch.cat(vids) if vids else torch.empty(0, dtype=IDX)
        if v.numel():
            mask[(a.v2p[v] - a.lo).to(torch.int64)] = True
        return mask

    def _request_vids(self, kind: GroupKind, r: _Request) -> torch.Tensor:
        if kind is FULL:
            return r.full
        if kind is SWA:
            return r.full[r.swa_first :]
        if kind is STATE:
            return torch.tensor([r.state] if r.state >= 0 else [], dtype=IDX)
        return r.draft

    def _settle(self) -> None:
        """Wait until the page copies issued so far have landed. A CUDA copy is asynchronous,
        and the engine that reads the moved pages runs in another process with its own stream:
        nothing orders its reads after our kernels but this wait, so every call that moves bytes
        returns only after they moved. No-op on host arenas (their copies are synchronous)."""
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)

    def _owner_handles(self, kind: GroupKind, vids: torch.Tensor) -> set[int]:
        table = self._vid_req[FULL if kind is SWA else kind]
        return set(table[vids].unique().tolist())

    # =========================================================================================
    # retraction fallback
    # =========================================================================================
    def offload(self, rid: str) -> int:
        """Copy ``rid``'s pages to host memory and free them. Returns the bytes offloaded.
        The request keeps its id (state "offloaded") until :meth:`restore` or :meth:`free`."""
        r = self._live(rid)
        off = _Offloaded(rid, r.tokens, r.base_tokens)
        nbytes = 0
        for k, a in self.groups.items():
            vids = self._request_vids(k, r)
            if vids.numel():
                pages = a.v2p[vids].to(torch.int64)
                view = self.page_view(k)
                off.host[k] = view.index_select(0, pages.to(view.device)).to("cpu")
                nbytes += off.host[k].numel()
        self._live_tokens -= self._release(self._requests.pop(rid))
        self._offloaded[rid] = off
        self.epoch += 1  # its pages may be reused: vectors quoted before are stale
        return nbytes

    def restore(self, rid: str) -> IndexVectors:
        """Bring an offloaded request back into new pages with identical bytes.
        Its virtual ids are new; vectors quoted before the offload are stale."""
        off = self._offloaded.get(rid)
        if off is None:
            if rid in self._requests:
                raise FailedPrecondition(f"restore: request {quote(rid)} is not offloaded (it is live)")
            raise NotFound(f"restore: request {quote(rid)} is not offloaded in this pool")
        if not self.finalized:
            raise NotFinalized("restore before finalize: call finalize(bytes) first")
        step = self._alloc_step(off.tokens, receive=False, base_tokens=off.base_tokens)
        plan = self._fit([step], f"restore of {quote(rid)}")
        r = _Request(rid, self._new_handle(), off.tokens, off.base_tokens, torch.empty(0, dtype=IDX),
                     self._swa_first(off.base_tokens), -1, torch.empty(0, dtype=IDX), 0)
        self._bind_step(r, step, plan)
        for k, host in off.host.items():
            pages = self.groups[k].v2p[self._request_vids(k, r)].to(torch.int64)
            self.page_view(k).index_copy_(0, pages.to(self.arena.device), host.to(self.arena.device))
        self._settle()
        del self._offloaded[rid]
        self.epoch += 1
        r.moved_epoch = self.epoch
        self._requests[rid] = r
        self._live_tokens += r.tokens
        self._by_handle[r.handle] = r
        return self._vectors(r)

    # =========================================================================================
    # introspection
    # =========================================================================================
    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def offloaded_ids(self) -> list[str]:
        return list(self._offloaded)

    def stats(self) -> PoolStats:
        groups = [
            GroupStats(
                name=k.value,
                direction=a.direction.value,
                page_bytes=a.pb,
                capacity_pages=a.capacity,
                used_pages=a.used,
                free_pages=a.capacity - a.used,
                hole_pages=a.n_holes,
                region_lo_bytes=a.lo * a.pb,
                region_hi_bytes=a.hi * a.pb,
            )
            for k, a in self.groups.items()
        ]
        return PoolStats(
            boot_id=self.boot_id,
            epoch=self.epoch,
            reserved_bytes=self.arena.reserved,
            backed_bytes=self.arena.backed,
            sink_bytes=self.sink_bytes,
            gap_bytes=self.gap_bytes(),
            finalized=self.finalized,
            requests_live=len(self._requests),
            requests_offloaded=len(self._offloaded),
            compactions_done=self.compactions_done,
            compactions_refused=self.compactions_refused,
            pages_moved=self.pages_moved,
            bytes_moved=self.bytes_moved,
            groups=groups,
        )

    def check(self) -> None:
        """Verify every invariant; raise :class:`InternalError` naming the first broken one.

        * tables: ``v2p``/``p2v`` inverse on bound entries; bound pages inside the group's
          region and the backed range; no page owned twice;
        * accounting: holes + used = region size; free + used = capacity; hole stack exact;
        * placement: regions disjoint in bytes, in arena order, above the sink, inside backing;
        * requests: every bound id belongs to exactly one live request; SWA pages exactly for
          the window tail ``[swa_first, n)``; page counts match token counts; rings consistent.
        """
        def fail(msg: str) -> None:
            raise InternalError(f"pool invariant broken: {msg}")

        live_tokens = sum(r.tokens for r in self._requests.values())
        if live_tokens != self._live_tokens:
            fail(f"live requests hold {live_tokens} tokens but the running count says {self._live_tokens}")
        prev_hi, prev_name = self.sink_bytes, "sink"
        for k, a in self.groups.items():
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
                if holes.unique().numel() != holes.numel():
                    fail(f"{k.value}: a hole is listed twice")
                if bool((a.p2v[holes.long()] != -1).any()) or int(holes.min()) < a.lo or int(holes.max()) >= a.hi:
                    fail(f"{k.value}: a listed hole is bound or outside the region")
            if a.used > a.capacity:
                fail(f"{k.value}: used {a.used} exceeds capacity {a.capacity}")
            lo_b, hi_b = a.bytes_range()
            if hi_b > lo_b:
                if lo_b < prev_hi:
                    fail(f"{k.value}: region starts at byte {lo_b} inside {prev_name} (ends {prev_hi})")
                if hi_b > self.arena.backed:
                    fail(f"{k.value}: region ends at byte {hi_b} past the backing {self.arena.backed}")
                prev_hi, prev_name = hi_b, k.value
        # requests
        counts = {k: 0 for k in self.groups}
        for r in self._requests.values():
            n = self._pages(FULL, r.tokens)
            if r.full.numel() != n:
                fail(f"request {r.rid}: {r.full.numel()} full pages for {r.tokens} tokens (want {n})")
            if r.base_tokens > r.tokens:
                fail(f"request {r.rid}: base_tokens {r.base_tokens} > tokens {r.tokens}")
            for k in self.groups:
                vids = self._request_vids(k, r)
                counts[k] += vids.numel()
                if vids.numel() and bool((self.groups[k].v2p[vids] < 0).any()):
                    fail(f"request {r.rid}: a {k.value} id is unbound")
                if k is not SWA and vids.numel():
                    if bool((self._vid_req[k][vids] != r.handle).any()):
                        fail(f"request {r.rid}: {k.value} ids not recorded as its own")
            if SWA in self.groups:
                if r.swa_first != self._swa_first(r.base_tokens):
                    fail(f"request {r.rid}: SWA pages start at page {r.swa_first}, window says {self._swa_first(r.base_tokens)}")
                if r.swa_first > 0 and bool((self.groups[SWA].v2p[r.full[: r.swa_first]] != -1).any()):
                    fail(f"request {r.rid}: an SWA page outside the window is still bound")
            if DRAFT in self.groups and r.draft.numel() != self._pages(DRAFT, r.tokens):
                fail(f"request {r.rid}: {r.draft.numel()} draft pages for {r.tokens} tokens")
            if STATE in self.groups and r.state < 0:
                fail(f"request {r.rid}: no state slot")
        for k, a in self.groups.items():
            if counts[k] != a.used:
                fail(f"{k.value}: requests hold {counts[k]} pages but {a.used} are bound (leak or double bind)")
        for k, ring in self._rings.items():
            if ring.count + self.groups[k].used != ring.size:
                fail(f"{k.value}: {ring.count} free ids + {self.groups[k].used} bound != {ring.size}")


def _check_tokens(what: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidArgument(f"{what}: token count must be an int, got {n!r}")
    if n <= 0:
        raise InvalidArgument(f"{what}: token count must be positive, got {n}")
