"""kvd's layout for a vLLM ``KVCacheConfig`` (:func:`layout_from_vllm`): each vLLM KV cache
group as a kvd group, and where each vLLM layer lives in it (:class:`LayerSlot`). The connector's
worker proposes it to its daemon when vLLM registers its KV caches (:mod:`kvd.connectors.vllm`).

kvd imports: :mod:`kvd.errors`, :mod:`kvd.pool.layout`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from kvd.errors import InvalidArgument
from kvd.pool.layout import DTYPES, GroupKind, GroupSpec, Layout

__all__ = ["LayerSlot", "layout_from_vllm"]

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class LayerSlot(NamedTuple):
    """Where one vLLM layer lives in kvd: group name, layer index in that group, vLLM group index."""

    group: str
    layer_index: int  # not ``index``: that would shadow tuple.index
    vllm_group: int


def layout_from_vllm(kv_cache_config: Any, *, name: str = "vllm") -> tuple[Layout, dict[str, LayerSlot]]:
    """kvd's layout for a vLLM ``KVCacheConfig``, and each layer's place in it.

    Full-attention groups become one ``full`` group, sliding-window groups one ``swa`` group
    (one window for all), Mamba groups one ``state`` group whose slot holds a layer's state bytes
    (``uint8``). Raises InvalidArgument for what kvd cannot carry (MLA, mixed head shapes or
    windows, block sizes that differ between attention groups, no full-attention layer)."""
    layers: dict[str, list[tuple[str, int]]] = {"full": [], "swa": [], "state": []}
    attn: dict[str, set] = {"full": set(), "swa": set()}
    windows: set[int] = set()
    state_bytes: set[int] = set()
    block_sizes: set[int] = set()
    dtypes: set[str] = set()
    for gi, grp in enumerate(kv_cache_config.kv_cache_groups):
        spec = grp.kv_cache_spec
        if type(spec) is MambaSpec:
            kind = "state"
            state_bytes.add(spec.real_page_size_bytes)
        elif type(spec) in (FullAttentionSpec, SlidingWindowSpec):
            kind = "swa" if type(spec) is SlidingWindowSpec else "full"
            if kind == "swa":
                windows.add(int(spec.sliding_window))
            elif spec.sliding_window is not None:
                raise InvalidArgument(f"kv cache group {gi}: a full-attention spec with a sliding window is not supported by kvd")
            dt = _DTYPE_NAMES.get(spec.dtype)
            if dt is None:
                raise InvalidArgument(f"kv cache group {gi}: dtype {spec.dtype} is not one kvd carries ({sorted(DTYPES)})")
            dtypes.add(dt)
            block_sizes.add(int(spec.block_size))
            attn[kind].add((int(spec.num_kv_heads), int(spec.head_size), int(spec.head_size_v or spec.head_size), dt))
        else:
            raise InvalidArgument(
                f"kv cache group {gi} is a {type(spec).__name__}; kvd's vLLM connector carries full attention, "
                "sliding window and Mamba groups"
            )
        layers[kind].extend((ln, gi) for ln in grp.layer_names)
    for kind, shapes in attn.items():
        if len(shapes) > 1:
            raise InvalidArgument(f"{kind}-attention layers differ in (kv heads, head size, v head size, dtype): {sorted(shapes)}")
    if len(windows) > 1 or len(state_bytes) > 1 or len(block_sizes) > 1 or len(dtypes) > 1:
        raise InvalidArgument(
            f"kvd needs one window ({sorted(windows)}), one state size ({sorted(state_bytes)}), one attention "
            f"block size ({sorted(block_sizes)}) and one dtype ({sorted(dtypes)}) per model"
        )
    if not layers["full"]:
        raise InvalidArgument("the model has no full-attention layer; kvd's layout needs a full group (it owns the page ids)")
    groups = []
    for kind in ("full", "swa"):
        if layers[kind]:
            h, d, dv, _ = next(iter(attn[kind]))
            groups.append(GroupSpec(kind=GroupKind(kind), num_layers=len(layers[kind]), num_kv_heads=h, head_dim=d,
                                    v_head_dim=dv, window=windows.pop() if kind == "swa" else None))
    if layers["state"]:
        groups.append(GroupSpec(kind=GroupKind.STATE, num_layers=len(layers["state"]), state_elems=state_bytes.pop(), dtype="uint8"))
    layout = Layout(name=name, page_size=block_sizes.pop(), dtype=dtypes.pop(), groups=tuple(groups),
                    source="vLLM KVCacheConfig (kvd.connectors.vllm.layout_from_vllm)")
    slots = {ln: LayerSlot(kind, i, gi) for kind, ls in layers.items() for i, (ln, gi) in enumerate(ls)}
    return layout, slots
