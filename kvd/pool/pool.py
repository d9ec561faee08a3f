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

import uuid
from collections.abc import Iterable, Mapping, Sequence

import torch

from kvd.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFinalized,
    NotFound,
    StaleEpoch,
)
from kvd.limits import quote
from kvd.memory.arena import Arena
from kvd.pool.allocator import IDX, Direction, GroupAllocator
from kvd.pool.binding import Bindings
from kvd.pool.check import check as check_pool
from kvd.pool.compaction import compact as compact_pool
from kvd.pool.layout import GroupKind, Layout
from kvd.pool.planner import Live, Placement, Planner, Step
from kvd.pool.offload import Offloaded, load as load_pages, save as save_pages
from kvd.pool.request import NO_IDS, Request
from kvd.records import AllocSpec, CompactionResult, Envelope, GroupStats, IndexVectors, PoolStats

__all__ = ["Pool"]

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT
#: the pages of a group the layout lacks, in every vector (shared: empty, so nothing can write it;
#: making one per vector cost a microsecond a call)
_NO_PAGES = torch.empty(0, dtype=IDX)


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
        # full, swa, state and draft (None: not in the layout), for the per-request paths
        ga = self.groups
        self._by_kind = (ga[FULL], ga.get(SWA), ga.get(STATE), ga.get(DRAFT))
        # envelopes() as last made, and the (region, base, backed) they were made for
        self._envelopes: tuple[tuple[str, int, int, int] | None, list[Envelope]] = (None, [])
        self._capacities = 0  # capacity changes (_set_capacity): part of the envelopes' key
        self._bindings = Bindings(self.groups)
        self._planner = Planner(layout, self.groups, self._bindings.rings, arena, self.sink_bytes)
        self._requests: dict[str, Request] = {}
        self._live_tokens = 0  # sum of the live requests' tokens (their mean weighs the state group)
        self._offloaded: dict[str, Offloaded] = {}
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
        step = self._planner.alloc_step(tokens or self.floor_tokens, receive=False)
        cursor = self.sink_bytes
        for k, a in self.groups.items():
            n = step.need.get(k, 0)
            cursor = (-(-cursor // a.pb) + n) * a.pb
        return cursor

    def _set_capacity(self, backed: int) -> None:
        for a in self.groups.values():
            a.set_capacity(backed)
        self._capacities += 1  # after the groups: envelopes() made meanwhile are not kept
        self._envelopes = None, []

    def finalize(self, nbytes: int | None) -> None:
        """Post-capture sizing: back ``nbytes`` in place and re-derive every group's capacity.

        The arena base address and the tables' storage do not move. Refused on an eager pool,
        twice, without a byte count, above the reservation or below the one-request floor."""
        if not self.post_capture:
            raise FailedPrecondition("finalize: this pool was built eagerly (post_capture=False); it has nothing to finalize")
        if self.finalized:
            raise FailedPrecondition("finalize: the pool is already finalized; use resize(bytes) to change its size")
        size = self._check_budget("finalize", nbytes)
        self.arena.set_backed(size)
        self._set_capacity(size)
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
        size = self._check_budget("resize", nbytes)
        self.arena.set_backed(size)
        self._set_capacity(size)
        self.epoch += 1

    def _check_budget(self, what: str, nbytes: int | None) -> int:
        """``nbytes``, checked as a budget for :meth:`finalize` / :meth:`resize`."""
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
        return nbytes

    # =========================================================================================
    # placement: the planner's answers over the live requests
    # =========================================================================================
    def _live_now(self) -> Live:
        return Live(len(self._requests), self._live_tokens)

    def _fit(self, steps: Sequence[Step], what: str) -> Placement:
        """Plan ``steps`` (:meth:`Planner.fit`); raise CapacityError when nothing fits."""
        return self._planner.fit(steps, what, self._live_now())

    def gap_bytes(self) -> int:
        """Free bytes between the groups' regions (not counting holes inside regions)."""
        return self._planner.gap_bytes()

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
        steps = [self._planner.alloc_step(s.tokens, s.receive) for s in specs]
        return self._planner.attempt(steps, self._live_now())[1]

    def allocate(self, rid: str, tokens: int, *, receive: bool = False) -> IndexVectors:
        """Allocate ``tokens`` tokens for new request ``rid``; see :class:`AllocSpec`."""
        return self.allocate_many([AllocSpec(rid, tokens, receive)])[0]

    def allocate_many(self, specs: Sequence[AllocSpec]) -> list[IndexVectors]:
        """Allocate several requests atomically: all fit and are bound, or none is."""
        specs = list(specs)
        self._validate_new(specs)
        steps = [self._planner.alloc_step(s.tokens, s.receive) for s in specs]
        plan = self._fit(steps, f"allocation of {len(specs)} request(s)")
        epoch, swa_first = self.epoch, self._planner.swa_first
        reqs = [
            Request(s.rid, self._bindings.new_handle(), s.tokens, s.tokens if s.receive else 0, NO_IDS,
                    swa_first(s.tokens if s.receive else 0), -1, NO_IDS, epoch)
            for s in specs
        ]
        # One allocator call per group for the whole batch (the pages one-by-one binds would give).
        self._bindings.bind_steps(reqs, steps, plan)
        for r in reqs:
            self._requests[r.rid] = r
            self._live_tokens += r.tokens
            self._bindings.by_handle[r.handle] = r
        return [self._vectors(r) for r in reqs]

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
        steps = [self._planner.extend_step(self._requests[rid], add) for rid, add in items]
        plan = self._fit(steps, f"extension of {len(items)} request(s)")
        # Release every step's old SWA pages before binding any: the plan counts them as holes
        # for the whole batch, so an earlier request may bind pages a later one releases.
        for (rid, _), step in zip(items, steps):
            r = self._requests[rid]
            if step.swa_release:
                self.groups[SWA].unbind(r.full[r.swa_first : r.swa_first + step.swa_release])
                r.swa_first += step.swa_release
        reqs = [self._requests[rid] for rid, _ in items]
        for r, (_, add) in zip(reqs, items):
            r.base_tokens = r.tokens
            r.tokens += add
            self._live_tokens += add
        self._bindings.bind_steps(reqs, steps, plan)
        return [self._vectors(r) for r in reqs]

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
        live = [self._requests.pop(rid) for rid in rids if self._offloaded.pop(rid, None) is None]
        self._live_tokens -= self._bindings.release_many(live)  # one allocator call per group
        # Freed pages may be bound to another request (possibly under the same id) next: vectors
        # quoted before this point must not pass require_fresh for whatever comes next.
        self.epoch += 1

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

    def _live(self, rid: str) -> Request:
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

    def _vectors(self, r: Request) -> IndexVectors:
        # Gathers through numpy views of the (CPU) tables: a SEND lease takes these on every
        # Send's critical path, and a small torch index op costs several times a numpy one.
        full, swa, state, draft = self._by_kind
        return IndexVectors(
            r.rid, self.boot_id, self.epoch, r.tokens, torch.from_numpy(full.v2p_np.take(r.full)), r.swa_first,
            torch.from_numpy(swa.v2p_np.take(r.full[r.swa_first :])) if swa is not None else _NO_PAGES,
            state.v2p_np.item(r.state) if state is not None and r.state >= 0 else None,
            torch.from_numpy(draft.v2p_np.take(r.draft)) if draft is not None else _NO_PAGES,
            r.version,
        )

    def footprint(self, rid: str) -> tuple[int, int, int]:
        """``(tokens, full pages, swa pages)`` of live request ``rid`` (kvd top); NotFound if none."""
        r = self._live(rid)
        return r.tokens, len(r.full), (len(r.full) - r.swa_first) if SWA in self.groups else 0

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
        out = {"full": torch.from_numpy(r.full.copy()), "draft": torch.from_numpy(r.draft.copy())}
        out["state"] = torch.tensor([r.state] if r.state >= 0 else [], dtype=IDX)
        return out

    def require_fresh(self, rid: str, epoch: int, boot_id: str) -> Request:
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
        """One envelope per group, arena order. Only the backed prefix is ever reported.

        The list is kept and shared (do not change it): the same object until the arena's
        region, base or backed size changes (finalize, resize), then a new one. A caller may
        key what it derives from the envelopes by this list's identity."""
        arena = self.arena
        key = (arena.region_id, arena.base, arena.backed, self._capacities)
        kept = self._envelopes
        if kept[0] == key:
            return kept[1]
        # Made again only when the backing or a capacity changed; kept only if no capacity changed
        # while they were made (a caller outside the node's lock during finalize/resize).
        made = [Envelope(k.value, arena.region_id, arena.base, arena.backed, a.pb, a.p_min, a.p_max - 1) for k, a in self.groups.items()]
        if self._capacities == key[3]:
            self._envelopes = (key, made)
        return made

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
        return compact_pool(self, pinned, around_pinned=around_pinned)

    def _settle(self) -> None:
        """Wait until the page copies issued so far have landed. A CUDA copy is asynchronous,
        and the engine that reads the moved pages runs in another process with its own stream:
        nothing orders its reads after our kernels but this wait, so every call that moves bytes
        returns only after they moved. No-op on host arenas (their copies are synchronous)."""
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)

    # =========================================================================================
    # retraction fallback
    # =========================================================================================
    def offload(self, rid: str) -> int:
        """Copy ``rid``'s pages to host memory and free them. Returns the bytes offloaded.
        The request keeps its id (state "offloaded") until :meth:`restore` or :meth:`free`."""
        r = self._live(rid)
        off, nbytes = save_pages(self.groups, self.page_view, r)
        self._live_tokens -= self._bindings.release(self._requests.pop(rid))
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
        step = self._planner.alloc_step(off.tokens, receive=False, base_tokens=off.base_tokens)
        plan = self._fit([step], f"restore of {quote(rid)}")
        r = Request(rid, self._bindings.new_handle(), off.tokens, off.base_tokens, NO_IDS,
                    self._planner.swa_first(off.base_tokens), -1, NO_IDS, 0)
        self._bindings.bind_step(r, step, plan)
        load_pages(self.groups, self.page_view, self.arena.device, off, r)
        self._settle()
        del self._offloaded[rid]
        self.epoch += 1
        r.moved_epoch = self.epoch
        self._requests[rid] = r
        self._live_tokens += r.tokens
        self._bindings.by_handle[r.handle] = r
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
        check_pool(self)


def _check_tokens(what: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidArgument(f"{what}: token count must be an int, got {n!r}")
    if n <= 0:
        raise InvalidArgument(f"{what}: token count must be positive, got {n}")
