"""vLLM's KV blocks <-> kvd's pages, on the CPU and on CUDA: the layouts vLLM's attention backends
allocate, their detection from a registered tensor, and the copies (no vLLM import: a GPU host
without vLLM imports this module, and so do kvd's tests and bench).

**vLLM 0.32** (the pinned release) gives every attention layer one logical view ``[B, H, N, C]``
(blocks, KV heads, tokens in a block, K|V fused: ``C = head_size + head_size_v``, in the KV dtype);
the backends differ only in the *physical* order, one ``KVCacheLayout`` for the whole model
(``vllm/v1/kv_cache_layout.py``, ``VLLM_KV_CACHE_LAYOUT``; resolved once from the backends'
``supported_kv_cache_layouts``; ``kv_cache_interface.compute_layout_strides`` /
``create_kv_cache_views``: a raw int8 buffer, ``as_strided`` to ``[L, B, H, N, C]`` with the order's
strides, a layer's view ``view_5d[l].view(dtype)``). FLASH_ATTN, TRITON_ATTN and FlashInfer off
Blackwell declare no preference, so vLLM's default ``LBNHC`` (``NHD``: tokens before heads) is what
they get; CPU_ATTN and FlashInfer on Blackwell (trtllm-gen) take ``LBHNC`` (``HND``); the
block-outer orders (``BLHNC``, ``BLNHC``, ``BHLNC``: one block holds every layer) and ``LHBNC``
are what ``VLLM_KV_CACHE_LAYOUT`` or mixed page sizes select. A backend that splits a manager block
into kernel blocks shows ``N`` = the kernel block size and ``B`` = blocks x ratio.

**Before the unified layout** (vLLM <= 0.1x, kept because operators still run them):
FLASH_ATTN ``[2, B, N, H, D]``, FlashInfer ``[B, 2, N, H, D]`` in NHD order or the same logical
shape with HND strides (heads before tokens: ``get_kv_cache_stride_order``).

Every layout is reduced to two strided views ``k``, ``v`` of ``[blocks, block_size, heads, D]``
(:class:`LayerBlocks`), so one pair of index expressions copies all of them. On CUDA the copies
run on a stream the caller owns (:class:`CopyStream`), after it waited for the current stream, with
the index tensors built on the CPU from Python lists and moved in one non-blocking copy from pinned
memory: nothing in a copy waits for the device.

**Two paths, the same bytes.** On CUDA with Triton a copy is one launch of
:func:`kvd.connectors.vllm_kernels.copy_rows` over the request's *rows* (runs of tokens that stay
in one vLLM (kernel) block and one kvd page: ``(block, offset, page, offset, tokens)``, built on the
CPU with the token slots and shipped in the same pinned copy), all heads and K and V of a layer;
:func:`load_layers` / :func:`save_layers` take every layer of a kvd group in that one launch when
the layers' tensors lie a uniform stride apart on both sides (vLLM 0.32 allocates a group's layers
as ``view_5d[l]`` of one buffer: they do; the legacy layouts' one buffer per layer mostly do not,
then one launch per layer). Elsewhere (the CPU, no Triton, mixed dtypes, a non-unit inner stride)
the torch path: two gathers and two ``index_put`` per layer through per-token index tensors.
:func:`kernel_refusal` says which applies and why; :data:`LAUNCHES` counts what was issued.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvd.client.views import LayerKV
from kvd.connectors import vllm_kernels as vk
from kvd.errors import InvalidArgument

__all__ = [
    "LAYOUTS",
    "ALIASES",
    "KVLayout",
    "LayerBlocks",
    "Slots",
    "DeviceSlots",
    "Whole",
    "CopyStream",
    "detect_layout",
    "layout_named",
    "token_slots",
    "save_layer",
    "load_layer",
    "save_layers",
    "load_layers",
    "kernel_refusal",
    "layer_stride",
    "token_rows",
    "LAUNCHES",
    "HOST_S",
    "state_bytes",
]

#: What the copies issued, for benches and tests: ``"triton"`` kernel launches, ``"torch"`` index
#: ops (four per layer), ``"layers"`` layers copied. Diagnostics only; reset it at will.
LAUNCHES: Counter[str] = Counter()
#: The host's seconds in the copies' pieces, for benches: ``"slots"`` (:func:`token_slots`),
#: ``"rows"`` (kernel blocks and rows, :meth:`CopyStream.slots`), ``"staging"`` (the pinned
#: buffer and the one copy to the device), ``"launch"`` (the copy calls: plan look-up and launches
#: or torch ops). Diagnostics only; reset it at will.
HOST_S: defaultdict[str, float] = defaultdict(float)


class KVLayout(NamedTuple):
    """One physical KV layout: ``name`` (vLLM's ``KVCacheLayout`` name, or ``*_LEGACY`` for the
    5-D layouts before it), what it looks like, and whether K|V are fused on the last dim."""

    name: str
    describe: str
    unified: bool  # vLLM 0.32's [B, H, N, Dk+Dv]; else a legacy 5-D [.., 2, ..] layout


LAYOUTS: dict[str, KVLayout] = {lay.name: lay for lay in (
    KVLayout("LBHNC", "vLLM 0.32 [B, H, N, K|V], per layer, heads before tokens (CPU_ATTN; HND)", True),
    KVLayout("LBNHC", "vLLM 0.32 [B, H, N, K|V] stored [B, N, H, K|V], per layer (the default: FLASH_ATTN, "
             "TRITON_ATTN, FLASHINFER; NHD)", True),
    KVLayout("LHBNC", "vLLM 0.32 [B, H, N, K|V] stored [H, B, N, K|V], per layer", True),
    KVLayout("BLHNC", "vLLM 0.32 [B, H, N, K|V], block-outer (a block holds every layer), heads before tokens", True),
    KVLayout("BLNHC", "vLLM 0.32 [B, H, N, K|V], block-outer, tokens before heads", True),
    KVLayout("BHLNC", "vLLM 0.32 [B, H, N, K|V], block-outer, heads before layers", True),
    KVLayout("FLASH_ATTN_LEGACY", "vLLM <= 0.1x FLASH_ATTN [2, B, N, H, D]", False),
    KVLayout("FLASHINFER_NHD_LEGACY", "vLLM <= 0.1x FLASHINFER [B, 2, N, H, D], NHD", False),
    KVLayout("FLASHINFER_HND_LEGACY", "vLLM <= 0.1x FLASHINFER [B, 2, N, H, D] stored [B, 2, H, N, D], HND", False),
)}

#: vLLM's own aliases (``VLLM_KV_CACHE_LAYOUT=NHD|HND``) and the backend names whose 0.32 layout is fixed
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC", "CPU_ATTN": "LBHNC"}


def layout_named(name: str) -> KVLayout:
    """The layout called ``name`` (a ``KVCacheLayout`` name, an alias in :data:`ALIASES`, or a legacy
    name); InvalidArgument naming the known ones otherwise."""
    got = LAYOUTS.get(ALIASES.get(name.upper(), name.upper()))
    if got is None:
        raise InvalidArgument(f"KV cache layout {name[:64]!r} is not one kvd's vLLM connector copies; "
                              f"known: {sorted(LAYOUTS)} (aliases {sorted(ALIASES)})")
    return got


def _refuse(t: torch.Tensor, want: str, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"a vLLM KV tensor of shape {tuple(t.shape)} strides {tuple(t.stride())} ({t.dtype}) is no layout kvd knows "
        f"for this model ({want}): {why}; known: {', '.join(f'{k} = {v.describe}' for k, v in LAYOUTS.items())}"
    )


def _unified_names(t: torch.Tensor) -> list[str]:
    """The 0.32 ``KVCacheLayout`` orders whose strides a ``[B, H, N, C]`` view has (several where
    extent-1 dims leave the order open: the same bytes either way)."""
    (b, h, n, c), (sb, sh, sn, sc) = t.shape, t.stride()
    if sc != 1 and c > 1:
        return []
    dims = {"B": (b, sb), "H": (h, sh), "N": (n, sn)}
    out: list[str] = []
    for order in ("BNH", "BHN", "HBN"):
        dense: dict[str, bool] = {}
        inner = c
        for d in reversed(order):  # innermost first: each stride at least the extent inside it
            e, st = dims[d]
            if e == 1:
                dense[d] = True
                continue
            if st < inner:
                break
            dense[d] = st == inner
            inner = st * e
        else:
            if order == "BNH" and dense["H"] and dense["N"]:
                out.append("LBNHC" if dense["B"] else "BLNHC")
            elif order == "BHN" and dense["N"]:
                out.append(("LBHNC" if dense["B"] else "BLHNC") if dense["H"] else "BHLNC")
            elif order == "HBN" and dense["N"] and dense["B"]:
                out.append("LHBNC")
    return out


def _legacy_name(t: torch.Tensor) -> str | None:
    s = t.stride()
    if t.shape[0] == 2 and s[0] == max(s):
        return "FLASH_ATTN_LEGACY" if s[2] > s[3] >= s[4] == 1 else None
    if t.shape[1] == 2 and s[0] == max(s) and s[4] == 1:
        if s[2] > s[3]:
            return "FLASHINFER_NHD_LEGACY"
        if s[3] > s[2]:
            return "FLASHINFER_HND_LEGACY"
    return None


@dataclass(frozen=True)
class LayerBlocks:
    """One vLLM layer's KV as ``k``, ``v`` views ``[blocks, tokens, heads, D]`` over vLLM's own
    tensor (no copy), in ``layout``. ``ratio``: kernel blocks per vLLM block (1 unless the backend
    splits blocks; then ``k`` has ``ratio`` x the blocks of ``block_size / ratio`` tokens)."""

    layout: KVLayout
    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    ratio: int

    @property
    def device(self) -> torch.device:
        return self.k.device


def detect_layout(t: torch.Tensor, *, num_kv_heads: int, block_size: int, head_size: int, head_size_v: int | None = None,
                  expect: str | None = None) -> LayerBlocks:
    """``t`` (one attention layer's registered KV tensor) as :class:`LayerBlocks`, its layout told
    from its shape and strides (``expect``: the layout vLLM says it resolved, e.g. its
    ``cache_config.kv_cache_layout``; then a tensor in another one is refused). InvalidArgument
    naming the shape and strides seen and the layouts known for anything else."""
    dv = head_size_v or head_size
    want = f"{num_kv_heads} kv heads, {block_size}-token blocks, head size {head_size}/{dv}"
    if t.dim() == 4:
        b, h, n, c = t.shape
        if h != num_kv_heads or c != head_size + dv or n < 1 or block_size % n:
            raise _refuse(t, want, f"a 4-D vLLM 0.32 view must be [blocks, {num_kv_heads}, {block_size} (or a kernel block "
                                   f"size dividing it), {head_size + dv}]")
        names = _unified_names(t)
        if not names:
            raise _refuse(t, want, "its strides match no KVCacheLayout order")
        told = ALIASES.get(expect.upper(), expect.upper()) if expect else None
        name = told if told in names else names[0]
        kt = t.transpose(1, 2)  # [B, N, H, C]
        k, v = kt[..., :head_size], kt[..., head_size:]
        ratio = block_size // n
    elif t.dim() == 5:
        if head_size != dv:
            raise _refuse(t, want, "the 5-D legacy layouts have one head size for K and V")
        legacy = _legacy_name(t)
        if legacy is None or tuple(t.shape[2:]) != (block_size, num_kv_heads, head_size):
            raise _refuse(t, want, f"a 5-D legacy layout is [2, B, {block_size}, {num_kv_heads}, {head_size}] "
                                   f"or [B, 2, {block_size}, {num_kv_heads}, {head_size}]")
        name = legacy
        k, v = (t[0], t[1]) if name == "FLASH_ATTN_LEGACY" else (t[:, 0], t[:, 1])
        ratio = 1
    else:
        raise _refuse(t, want, f"{t.dim()} dims")
    lay = LAYOUTS[name]
    if expect is not None:
        if layout_named(expect).name != name:
            raise _refuse(t, want, f"vLLM resolved {layout_named(expect).name}, these strides are {name}")
    return LayerBlocks(lay, k, v, block_size, ratio)


def state_bytes(t: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of a Mamba state layer's ``block`` (a whole-slot copy), as a uint8 view of ``t``."""
    row = t[block]
    if not row.is_contiguous():
        raise InvalidArgument(f"a vLLM state tensor {tuple(t.shape)} strides {tuple(t.stride())}: a block's state is not "
                              "contiguous; kvd copies a state slot as one run of bytes")
    return row.reshape(-1).view(torch.uint8)


class Slots(NamedTuple):
    """vLLM block, in-block offset and kvd page of each token copied (CPU int64 tensors)."""

    block: torch.Tensor
    offset: torch.Tensor
    page: torch.Tensor


def token_slots(block_ids: Sequence[int], start: int, end: int, block_size: int, pages: Sequence[int], first: int = 0,
                *, what: str = "") -> Slots:
    """Slots of tokens ``[start, end)`` that vLLM keeps: request block ``j`` is vLLM block
    ``block_ids[j]`` and kvd page ``pages[j - first]``; tokens in vLLM's null block 0 (blocks a
    sliding window dropped) are skipped. RuntimeError (naming ``what``) when the lists are too
    short. CPU work only, from Python lists (in numpy: a handful of array ops, no per-token
    Python and no small torch ops, which cost more than the arithmetic here)."""
    t0 = time.perf_counter()
    t = np.arange(start, end, dtype=np.int64)
    j = t // block_size
    if len(t) and int(j[-1]) >= len(block_ids):  # j is ascending
        raise RuntimeError(f"{what}: tokens up to {end} but vLLM gave {len(block_ids)} blocks")
    blk = np.asarray(block_ids, dtype=np.int64)[j]
    keep = blk != 0
    if not keep.all():
        t, j, blk = t[keep], j[keep], blk[keep]
    k = j - first
    if len(k) and (int(k[0]) < 0 or int(k[-1]) >= len(pages)):
        raise RuntimeError(f"{what}: vLLM keeps request blocks {sorted(set(j.tolist()))}, kvd holds pages for "
                           f"[{first}, {first + len(pages)})")
    page = np.asarray(pages, dtype=np.int64)[k] if len(k) else np.empty(0, dtype=np.int64)
    HOST_S["slots"] += time.perf_counter() - t0
    return Slots(torch.from_numpy(blk), torch.from_numpy(t % block_size), torch.from_numpy(page))


def _rows(block: np.ndarray, boff: np.ndarray, page: np.ndarray, poff: np.ndarray) -> np.ndarray:
    """:func:`token_rows` on int64 numpy columns: ``[R, 5]``."""
    n = len(page)
    cut = np.ones(n, dtype=bool)
    cut[1:] = (block[1:] != block[:-1]) | (page[1:] != page[:-1]) | (boff[1:] != boff[:-1] + 1) | (poff[1:] != poff[:-1] + 1)
    first = np.flatnonzero(cut)
    out = np.empty((len(first), vk.ROW_COLS), dtype=np.int64)
    for c, col in enumerate((block, boff, page, poff)):
        out[:, c] = col[first]
    out[:, 4] = np.diff(first, append=n)
    return out


def token_rows(block: torch.Tensor, boff: torch.Tensor, page: torch.Tensor, poff: torch.Tensor) -> torch.Tensor:
    """The rows of per-token slots (CPU int64 ``[R, 5]``: vLLM block, its first token, kvd page,
    its first token, tokens): a row is a run of consecutive tokens that stay in one block and one
    page with consecutive offsets on both sides. CPU work only."""
    return torch.from_numpy(_rows(*(np.asarray(c, dtype=np.int64) for c in (block, boff, page, poff))))


class Whole(NamedTuple):
    """The torch path's shortcut (:meth:`CopyStream.slots` on the CPU): the runs that fill a whole
    kernel block and a whole page, copied block for page (two index ops a tensor, whatever their
    number), and the other tokens, copied token by token."""

    blocks: torch.Tensor  # vLLM kernel block of each whole run
    pages: torch.Tensor  # ... and its kvd page
    rest: DeviceSlots  # the tokens of the other runs (no rows, no shortcut)
    #: the whole runs as (first block, first page, count) of consecutive blocks on consecutive
    #: pages, where there are at most :data:`_SPANS` of them: a slice copy each (a memcpy), not a
    #: gather and a scatter through a temporary; None: more (scattered blocks), the index ops
    spans: tuple[tuple[int, int, int], ...] | None


def _whole(rows: np.ndarray, n: int, cols: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> Whole | None:
    """:class:`Whole` of ``rows`` (:func:`_rows`) for kernel blocks of ``n`` tokens: the runs of
    ``n`` tokens from offset 0 on both sides, and the per-token ``cols`` of the others; None when
    no run is whole (the shortcut would only add work)."""
    full = (rows[:, 1] == 0) & (rows[:, 3] == 0) & (rows[:, 4] == n)
    if not full.any():
        return None
    rest = np.flatnonzero(~np.repeat(full, rows[:, 4]))
    idx = torch.from_numpy(rest)
    b, bo, pg, po = cols
    part = DeviceSlots(b[idx], bo[idx], pg[idx], po[idx])
    blk, page = rows[full, 0].copy(), rows[full, 2].copy()
    cut = np.flatnonzero((np.diff(blk) != 1) | (np.diff(page) != 1)) + 1  # where a span of consecutive blocks and pages ends
    spans = None
    if len(cut) < _SPANS:
        starts = np.concatenate(([0], cut))
        counts = np.diff(np.append(starts, len(blk)))
        spans = tuple(zip(blk[starts].tolist(), page[starts].tolist(), counts.tolist()))
    return Whole(torch.from_numpy(blk), torch.from_numpy(page), part, spans)


#: The most spans of whole runs copied as slices (:class:`Whole`): past it, two index ops cost less
#: than that many small copies.
_SPANS = 8


class DeviceSlots(NamedTuple):
    """:class:`Slots` where the copy runs: vLLM (kernel) block and offset, kvd page and offset of
    each token (the torch path), ``rows`` (:func:`token_rows`: the kernel's table; None when
    built without it) and ``whole`` (:class:`Whole`: the torch path's block-for-page runs, where
    pages are as long as kernel blocks; None when not worked out)."""

    block: torch.Tensor
    boff: torch.Tensor
    page: torch.Tensor
    poff: torch.Tensor
    rows: torch.Tensor | None = None
    whole: Whole | None = None

    @property
    def tokens(self) -> int:
        """Tokens copied (not ``len``: a NamedTuple's own ``_make`` and ``_replace`` need that to
        count its fields)."""
        return int(self.page.shape[0])


#: Pinned staging buffers one CopyStream keeps (a step's requests each take one while its copy is queued).
_STAGE_MAX = 16


class CopyStream:
    """Where the copies of one connector run: on the CPU, in line; on a CUDA device, on a stream of
    its own. ``with cs.after_current():`` makes the stream wait for the device's current stream
    (vLLM's forward) and makes it current for the block; :meth:`record` an event after the copies
    (None on the CPU); :meth:`slots` moves index tensors there without waiting."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Pinned staging buffers, each with the event after its last copy out (None: never used):
        # reused once that event is done, which saves the host allocator's work per call.
        self._stage: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._age: list[int] = []  # the call count at each buffer's last use: the oldest is waited for
        self._calls = 0
        self._turn = 0

    @contextlib.contextmanager
    def after_current(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def _staging(self, n: int) -> torch.Tensor:
        """A pinned int64 buffer of at least ``n`` elements that no queued copy still reads: a free
        one of the pool (its last copy out done: an event query, no wait), else a new one. The copy
        stream runs behind vLLM's forward, so waiting for a buffer would hold the host back with it:
        only at :data:`_STAGE_MAX` buffers all busy does it wait, for the oldest copy."""
        slot = None  # the buffer to replace
        for i, (buf, ev) in enumerate(self._stage):
            if ev is None or ev.query():
                if buf.numel() >= n:
                    self._turn = i
                    return buf
                slot = i if slot is None else slot  # free but too small
        if slot is None and len(self._stage) >= _STAGE_MAX:
            slot = min(range(len(self._stage)), key=self._age.__getitem__)
            ev = self._stage[slot][1]
            if ev is not None:
                ev.synchronize()  # that buffer's last copy out only, never the device
        buf = torch.empty(1 << (max(n, 1024) - 1).bit_length(), dtype=torch.long, pin_memory=True)
        if slot is None:
            self._stage.append((buf, None))
            self._age.append(0)
            slot = len(self._stage) - 1
        else:
            self._stage[slot] = (buf, None)
        self._turn = slot
        return buf

    def slots(self, s: Slots, blocks: LayerBlocks | None = None) -> DeviceSlots:
        """``s`` on this device for the layers shaped like ``blocks``: where it splits each vLLM
        block into ``ratio`` kernel blocks of ``N = block_size / ratio`` tokens, token ``o`` of block
        ``b`` is kernel block ``b * ratio + o // N``, offset ``o % N``. On a CUDA device the
        per-token columns and the rows (:func:`token_rows`) travel in one buffer: call inside
        :meth:`after_current`: the one copy from pinned memory is ordered on this stream and waits
        for nothing (unless :data:`_STAGE_MAX` staging buffers are all still being copied out). On
        the CPU they stay where they are, with the torch path's :class:`Whole` runs worked out."""
        t0 = time.perf_counter()
        blk, off, page = (np.asarray(c, dtype=np.int64) for c in s)
        if blocks is not None and blocks.ratio != 1:
            n = blocks.block_size // blocks.ratio
            blk, boff = blk * blocks.ratio + off // n, off % n
        else:
            boff = off
        rows = _rows(blk, boff, page, off)
        t = len(page)
        size = 4 * t + rows.size
        t1 = time.perf_counter()
        HOST_S["rows"] += t1 - t0
        if self.stream is None:  # in place on the CPU: the columns as they are, nothing to pack
            cols = (torch.from_numpy(blk), torch.from_numpy(boff), torch.from_numpy(page), torch.from_numpy(off))
            whole = _whole(rows, blocks.block_size // blocks.ratio, cols) if blocks is not None and len(rows) else None
            HOST_S["staging"] += time.perf_counter() - t1
            return DeviceSlots(*cols, torch.from_numpy(rows), whole)
        packed = self._staging(size)[:size]
        out = packed.numpy()
        for i, col in enumerate((blk, boff, page, off)):
            out[i * t:(i + 1) * t] = col
        out[4 * t:] = rows.reshape(-1)
        packed = packed.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._calls += 1
        self._stage[self._turn] = (self._stage[self._turn][0], ev)
        self._age[self._turn] = self._calls
        HOST_S["staging"] += time.perf_counter() - t1
        b, bo, pg, po = packed[: 4 * t].view(4, t).unbind(0)
        return DeviceSlots(b, bo, pg, po, packed[4 * t:].view(-1, vk.ROW_COLS))

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def kernel_refusal(blocks: LayerBlocks, view: LayerKV) -> str | None:
    """None when the Triton kernel copies this layer, else why the torch path does."""
    if view.v is None:
        return "kvd's view is a state slot, not K/V pages"
    dev = blocks.device
    if not vk.available(dev):
        return f"no Triton kernel on {dev} (Triton {'missing' if vk.triton is None else 'needs CUDA'})"
    if view.k.device != dev:
        return f"vLLM's blocks on {dev}, kvd's pages on {view.k.device}"
    for what, x, y in (("K", blocks.k, view.k), ("V", blocks.v, view.v)):
        if x.dtype != y.dtype:
            return f"{what}: vLLM {x.dtype}, kvd {y.dtype}"
        if x.shape[2:] != y.shape[2:]:
            return f"{what}: vLLM [heads, D] {tuple(x.shape[2:])}, kvd {tuple(y.shape[2:])}"
        if x.stride(-1) != 1 or y.stride(-1) != 1:
            return f"{what}: D is not unit-strided (vLLM {x.stride(-1)}, kvd {y.stride(-1)})"
    if blocks.k.shape[2] != blocks.v.shape[2]:
        return "K and V differ in heads"
    return None


def layer_stride(ts: Sequence[torch.Tensor]) -> int | None:
    """The element distance from each tensor of ``ts`` to the next when they are one view moved by
    a uniform stride (same shape, strides and dtype, data pointers evenly spaced; 0 for one tensor),
    else None. Host metadata only: no device work."""
    t0 = ts[0]
    if len(ts) == 1:
        return 0
    step = ts[1].data_ptr() - t0.data_ptr()
    size = t0.element_size()
    if step % size:
        return None
    for i, t in enumerate(ts):
        if t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype or t.device != t0.device:
            return None
        if t.data_ptr() - t0.data_ptr() != i * step:
            return None
    return step // size


def _row_bytes(view: LayerKV) -> int:
    """Bytes of one token of one layer (K and V rows): from the shapes, no indexing."""
    assert view.v is not None
    return (view.k.shape[2] * view.k.shape[3] + view.v.shape[2] * view.v.shape[3]) * view.k.element_size()


def _torch_copy(blocks: LayerBlocks, at: DeviceSlots, view: LayerKV, to_kvd: bool) -> None:
    assert view.v is not None
    w = at.whole
    if w is not None and view.k.shape[1] == blocks.k.shape[1] and view.k.dtype == blocks.k.dtype == view.v.dtype == blocks.v.dtype:
        # pages as long as kernel blocks: whole runs block for page, not token by token (~7x a
        # plain copy's time per token that way on the CPU)
        pairs = ((view.k, blocks.k), (view.v, blocks.v)) if to_kvd else ((blocks.k, view.k), (blocks.v, view.v))
        for dst, src in pairs:  # index 0: page (kvd) or kernel block (vLLM)
            if w.spans is not None:
                for b, p, n in w.spans:
                    d, s = (p, b) if to_kvd else (b, p)
                    dst[d:d + n].copy_(src[s:s + n])
            else:
                d_ids, s_ids = (w.pages, w.blocks) if to_kvd else (w.blocks, w.pages)
                dst.index_copy_(0, d_ids, src.index_select(0, s_ids))
        LAUNCHES["torch"] += 2 * (len(w.spans) if w.spans is not None else 2)
        at = w.rest
        if not at.tokens:
            return
    if to_kvd:
        view.k[at.page, at.poff] = blocks.k[at.block, at.boff]
        view.v[at.page, at.poff] = blocks.v[at.block, at.boff]
    else:
        blocks.k[at.block, at.boff] = view.k[at.page, at.poff]
        blocks.v[at.block, at.boff] = view.v[at.page, at.poff]
    LAUNCHES["torch"] += 4


def _copy(blocks: Sequence[LayerBlocks], at: DeviceSlots, views: Sequence[LayerKV], to_kvd: bool, path: str | None) -> int:
    """Copy the layers ``blocks[i]`` <-> ``views[i]`` at ``at``: ``path`` None (the kernel where
    :func:`kernel_refusal` allows it, else torch), ``"triton"`` (InvalidArgument where it does not
    apply) or ``"torch"``."""
    if len(blocks) != len(views):
        raise InvalidArgument(f"{len(blocks)} vLLM layers for {len(views)} kvd layer views; pass one view per layer")
    if path not in (None, "triton", "torch"):
        raise InvalidArgument(f"copy path {path!r}: use 'triton', 'torch' or None (the kernel where it applies)")
    t0 = time.perf_counter()
    plan = _plan(blocks, views)
    nbytes = at.tokens * plan.row_bytes
    LAUNCHES["layers"] += len(blocks)
    kernel = path != "torch" and at.rows is not None
    if kernel:
        if plan.why is not None and path == "triton":
            raise InvalidArgument(f"the Triton copy does not apply here: {plan.why}")
        kernel = plan.why is None
    elif path == "triton":
        raise InvalidArgument("the Triton copy needs the rows: build the slots with CopyStream.slots")
    if not kernel:
        for b, v in zip(blocks, views):
            _torch_copy(b, at, v, to_kvd)
    else:
        assert at.rows is not None and plan.launches is not None
        for prep in plan.launches:
            LAUNCHES["triton"] += vk.launch(at.rows, prep, to_b=to_kvd)
    HOST_S["launch"] += time.perf_counter() - t0
    return nbytes


class _Plan(NamedTuple):
    """What a copy of the same layers repeats: the kernel's verdict (:func:`kernel_refusal` of the
    first layer that refuses, None: the kernel applies), its launches, a token's bytes (all layers)."""

    why: str | None
    launches: tuple[vk.Prepared, ...] | None
    row_bytes: int
    refs: tuple[weakref.ref, ...]  # the tensors it was made for (held weakly: never keeps vLLM's KV alive)


#: Plans by their tensors' (id, data pointer): layer-invariant work is done once per layer set,
#: not per layer per step. Bounded: emptied when full (plans of freed tensors are never hit again).
_PLANS: dict[tuple[int, ...], _Plan] = {}
_PLANS_MAX = 1024


def _plan(blocks: Sequence[LayerBlocks], views: Sequence[LayerKV]) -> _Plan:
    ts = [t for b, v in zip(blocks, views) for t in (b.k, b.v, v.k, v.v) if t is not None]
    key = tuple(x for t in ts for x in (id(t), t.data_ptr()))
    got = _PLANS.get(key)
    if got is not None and len(got.refs) == len(ts) and all(r() is t for r, t in zip(got.refs, ts)):
        return got
    row_bytes = sum(_row_bytes(v) for v in views)
    why = next((w for w in (kernel_refusal(b, v) for b, v in zip(blocks, views)) if w), None)
    launches: tuple[vk.Prepared, ...] | None = None
    if why is None:
        # one launch for all layers where both sides step by one stride per layer, else one per layer
        strides = [layer_stride(ts) for ts in ([b.k for b in blocks], [b.v for b in blocks],
                                                [v.k for v in views], [v.v for v in views if v.v is not None])]
        if None not in strides:
            sk, sv, pk, pv = (int(x) for x in strides if x is not None)
            a, c = vk.Side(blocks[0].k, blocks[0].v, sk, sv), vk.Side(views[0].k, views[0].v, pk, pv)  # type: ignore[arg-type]
            launches = (vk.prepare(a, c, layers=len(blocks)),)
        else:
            launches = tuple(vk.prepare(vk.Side(b.k, b.v), vk.Side(v.k, v.v)) for b, v in zip(blocks, views))  # type: ignore[arg-type]
    plan = _Plan(why, launches, row_bytes, tuple(weakref.ref(t) for t in ts))
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def save_layer(blocks: LayerBlocks, at: DeviceSlots, view: LayerKV, *, path: str | None = None) -> int:
    """vLLM's blocks -> kvd's pages of one layer at ``at`` (one launch on the kernel path); the
    bytes copied. ``path``: see :func:`save_layers`."""
    return _copy([blocks], at, [view], True, path)


def load_layer(blocks: LayerBlocks, at: DeviceSlots, view: LayerKV, *, path: str | None = None) -> int:
    """kvd's pages -> vLLM's blocks of one layer at ``at``; the bytes copied."""
    return _copy([blocks], at, [view], False, path)


def save_layers(blocks: Sequence[LayerBlocks], at: DeviceSlots, views: Sequence[LayerKV], *, path: str | None = None) -> int:
    """vLLM's blocks -> kvd's pages of layers ``blocks[i]`` -> ``views[i]`` that share the slots
    ``at`` (one vLLM group's layers of one kvd group); the bytes copied. On the kernel path one
    launch for all of them when both sides' layers lie a uniform stride apart
    (:func:`layer_stride`), else one per layer. ``path``: None (the kernel where
    :func:`kernel_refusal` allows it), ``"triton"`` (InvalidArgument where it does not) or
    ``"torch"``."""
    return _copy(blocks, at, views, True, path)


def load_layers(blocks: Sequence[LayerBlocks], at: DeviceSlots, views: Sequence[LayerKV], *, path: str | None = None) -> int:
    """kvd's pages -> vLLM's blocks of layers ``views[i]`` -> ``blocks[i]``, as :func:`save_layers`."""
    return _copy(blocks, at, views, False, path)
