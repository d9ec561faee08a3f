"""A request's record in the pool: the virtual ids it holds per group.

The pool owns these records and keeps them consistent with its allocators; the planner, the
bindings, the compactor, offload and the checker read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.pool.allocator import IDX
from kvd.pool.layout import GroupKind

__all__ = ["Request", "request_vids"]

FULL, SWA, STATE = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE


@dataclass(slots=True)
class Request:
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


def request_vids(kind: GroupKind, r: Request) -> torch.Tensor:
    """The virtual ids ``r`` holds bound in group ``kind`` (SWA: the window tail of its full ids)."""
    if kind is FULL:
        return r.full
    if kind is SWA:
        return r.full[r.swa_first :]
    if kind is STATE:
        return torch.tensor([r.state] if r.state >= 0 else [], dtype=IDX)
    return r.draft
