"""Runs: coalesce paired page ids into blocks where source and destination are both consecutive.

Compaction, offload and the transfer planner all move pages ``src[i] -> dst[i]``. Copying run by
run instead of page by page turns thousands of small copies into a few large ones; on the wire a
run is one block carrying every layer of its group (pages are page-major).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Runs", "coalesce", "coalesce_np", "coalesce_lists", "SMALL", "expand", "copy_host"]


class Runs(NamedTuple):
    """Blocks ``src[start_i : start_i + length_i] -> dst[...]`` in page units (int64 tensors)."""

    src: torch.Tensor
    dst: torch.Tensor
    length: torch.Tensor

    def __len__(self) -> int:
        return self.src.numel()


def coalesce_np(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`coalesce` on numpy int arrays, returning ``(src, dst, length)`` int64 arrays.

    The planner's hot path: a Send plans its blocks with a handful of numpy calls (~1 us each)
    where the same steps on small torch tensors cost ~10 us each."""
    n = src.size
    if n != dst.size:
        raise ValueError(f"coalesce: {n} sources but {dst.size} destinations")
    if n == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    if n <= SMALL:
        rs, rd, rn = coalesce_lists(src.reshape(-1).tolist(), dst.reshape(-1).tolist())
        return np.array(rs, dtype=np.int64), np.array(rd, dtype=np.int64), np.array(rn, dtype=np.int64)
    s, d = src.reshape(-1).astype(np.int64, copy=False), dst.reshape(-1).astype(np.int64, copy=False)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(s[1:], s[:-1] + 1, out=brk[1:])
    brk[1:] |= d[1:] != d[:-1] + 1
    starts = np.flatnonzero(brk)
    length = np.empty_like(starts)
    length[:-1] = starts[1:] - starts[:-1]
    length[-1] = n - starts[-1]
    return s[starts], d[starts], length


#: Up to this many pairs a Python loop over lists beats the dozen numpy calls (a short request's
#: Send, a state slot: ~2 us against ~10).
SMALL = 32


def coalesce_lists(s: list[int], d: list[int]) -> tuple[list[int], list[int], list[int]]:
    """:func:`coalesce_np` of a few pairs (:data:`SMALL`), as lists: ``(src, dst, length)``.
    ``s`` and ``d`` must have equal, nonzero length."""
    rs, rd, rn = [s[0]], [d[0]], [1]
    for a, b, x, y in zip(s, d, s[1:], d[1:]):  # each pair with the one before it
        if x == a + 1 and y == b + 1:
            rn[-1] += 1
        else:
            rs.append(x)
            rd.append(y)
            rn.append(1)
    return rs, rd, rn


def coalesce(src: torch.Tensor, dst: torch.Tensor) -> Runs:
    """Split paired ids into maximal runs where both ``src`` and ``dst`` step by +1.

    Vectorised: no Python loop over pages. Runs are not cut to a size: a backend splits what
    its transport needs split (Mooncake's ``max_block``). ``src`` and ``dst`` must have equal
    length."""
    s, d, n = coalesce_np(src.numpy(force=True), dst.numpy(force=True))
    return Runs(torch.from_numpy(s), torch.from_numpy(d), torch.from_numpy(n))


#: Below this many bytes per run on average, one gather/scatter beats a Python loop of copies.
_LOOP_MIN_RUN_BYTES = 64 * 1024


def copy_host(src_view: torch.Tensor, dst_view: torch.Tensor, runs: Runs) -> None:
    """Copy page runs between two ``[pages, page_bytes]`` views with torch, on the host (the CPU
    path of :func:`kvd.copy.pages.copy_runs`; may be the same view).

    Source and destination pages must not overlap. Large runs are copied one ``copy_`` each, so
    each is a memcpy; many small runs go through one ``index_select``/``index_copy_`` pair instead."""
    if len(runs) == 0:
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
