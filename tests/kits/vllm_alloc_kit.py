"""KV tensors allocated exactly as vLLM 0.32's GPU/CPU model runner does, without vLLM (a GPU host
has none): the same arithmetic as ``vllm/v1/core/kv_cache_utils.py: get_kv_cache_config_from_groups``
(bytes per block, one KVCacheTensor per group at byte 0: groups alias one block pool) and
``vllm/v1/kv_cache_interface.py: compute_layout_strides`` / ``create_kv_cache_views`` (a raw int8
buffer, ``as_strided`` to ``[L, B, H, N, C]`` bytes in the layout's stride order, a layer's view
``view_5d[l].view(dtype)``), for attention specs without padding or kernel-block splitting. Also
the legacy 5-D layouts (vLLM <= 0.1x ``_reshape_kv_cache_tensors``: raw buffer -> the backend's
shape in ``get_kv_cache_stride_order`` order -> permuted back to the logical shape).
Used by tests/core/test_vllm_blocks.py, tests/gpu/test_vllm_gpu_blocks.py and bench/vllm_gpu_copy.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["STRIDE_ORDERS", "BLOCK_OUTER", "Group", "layout_strides", "allocate", "allocate_legacy"]

# vllm/v1/kv_cache_layout.py: KVCacheLayout values (logical [L, B, H, N, C] -> physical order)
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
BLOCK_OUTER = {name for name, order in STRIDE_ORDERS.items() if order[0] == 1}  # is_block_outermost


@dataclass(frozen=True)
class Group:
    """One vLLM KV cache group of attention layers (FullAttentionSpec or SlidingWindowSpec alike)."""

    layers: tuple[str, ...]
    heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def content_bytes(self) -> int:  # AttentionSpec.state_content_size_bytes: (head_size + head_size_v) * dtype size
        return 2 * self.head_size * torch.empty((), dtype=self.dtype).element_size()


def layout_strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple[int | None, ...] = (None,) * 5) -> tuple[int, ...]:
    """``compute_layout_strides`` without padding: byte strides of logical ``[L, B, H, N, C]``."""
    strides = [0] * 5
    cur = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or cur
        cur = strides[dim] * shape[dim]
    return tuple(strides)


def allocate(groups: list[Group], num_blocks: int, block_size: int, layout: str, device: str = "cpu",
             fill: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the raw int8 buffer, ``{layer: [B, H, N, 2 * head_size] view}``) as vLLM 0.32 allocates them
    for ``layout``; the buffer zeroed (vLLM: ``torch.zeros``), or random bytes from seed ``fill``."""
    order = STRIDE_ORDERS[layout]
    page = {id(g): g.heads * block_size * g.content_bytes for g in groups}
    # _get_kv_cache_bytes_per_block (no padding, no alignment beyond 1)
    bytes_per_block = max(len(g.layers) * page[id(g)] for g in groups)
    size = bytes_per_block * num_blocks
    if fill is None:
        raw = torch.zeros(size, dtype=torch.int8, device=device)
    else:
        gen = torch.Generator().manual_seed(fill)
        raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen).to(device)
    views: dict[str, torch.Tensor] = {}
    interleaved = bytes_per_block if layout in BLOCK_OUTER else None
    for g in groups:  # each group's KVCacheTensor at byte 0 (groups alias the block pool)
        shape = (len(g.layers), num_blocks, g.heads, block_size, g.content_bytes)
        layer_stride, block_stride, *_ = layout_strides(shape, order, (None, interleaved, None, None, None))
        strides = layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
        view_5d = torch.as_strided(raw, size=shape, stride=strides, storage_offset=raw.storage_offset())
        for i, name in enumerate(g.layers):
            views[name] = view_5d[i].view(g.dtype)
    return raw, views


# vLLM <= 0.1x: get_kv_cache_shape and get_kv_cache_stride_order of each backend
_LEGACY = {
    "FLASH_ATTN_LEGACY": (lambda b, n, h, d: (2, b, n, h, d), (0, 1, 2, 3, 4)),
    "FLASHINFER_NHD_LEGACY": (lambda b, n, h, d: (b, 2, n, h, d), (0, 1, 2, 3, 4)),
    "FLASHINFER_HND_LEGACY": (lambda b, n, h, d: (b, 2, n, h, d), (0, 1, 3, 2, 4)),
}


def allocate_legacy(groups: list[Group], num_blocks: int, block_size: int, layout: str, device: str = "cpu",
                    fill: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The legacy 5-D layouts as ``_reshape_kv_cache_tensors`` made them: one raw buffer per layer,
    viewed in the stride order's physical shape, permuted back to the logical one."""
    shape_of, order = _LEGACY[layout]
    inv = [order.index(i) for i in range(5)]
    views: dict[str, torch.Tensor] = {}
    raws = []
    gen = torch.Generator().manual_seed(fill) if fill is not None else None
    for g in groups:
        logical = shape_of(num_blocks, block_size, g.heads, g.head_size)
        physical = tuple(logical[i] for i in order)
        for name in g.layers:
            nbytes = num_blocks * page_bytes(g, block_size)
            raw = (torch.zeros(nbytes, dtype=torch.int8) if gen is None
                   else torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)).to(device)
            raws.append(raw)
            views[name] = raw.view(g.dtype).view(physical).permute(*inv)
    return torch.cat(raws), views


def page_bytes(g: Group, block_size: int) -> int:
    return g.heads * block_size * g.content_bytes
