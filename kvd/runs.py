"""Runs: coalesce paired page ids into blocks where source and destination are both consecutive.

Compaction, offload and the transfer planner all move pages ``src[i] -> dst[i]``. Copying run by
run instead of page by page turns thousands of small copies into a few large ones; on the wire a
run is one block carrying every layer of its group (pages are page-major).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Runs", "coalesce"]


class Runs(NamedTuple):
    """Blocks ``src[start_i : start_i + length_i] -> dst[...]`` in page units (int64 tensors)."""

    src: torch.Tensor
    dst: torch.Tensor
    length: torch.Tensor

    def __len__(self) -> int:
        return self.src.numel()


def coalesce(src: torch.Tensor, dst: torch.Tensor, max_run: int | None = None) -> Runs:
    """Split paired ids into maximal runs where both ``src`` and ``dst`` step by +1.

    ``max_run`` caps a run's length (bounded block sizes for a backend). Vectorised: no Python
    loop over pages. ``src`` and ``dst`` must have equal length."""
    if src.numel() != dst.numel():
        raise ValueError(f"coalesce: {src.numel()} sources but {dst.numel()} destinations")
    n = src.numel()
    s, d = src.to(torch.int64).flatten(), dst.to(torch.int64).flatten()
    if n == 0:
        e = torch.empty(0, dtype=torch.int64)
        return Runs(e, e, e)
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    if max_run is not None and max_run > 0:
        # Position inside the current run; break every max_run pages.
        idx = torch.arange(n, dtype=torch.int64)
        run_start = torch.cummax(torch.where(brk, idx, torch.zeros_like(idx)), 0).values
        brk |= (idx - run_start) % max_run == 0
    starts = brk.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([n], dtype=torch.int64)])
    return Runs(s[starts], d[starts], ends - starts)


#: Below this many bytes per run on average, one gather/scatter beats a Python loop of copies.
_LOOP_MIN_RUN_BYTES = 64 * 1024


def copy_runs(src_view: torch.Tensor, dst_view: torch.Tensor, runs: Runs) -> None:
    """Copy page runs between two ``[pages, page_bytes]`` views (may be the same view).

    Source and destination pages must not overlap (compaction moves live pages into holes;
    transfers copy between arenas). Large runs are copied one ``copy_`` each, so each is a
    memcpy; many small runs go through one ``index_select``/``index_copy_`` pair instead.
    CUDA views go to :func:`kvd.kernels.move_pages` (one Triton launch over the runs)."""
    if len(runs) == 0:
        return
    if src_view.is_cuda or dst_view.is_cuda:
        from kvd.kernels import move_pages  # imported here: CPU nodes never load Triton

        move_pages(src_view, dst_view, runs)
        return
    page_bytes = src_view.shape[1]
    total = int(runs.length.sum())
    if total * page_bytes >= len(runs) * _LOOP_MIN_RUN_BYTES:
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()):
            dst_view[d : d + n].copy_(src_view[s : s + n])
        return
    src, dst = expand(runs)
    dst_view.index_copy_(0, dst, src_view.index_select(0, src).to(dst_view.device))


def expand(runs: Runs) -> tuple[torch.Tensor, torch.Tensor]:
    """Page ids of every page covered by ``runs`` (inverse of :func:`coalesce`)."""
    total = int(runs.length.sum())
    offs = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(runs.length, 0) - runs.length, runs.length
    )
    return torch.repeat_interleave(runs.src, runs.length) + offs, torch.repeat_interleave(runs.dst, runs.length) + offs
