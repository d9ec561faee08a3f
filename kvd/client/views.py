"""Per-layer torch views over an arena: how an engine reads and writes KV in place.

Pages are page-major (see :mod:`kvd.pool.layout`), so the K cache of layer ``l`` of a group is a
strided view ``[pages, page_size, kv_heads, head_dim]`` whose page stride is the group's page
bytes. Index it with *physical* page ids from the daemon's index vectors; the views never copy
and stay valid while the arena mapping lives and its backing does not shrink.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvd.pool.layout import GroupKind, GroupSpec, Layout

__all__ = ["LayerKV", "group_views", "all_views"]


class LayerKV(NamedTuple):
    """K and V of one layer: ``[pages, page_size, kv_heads, head_dim]`` each (state groups:
    ``k`` is ``[slots, state_elems]`` and ``v`` is None)."""

    k: torch.Tensor
    v: torch.Tensor | None


def group_views(layout: Layout, arena: torch.Tensor, g: GroupSpec) -> list[LayerKV]:
    """Views of every layer of group ``g`` over ``arena`` (a uint8 tensor of the backed prefix)."""
    dt = layout.torch_dtype(g)
    it = layout.itemsize(g)
    pb = layout.page_bytes(g)
    pages = arena.numel() // pb
    flat = arena[: pages * pb].view(dt)
    stride_page = pb // it
    out: list[LayerKV] = []
    if g.kind is GroupKind.STATE:
        for layer in range(g.num_layers):
            k = torch.as_strided(flat, (pages, g.state_elems), (stride_page, 1), layer * g.state_elems)
            out.append(LayerKV(k, None))
        return out
    ps, h, dk = layout.page_size_of(g), g.num_kv_heads, g.head_dim
    dv = g.v_dim
    per_layer = ps * h * (dk + dv)
    for layer in range(g.num_layers):
        off = layer * per_layer
        k = torch.as_strided(flat, (pages, ps, h, dk), (stride_page, h * dk, dk, 1), off)
        v = torch.as_strided(flat, (pages, ps, h, dv), (stride_page, h * dv, dv, 1), off + ps * h * dk)
        out.append(LayerKV(k, v))
    return out


def all_views(layout: Layout, arena: torch.Tensor) -> dict[str, list[LayerKV]]:
    """``{group name: [LayerKV per layer]}`` for every group of the layout."""
    return {g.name: group_views(layout, arena, g) for g in layout.groups}
