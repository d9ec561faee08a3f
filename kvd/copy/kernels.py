"""GPU kernels of the pool's data plane, in Triton: page moves over runs, and id translation.

* :func:`move_pages` copies runs of pages (``kvd.copy.runs.Runs``) between two ``[pages, page_bytes]``
  views. Pages are page-major and a view's rows are contiguous, so a run is one contiguous block
  in the source and one in the destination. Default ("flat" strategy): the runs are expanded on
  the device into a table of 8 KiB tiles (source offset, destination offset, valid words) and a
  1-D grid launches one program per tile, which copies it with 16-byte loads and stores: no loop,
  no per-run arithmetic, many small equal programs (on an H200, 0.91-0.97 of a contiguous
  device-to-device copy of the same bytes for 4 KiB - 2 MiB pages; bench/gpu.py). A run table
  on the CPU (what compaction passes) reaches the device without a sync: the host packs it into
  a reused pinned buffer (:mod:`kvd.copy.staging`), counts the tiles from the CPU lengths, and one
  asynchronous copy plus one table-building launch precede the move. The "tile"
  and "balanced" strategies (a ``(run piece, tile)`` grid, programs looping over tiles) are kept
  as alternatives; they measured 0.67-0.74.
* :func:`translate` gathers ``v2p[vids]`` (int32 page ids; ``-1`` for ids outside the table);
  :class:`TranslateTuning` selects ids per program, warps and cache hints (``_TRANSLATE``).

Both fall back to the torch implementation when the tensors are on the CPU (or, for moves,
on different devices, or in a layout the kernel does not cover), so callers need not care.
Triton is imported with this module when it is installed; kvd does not need it on CPU nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvd.errors import InvalidArgument
from kvd.copy.runs import Runs, copy_runs, expand
from kvd.copy.staging import staging_for

try:  # Triton ships with CUDA builds of torch; CPU nodes run without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["move_pages", "prepare_runs", "prepare_tiles", "TileTable", "translate", "TranslateTuning", "available"]

#: "tile"/"balanced": bytes one program copies per loop iteration (smaller pages use smaller tiles).
_TILE_BYTES = 32 * 1024
_MIN_TILE_BYTES = 4 * 1024
#: How runs become programs. "tile": runs are cut into pieces of at most one page or one tile,
#: whichever is larger, and every program copies one tile (many small, equal programs: no
#: wave-quantisation tail, no idle programs). "balanced": fewer, longer programs that loop over
#: tiles (runs cut to total / (_SPLIT_PER_SM * SMs) bytes, about _PROGRAMS_PER_SM programs per SM).
#: "flat" (the default): one program per tile of ``_FLAT_TILE_BYTES``, 1-D grid over a tile table
#: built on the device ((src, dst, valid) word offsets per tile): no loop and no per-run arithmetic.
_STRATEGY = "flat"
_FLAT_TILE_BYTES = 8 * 1024
_FLAT_WARPS = 8
_STREAM = True  # .cg loads / .cs stores: the moved bytes are not read again soon
_PROGRAMS_PER_SM = 32
_SPLIT_PER_SM = 4
#: At most this many pieces in a run table (bounds the table's size for huge moves).
_MAX_PIECES = 1 << 20
#: "flat" with the run table on the CPU (what compaction's copy_runs passes): the table goes to
#: the device through a reused pinned buffer (kvd.copy.staging) in one asynchronous copy, and one
#: Triton launch expands it to tiles; no device sync, no pageable copy. False: the older torch
#: expansion (a pageable copy, which waits for the stream, and about ten launches); benchmarks.
_STAGED_TABLE = True
#: Tiles per program of the table-building kernel.
_BUILD_BLOCK = 256


def available(device: torch.device | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: the current CUDA device)."""
    return triton is not None and torch.cuda.is_available() and (device is None or device.type == "cuda")


if triton is not None:

    @triton.jit
    def _move_runs_kernel(
        src_ptr,
        dst_ptr,
        run_src,
        run_dst,
        run_len,
        words_per_page,
        BLOCK: tl.constexpr,
        EVEN: tl.constexpr,
        STREAM: tl.constexpr,
    ):
        r = tl.program_id(0)
        slot = tl.program_id(1)
        slots = tl.num_programs(1)
        # int64 element offsets: arenas are far larger than 2^31 words.
        s = tl.load(run_src + r).to(tl.int64) * words_per_page
        d = tl.load(run_dst + r).to(tl.int64) * words_per_page
        n = tl.load(run_len + r).to(tl.int64) * words_per_page
        tiles = tl.cdiv(n, BLOCK)
        lane = tl.arange(0, BLOCK)
        t = slot.to(tl.int64)
        while t < tiles:
            off = t * BLOCK + lane
            if EVEN:
                if STREAM:
                    x = tl.load(src_ptr + s + off, cache_modifier=".cg")
                    tl.store(dst_ptr + d + off, x, cache_modifier=".cs")
                else:
                    x = tl.load(src_ptr + s + off)
                    tl.store(dst_ptr + d + off, x)
            else:
                m = off < n
                if STREAM:
                    x = tl.load(src_ptr + s + off, mask=m, cache_modifier=".cg")
                    tl.store(dst_ptr + d + off, x, mask=m, cache_modifier=".cs")
                else:
                    x = tl.load(src_ptr + s + off, mask=m)
                    tl.store(dst_ptr + d + off, x, mask=m)
            t += slots

    @triton.jit
    def _move_tiles_kernel(src_ptr, dst_ptr, table_ptr, BLOCK: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr):
        # One tile per program; row i of the table: src word offset, dst word offset, valid words.
        i = tl.program_id(0).to(tl.int64) * 4
        s = tl.multiple_of(tl.load(table_ptr + i), VEC)
        d = tl.multiple_of(tl.load(table_ptr + i + 1), VEC)
        lane = tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(src_ptr + s + lane)
            tl.store(dst_ptr + d + lane, x)
        else:
            valid = tl.multiple_of(tl.load(table_ptr + i + 2), VEC)
            m = lane < valid
            x = tl.load(src_ptr + s + lane, mask=m)
            tl.store(dst_ptr + d + lane, x, mask=m)

    @triton.jit(do_not_specialize=["n_runs", "total", "wpp", "block", "steps"])
    def _tile_rows_kernel(
        run_src, run_dst, run_len, run_first, table_ptr, n_runs, total, wpp, block, steps, BLOCK: tl.constexpr
    ):
        # Rows t of the tile table (see TileTable), BLOCK per program. run_* are int64 per-run
        # columns (pages, and run_first[r] = tiles of the runs before r: non-decreasing, 0 first).
        # Tile t belongs to the last run r with run_first[r] <= t, found by a binary search over
        # [lo, hi): run_first[lo] <= t < run_first[hi] (run_first[n_runs] would be total) holds
        # throughout, so lo < hi, every probe mid lies in [0, n_runs), and runs with no tiles
        # (equal run_first) are stepped over. steps >= ceil(log2(n_runs)) halvings end at hi = lo + 1.
        t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = t < total
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = lo + n_runs
        for _ in range(steps):
            mid = (lo + hi) >> 1
            go = tl.load(run_first + mid, mask=m, other=0) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        k = (t - tl.load(run_first + lo, mask=m, other=0)) * block  # word offset of the tile in its run
        rest = tl.load(run_len + lo, mask=m, other=0) * wpp - k
        row = table_ptr + t * 4
        tl.store(row, tl.load(run_src + lo, mask=m, other=0) * wpp + k, mask=m)
        tl.store(row + 1, tl.load(run_dst + lo, mask=m, other=0) * wpp + k, mask=m)
        tl.store(row + 2, tl.minimum(rest, block), mask=m)
        tl.store(row + 3, k * 0, mask=m)

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


_SM_COUNT: dict[int, int] = {}


def _sms(dev: torch.device) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _word_dtype(src: torch.Tensor, dst: torch.Tensor, page_bytes: int) -> torch.dtype:
    """Widest integer type that divides the page and both base addresses."""
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if page_bytes % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0:
            return dt
    return torch.uint8


def _rows_contiguous(v: torch.Tensor) -> bool:
    return v.dim() == 2 and v.dtype == torch.uint8 and (v.shape[0] <= 1 or v.stride(0) == v.shape[1]) and (
        v.shape[1] <= 1 or v.stride(1) == 1
    )


def _split(runs: Runs, max_pages: int) -> Runs:
    """Cut every run longer than ``max_pages`` into pieces of at most ``max_pages`` (vectorised)."""
    if int(runs.length.max()) <= max_pages:
        return runs
    pieces = (runs.length + max_pages - 1) // max_pages
    rep = torch.repeat_interleave(torch.arange(pieces.numel()), pieces)
    first = torch.cumsum(pieces, 0) - pieces
    k = torch.arange(rep.numel()) - first[rep]  # piece number inside its run
    off = k * max_pages
    length = torch.minimum(runs.length[rep] - off, torch.full_like(off, max_pages))
    return Runs(runs.src[rep] + off, runs.dst[rep] + off, length)


def _torch_move(src_view: torch.Tensor, dst_view: torch.Tensor, runs: Runs) -> None:
    """Device-agnostic fallback: one copy per run (cross-device) or one gather/scatter pair."""
    if src_view.device != dst_view.device:
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()):
            dst_view[d : d + n].copy_(src_view[s : s + n])
        return
    src, dst = expand(runs)
    dev = src_view.device
    dst_view.index_copy_(0, dst.to(dev), src_view.index_select(0, src.to(dev)))


def _tile(page_bytes: int, tile_bytes: int | None) -> int:
    return tile_bytes or min(_TILE_BYTES, max(_MIN_TILE_BYTES, page_bytes & -page_bytes))


def _geometry(src_view: torch.Tensor, dst_view: torch.Tensor, tile_bytes: int | None) -> tuple[torch.dtype, int, int, bool]:
    """Word type, word size, tile length in words (a power of two) and whether every run is a
    whole number of tiles (no mask)."""
    page_bytes = int(src_view.shape[1])
    dt = _word_dtype(src_view, dst_view, page_bytes)
    w = torch.empty(0, dtype=dt).element_size()
    block = max(1, _tile(page_bytes, tile_bytes) // w)
    block = 1 << (block.bit_length() - 1)  # tl.arange needs a power of two
    return dt, w, block, (page_bytes // w) % block == 0


@dataclass(frozen=True)
class TileTable:
    """Runs expanded to tiles for the "flat" strategy, on the device: row ``i`` of ``table``
    (int64 ``[tiles, 4]``) is (source word offset, destination word offset, valid words, 0)."""

    table: torch.Tensor
    page_bytes: int
    word_bytes: int
    block: int  # words per tile

    def __len__(self) -> int:
        return int(self.table.shape[0])


def _tile_table(runs: Runs, page_bytes: int, word_bytes: int, block: int, device: torch.device) -> TileTable:
    """Expand ``runs`` to one row per tile, on ``device``: staged (one pinned copy, one launch)
    when the table is on the CPU and the device is CUDA with Triton, else with torch ops."""
    if _STAGED_TABLE and triton is not None and device.type == "cuda" and all(t.device.type == "cpu" for t in runs):
        return _tile_table_staged(runs, page_bytes, word_bytes, block, device)
    return _tile_table_torch(runs, page_bytes, word_bytes, block, device)


def _tile_table_staged(runs: Runs, page_bytes: int, word_bytes: int, block: int, device: torch.device) -> TileTable:
    """The tile table of a CPU run table, built without a device sync.

    The host writes four int64 columns into a pinned staging buffer (``stride`` apart, even so
    that every column starts 16-byte aligned)::

        [ src pages | dst pages | lengths | first tile of each run ]   each `stride` long

    computes the total tile count from the lengths (one cumsum, on the host), ships the columns
    in one asynchronous copy on the current stream and expands them with one launch of
    ``_tile_rows_kernel`` into a ``[total, 4]`` table allocated from the known total."""
    n = len(runs)
    if n == 0:
        return TileTable(torch.empty(0, 4, dtype=torch.int64, device=device), page_bytes, word_bytes, block)
    wpp = page_bytes // word_bytes
    stride = n + (n & 1)
    staging = staging_for(device)
    with staging.lock:
        slot, host = staging.acquire(4 * stride)
        cols = host[: 4 * stride].view(4, stride)
        for i, t in enumerate(runs):
            cols[i, :n].copy_(t.reshape(-1))
        # Tiles per run; a negative length moves nothing (as copy_runs' slices on the CPU).
        tiles = (cols[2, :n].clamp(min=0) * wpp + (block - 1)) // block
        first = cols[3, :n]
        torch.cumsum(tiles, 0, out=first)
        total = int(first[-1])
        first -= tiles
        if total == 0:
            return TileTable(torch.empty(0, 4, dtype=torch.int64, device=device), page_bytes, word_bytes, block)
        dev_cols = staging.to_device(slot, 4 * stride).view(4, stride)
    table = torch.empty(total, 4, dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _tile_rows_kernel[(triton.cdiv(total, _BUILD_BLOCK),)](
            dev_cols[0], dev_cols[1], dev_cols[2], dev_cols[3], table,
            n, total, wpp, block, max(1, (n - 1).bit_length()),
            BLOCK=_BUILD_BLOCK, num_warps=4,
        )
    return TileTable(table, page_bytes, word_bytes, block)


def _tile_table_torch(runs: Runs, page_bytes: int, word_bytes: int, block: int, device: torch.device) -> TileTable:
    """Expand ``runs`` to one row per tile with torch ops. Tile counts come from the host copy
    of the lengths when ``runs`` is on the CPU (no sync); the expansion itself runs on ``device``."""
    wpp = page_bytes // word_bytes
    length_host = runs.length if runs.length.device.type == "cpu" else None
    small = torch.stack([t.to(torch.int64).reshape(-1) for t in runs]).to(device, non_blocking=True)
    src, dst, length = small[0], small[1], small[2]
    tiles = (length * wpp + block - 1) // block
    if length_host is not None:
        total = int(((length_host.to(torch.int64) * wpp + block - 1) // block).sum())
    else:
        total = int(tiles.sum())
    if total == 0:
        return TileTable(torch.empty(0, 4, dtype=torch.int64, device=device), page_bytes, word_bytes, block)
    rep = torch.repeat_interleave(torch.arange(tiles.numel(), device=device), tiles, output_size=total)
    first = torch.cumsum(tiles, 0) - tiles
    k = torch.arange(total, device=device) - first[rep]
    table = torch.empty(total, 4, dtype=torch.int64, device=device)
    table[:, 0] = src[rep] * wpp + k * block
    table[:, 1] = dst[rep] * wpp + k * block
    table[:, 2] = torch.clamp(length[rep] * wpp - k * block, max=block)
    table[:, 3] = 0
    return TileTable(table, page_bytes, word_bytes, block)


def _flat_geometry(
    src_view: torch.Tensor, dst_view: torch.Tensor, tile_bytes: int | None
) -> tuple[torch.dtype, int, int, bool, int]:
    page_bytes = int(src_view.shape[1])
    dt = _word_dtype(src_view, dst_view, page_bytes)
    w = torch.empty(0, dtype=dt).element_size()
    block = max(1, (tile_bytes or _FLAT_TILE_BYTES) // w)
    block = 1 << (block.bit_length() - 1)
    wpp = page_bytes // w
    vec = 16 // w if w < 16 and wpp % (16 // w) == 0 and block % (16 // w) == 0 else 1
    return dt, w, block, wpp % block == 0, vec


def prepare_runs(
    runs: Runs, page_bytes: int, device: torch.device, *, tile_bytes: int | None = None, strategy: str | None = None
) -> Runs:
    """The run table as :func:`move_pages` launches it: runs cut into pieces (see ``_STRATEGY``),
    int64, on ``device``. Pass the result to :func:`move_pages` (with the same ``tile_bytes`` and
    ``strategy``) to reuse it: no host work and no transfer per call."""
    strategy = strategy or _STRATEGY
    if strategy == "flat":
        raise InvalidArgument("prepare_runs: the flat strategy needs the views; use prepare_tiles(src_view, dst_view, runs)")
    src, dst, length = (t.to(torch.int64).cpu() for t in runs)
    pages = int(length.sum())
    if strategy == "tile":
        cap = max(1, _tile(page_bytes, tile_bytes) // max(1, page_bytes), -(-pages // _MAX_PIECES))
    elif strategy == "balanced":
        cap = max(1, math.ceil(pages / (_SPLIT_PER_SM * _sms(device))))
    else:
        raise InvalidArgument(f"move_pages: unknown strategy {strategy!r}; use 'tile', 'balanced' or 'flat'")
    r = _split(Runs(src, dst, length), cap)
    table = torch.stack([r.src, r.dst, r.length]).to(device, non_blocking=True)
    return Runs(table[0], table[1], table[2])


def prepare_tiles(
    src_view: torch.Tensor, dst_view: torch.Tensor, runs: Runs, *, tile_bytes: int | None = None
) -> TileTable:
    """The tile table of the "flat" strategy for these views (pass it to :func:`move_pages`)."""
    _, w, block, _, _ = _flat_geometry(src_view, dst_view, tile_bytes)
    return _tile_table(runs, int(src_view.shape[1]), w, block, src_view.device)


def move_pages(
    src_view: torch.Tensor,
    dst_view: torch.Tensor,
    runs: Runs | TileTable,
    *,
    tile_bytes: int | None = None,
    strategy: str | None = None,
    stream: bool | None = None,
    num_warps: int | None = None,
) -> None:
    """Copy page runs ``src_view[s:s+n] -> dst_view[d:d+n]`` for every run ``(s, d, n)``.

    ``src_view`` and ``dst_view`` are ``uint8 [pages, page_bytes]`` views (they may be the same
    view; source and destination pages must not overlap, as for :func:`kvd.copy.runs.copy_runs`).
    On one CUDA device this is one Triton launch, plus a small host-to-device copy of the run
    table when ``runs`` is on the CPU (runs already on the device, e.g. from
    :func:`prepare_runs`, are launched as they are); otherwise it falls back to torch.
    ``tile_bytes``, ``strategy``, ``stream`` and ``num_warps`` are tuning knobs (benchmarks)."""
    if len(runs) == 0:
        return
    if src_view.dim() != 2 or dst_view.dim() != 2 or src_view.shape[1] != dst_view.shape[1]:
        raise InvalidArgument(
            f"move_pages: views must be [pages, page_bytes] with equal page sizes, got {tuple(src_view.shape)} "
            f"and {tuple(dst_view.shape)}; page sizes differ or a view is not 2-D"
        )
    dev = src_view.device
    fast = (
        triton is not None
        and src_view.is_cuda
        and dst_view.is_cuda
        and dst_view.device == dev
        and _rows_contiguous(src_view)
        and _rows_contiguous(dst_view)
    )
    if isinstance(runs, TileTable):
        if not fast:
            raise InvalidArgument("move_pages: a TileTable runs only on two row-contiguous views of one CUDA device")
        _launch_flat(src_view, dst_view, runs, num_warps)
        return
    if not src_view.is_cuda and not dst_view.is_cuda:
        copy_runs(src_view, dst_view, runs)  # the CPU implementation
        return
    if not fast:
        _torch_move(src_view, dst_view, Runs(*(t.cpu() for t in runs)))
        return
    page_bytes = int(src_view.shape[1])
    if page_bytes == 0:
        return
    strategy = strategy or _STRATEGY
    if strategy == "flat":
        _launch_flat(src_view, dst_view, prepare_tiles(src_view, dst_view, runs, tile_bytes=tile_bytes), num_warps)
        return
    dt, w, block, even = _geometry(src_view, dst_view, tile_bytes)
    if runs.src.device != dev:
        runs = prepare_runs(runs, page_bytes, dev, tile_bytes=tile_bytes, strategy=strategy)
    r = runs.src.numel()
    max_len = int(runs.length.max())  # one sync when the table lives on the device
    max_tiles = math.ceil(max_len * page_bytes / (block * w))
    if strategy == "tile":
        slots = max_tiles  # one tile per program (pieces are at most max(page, tile) bytes)
    else:
        slots = max(1, min(max_tiles, math.ceil(_PROGRAMS_PER_SM * _sms(dev) / r)))
    slots = min(slots, 65535)  # grid limit; programs loop over the remaining tiles
    if r > 2**31 - 1:
        raise InvalidArgument(f"move_pages: {r} runs exceed the launch grid; pass fewer runs per call")
    src_w = src_view.reshape(-1).view(dt)
    dst_w = dst_view.reshape(-1).view(dt)
    with torch.cuda.device(dev):
        _move_runs_kernel[(r, slots)](
            src_w, dst_w, runs.src, runs.dst, runs.length, page_bytes // w,
            BLOCK=block, EVEN=even, STREAM=_STREAM if stream is None else stream,
            num_warps=num_warps or (8 if block * w >= 16 * 1024 else 4),
        )


def _launch_flat(src_view: torch.Tensor, dst_view: torch.Tensor, tiles: TileTable, num_warps: int | None) -> None:
    page_bytes = int(src_view.shape[1])
    dt, w, _, _, _ = _flat_geometry(src_view, dst_view, tiles.block * tiles.word_bytes)
    if page_bytes != tiles.page_bytes or w != tiles.word_bytes:
        raise InvalidArgument(
            f"move_pages: the tile table was built for {tiles.page_bytes}-byte pages in {tiles.word_bytes}-byte words, "
            f"not {page_bytes}-byte pages in {w}-byte words; build it with prepare_tiles for these views"
        )
    if len(tiles) == 0:
        return
    wpp, block = page_bytes // w, tiles.block
    vec = 16 // w if w < 16 and wpp % (16 // w) == 0 and block % (16 // w) == 0 else 1
    with torch.cuda.device(src_view.device):
        _move_tiles_kernel[(len(tiles),)](
            src_view.reshape(-1).view(dt), dst_view.reshape(-1).view(dt), tiles.table,
            BLOCK=block, EVEN=wpp % block == 0, VEC=vec,
            num_warps=num_warps or (_FLAT_WARPS if block * w >= 8192 else 4),
        )


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
