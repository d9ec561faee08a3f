"""Offload, the retraction fallback: a request's page bytes copied to host memory, and back into new pages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from kvd.pool.allocator import GroupAllocator
from kvd.pool.layout import GroupKind
from kvd.pool.request import Request, request_vids

__all__ = ["Offloaded", "load", "save"]

PageView = Callable[[GroupKind], torch.Tensor]  # a group's pages, [pages, page_bytes] uint8 (Pool.page_view)


@dataclass(slots=True)
class Offloaded:
    rid: str
    tokens: int
    base_tokens: int
    host: dict[GroupKind, torch.Tensor] = field(default_factory=dict)  # page bytes in vector order


def save(groups: Mapping[GroupKind, GroupAllocator], page_view: PageView, r: Request) -> tuple[Offloaded, int]:
    """Copy ``r``'s pages to host memory, in vector order. Returns them and their byte count; binds nothing."""
    off = Offloaded(r.rid, r.tokens, r.base_tokens)
    nbytes = 0
    for k, a in groups.items():
        vids = request_vids(k, r)
        if vids.numel():
            pages = a.v2p[vids].to(torch.int64)
            view = page_view(k)
            off.host[k] = view.index_select(0, pages.to(view.device)).to("cpu")
            nbytes += off.host[k].numel()
    return off, nbytes


def load(groups: Mapping[GroupKind, GroupAllocator], page_view: PageView, device: torch.device, off: Offloaded, r: Request) -> None:
    """Copy ``off``'s bytes into ``r``'s pages (bound already, the same counts), on ``device``.
    The copies may still be in flight on return: the caller waits (:meth:`Pool._settle`)."""
    for k, host in off.host.items():
        pages = groups[k].v2p[request_vids(k, r)].to(torch.int64)
        page_view(k).index_copy_(0, pages.to(device), host.to(device))
