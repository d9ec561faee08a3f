"""One Triton launch for the vLLM connector's copies (:mod:`kvd.connectors.vllm_blocks`): runs of
tokens between vLLM's KV blocks and kvd's pages, every head and K and V, of one layer or of many
layers a uniform stride apart.

A copy is a table of **rows**, int64 ``[R, 5]`` on the device: ``(vLLM block, first token in it,
kvd page, first token in it, tokens)``. Both sides are read through their element strides, so
one kernel serves every vLLM layout (the six 0.32 orders and the legacy 5-D ones): a side is K and
V base tensors ``[rows, tokens, heads, D]`` with a unit stride on ``D`` (:class:`Side`, with
the element distance from one layer to the next). The grid is ``(rows x token chunks, layers, 2)``:
one program copies one chunk of one row's tokens (a tile of at most :data:`TILE` elements: all of
D, heads looped past that) of one layer's K (or V), masked to the row's token count: nothing
outside the row's tokens is read or written.

Conventions as :mod:`kvd.copy.kernels`: Triton is imported when it is installed (CPU nodes run
without it: :func:`available` says so and the caller takes its torch path); the launch runs on
the caller's current stream; no host sync. ``TRITON_INTERPRET=1`` (Triton's interpreter) also
runs it on CPU tensors: how the kernel is checked without a GPU.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kvd.errors import InvalidArgument

try:  # Triton ships with CUDA builds of torch; CPU nodes run without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["ROW_COLS", "TILE", "Side", "Prepared", "available", "prepare", "launch", "copy_rows"]

#: Columns of a row: vLLM block, its first token, kvd page, its first token, tokens.
ROW_COLS = 5
#: Elements one program moves per loop step (tokens x heads x D of a tile; 16 KiB of bf16).
TILE = 8192
_WARPS = 4
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: Whether a Prepared launch after its first calls the compiled kernel directly, past Triton's
#: per-call argument binding and cache-key string (most of a launch's host time). Only on the
#: Triton release whose launcher convention this was checked against (3.6: ``CompiledKernel[grid]``
#: takes every argument, constexprs too, in the kernel's order); ``KVD_TRITON_FAST_LAUNCH=0`` turns it off.
FAST_LAUNCH = (triton is not None and not _INTERPRET and triton.__version__.split(".")[:2] == ["3", "6"]
               and os.environ.get("KVD_TRITON_FAST_LAUNCH", "1") != "0")


class Side(NamedTuple):
    """One side of a copy: ``k``, ``v`` of the first layer, ``[rows, tokens, heads, D]`` with
    ``stride(-1) == 1``; ``layer_k``, ``layer_v``: elements from one layer's K (V) to the next's."""

    k: torch.Tensor
    v: torch.Tensor
    layer_k: int = 0
    layer_v: int = 0


def available(device: torch.device) -> bool:
    """Whether :func:`copy_rows` runs on ``device`` (Triton installed; CUDA, or the interpreter)."""
    return triton is not None and (device.type == "cuda" and torch.cuda.is_available() or _INTERPRET)


if triton is not None:

    @triton.jit
    def _part(a_ptr, b_ptr, a_off, b_off, t0, n, a_tok, a_head, b_tok, b_head, H: tl.constexpr, D: tl.constexpr,
              BT: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, TO_B: tl.constexpr):
        # tokens [t0, t0 + BT) of a row's [0, n), every head, all of D: a -> b (TO_B) or b -> a.
        # Offsets in int64 elements (a vLLM KV buffer far exceeds 2^31 elements).
        tt = t0 + tl.arange(0, BT).to(tl.int64)
        h = tl.arange(0, BH).to(tl.int64)
        d = tl.arange(0, BD)
        m_t = (tt < n)[:, None, None]
        a_t = a_ptr + a_off + tt[:, None, None] * a_tok
        b_t = b_ptr + b_off + tt[:, None, None] * b_tok
        for h0 in range(0, H, BH):
            hh = h0 + h
            m = m_t & ((hh < H)[:, None] & (d < D)[None, :])[None, :, :]
            pa = a_t + (hh[:, None] * a_head + d[None, :])[None, :, :]
            pb = b_t + (hh[:, None] * b_head + d[None, :])[None, :, :]
            if TO_B:
                tl.store(pb, tl.load(pa, mask=m), mask=m)
            else:
                tl.store(pa, tl.load(pb, mask=m), mask=m)

    @triton.jit
    def _rows_kernel(rows, ak, av, bk, bv,
                     a_row_k, a_tok_k, a_head_k, a_lay_k, a_row_v, a_tok_v, a_head_v, a_lay_v,
                     b_row_k, b_tok_k, b_head_k, b_lay_k, b_row_v, b_tok_v, b_head_v, b_lay_v,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNKS: tl.constexpr,
                     BT: tl.constexpr, BH: tl.constexpr, BD_K: tl.constexpr, BD_V: tl.constexpr, TO_B: tl.constexpr):
        # program (row r, token chunk c) of axis 0, layer of axis 1, K (0) or V (1) of axis 2
        pid = tl.program_id(0)
        row = rows + (pid // CHUNKS).to(tl.int64) * 5
        t0 = (pid % CHUNKS) * BT
        n = tl.load(row + 4).to(tl.int32)
        if t0 < n:
            layer = tl.program_id(1).to(tl.int64)
            blk = tl.load(row)
            boff = tl.load(row + 1)
            page = tl.load(row + 2)
            poff = tl.load(row + 3)
            if tl.program_id(2) == 0:
                _part(ak, bk, blk * a_row_k + boff * a_tok_k + layer * a_lay_k, page * b_row_k + poff * b_tok_k + layer * b_lay_k,
                      t0, n, a_tok_k, a_head_k, b_tok_k, b_head_k, H, DK, BT, BH, BD_K, TO_B)
            else:
                _part(av, bv, blk * a_row_v + boff * a_tok_v + layer * a_lay_v, page * b_row_v + poff * b_tok_v + layer * b_lay_v,
                      t0, n, a_tok_v, a_head_v, b_tok_v, b_head_v, H, DV, BT, BH, BD_V, TO_B)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _tile(tokens: int, heads: int, d: int) -> tuple[int, int]:
    """(tokens, heads) of one program's tile (all of D): as many heads as fit in :data:`TILE`
    (more loop inside the program), then as many tokens (more make more programs)."""
    bd = _pow2(d)
    bh = min(_pow2(heads), max(1, TILE // bd))
    return min(_pow2(tokens), max(1, TILE // (bh * bd))), bh


class Prepared(NamedTuple):
    """What one launch over ``layers`` layers of sides ``a``, ``b`` needs besides the rows and the
    direction (:func:`prepare`: strides, tile, grid's chunks), so a caller that copies the same
    layers again builds none of it per call."""

    args: tuple  # the kernel's arguments after ``rows``: tensors, then strides
    meta: dict  # its constexprs but TO_B
    chunks: int
    layers: int
    device: int | None  # CUDA device index (None: the interpreter on the CPU)
    consts: tuple = ()  # ``meta``'s constexprs in the kernel's order (the compiled kernel takes them positionally)
    compiled: dict | None = None  # TO_B -> the compiled kernel its first launch returned (:data:`FAST_LAUNCH`)


def prepare(a: Side, b: Side, *, layers: int = 1) -> Prepared:
    """The layer-invariant part of :func:`copy_rows` for sides ``a``, ``b`` (same contract)."""
    heads, dk, dv = int(a.k.shape[2]), int(a.k.shape[3]), int(a.v.shape[3])
    tokens = min(int(a.k.shape[1]), int(b.k.shape[1]))  # a row's tokens fit in a block and in a page
    bt, bh = _tile(tokens, heads, max(dk, dv))
    args = (a.k, a.v, b.k, b.v,
            a.k.stride(0), a.k.stride(1), a.k.stride(2), a.layer_k, a.v.stride(0), a.v.stride(1), a.v.stride(2), a.layer_v,
            b.k.stride(0), b.k.stride(1), b.k.stride(2), b.layer_k, b.v.stride(0), b.v.stride(1), b.v.stride(2), b.layer_v)
    meta = dict(H=heads, DK=dk, DV=dv, CHUNKS=-(-tokens // bt), BT=bt, BH=bh, BD_K=_pow2(dk), BD_V=_pow2(dv), num_warps=_WARPS)
    consts = tuple(meta[k] for k in ("H", "DK", "DV", "CHUNKS", "BT", "BH", "BD_K", "BD_V"))
    return Prepared(args, meta, meta["CHUNKS"], layers, a.k.device.index if a.k.is_cuda else None, consts, {})


def launch(rows: torch.Tensor, p: Prepared, *, to_b: bool = True) -> int:
    """:func:`copy_rows` of ``rows`` with the launch ``p`` prepared; the launches issued (0 or 1)."""
    n_rows = int(rows.shape[0])
    if n_rows == 0 or p.layers == 0:
        return 0
    if n_rows * p.chunks > 2**31 - 1 or p.layers > 65535:
        raise InvalidArgument(f"{n_rows} rows x {p.chunks} chunks, {p.layers} layers exceed the launch grid; copy fewer per call")
    grid = (n_rows * p.chunks, p.layers, 2)
    if p.device is None or p.device == torch.cuda.current_device():  # the context switch costs more than the check
        _run(grid, rows, p, to_b)
    else:
        with torch.cuda.device(p.device):
            _run(grid, rows, p, to_b)
    return 1


def _run(grid: tuple[int, int, int], rows: torch.Tensor, p: Prepared, to_b: bool) -> None:
    # Every argument but ``rows`` is fixed per Prepared, and rows from CopyStream.slots are int64 and
    # 16-byte aligned: the specialization Triton keys its cache on is the first launch's, so later
    # launches go straight to that compiled kernel (what JITFunction.run ends in).
    same = rows.dtype == torch.int64 and rows.data_ptr() % 16 == 0
    ck = p.compiled.get(to_b) if FAST_LAUNCH and same and p.compiled is not None else None
    if ck is not None:
        ck[grid](rows, *p.args, *p.consts, to_b)
        return
    got = _rows_kernel[grid](rows, *p.args, TO_B=to_b, **p.meta)
    if FAST_LAUNCH and same and p.compiled is not None and hasattr(got, "function") and not hasattr(got, "result"):
        p.compiled[to_b] = got


def copy_rows(rows: torch.Tensor, a: Side, b: Side, *, layers: int = 1, to_b: bool = True) -> int:
    """Copy every row of ``rows`` (int64 ``[R, 5]`` on the tensors' device, see the module
    docstring) for ``layers`` layers: ``a`` is vLLM's side (rows index its blocks), ``b`` kvd's
    (rows index its pages); ``to_b``: vLLM -> kvd (a save), else kvd -> vLLM (a load). Both sides
    have the same dtype, heads and D per K and V, and a unit stride on D (the caller checks:
    :func:`kvd.connectors.vllm_blocks.kernel_refusal`). Returns the launches issued (0 or 1).
    Callers that copy the same layers again keep :func:`prepare`'s result and call :func:`launch`."""
    if int(rows.shape[0]) == 0 or layers == 0:
        return 0
    return launch(rows, prepare(a, b, layers=layers), to_b=to_b)
