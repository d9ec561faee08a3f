"""Copy byte blocks between two uint8 tensors of one GPU: one Triton launch over the blocks
(:func:`copy_blocks`) or the copy engines (:func:`copy_engine_blocks`: one
``cuMemcpyBatchAsync`` where the driver has it), and which of the two a write takes
(:func:`copy_strategy`, a pure function). The local CUDA backend
(:mod:`kvd.backends.local_cuda`) copies a peer handoff's blocks with these; the destination
may be memory of a peer GPU mapped for this one.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

from kvd.copy.runs import Runs

__all__ = ["COPY_ENGINE", "KERNEL", "CE_MIN_AVG_BLOCK", "CE_MAX_BLOCKS", "batch_usable", "copy_blocks", "copy_engine_blocks", "copy_strategy"]

log = logging.getLogger("kvd.copy.blocks")

#: Copy strategies (:func:`copy_strategy`).
KERNEL = "kernel"
COPY_ENGINE = "copy-engine"
#: Across GPUs, blocks of at least this many bytes on average go through the copy engines: one
#: memcpy per block costs a few microseconds to issue, so small blocks are the kernel's (one launch).
CE_MIN_AVG_BLOCK = 256 << 10
#: ... and at most this many blocks per write batch (~4 us to issue each: at most ~16 ms of issuing).
CE_MAX_BLOCKS = 4096


def copy_strategy(home: int | None, lens: list[int], *, batch: bool = True) -> str:
    """How to move blocks of ``lens`` bytes into a peer arena whose memory lives on GPU ``home``
    (None: this daemon's own GPU); ``batch``: whether ``cuMemcpyBatchAsync`` is usable here.
    Pure: COPY_ENGINE for few large blocks -- across GPUs always (the copy engines beat the
    kernel over NVLink, even one memcpy per block), on the same GPU only as one batch (1.76 GB
    in 17 blocks on one H200: batch 0.94 ms, the kernel 1.36, one copy 0.85; one memcpy per
    block loses to the kernel as blocks get many) -- and KERNEL otherwise (one launch)."""
    if not lens or len(lens) > CE_MAX_BLOCKS or (home is None and not batch):
        return KERNEL
    return COPY_ENGINE if sum(lens) >= CE_MIN_AVG_BLOCK * len(lens) else KERNEL


def copy_engine_blocks(src: torch.Tensor, dst: torch.Tensor, s: list[int], d: list[int], n: list[int], home: int | None = None,
                       stream: torch.cuda.Stream | None = None) -> int:
    """Copy ``src[s_i : s_i + n_i] -> dst[d_i : ...]`` through the copy engines (byte offsets
    into two uint8 tensors); returns the bytes moved. On a GPU: on ``stream`` (None: the current
    stream of ``src``'s device), not waited for (the caller synchronizes), as one
    ``cuMemcpyBatchAsync`` of every block where the driver has it and that stream is not the
    legacy default stream (which the driver refuses for batches), else one device-to-device
    memcpy per block. ``dst`` must be a tensor of the same device (an import for this GPU, even
    of memory on a peer GPU); ``home``: the GPU its memory lives on (None: ``src``'s), a hint to
    the driver. The batch is one driver call with no torch stream or device guard around it
    (those cost more than the call: ~0.1 ms of a Send's issue on the H200 host).

    Why a batch: each memcpy costs the copy engines ~15 us of link time on top of its bytes
    (GPU 0 -> 1 on H200, 1.76 GB: one copy 4.50 ms, the same bytes as 17 memcpys 4.76 ms, as 64
    memcpys 5.4 ms; as one batch of 17 or 64, 4.50-4.52 ms -- bench/nvlink_streams.py), and
    one driver call replaces a Python loop of them."""
    if len(s) != len(n) or len(d) != len(n):
        raise ValueError(f"copy_engine_blocks: {len(s)} sources, {len(d)} destinations, {len(n)} lengths")
    if src.is_cuda:
        stream = stream if stream is not None else torch.cuda.current_stream(src.device)
        if not _copy_batch(src, dst, s, d, n, home, stream):
            with torch.cuda.device(src.device), torch.cuda.stream(stream):
                for a, b, k in zip(s, d, n):
                    dst[b : b + k].copy_(src[a : a + k], non_blocking=True)
    else:
        for a, b, k in zip(s, d, n):
            dst[b : b + k].copy_(src[a : a + k])
    return sum(n)


#: Whether ``cuMemcpyBatchAsync`` may be used (False once the bindings or the driver lacked it).
_batch_ok = True
_batch_attrs: dict[tuple[int, int], Any] = {}  # (source GPU, destination GPU) -> CUmemcpyAttributes
_primary: dict[int, Any] = {}  # GPU -> its primary context (retained once, for the process's life)
_primary_lock = threading.Lock()


def _bind_primary(cu: Any, dev: int) -> None:
    """Make GPU ``dev``'s primary context (torch's) current on this thread for a driver call. A
    thread that has made no CUDA runtime call yet has none current, and ``torch.cuda.device``
    of the device it already reports makes none (then the batch call fails INVALID_VALUE: a
    gRPC worker thread's first write, seen with eight concurrent senders)."""
    with _primary_lock:
        ctx = _primary.get(dev)
        if ctx is None:
            err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuDevicePrimaryCtxRetain({dev}) failed: {getattr(err, 'name', err)}")
            _primary[dev] = ctx
    (err,) = cu.cuCtxSetCurrent(ctx)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuCtxSetCurrent (GPU {dev}) failed: {getattr(err, 'name', err)}")


def _copy_batch(src: torch.Tensor, dst: torch.Tensor, s: list[int], d: list[int], n: list[int], home: int | None,
                stream: torch.cuda.Stream) -> bool:
    """Queue the blocks as one ``cuMemcpyBatchAsync`` on ``stream``: True when queued, False
    when this process cannot (then nothing was queued; the caller copies block by block).
    RuntimeError when the driver refuses this batch (a CUDA error: the caller's copy failed)."""
    global _batch_ok
    if not _batch_ok or not n or stream.cuda_stream == 0:
        return False
    from kvd.memory.cuda import driver

    cu = driver()
    fn = getattr(cu, "cuMemcpyBatchAsync", None)  # CUDA >= 12.8 bindings
    if fn is None:
        _batch_ok = False
        log.info("cuda bindings have no cuMemcpyBatchAsync: copy-engine writes go one memcpy per block")
        return False
    here = src.device.index if src.device.index is not None else torch.cuda.current_device()
    there = here if home is None else home
    attr = _batch_attrs.get((here, there))
    if attr is None:
        attr = cu.CUmemcpyAttributes()
        # The blocks are read in stream order: after whatever the stream ran before them.
        attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.srcLocHint.type = attr.dstLocHint.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        attr.srcLocHint.id, attr.dstLocHint.id = here, there
        _batch_attrs[(here, there)] = attr
    _bind_primary(cu, here)
    a, b, ptr = src.data_ptr(), dst.data_ptr(), cu.CUdeviceptr
    try:
        res = fn([ptr(b + x) for x in d], [ptr(a + x) for x in s], n, len(n), [attr], [0], 1, stream.cuda_stream)
    except TypeError as exc:  # bindings of another signature
        _batch_ok = False
        log.info("cuMemcpyBatchAsync not usable (%s): copy-engine writes go one memcpy per block", exc)
        return False
    err = res[0] if isinstance(res, tuple) else res
    if err == cu.CUresult.CUDA_SUCCESS:
        return True
    if err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:  # a driver older than the bindings
        _batch_ok = False
        log.info("the CUDA driver does not support cuMemcpyBatchAsync: copy-engine writes go one memcpy per block")
        return False
    raise RuntimeError(f"cuMemcpyBatchAsync of {len(n)} blocks failed: {getattr(err, 'name', err)}")


def batch_usable() -> bool:
    """Whether ``cuMemcpyBatchAsync`` may be used here (False once the bindings or the driver
    lacked it): the ``batch`` of :func:`copy_strategy`."""
    return _batch_ok


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, s: list[int], d: list[int], n: list[int]) -> int:
    """Copy ``src[s_i : s_i + n_i] -> dst[d_i : ...]`` (byte offsets into two uint8 tensors) in
    one :func:`kvd.copy.kernels.move_pages` call; returns the bytes moved.

    Both tensors are viewed as rows of ``g`` bytes, ``g`` the gcd of every offset and length, so
    each block is a run of whole rows. ``g`` is whatever the blocks allow: page-aligned blocks of
    the pool give a multiple of the smallest page size (hundreds of bytes), which lets the kernel
    move 16-byte words. Off the GPU, ``move_pages`` falls back to torch."""
    if not n:
        return 0
    from kvd.copy.kernels import move_pages

    g = math.gcd(*s, *d, *n)
    rows_s = src[: src.numel() // g * g].view(-1, g)
    rows_d = dst[: dst.numel() // g * g].view(-1, g)
    runs = Runs(
        torch.tensor(s, dtype=torch.int64) // g,
        torch.tensor(d, dtype=torch.int64) // g,
        torch.tensor(n, dtype=torch.int64) // g,
    )
    move_pages(rows_s, rows_d, runs)
    return sum(n)
