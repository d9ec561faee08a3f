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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvd.client.views import LayerKV
from kvd.errors import InvalidArgument

__all__ = [
    "LAYOUTS",
    "ALIASES",
    "KVLayout",
    "LayerBlocks",
    "Slots",
    "DeviceSlots",
    "CopyStream",
    "detect_layout",
    "layout_named",
    "token_slots",
    "save_layer",
    "load_layer",
    "state_bytes",
]


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
    short. CPU work only, from Python lists."""
    t = torch.arange(start, end)
    j = t // block_size
    if len(t) and int(j.max()) >= len(block_ids):
        raise RuntimeError(f"{what}: tokens up to {end} but vLLM gave {len(block_ids)} blocks")
    blk = torch.tensor(list(block_ids), dtype=torch.long)[j]
    keep = blk != 0
    t, j, blk = t[keep], j[keep], blk[keep]
    k = j - first
    if len(k) and (int(k.min()) < 0 or int(k.max()) >= len(pages)):
        raise RuntimeError(f"{what}: vLLM keeps request blocks {sorted(set(j.tolist()))}, kvd holds pages for "
                           f"[{first}, {first + len(pages)})")
    return Slots(blk, t % block_size, torch.tensor(list(pages), dtype=torch.long)[k])


class DeviceSlots(NamedTuple):
    """:class:`Slots` where the copy runs: vLLM (kernel) block and offset, kvd page and offset."""

    block: torch.Tensor
    boff: torch.Tensor
    page: torch.Tensor
    poff: torch.Tensor

    def __len__(self) -> int:  # type: ignore[override]
        return int(self.page.shape[0])


class CopyStream:
    """Where the copies of one connector run: on the CPU, in line; on a CUDA device, on a stream of
    its own. ``with cs.after_current():`` makes the stream wait for the device's current stream
    (vLLM's forward) and makes it current for the block; :meth:`record` an event after the copies
    (None on the CPU); :meth:`slots` moves index tensors there without waiting."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @contextlib.contextmanager
    def after_current(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def slots(self, s: Slots, blocks: LayerBlocks | None = None) -> DeviceSlots:
        """``s`` on this device for the layers shaped like ``blocks``: where it splits each vLLM
        block into ``ratio`` kernel blocks of ``N = block_size / ratio`` tokens, token ``o`` of block
        ``b`` is kernel block ``b * ratio + o // N``, offset ``o % N``. Call inside
        :meth:`after_current`: the one copy from pinned memory is ordered on this stream and waits
        for nothing."""
        if blocks is None or blocks.ratio == 1:
            packed = torch.stack([s.block, s.offset, s.page, s.offset])
        else:
            n = blocks.block_size // blocks.ratio
            packed = torch.stack([s.block * blocks.ratio + s.offset // n, s.offset % n, s.page, s.offset])
        if self.stream is not None:
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        return DeviceSlots(*packed.unbind(0))

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def save_layer(blocks: LayerBlocks, at: DeviceSlots, view: LayerKV) -> int:
    """vLLM's blocks -> kvd's pages of one layer at ``at``; the bytes copied."""
    assert view.v is not None
    view.k[at.page, at.poff] = blocks.k[at.block, at.boff]
    view.v[at.page, at.poff] = blocks.v[at.block, at.boff]
    return len(at) * (view.k[0, 0].nbytes + view.v[0, 0].nbytes)


def load_layer(blocks: LayerBlocks, at: DeviceSlots, view: LayerKV) -> int:
    """kvd's pages -> vLLM's blocks of one layer at ``at``; the bytes copied."""
    assert view.v is not None
    blocks.k[at.block, at.boff] = view.k[at.page, at.poff]
    blocks.v[at.block, at.boff] = view.v[at.page, at.poff]
    return len(at) * (view.k[0, 0].nbytes + view.v[0, 0].nbytes)
