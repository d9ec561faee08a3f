"""Id translation on the GPU, in Triton: :func:`translate` gathers ``v2p[vids]`` (int32 page
ids; ``-1`` for ids outside the table); :class:`TranslateTuning` selects ids per program, warps
and cache hints (``_TRANSLATE``). On the CPU (or without Triton) it is one ``index_select``.
Triton is imported with this module when it is installed; kvd does not need it on CPU nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvd.errors import InvalidArgument

try:  # Triton ships with CUDA builds of torch; CPU nodes run without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["translate", "TranslateTuning", "TRANSLATE_VARIANTS"]


if triton is not None:

    @triton.jit
    def _translate_kernel(
        v2p_ptr, vids_ptr, out_ptr, n, table_n,
        BLOCK: tl.constexpr, EVEN: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
    ):
        # EVEN: n % BLOCK == 0, no bounds mask on the ids and the output. STREAM: the ids and the
        # output are touched once (evict_first load, .cs store). KEEP: table entries are kept in
        # L2 (evict_last) across calls. Out-of-table ids read nothing and give -1 in every case.
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        if EVEN:
            if STREAM:
                v = tl.load(vids_ptr + off, eviction_policy="evict_first")
            else:
                v = tl.load(vids_ptr + off)
        else:
            if STREAM:
                v = tl.load(vids_ptr + off, mask=m, other=0, eviction_policy="evict_first")
            else:
                v = tl.load(vids_ptr + off, mask=m, other=0)
        v = v.to(tl.int64)
        ok = m & (v >= 0) & (v < table_n)
        if KEEP:
            p = tl.load(v2p_ptr + v, mask=ok, other=-1, eviction_policy="evict_last")
        else:
            p = tl.load(v2p_ptr + v, mask=ok, other=-1)
        p = p.to(tl.int32)
        if EVEN:
            if STREAM:
                tl.store(out_ptr + off, p, cache_modifier=".cs")
            else:
                tl.store(out_ptr + off, p)
        else:
            if STREAM:
                tl.store(out_ptr + off, p, mask=m, cache_modifier=".cs")
            else:
                tl.store(out_ptr + off, p, mask=m)


class TranslateTuning(NamedTuple):
    """How :func:`translate` launches its gather. Every setting gives the same result."""

    block: int = 2048  # ids per program (a power of two): more ids in flight per thread
    num_warps: int = 4
    even: bool = False  # no bounds mask on ids and output when the id count is a multiple of block
    stream: bool = False  # ids loaded evict_first, output stored .cs: both are touched once
    keep: bool = False  # table entries loaded evict_last: the table stays in L2 between calls


#: The tuning :func:`translate` uses by default. On an H200 (bench/gpu.py, 2026-11-29) streaming
#: the ids and the output (touched once) beat the plain gather by 1.23x for request-ordered ids
#: (0.79 of the copy ceiling against 0.64) and matched it for random ids; keeping the table in L2
#: or other block sizes gained nothing more.
_TRANSLATE = TranslateTuning(even=True, stream=True)
#: Variants bench/gpu.py times side by side (and the GPU tests check), by label.
TRANSLATE_VARIANTS: dict[str, TranslateTuning] = {
    "default 2048/4w": _TRANSLATE,
    "plain 2048/4w": TranslateTuning(),
    "even 2048/4w": TranslateTuning(even=True),
    "keep 2048/4w": TranslateTuning(even=True, keep=True),
    "stream+keep 2048/4w": TranslateTuning(even=True, stream=True, keep=True),
    "stream+keep 4096/4w": TranslateTuning(4096, 4, True, True, True),
    "stream+keep 4096/8w": TranslateTuning(4096, 8, True, True, True),
    "stream+keep 8192/8w": TranslateTuning(8192, 8, True, True, True),
    "stream+keep 1024/4w": TranslateTuning(1024, 4, True, True, True),
}


def translate(
    v2p: torch.Tensor,
    vids: torch.Tensor,
    *,
    check: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
    tuning: TranslateTuning | None = None,
) -> torch.Tensor:
    """``v2p[vids]`` as a new int32 tensor (one gather on the GPU, ``index_select`` on the CPU).

    ``v2p`` is a 1-D int32 table (``-1`` = unbound); ``vids`` any integer tensor of ids. Ids outside
    ``[0, len(v2p))`` give ``-1`` on the GPU; with ``check=True`` (one device sync) they are
    refused with :class:`~kvd.errors.InvalidArgument` on either device, as the pool refuses them.
    ``tuning`` (default ``_TRANSLATE``) and ``block`` (ids per program, a power of two) /
    ``num_warps`` overriding it are tuning knobs (benchmarks)."""
    if v2p.dim() != 1:
        raise InvalidArgument(f"translate: v2p must be 1-D, got shape {tuple(v2p.shape)}")
    if vids.dtype.is_floating_point or vids.dtype == torch.bool:
        raise InvalidArgument(f"translate: ids must be integers, got {vids.dtype}")
    flat = vids.reshape(-1)
    n, table_n = flat.numel(), v2p.numel()
    if check and n and (int(flat.min()) < 0 or int(flat.max()) >= table_n):
        raise InvalidArgument(f"translate: virtual ids must lie in [0, {table_n})")
    if not v2p.is_cuda or triton is None:
        if not check and n and (int(flat.min()) < 0 or int(flat.max()) >= table_n):
            flat = flat.to(torch.int64)
            ok = (flat >= 0) & (flat < table_n)
            out = torch.full((n,), -1, dtype=torch.int32, device=v2p.device)
            out[ok.to(v2p.device)] = v2p.index_select(0, flat[ok].to(v2p.device)).to(torch.int32)
            return out.view(vids.shape)
        return v2p.index_select(0, flat.to(device=v2p.device, dtype=torch.int64)).to(torch.int32).view(vids.shape)
    dev = v2p.device
    flat = flat.to(dev)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    table = v2p if v2p.is_contiguous() else v2p.contiguous()
    out = torch.empty(n, dtype=torch.int32, device=dev)
    if n:
        tu = tuning or _TRANSLATE
        block, num_warps = block or tu.block, num_warps or tu.num_warps
        if block <= 0 or block & (block - 1):
            raise InvalidArgument(f"translate: block must be a power of two, got {block}")
        with torch.cuda.device(dev):
            _translate_kernel[(triton.cdiv(n, block),)](
                table, flat, out, n, table_n,
                BLOCK=block, EVEN=tu.even and n % block == 0, STREAM=tu.stream, KEEP=tu.keep, num_warps=num_warps,
            )
    return out.view(vids.shape)
