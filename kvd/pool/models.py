"""Layouts from a Hugging Face ``config.json``: what vLLM and SGLang would allocate for a model.

An operator starts from a model, not from kvd's preset names. :func:`layout_from_config` reads
the fields a model's config carries (a multimodal config's ``text_config`` is used where there is
one) and derives a :class:`~kvd.pool.layout.Layout` for one engine rank at tensor-parallel degree
``tp``. Families, told apart by their fields rather than by a list of names:

* **full attention** (Llama, Qwen2/3, Mistral): every layer caches K and V of
  ``num_key_value_heads // tp`` heads of ``head_dim``;
* **sliding windows** (Gemma 2/3/4, gpt-oss): ``layer_types`` (or Gemma 2's alternation and
  Gemma 3's ``sliding_window_pattern``) splits the layers into a full and a swa group; Gemma 4's
  full layers have their own heads (``num_global_key_value_heads``, ``global_head_dim``);
* **Mamba2 / linear attention** (GraniteMoeHybrid, Falcon-H1, NemotronH, Qwen3-Next, Qwen3.5):
  the recurrent layers are one state group, one slot per request (Falcon-H1 runs attention and
  Mamba in every layer: both groups have all its layers);
* **MLA** (DeepSeek-V2/V3, Kimi-K2): one latent of ``kv_lora_rank + qk_rope_head_dim`` per token
  per layer, no V, the same on every rank (the latent is not split by TP).

Bytes per token, per layer, as vLLM's ``AttentionSpec.page_size_bytes`` and its
``MambaStateShapeCalculator`` (and SGLang's ``Mamba2StateShape``) compute them::

    attention      2 (K, V) x kv_heads/tp x head_dim x dtype bytes
    MLA            (kv_lora_rank + qk_rope_head_dim) x dtype bytes
    Mamba2 slot    conv: (d_conv - 1) x (intermediate + 2 x groups x d_state) / tp    x dtype
                   ssm : heads/tp x head_dim x d_state                               x ssm dtype
    GatedDeltaNet  conv: (conv_kernel - 1) x (2 x k_heads x k_dim + v_heads x v_dim) / tp
                   ssm : v_heads/tp x k_dim x v_dim

where ``groups`` becomes ``tp`` when it does not divide by ``tp`` (vLLM replicates the groups
across head shards). The state group has one dtype, the SSM state's (float32 by default, as
SGLang allocates it; vLLM's ``mamba_ssm_cache_dtype=auto`` is the model dtype): the conv state,
kept in the model dtype, is counted in words of that dtype, rounded up.

An architecture whose fields this module cannot read is refused with
:class:`~kvd.errors.InvalidArgument` naming the fields that are missing; a layer type it does
not know (Llama 4's chunked attention) is refused by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.errors import InvalidArgument
from kvd.pool.layout import DTYPES, GroupKind, GroupSpec, Layout

__all__ = ["read_config", "layout_from_config", "load_model", "MODEL_FAMILIES"]

#: What :func:`layout_from_config` covers, for ``kvd plan --help`` and the docs.
MODEL_FAMILIES = (
    "full attention: Llama, Qwen2/Qwen3, Mistral (layers x kv_heads/tp x head_dim, K and V)",
    "sliding window: Gemma 2/3/4, gpt-oss (layer_types / sliding_window_pattern -> full + swa)",
    "Mamba2 state: GraniteMoeHybrid, Falcon-H1, NemotronH (conv + ssm state per slot)",
    "linear attention: Qwen3-Next, Qwen3.5 (Gated DeltaNet state per slot)",
    "MLA: DeepSeek-V2/V3, Kimi-K2 (one kv_lora_rank + qk_rope_head_dim latent per token)",
)

_FULL = {"full_attention", "attention", "global_attention", "global"}
_SLIDING = {"sliding_attention", "sliding_window", "local_attention", "local"}
_MAMBA = {"mamba", "mamba2"}
_LINEAR = {"linear_attention"}
# dtypes a config's torch_dtype may name that a KV cache is kept in ("auto" in vLLM).
_KV_DTYPES = {"bfloat16", "float16", "float32"}


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``config.json`` (or a directory holding one) from disk; InvalidArgument saying why not."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InvalidArgument(f"model config {os.fspath(path)!r} is not a file (give the path of a Hugging Face config.json)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"model config {p}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidArgument(f"model config {p}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def load_model(
    path: str | os.PathLike[str],
    *,
    tp: int = 1,
    draft: str | os.PathLike[str] | None = None,
    page_size: int = 16,
    dtype: str | None = None,
    ssm_dtype: str = "float32",
) -> Layout:
    """:func:`layout_from_config` of the config at ``path`` (and of a draft model's at ``draft``).

    Every message names the file it is about."""
    cfg = read_config(path)
    name = _model_name(cfg, path)
    try:
        layout = layout_from_config(cfg, tp=tp, page_size=page_size, dtype=dtype, ssm_dtype=ssm_dtype, name=name)
        if draft is None:
            return layout
    except InvalidArgument as e:
        raise InvalidArgument(f"model config {os.fspath(path)}: {e}") from None
    dcfg = read_config(draft)
    try:
        d = layout_from_config(dcfg, tp=tp, page_size=page_size, dtype=dtype, ssm_dtype=ssm_dtype, name="draft")
    except InvalidArgument as e:
        raise InvalidArgument(f"draft config {os.fspath(draft)}: {e}") from None
    try:
        return _with_draft(layout, d, draft_name=_model_name(dcfg, draft))
    except InvalidArgument as e:
        raise InvalidArgument(f"draft config {os.fspath(draft)}: {e}") from None


def _with_draft(layout: Layout, draft: Layout, *, draft_name: str = "draft") -> Layout:
    """``layout`` plus a draft group holding ``draft``'s KV (its page size and dtype).

    The draft model must be plain full attention (one group): a draft's sliding or state layers
    would need groups of their own, which a layout does not have."""
    if layout.has(GroupKind.DRAFT):
        raise InvalidArgument(f"layout {layout.name!r} already has a draft group")
    if len(draft.groups) != 1:
        raise InvalidArgument(
            f"draft model {draft_name!r} derives to groups {draft.group_names}; a draft must be full attention only "
            "(one group of layers stored alike)"
        )
    f = draft.groups[0]
    g = GroupSpec(kind=GroupKind.DRAFT, num_layers=f.num_layers, num_kv_heads=f.num_kv_heads, head_dim=f.head_dim,
                  v_head_dim=f.v_head_dim, page_size=draft.page_size, dtype=draft.dtype)
    return Layout(name=f"{layout.name}+{draft_name}", page_size=layout.page_size, dtype=layout.dtype,
                  groups=(*layout.groups, g), source=f"{layout.source}; draft: {draft.source}")


def _model_name(cfg: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    p = Path(path)
    folder = p.name if p.is_dir() else p.parent.name
    return str(cfg.get("_name_or_path") or folder or cfg.get("model_type") or "model").rstrip("/").split("/")[-1]


# ---- the derivation --------------------------------------------------------------------------


@dataclass(slots=True)
class _Cfg:
    """A config's fields, read with the names they go by, recording what was looked for in vain."""

    raw: Mapping[str, Any]
    missing: list[str]

    def get(self, *names: str, default: Any = None) -> Any:
        for n in names:
            v = self.raw.get(n)
            if v is not None:
                return v
        return default

    def need(self, *names: str) -> Any:
        """The first of ``names`` that is set; the first name is recorded as missing if none is."""
        v = self.get(*names)
        if v is None:
            self.missing.append(names[0] if len(names) == 1 else " or ".join(names))
            return 0
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidArgument(f"field {names[0]} must be a non-negative integer, got {v!r}")
        return v


def layout_from_config(
    config: Mapping[str, Any],
    *,
    tp: int = 1,
    page_size: int = 16,
    dtype: str | None = None,
    ssm_dtype: str = "float32",
    name: str | None = None,
) -> Layout:
    """The layout of one rank of the model ``config`` describes at tensor-parallel degree ``tp``.

    ``dtype``: the KV cache dtype (default: the config's ``torch_dtype``, else bfloat16).
    ``ssm_dtype``: the dtype of a state group (Mamba2 / linear-attention SSM state).
    Raises InvalidArgument naming the missing fields of an architecture it cannot read, an unknown
    layer type, or KV heads that do not split across ``tp``."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise InvalidArgument(f"tp must be a positive integer, got {tp!r}")
    top = dict(config)
    text = top.get("text_config")
    raw: dict[str, Any] = {**top, **text} if isinstance(text, Mapping) else top
    c = _Cfg(raw, [])
    arch = ", ".join(top.get("architectures") or []) or "?"
    what = f"model_type {raw.get('model_type', top.get('model_type', '?'))!r} (architectures {arch})"
    kv_dtype = dtype or _config_dtype(raw)
    if kv_dtype not in DTYPES:
        raise InvalidArgument(f"KV dtype {kv_dtype!r} is not one of {sorted(DTYPES)}")
    if ssm_dtype not in DTYPES:
        raise InvalidArgument(f"ssm dtype {ssm_dtype!r} is not one of {sorted(DTYPES)}")

    n_layers = c.need("num_hidden_layers", "n_layer", "num_layers")
    if c.missing:
        _refuse(what, c)
    types = _layer_types(c, n_layers)
    unknown = sorted({t for t in types if t not in _FULL | _SLIDING | _MAMBA | _LINEAR | {"both"}})
    if unknown:
        raise InvalidArgument(
            f"{what}: layer types {unknown} are not supported (kvd knows full, sliding-window, mamba and "
            "linear attention layers); write a layout file instead (--layout)"
        )
    n_full = sum(t in _FULL or t == "both" for t in types)
    n_swa = sum(t in _SLIDING for t in types)
    n_mamba = sum(t in _MAMBA or t == "both" for t in types)
    n_linear = sum(t in _LINEAR for t in types)

    groups: list[GroupSpec] = []
    notes: list[str] = []
    if c.get("kv_lora_rank") is not None:  # MLA: one latent per token, replicated on every rank
        latent = c.need("kv_lora_rank") + c.need("qk_rope_head_dim")
        if c.missing:
            _refuse(what, c)
        groups.append(GroupSpec(kind=GroupKind.FULL, num_layers=n_full, num_kv_heads=1, head_dim=latent, v_head_dim=0))
        notes.append(f"MLA: {n_full} layers x latent {latent} (kv_lora_rank + qk_rope_head_dim), no V, same on every rank")
    elif n_full or n_swa:
        heads = c.need("num_key_value_heads", "num_kv_heads", "n_head_kv", "num_attention_heads")
        head_dim = c.get("head_dim") or _default_head_dim(c)
        if c.missing:
            _refuse(what, c)
        if n_full:
            # Gemma 4: full layers have their own KV heads and head dim.
            fh = c.get("num_global_key_value_heads", default=heads)
            fd = c.get("global_head_dim", default=head_dim)
            groups.append(GroupSpec(kind=GroupKind.FULL, num_layers=n_full, num_kv_heads=_per_rank(fh, tp, "full"), head_dim=fd))
            notes.append(f"{n_full} full layers x {fh} kv heads (/{tp}) x head_dim {fd}, K and V")
        if n_swa:
            window = c.need("sliding_window")
            if c.missing:
                _refuse(what, c)
            groups.append(GroupSpec(kind=GroupKind.SWA, num_layers=n_swa, num_kv_heads=_per_rank(heads, tp, "sliding"),
                                    head_dim=head_dim, window=window))
            notes.append(f"{n_swa} sliding layers x {heads} kv heads (/{tp}) x head_dim {head_dim}, window {window}")
    if not any(g.kind is GroupKind.FULL for g in groups):
        raise InvalidArgument(
            f"{what}: no full-attention layer found ({n_swa} sliding, {n_mamba} mamba, {n_linear} linear); a kvd "
            "layout needs a full-attention group (it owns the virtual page ids)"
        )
    if n_mamba and n_linear:
        raise InvalidArgument(f"{what}: both mamba and linear-attention layers; kvd has one state group")
    if n_mamba or n_linear:
        conv, ssm, desc = _mamba_state(c, tp) if n_mamba else _delta_state(c, tp)
        if c.missing:
            _refuse(what, c)
        conv_bytes = conv * DTYPES[kv_dtype].itemsize
        it = DTYPES[ssm_dtype].itemsize
        elems = ssm + -(-conv_bytes // it)  # the conv state in words of the group's dtype, rounded up
        groups.append(GroupSpec(kind=GroupKind.STATE, num_layers=n_mamba or n_linear, state_elems=elems, dtype=ssm_dtype))
        notes.append(f"{n_mamba or n_linear} {'mamba' if n_mamba else 'linear-attention'} layers: {desc}; "
                     f"conv {conv} x {kv_dtype} + ssm {ssm} x {ssm_dtype} per layer")
    label = name or str(raw.get("_name_or_path") or raw.get("model_type") or "model").split("/")[-1]
    return Layout(
        name=f"{label}-tp{tp}" if tp > 1 else label,
        page_size=page_size,
        dtype=kv_dtype,
        groups=tuple(groups),
        source=f"derived from config.json ({what}), TP{tp}: " + "; ".join(notes),
    )


def _refuse(what: str, c: _Cfg) -> None:
    raise InvalidArgument(
        f"{what}: cannot derive a KV layout, missing field(s): {', '.join(dict.fromkeys(c.missing))}; "
        f"supported: {'; '.join(f.split(':')[0] for f in MODEL_FAMILIES)} (or give --layout)"
    )


def _config_dtype(raw: Mapping[str, Any]) -> str:
    d = raw.get("torch_dtype") or raw.get("dtype")
    return d if d in _KV_DTYPES else "bfloat16"


def _default_head_dim(c: _Cfg) -> int:
    hidden = c.need("hidden_size")
    heads = c.need("num_attention_heads")
    return hidden // heads if heads else 0


def _per_rank(heads: int, tp: int, what: str) -> int:
    """KV heads on one rank: split across ``tp``, replicated (one per rank) when fewer than ``tp``."""
    if heads >= tp and heads % tp:
        raise InvalidArgument(f"{what} layers: {heads} kv heads do not split across tp={tp}; pick a tp that divides them")
    return max(1, heads // tp)


def _layer_types(c: _Cfg, n: int) -> list[str]:
    """Each layer's kind: ``layer_types``, NemotronH's pattern, Qwen3-Next's interval, Gemma 2/3's
    alternation, or full attention everywhere."""
    lt = c.get("layer_types", "layers_block_type")
    if isinstance(lt, Sequence) and not isinstance(lt, str):
        if len(lt) != n:
            raise InvalidArgument(f"layer_types has {len(lt)} entries for num_hidden_layers {n}")
        return [str(t).lower() for t in lt]
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # NemotronH: M mamba, * attention, - / E mlp or moe (no cache)
        cache = [ch for ch in pattern if ch in "M*"]
        return ["mamba" if ch == "M" else "full_attention" for ch in cache]
    model_type = str(c.get("model_type", default=""))
    if model_type.startswith("falcon_h1"):  # attention and mamba side by side in every layer
        return ["both"] * n
    interval = c.get("full_attention_interval")
    if interval:  # Qwen3-Next / Qwen3.5: every interval-th layer is full attention
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if c.get("sliding_window") is not None and c.get("use_sliding_window", default=True):
        every = c.get("sliding_window_pattern")
        if every:  # Gemma 3: every pattern-th layer is full
            return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        if model_type.startswith("gemma2"):  # Gemma 2: sliding, full, sliding, ...
            return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if model_type.startswith(("mistral", "qwen2", "qwen3", "llama")):  # one window on every layer
            return ["sliding_attention"] * n
    return ["full_attention"] * n


def _mamba_state(c: _Cfg, tp: int) -> tuple[int, int, str]:
    """Mamba2 conv and ssm elements per layer on one rank (vLLM's mamba2_state_shape)."""
    heads = c.need("mamba_n_heads", "mamba_num_heads")
    head_dim = c.need("mamba_d_head", "mamba_head_dim")
    d_state = c.need("mamba_d_state", "ssm_state_size")
    d_conv = c.need("mamba_d_conv", "conv_kernel")
    groups = c.need("mamba_n_groups", "n_groups")
    inner = c.get("mamba_d_ssm") or heads * head_dim
    if c.missing:
        return 0, 0, ""
    if heads % tp or inner % tp:
        raise InvalidArgument(f"mamba layers: {heads} heads (intermediate {inner}) do not split across tp={tp}")
    groups_eff = groups if groups % tp == 0 else tp  # vLLM replicates groups across head shards
    conv = (d_conv - 1) * (inner + 2 * groups_eff * d_state) // tp
    ssm = heads // tp * head_dim * d_state
    return conv, ssm, f"{heads} heads x {head_dim} x d_state {d_state}, {groups} groups, d_conv {d_conv} (/{tp})"


def _delta_state(c: _Cfg, tp: int) -> tuple[int, int, str]:
    """Gated DeltaNet conv and ssm elements per layer on one rank (vLLM's gated_delta_net_state_shape)."""
    kh = c.need("linear_num_key_heads")
    vh = c.need("linear_num_value_heads")
    kd = c.need("linear_key_head_dim")
    vd = c.need("linear_value_head_dim")
    kernel = c.need("linear_conv_kernel_dim")
    if c.missing:
        return 0, 0, ""
    if kh % tp or vh % tp:
        raise InvalidArgument(f"linear-attention layers: {kh} key / {vh} value heads do not split across tp={tp}")
    conv = (kernel - 1) * (2 * kh * kd + vh * vd) // tp
    ssm = vh // tp * kd * vd
    return conv, ssm, f"{kh} k-heads x {kd}, {vh} v-heads x {vd}, conv kernel {kernel} (/{tp})"
