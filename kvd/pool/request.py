"""A request's record in the pool: the virtual ids it holds per group.

The pool owns these records and keeps them consistent with its allocators; the planner, the
bindings, the compactor, offload and the checker read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvd.pool.allocator import IDX_NP
from kvd.pool.layout import GroupKind

__all__ = ["NO_IDS", "Request", "request_vids"]

FULL, SWA, STATE = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE

#: the ids of a request that holds none in a group (shared: steps concatenate, never write)
NO_IDS = np.empty(0, dtype=IDX_NP)


@dataclass(slots=True)
class Request:
    rid: str
    handle: int  # small int naming the request in the vid -> request tables
    tokens: int
    base_tokens: int  # length before the last allocate/extend step: anchors the SWA tail
    full: np.ndarray  # virtual ids, one per page (int32; numpy: a request's few ids cost less than in torch)
    swa_first: int  # first request page with an SWA page bound
    state: int  # state slot virtual id, -1 when the layout has no state group
    draft: np.ndarray  # draft virtual ids (int32)
    moved_epoch: int  # epoch at which this request's physical pages last changed
    version: int = 0  # bumped (pool-wide sequence) whenever any of its pages is bound, released or moved


def request_vids(kind: GroupKind, r: Request) -> torch.Tensor:
    """The virtual ids ``r`` holds bound in group ``kind`` (SWA: the window tail of its full ids),
    as a tensor over the request's own memory (do not write it)."""
    if kind is FULL:
        return torch.from_numpy(r.full)
    if kind is SWA:
        return torch.from_numpy(r.full[r.swa_first :])
    if kind is STATE:
        return torch.tensor([r.state] if r.state >= 0 else [], dtype=torch.int32)
    return torch.from_numpy(r.draft)
