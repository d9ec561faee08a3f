"""Paged KV access: one request's KV in the daemon's arena, by physical page id.

The arena's per-layer views (:func:`kvd.client.views.all_views`) are ``[pages, page_size, kv_heads,
head_dim]`` tensors over shared memory; a request's pages are the physical ids in its
:class:`~kvd.records.IndexVectors`. Token ``t`` of group ``g`` lives at page
``ids[t // page_size - first]``, slot ``t % page_size``, where ``ids``/``first`` are::

    full    vec.full   first 0                 every page of the request
    swa     vec.swa    first vec.swa_first_page only the window tail: older pages are released
    draft   vec.draft  first 0                 the draft model's own page size
    state   vec.state  one slot (the recurrent state after the last committed token)

Reading a position whose page the vectors do not cover raises ``RuntimeError``: it means the
engine asked for KV the pool released (an engine bug), never something to paper over.

A :class:`SeqKV` holds vectors of one epoch; after the daemon compacts, restores or extends,
make a new one from the fresh vectors (:meth:`PagedKV.seq`).

Devices: the index vectors arrive from the daemon as CPU int32 tensors; the views live where the
arena does (shared memory, or GPU memory with ``arena=cuda``). Page ids are moved to the views'
device before they index them; the K/V given to :meth:`SeqKV.write` must already be there (a
tensor on another device fails, it is never copied across silently).
"""

from __future__ import annotations

import functools

import torch

from kvd.pool.layout import GroupKind, Layout
from kvd.records import IndexVectors
from kvd.client.views import LayerKV

__all__ = ["PagedKV", "SeqKV"]


class PagedKV:
    """The arena views of one engine process (from ``Client.attach().views`` or an in-process
    pool's arena), shared by every request."""

    def __init__(self, layout: Layout, views: dict[str, list[LayerKV]]) -> None:
        self.layout = layout
        self.views = views
        self.page_size = {g.name: layout.page_size_of(g) for g in layout.groups}
        devices = {lkv.k.device for layers in views.values() for lkv in layers}
        if len(devices) > 1:
            raise ValueError(f"arena views on more than one device: {sorted(map(str, devices))}")
        #: where the views (the arena) live; forward passes reading them must compute here
        self.device = devices.pop() if devices else torch.device("cpu")

    def seq(self, vec: IndexVectors) -> SeqKV:
        return SeqKV(self, vec)


class SeqKV:
    """One request's KV, addressed through its physical index vectors."""

    def __init__(self, kv: PagedKV, vec: IndexVectors) -> None:
        self.kv = kv
        self.vec = vec

    def _ids(self, group: str) -> tuple[torch.Tensor, int]:
        v = self.vec
        if group == GroupKind.FULL.value:
            return v.full, 0
        if group == GroupKind.SWA.value:
            return v.swa, v.swa_first_page
        if group == GroupKind.DRAFT.value:
            return v.draft, 0
        raise ValueError(f"group {group!r} is not paged")

    def _span(self, group: str, lo: int, hi: int) -> tuple[torch.Tensor, int, int, int]:
        """``(ids, first, p0, p1)``: the group's vector, its first request page, and the request
        pages ``[p0, p1)`` holding positions ``[lo, hi)``; RuntimeError if the vector lacks them."""
        ids, first = self._ids(group)
        ps = self.kv.page_size[group]
        p0, p1 = lo // ps, -(-hi // ps)
        if p0 < first or p1 - first > ids.numel():
            raise RuntimeError(
                f"request {self.vec.rid!r}: {group} positions [{lo}, {hi}) need request pages [{p0}, {p1}) but the "
                f"vectors cover [{first}, {first + ids.numel()}) -- the engine reads KV the pool does not hold for it"
            )
        return ids, first, p0, p1

    def _pages(self, group: str, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """Physical pages holding positions ``[lo, hi)`` (on the arena's device) and the first one's request index."""
        ids, first, p0, p1 = self._span(group, lo, hi)
        return ids[p0 - first : p1 - first].to(device=self.kv.device, dtype=torch.int64), p0

    def read(self, group: str, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[lo, hi)``: ``[hi - lo, kv_heads, head_dim]`` copies."""
        pages, p0 = self._pages(group, lo, hi)
        ps = self.kv.page_size[group]
        view = self.kv.views[group][layer]
        off = lo - p0 * ps
        k = view.k.index_select(0, pages).flatten(0, 1)[off : off + hi - lo]
        v = view.v.index_select(0, pages).flatten(0, 1)[off : off + hi - lo]
        return k, v

    def write(self, group: str, layer: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V for positions ``[lo, lo + len(k))`` in place."""
        n = k.shape[0]
        ids, first, _, _ = self._span(group, lo, lo + n)  # bounds check with a clear message
        ps = self.kv.page_size[group]
        pos = torch.arange(lo, lo + n)
        page = ids[pos // ps - first].to(torch.int64)  # offsets are computed on the host (CPU vectors), moved once
        slot = pos % ps
        view = self.kv.views[group][layer]
        if k.device != view.k.device or v.device != view.k.device:
            raise ValueError(f"K/V on {k.device}/{v.device} for arena views on {view.k.device}")
        _put_rows(view.k, page, slot, k)
        _put_rows(view.v, page, slot, v)

    def read_state(self, layer: int) -> torch.Tensor:
        return self.kv.views[GroupKind.STATE.value][layer].k[self._slot()].clone()

    def write_state(self, layer: int, h: torch.Tensor) -> None:
        view = self.kv.views[GroupKind.STATE.value][layer].k
        if h.device != view.device:
            raise ValueError(f"state on {h.device} for arena views on {view.device}")
        view[self._slot()] = h.to(view.dtype)

    def _slot(self) -> int:
        if self.vec.state is None:
            raise RuntimeError(f"request {self.vec.rid!r} has no state slot; the layout needs a state group")
        return self.vec.state


@functools.lru_cache(maxsize=64)
def _inner_offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """Element offsets of one row (heads x dim) from its first element: the same for every write
    to a layer view, so built once per (shape, strides). Read only by callers (``+`` makes a new
    tensor)."""
    inner = torch.zeros((), dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(shape, strides)):
        view_shape = [1] * len(shape)
        view_shape[d] = size
        inner = inner + (torch.arange(size) * stride).view(view_shape)
    return inner


def _put_rows(view: torch.Tensor, page: torch.Tensor, slot: torch.Tensor, rows: torch.Tensor) -> None:
    """``view[page[i], slot[i]] = rows[i]`` for a ``[pages, page_size, heads, dim]`` arena view,
    writing those elements and no other byte. ``page`` and ``slot`` are CPU int64 vectors.

    Not ``view.index_put_``: with deterministic algorithms on (the GPU demo), CUDA's index_put_
    into a non-contiguous tensor -- an arena view is one: its page stride spans every layer of
    the group -- copies the whole view out and back. That read-modify-write of every page of the
    layer would race with the daemon writing other requests' incoming KV into the same arena.
    Addressing the elements by offset in a flat view of the storage makes every implementation
    write element by element (the offsets are distinct, so the order does not matter)."""
    if rows.shape[0] != page.numel() or rows.shape[1:] != view.shape[2:]:
        raise ValueError(f"rows of shape {tuple(rows.shape)} for {page.numel()} positions of a view {tuple(view.shape)}")
    inner = _inner_offsets(tuple(view.shape[2:]), tuple(view.stride()[2:]))
    base = view.storage_offset() + page * view.stride(0) + slot * view.stride(1)
    offs = (base.view(-1, *[1] * (view.dim() - 2)) + inner).reshape(-1)
    flat = torch.as_strided(view, (view.untyped_storage().nbytes() // view.element_size(),), (1,), 0)
    flat.index_put_((offs.to(view.device),), rows.reshape(-1).to(view.dtype))
