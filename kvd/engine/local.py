"""The engine-facing calls over an in-process :class:`~kvd.pool.pool.Pool` -- no daemon, no handoff.

The colocated reference runs the same engine code as the prefill-decode pair, prefill and decode
in one pool; this adapter gives it the subset of :class:`kvd.client.Client` the engines use, with
the same names, arguments and exceptions.

``device="cuda:N"`` puts the pool on a CUDA virtual-memory arena on that GPU (needs
``cuda-python``, and Triton for compaction), so the reference reads KV from GPU memory as the
engines of ``kvd demo --device cuda`` do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvd.memory.arena import Arena, ShmArena
from kvd.pool.layout import Layout
from kvd.records import CompactionResult, IndexVectors
from kvd.pool.pool import Pool
from kvd.client.views import LayerKV, all_views

__all__ = ["LocalKV"]


class LocalKV:
    """A pool over its own arena (shared memory, or GPU memory for a CUDA ``device``), spoken to
    like a daemon. Close when done."""

    def __init__(self, layout: Layout, nbytes: int, *, device: torch.device | str = "cpu") -> None:
        dev = torch.device(device)
        self.arena: Arena
        if dev.type == "cuda":
            from kvd.memory.vmm import CudaVmmArena

            self.arena = CudaVmmArena(nbytes, nbytes, device=dev)
        elif dev.type == "cpu":
            self.arena = ShmArena(nbytes, nbytes)
        else:
            raise ValueError(f"LocalKV: no arena for device {dev} (cpu or cuda)")
        try:
            self.pool = Pool(layout, self.arena)
        except BaseException:
            self.arena.close()
            raise

    @property
    def views(self) -> dict[str, list[LayerKV]]:
        return all_views(self.pool.layout, self.arena.tensor())

    def allocate(self, rid: str, tokens: int, *, receive: bool = False) -> IndexVectors:
        return self.pool.allocate(rid, tokens, receive=receive)

    def extend_many(self, items: Sequence[tuple[str, int]]) -> list[IndexVectors]:
        return self.pool.extend_many(items)

    def vectors(self, rid: str) -> IndexVectors:
        return self.pool.vectors(rid)

    def vectors_many(self, rids: Sequence[str]) -> list[IndexVectors]:
        return [self.pool.vectors(r) for r in rids]

    def free(self, *rids: str) -> int:
        self.pool.free_many(list(rids))
        return len(rids)

    def offload(self, rid: str) -> int:
        return self.pool.offload(rid)

    def restore(self, rid: str) -> IndexVectors:
        return self.pool.restore(rid)

    def compact(self, *, around_pinned: bool = False) -> CompactionResult:
        return self.pool.compact((), around_pinned=around_pinned)

    def close(self) -> None:
        self.arena.close()
