"""Page allocation for one group: physical pages, the v2p/p2v tables, and virtual-id rings.

Every group is anchored at byte 0 of the arena with its own stride ``page_bytes``; physical page
``p`` of the group covers bytes ``[p * pb, (p + 1) * pb)``. A group owns one *region*
``[lo, hi)`` of its page ids; the pool's frontiers keep the groups' byte ranges disjoint::

    byte 0                                                                    backed
    [ sink | UP group [lo..hi) -> | gap | <- FLOAT [lo..hi) -> | gap | <- DOWN [lo..hi) ]

Inside its region a group keeps a stack of *holes* (free pages); a region grows only at its
edges, by the amounts the pool's planner assigns, and shrinks by :meth:`GroupAllocator.trim`
(free pages at an edge go back to the shared gap) or by compaction.

Tables (int32 torch tensors, ``-1`` = unbound):

* ``v2p[v]`` -> physical page of virtual id ``v``. Sized by the **id owner's** id space: the
  swa group binds the full group's ids, so its ``v2p`` must be as long as full's (seed 004).
* ``p2v[p]`` -> virtual id bound to physical page ``p``; sized by this group's own pages.

Both tables are sized once, for the whole reservation, so post-capture sizing never
reallocates them (their ``data_ptr`` is stable for the pool's lifetime). The per-request paths
(bind, unbind, the rings) work on numpy views of the same memory: a request binds a handful of
ids, where torch's per-op overhead (several microseconds) was most of an allocation's cost.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from kvd.errors import InternalError

__all__ = ["Direction", "IdRing", "GroupAllocator", "IDX", "IDX_NP", "as_np"]

#: dtype of every id tensor (virtual ids, physical page ids). 2^31 pages is far above any arena.
IDX = torch.int32
#: the same dtype in numpy (the tables' numpy views)
IDX_NP = np.int32


_IDX_DTYPE = np.dtype(IDX_NP)


def as_np(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """``ids`` as a numpy int32 array (a view of a CPU tensor's memory, no copy)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.numpy()
    return ids if ids.dtype is _IDX_DTYPE or ids.dtype == _IDX_DTYPE else ids.astype(IDX_NP)


# A numpy reduction costs ~1 us whatever its size; a request's few ids reduce faster as a list.
_SMALL = 64
# One id (a state slot, the page a decode step adds), and up to _FEW ids (a short request's
# pages), bind and unbind through scalar reads and writes of the tables: the same steps as for an
# array, at a fraction of the half-dozen numpy calls (~1 us each). Tests turn this (and _SMALL)
# off to compare both ways.
_SCALAR = True
_FEW = 8


def _peak(a: np.ndarray) -> int:
    """The largest element of non-empty ``a``."""
    return max(a.tolist()) if len(a) < _SMALL else int(a.max())


def _floor(a: np.ndarray) -> int:
    """The smallest element of non-empty ``a``."""
    return min(a.tolist()) if len(a) < _SMALL else int(a.min())


class Direction(enum.Enum):
    UP = "up"  # anchored at the sink, grows toward higher addresses
    DOWN = "down"  # anchored at the top of the backing, grows toward lower addresses
    FLOAT = "float"  # between the two; grows either way


class IdRing:
    """FIFO ring of free virtual ids.

    Ids come off the front and freed ids go to the back, so a freed id is reused as late as
    possible: a stale reference to it fails loudly for longer, and churn walks the whole id
    space (the condition under which seed 004's undersized table crashed)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ring = torch.arange(size, dtype=IDX)
        self._np = self._ring.numpy()  # the same memory
        self._head = 0
        self.count = size

    def take_np(self, n: int) -> np.ndarray:
        """The next ``n`` free ids (a new array), off the front."""
        if n > self.count:
            raise InternalError(f"id ring: asked for {n} ids with {self.count} free; the planner should have refused")
        h = self._head
        end = h + n
        if end < self.size:
            out: np.ndarray = self._np[h:end].copy()
            self._head = end
        else:
            end -= self.size
            out = self._np[h:].copy() if end == 0 else np.concatenate((self._np[h:], self._np[:end]))
            self._head = end
        self.count -= n
        return out

    def take(self, n: int) -> torch.Tensor:
        return torch.from_numpy(self.take_np(n))

    def give(self, ids: torch.Tensor | np.ndarray) -> None:
        """Put ``ids`` back at the end (the ring copies them)."""
        ids = as_np(ids)
        n = len(ids)
        if self.count + n > self.size:
            raise InternalError(f"id ring: {n} ids returned to a ring with {self.size - self.count} taken")
        at = self._head + self.count
        if at >= self.size:
            at -= self.size
        first = self.size - at
        if n <= first:
            self._np[at : at + n] = ids
        else:
            self._np[at:] = ids[:first]
            self._np[: n - first] = ids[first:]
        self.count += n

    def free_ids(self) -> torch.Tensor:
        idx = (torch.arange(self.count, dtype=torch.int64) + self._head) % self.size
        return self._ring[idx]

    def reset(self) -> None:
        torch.arange(self.size, dtype=IDX, out=self._ring)
        self._head, self.count = 0, self.size


class GroupAllocator:
    """Physical pages of one group. Mutated only by the pool, which plans before it commits.

    Methods here never fail on valid plans; a failure is an :class:`InternalError` (a bug)."""

    def __init__(
        self,
        name: str,
        page_bytes: int,
        direction: Direction,
        *,
        sink_bytes: int,
        table_pages: int,
        id_space: int,
    ) -> None:
        self.name = name
        self.pb = page_bytes
        self.direction = direction
        #: first page id above the sink: pages below it overlap bytes [0, sink) and are never used
        self.p_min = -(-sink_bytes // page_bytes)
        self.p2v = torch.full((table_pages,), -1, dtype=IDX)
        self.v2p = torch.full((id_space,), -1, dtype=IDX)
        self._holes = torch.empty(table_pages, dtype=IDX)
        self._holes_np = self._holes.numpy()
        self.n_holes = 0
        self.used = 0
        self.p_max = self.p_min  # exclusive; set by set_capacity
        self.lo = self.hi = self.p_min

    # The tables, and numpy views of the same memory that the per-request paths index through
    # (kept in step when a table is replaced).
    @property
    def p2v(self) -> torch.Tensor:
        return self._p2v_t

    @p2v.setter
    def p2v(self, t: torch.Tensor) -> None:
        self._p2v_t, self._p2v = t, t.numpy()

    @property
    def v2p(self) -> torch.Tensor:
        return self._v2p_t

    @v2p.setter
    def v2p(self, t: torch.Tensor) -> None:
        self._v2p_t, self._v2p = t, t.numpy()

    @property
    def v2p_np(self) -> np.ndarray:
        """``v2p``'s memory as a numpy array, for the pool's per-request reads (gathers); it is
        written only by this allocator's binds, unbinds and moves."""
        return self._v2p

    # ---- capacity ---------------------------------------------------------------------------
    def set_capacity(self, backed_bytes: int) -> None:
        """Re-derive the usable page range from the backed size. Only on an empty group."""
        if self.used:
            raise InternalError(f"{self.name}: set_capacity with {self.used} pages in use")
        self.p_max = max(self.p_min, min(backed_bytes // self.pb, self.p2v.numel()))
        if self.direction is Direction.FLOAT:
            # An empty float keeps its last position; a smaller backing may end below it. Start
            # over at the anchor, as a freshly built group does.
            self.lo = self.hi = self.p_min
        self.collapse()

    @property
    def capacity(self) -> int:
        """Pages this group could hold if it had the whole backed arena to itself."""
        return self.p_max - self.p_min

    def collapse(self) -> None:
        """Empty group: shrink the region to zero width at its anchor and forget its holes."""
        if self.used:
            raise InternalError(f"{self.name}: collapse with {self.used} pages in use")
        if self.direction is Direction.UP:
            self.lo = self.hi = self.p_min
        elif self.direction is Direction.DOWN:
            self.lo = self.hi = self.p_max
        else:
            self.hi = self.lo
        self.n_holes = 0

    @property
    def empty(self) -> bool:
        return self.hi == self.lo

    # ---- bind / unbind ----------------------------------------------------------------------
    def bind(self, v: np.ndarray, grow_lo: int, grow_hi: int, new_lo: int | None = None,
             lo_parts: np.ndarray | None = None) -> None:
        """Bind int32 ids ``v`` to pages: holes first, then ``grow_lo`` pages below the region and
        ``grow_hi`` above it, in the order of ``v``. ``new_lo`` re-anchors an empty float first.

        ``lo_parts``: the growth below split among several requests bound in one call (their
        shares, in order, summing to ``grow_lo``): each share gets the pages that many one-by-one
        binds would have given it, ascending within the share, the first share highest."""
        n = len(v)
        from_holes = n - grow_lo - grow_hi
        if new_lo is not None:
            if self.hi != self.lo:
                raise InternalError(f"{self.name}: re-anchor of a non-empty region")
            self.lo = self.hi = new_lo
        lo, hi, n_holes = self.lo, self.hi, self.n_holes
        if from_holes < 0 or from_holes > n_holes:
            raise InternalError(f"{self.name}: plan takes {from_holes} holes of {n_holes}")
        if lo - grow_lo < self.p_min or hi + grow_hi > self.p_max:
            raise InternalError(f"{self.name}: region [{lo - grow_lo}, {hi + grow_hi}) left [{self.p_min}, {self.p_max})")
        v2p = self._v2p
        if n == 1 and _SCALAR:
            vid = int(v[0])
            if v2p[vid] >= 0:  # unbound is -1
                raise InternalError(f"{self.name}: binding virtual ids that are already bound")
            if from_holes:
                self.n_holes = n_holes = n_holes - 1
                page = int(self._holes_np[n_holes])
            elif grow_lo:
                page = self.lo = lo - 1
            else:
                page = hi
                self.hi = hi + 1
            self._p2v[page] = vid
            v2p[vid] = page
            self.used += 1
            return
        if n <= _FEW and _SCALAR and lo_parts is None:
            self._bind_few(v.tolist(), from_holes, grow_lo, grow_hi)
            return
        if n and _peak(v2p.take(v)) >= 0:
            raise InternalError(f"{self.name}: binding virtual ids that are already bound")
        parts = []
        if from_holes:
            n_holes -= from_holes
            parts.append(self._holes_np[n_holes : n_holes + from_holes][::-1])
            self.n_holes = n_holes
        if grow_lo:
            # Ascending, so a request's pages form +1 runs on both sides of a transfer.
            if lo_parts is None:
                parts.append(np.arange(lo - grow_lo, lo, dtype=IDX_NP))
            else:
                ends = np.cumsum(lo_parts)
                seg = np.repeat(np.arange(len(lo_parts)), lo_parts)
                parts.append((lo - ends[seg] + (np.arange(grow_lo) - (ends - lo_parts)[seg])).astype(IDX_NP))
            self.lo = lo - grow_lo
        if grow_hi:
            parts.append(np.arange(hi, hi + grow_hi, dtype=IDX_NP))
            self.hi = hi + grow_hi
        # one part: fresh from arange, or a view of the hole stack (put reads it before any
        # later bind or unbind rewrites the stack)
        pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if not from_holes and lo_parts is None and (not grow_lo or not grow_hi):
            start = lo - grow_lo if grow_lo else hi  # one ascending run: a slice, not a scatter
            self._p2v[start : start + n] = v
        else:
            self._p2v.put(pages, v)
        v2p.put(v, pages)
        self.used += n

    def _bind_few(self, ids: list[int], from_holes: int, grow_lo: int, grow_hi: int) -> None:
        """:meth:`bind` of a few ids (checked, no ``lo_parts``) through scalar reads and writes:
        the same pages, in the same order, as the array path."""
        v2p = self._v2p
        item = v2p.item
        for vid in ids:
            if item(vid) >= 0:  # unbound is -1
                raise InternalError(f"{self.name}: binding virtual ids that are already bound")
        pages: list[int] = []
        if from_holes:
            n_holes = self.n_holes - from_holes
            pages = self._holes_np[n_holes : n_holes + from_holes].tolist()
            pages.reverse()
            self.n_holes = n_holes
        if grow_lo:
            lo = self.lo
            pages += range(lo - grow_lo, lo)
            self.lo = lo - grow_lo
        if grow_hi:
            hi = self.hi
            pages += range(hi, hi + grow_hi)
            self.hi = hi + grow_hi
        p2v = self._p2v
        for vid, page in zip(ids, pages):
            p2v[page] = vid
            v2p[vid] = page
        self.used += len(ids)

    def unbind(self, v: np.ndarray, parts: np.ndarray | None = None) -> None:
        """Unbind int32 ids ``v``; their pages become holes.

        ``parts``: ``v`` is several requests' ids (their counts, in order): the hole stack ends
        as one-by-one unbinds in that order would leave it."""
        n = len(v)
        if n == 0:
            return
        v2p = self._v2p
        if n == 1 and _SCALAR:
            vid = int(v[0])
            page = int(v2p[vid])
            if page < 0:
                raise InternalError(f"{self.name}: unbinding virtual ids that are not bound")
            self._p2v[page] = -1
            v2p[vid] = -1
            self.used -= 1
            if self.used == 0:
                self.collapse()
            else:
                self._holes_np[self.n_holes] = page
                self.n_holes += 1
            return
        if n <= _FEW and _SCALAR and parts is None:
            self._unbind_few(v.tolist())
            return
        pages = v2p.take(v)
        if _floor(pages) < 0:
            raise InternalError(f"{self.name}: unbinding virtual ids that are not bound")
        self._p2v.put(pages, -1)
        v2p.put(v, -1)
        self.used -= n
        if self.used == 0:
            self.collapse()
            return
        # Pushed in reverse so bind() pops them back ascending: a request reusing freed pages
        # gets the same runs (few transfer blocks) it had, not one block per page. Several
        # requests: each one's pages reversed, the first request's pushed first.
        if parts is None:
            pushed = pages[::-1]
        else:
            ends = np.cumsum(parts)
            seg = np.repeat(np.arange(len(parts)), parts)
            pushed = pages[(ends - 1)[seg] - (np.arange(n) - (ends - parts)[seg])]
        self._holes_np[self.n_holes : self.n_holes + n] = pushed
        self.n_holes += n

    def _unbind_few(self, ids: list[int]) -> None:
        """:meth:`unbind` of a few ids of one request through scalar reads and writes: the same
        tables and hole stack as the array path."""
        v2p, p2v = self._v2p, self._p2v
        item = v2p.item
        pages = [item(vid) for vid in ids]
        if min(pages) < 0:
            raise InternalError(f"{self.name}: unbinding virtual ids that are not bound")
        for vid, page in zip(ids, pages):
            p2v[page] = -1
            v2p[vid] = -1
        self.used -= len(ids)
        if self.used == 0:
            self.collapse()
            return
        at = self.n_holes
        holes = self._holes_np
        for page in reversed(pages):  # pushed in reverse, as the array path does
            holes[at] = page
            at += 1
        self.n_holes = at

    # ---- edges ------------------------------------------------------------------------------
    def trimmed_bounds(self) -> tuple[int, int]:
        """The region after :meth:`trim`, without changing anything."""
        if self.used == 0:
            anchor = {Direction.UP: self.p_min, Direction.DOWN: self.p_max}.get(self.direction, self.lo)
            return anchor, anchor
        if self.n_holes == 0:
            return self.lo, self.hi
        bound = (self.p2v[self.lo : self.hi] != -1).nonzero()
        first, last = int(bound[0]) + self.lo, int(bound[-1]) + self.lo + 1
        if self.direction is Direction.UP:
            return self.lo, last
        if self.direction is Direction.DOWN:
            return first, self.hi
        return first, last

    def trim(self) -> int:
        """Give free pages at the region's edges back to the gap. Returns pages given back."""
        lo, hi = self.trimmed_bounds()
        given = (self.hi - self.lo) - (hi - lo)
        if given:
            if self.used == 0:
                self.collapse()
            else:
                holes = self._holes[: self.n_holes]
                keep = holes[(holes >= lo) & (holes < hi)]
                self.n_holes = keep.numel()
                self._holes[: self.n_holes] = keep
                self.lo, self.hi = lo, hi
        return given

    # ---- compaction -------------------------------------------------------------------------
    def plan_compaction(self, fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Moves ``(src, dst)`` that pack live pages toward the anchor end (float: toward lo).

        ``fixed`` is a bool mask over the region's pages that must not move; pass None to plan
        as if nothing were pinned. Sources are live pages from the far end, destinations the
        holes nearest the anchor; each pair moves a page strictly toward the anchor."""
        region = self.p2v[self.lo : self.hi]
        live = region != -1
        holes = (~live).nonzero().flatten().to(IDX) + self.lo
        movable = live if fixed is None else live & ~fixed
        src = movable.nonzero().flatten().to(IDX) + self.lo
        if self.direction is Direction.DOWN:
            holes = holes.flip(0)  # highest holes first; sources lowest first
            k = min(holes.numel(), src.numel())
            ok = holes[:k] > src[:k]
        else:
            src = src.flip(0)  # highest sources first; holes lowest first
            k = min(holes.numel(), src.numel())
            ok = holes[:k] < src[:k]
        m = int(ok.sum())  # a prefix: holes move away from the anchor while sources move toward it
        return src[:m], holes[:m]

    def apply_moves(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rebind the virtual ids of pages ``src`` to pages ``dst`` (bytes already copied), then
        rebuild the hole stack and trim. Virtual ids never change."""
        if src.numel():
            vids = self.p2v[src]
            self.p2v[dst] = vids
            self.p2v[src] = -1
            self.v2p[vids] = dst
        self.rebuild_holes()
        self.trim()

    def plan_slide(self, new_lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Moves ``(src, dst)`` that shift a packed region (no holes) to start at ``new_lo``.
        Source and destination ranges may overlap: copy through a gather first."""
        if self.n_holes:
            raise InternalError(f"{self.name}: slide of a region with {self.n_holes} holes; compact it first")
        n = self.hi - self.lo
        return torch.arange(self.lo, self.hi, dtype=IDX), torch.arange(new_lo, new_lo + n, dtype=IDX)

    def apply_slide(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rebind after :meth:`plan_slide`'s bytes were copied; the region becomes ``dst``'s range."""
        vids = self.p2v[src].clone()
        self.p2v[src] = -1
        self.p2v[dst] = vids
        self.v2p[vids] = dst
        self.lo, self.hi = int(dst[0]), int(dst[-1]) + 1
        if self.lo < self.p_min or self.hi > self.p_max:
            raise InternalError(f"{self.name}: slide left [{self.p_min}, {self.p_max})")

    def rebuild_holes(self) -> None:
        """Recompute the hole stack from ``p2v`` (ordered so the pages nearest the anchor pop first)."""
        holes = (self.p2v[self.lo : self.hi] == -1).nonzero().flatten().to(IDX) + self.lo
        if self.direction is not Direction.DOWN:
            holes = holes.flip(0)
        self.n_holes = holes.numel()
        self._holes[: self.n_holes] = holes

    def holes(self) -> torch.Tensor:
        return self._holes[: self.n_holes]

    def bytes_range(self) -> tuple[int, int]:
        return self.lo * self.pb, self.hi * self.pb
