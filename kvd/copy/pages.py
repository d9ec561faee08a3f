"""Copy page runs between two arena views, wherever they live: the one entry point compaction,
offload and restore use.

:func:`copy_runs` sends CUDA views to :func:`kvd.copy.kernels.move_pages` (one Triton launch
over the runs) and host views to :func:`kvd.copy.runs.copy_host`. The kernels module is
imported with the first CUDA copy, so a CPU-only daemon never loads Triton.
"""

from __future__ import annotations

import torch

from kvd.copy.runs import Runs, copy_host

__all__ = ["copy_runs"]


def copy_runs(src_view: torch.Tensor, dst_view: torch.Tensor, runs: Runs) -> None:
    """Copy page runs between two ``[pages, page_bytes]`` views (may be the same view).

    Source and destination pages must not overlap (compaction moves live pages into holes;
    transfers copy between arenas). Host views: :func:`~kvd.copy.runs.copy_host` (a memcpy per
    large run, one gather/scatter for many small ones). CUDA views (either side) go to
    :func:`kvd.copy.kernels.move_pages` (one Triton launch over the runs)."""
    if len(runs) == 0:
        return
    if src_view.is_cuda or dst_view.is_cuda:
        from kvd.copy.kernels import move_pages  # Triton loads with the first CUDA copy

        move_pages(src_view, dst_view, runs)
        return
    copy_host(src_view, dst_view, runs)
