"""Named layouts of real models, and loading a layout from a name or a file.

A preset is a :class:`~kvd.pool.layout.Layout` for one engine rank of a known model, so an operator
can say ``--layout gemma-4-31b-it-tp2`` instead of spelling out every group. Each preset's
``source`` cites the public ``config.json`` it was read from and any derivation; the comment
block above each one shows the arithmetic of its per-token entry bytes.

Conventions (per engine rank):

* KV dtype ``bfloat16`` unless the model says otherwise; ``page_size`` 16.
* Per-rank KV heads are ``num_kv_heads // tp``; a model with fewer KV heads than ``tp``
  replicates them, one head per rank.
* K and V are both stored for every attention layer, even where the model derives them from one
  projection (Gemma 4's ``attention_k_eq_v``): after RoPE on K and the different K/V norms the
  two tensors differ, and SGLang's pool sizing (seed 004) counts both.

Seed 004 (``/work/shared/seeds/004_*``) gives the check numbers for the hybrid-SWA presets.
SGLang's unified pool sizes each sub-pool as ``total_bytes // entry_bytes``, so the ratio of two
sub-pools' page counts is the inverse ratio of their per-token entry bytes:

========================  ================  ================  ====================
model                     full v2p len      swa v2p len       e_swa / e_full
========================  ================  ================  ====================
gemma-4-31b-it (TP2)      2,065,601         206,561           10
gemma-4-E2B-it (TP1)      7,576,246         3,788,123         2
gpt-oss-20b (TP1)         equal             equal             1
========================  ================  ================  ====================

(a v2p table has ``num_pages + 1`` entries: ``2,065,600 // 10 == 206,560``.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvd.errors import InvalidArgument
from kvd.pool.layout import GroupKind, GroupSpec, Layout

__all__ = ["PRESETS", "preset", "preset_names", "load_layout"]


# ---------------------------------------------------------------------------------------------
# tiny-hybrid: a made-up model with one group of every kind, for tests and the CPU demo.
#   float32 (4 B) so tests can compare bytes exactly; page_size 4 tokens.
#   full : 2 layers x 2 heads x (16 K + 16 V) x 4 B =   512 B/token -> page 4 x 512 = 2,048 B
#   swa  : same shape, window 32                     =   512 B/token -> page         2,048 B
#   state: 1 layer x 64 elems x 4 B                  =   256 B/slot
#   draft: 1 layer x 1 head x (16 + 16) x 4 B        =   128 B/token -> page 8 x 128 = 1,024 B
# ---------------------------------------------------------------------------------------------
_TINY_HYBRID = Layout(
    name="tiny-hybrid",
    page_size=4,
    dtype="float32",
    groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=2, num_kv_heads=2, head_dim=16),
        GroupSpec(kind=GroupKind.SWA, num_layers=2, num_kv_heads=2, head_dim=16, window=32),
        GroupSpec(kind=GroupKind.STATE, num_layers=1, state_elems=64),
        GroupSpec(kind=GroupKind.DRAFT, num_layers=1, num_kv_heads=1, head_dim=16, page_size=8),
    ),
    source="synthetic: a tiny demo model for tests and the CPU demo; not a real checkpoint",
)

# ---------------------------------------------------------------------------------------------
# gemma-4-31b-it at TP2. text_config: 60 layers, 5 sliding : 1 full -> 50 swa + 10 full;
#   sliding: num_key_value_heads 16, head_dim 256, sliding_window 1024
#   full   : num_global_key_value_heads 4, global_head_dim 512, attention_k_eq_v true
#   per rank (TP2): swa 16/2 = 8 heads; full 4/2 = 2 heads.
#   swa : 50 x 8 x (256 + 256) x 2 B = 409,600 B/token
#   full: 10 x 2 x (512 + 512) x 2 B =  40,960 B/token   (K and V both stored, see below)
#   e_swa / e_full = 409,600 / 40,960 = 10  == seed 004's 2,065,600 / 206,560.
#   Storing K once on the k_eq_v layers would give 20,480 B and a ratio of 20, which seed 004
#   rules out: K gets RoPE and a scaled norm, V an unscaled norm, so the cached tensors differ.
# ---------------------------------------------------------------------------------------------
_GEMMA4_31B_TP2 = Layout(
    name="gemma-4-31b-it-tp2",
    page_size=16,
    dtype="bfloat16",
    groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=10, num_kv_heads=2, head_dim=512),
        GroupSpec(kind=GroupKind.SWA, num_layers=50, num_kv_heads=8, head_dim=256, window=1024),
    ),
    source=(
        "https://huggingface.co/google/gemma-4-31B-it/blob/main/config.json (text_config; the "
        "same text_config as google/gemma-4-31B, locked at revision 2d418d1b in "
        "github.com/amazingvince/gemma4-fa4-kernels configs/model/gemma4-31b.lock.json): 60 layers "
        "= 50 sliding (16 kv heads, head_dim 256, window 1024) + 10 full (4 global kv heads, "
        "global_head_dim 512, attention_k_eq_v). TP2 -> 8 and 2 kv heads per rank. K and V are "
        "both cached on the k_eq_v layers (they differ after RoPE/norms). Derived check, seed 004: "
        "e_swa/e_full = 50*8*512 / (10*2*1024) = 10, matching v2p lengths 2,065,601 vs 206,561."
    ),
)

# ---------------------------------------------------------------------------------------------
# gemma-4-E2B-it at TP1. text_config: 35 layers, 4 sliding : 1 full -> 28 swa + 7 full;
#   num_key_value_heads 1 (num_global_key_value_heads null -> 1), head_dim 256,
#   global_head_dim 512, attention_k_eq_v false, sliding_window 512, num_kv_shared_layers 20.
#   swa : 28 x 1 x (256 + 256) x 2 B = 28,672 B/token
#   full:  7 x 1 x (512 + 512) x 2 B = 14,336 B/token
#   e_swa / e_full = 2  == seed 004's 7,576,245 / 3,788,122 (2:1 in pages).
#   KV sharing: layers 15-34 reuse the KV of layers 13 (sliding) / 14 (full), so only 12 swa +
#   3 full layers produce KV. Counting only those gives the same 2:1 ratio (6,144 vs 3,072 B);
#   the layer counts here follow seed 004 (7 / 28) because the absolute budget it implies,
#   7,576,245 x 14,336 B = 108.6 GB on one GPU, only fits if every layer has its own KV
#   (deduplicated it would be 46.5 GB, less than half the card at mem-fraction 0.8).
# ---------------------------------------------------------------------------------------------
_GEMMA4_E2B = Layout(
    name="gemma-4-e2b-it",
    page_size=16,
    dtype="bfloat16",
    groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=7, num_kv_heads=1, head_dim=512),
        GroupSpec(kind=GroupKind.SWA, num_layers=28, num_kv_heads=1, head_dim=256, window=512),
    ),
    source=(
        "https://huggingface.co/google/gemma-4-E2B-it/blob/main/config.json (text_config): 35 "
        "layers = 28 sliding (1 kv head, head_dim 256, window 512) + 7 full (1 kv head, "
        "global_head_dim 512), attention_k_eq_v false, num_kv_shared_layers 20. TP1. Every layer "
        "is given its own KV as in SGLang's pool (seed 004: 7 full / 28 sliding); deduplicating "
        "the 20 shared layers (3 full + 12 sliding) keeps the same ratio. Derived check, seed 004: "
        "e_swa/e_full = 28*512 / (7*1024) = 2, matching 7,576,246 vs 3,788,123 pages."
    ),
)

# ---------------------------------------------------------------------------------------------
# gpt-oss-20b at TP1. config: 24 layers alternating sliding / full -> 12 + 12;
#   num_key_value_heads 8, head_dim 64, sliding_window 128; attention runs in bf16.
#   full: 12 x 8 x (64 + 64) x 2 B = 24,576 B/token
#   swa : 12 x 8 x (64 + 64) x 2 B = 24,576 B/token   -> equal pages (seed 004).
# ---------------------------------------------------------------------------------------------
_GPT_OSS_20B = Layout(
    name="gpt-oss-20b",
    page_size=16,
    dtype="bfloat16",
    groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=12, num_kv_heads=8, head_dim=64),
        GroupSpec(kind=GroupKind.SWA, num_layers=12, num_kv_heads=8, head_dim=64, window=128),
    ),
    source=(
        "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json: 24 layers alternating "
        "sliding_attention / full_attention (12 + 12), 8 kv heads, head_dim 64, sliding_window "
        "128. TP1. Derived check, seed 004: equal entry bytes, so equal full and swa pages."
    ),
)

# ---------------------------------------------------------------------------------------------
# Qwen3.5-0.8B at TP1. text_config: 24 layers, [linear x3, full] x 6 -> 18 linear + 6 full.
#   full attention: num_key_value_heads 2, head_dim 256
#     full: 6 x 2 x (256 + 256) x 2 B = 12,288 B/token
#   Gated DeltaNet (per layer per request, as SGLang's Mamba2StateShape sizes it):
#     linear_num_key_heads 16, linear_num_value_heads 16, linear_key_head_dim 128,
#     linear_value_head_dim 128, linear_conv_kernel_dim 4
#     temporal (recurrent) state: 16 v-heads x 128 x 128          = 262,144 elems, float32
#     conv state: conv_dim x (kernel - 1), conv_dim = 2 x 16 x 128 + 16 x 128 = 6,144
#                 6,144 x 3                                      =  18,432 elems, bfloat16
#     bytes/layer = 262,144 x 4 + 18,432 x 2 = 1,048,576 + 36,864 = 1,085,440 B
#   A group has one dtype, so the state group is float32 with the bf16 conv state counted in
#   4-byte words: state_elems = 262,144 + 18,432 / 2 = 271,360 (x 4 B = 1,085,440 B, exact).
#     slot: 18 x 1,085,440 B = 19,537,920 B (18.6 MiB) per request.
# ---------------------------------------------------------------------------------------------
_QWEN35_0_8B = Layout(
    name="qwen3.5-0.8b",
    page_size=16,
    dtype="bfloat16",
    groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=6, num_kv_heads=2, head_dim=256),
        GroupSpec(kind=GroupKind.STATE, num_layers=18, state_elems=271_360, dtype="float32"),
    ),
    source=(
        "https://huggingface.co/Qwen/Qwen3.5-0.8B/blob/main/config.json (text_config): 24 layers, "
        "full_attention_interval 4 -> 18 linear (Gated DeltaNet) + 6 full (2 kv heads, head_dim "
        "256). TP1. State per linear layer, sized as SGLang's Mamba2StateShape "
        "(sgl-project/sglang python/sglang/srt/configs/mamba_utils.py) with the default float32 "
        "SSM dtype: temporal 16 v-heads x 128 x 128 = 262,144 float32 + conv (2*16*128 + "
        "16*128) x (4-1) = 18,432 bfloat16 = 1,085,440 B, expressed as 271,360 float32 words "
        "(the bf16 conv state packed two per word). Derived from the public config, not measured."
    ),
)

#: Every named layout, by name. The values are frozen; share them freely.
PRESETS: dict[str, Layout] = {
    layout.name: layout
    for layout in (_TINY_HYBRID, _GEMMA4_31B_TP2, _GEMMA4_E2B, _GPT_OSS_20B, _QWEN35_0_8B)
}


def preset_names() -> list[str]:
    """The known preset names, sorted."""
    return sorted(PRESETS)


def preset(name: str) -> Layout:
    """Return the preset layout called ``name``.

    Raises :class:`~kvd.errors.InvalidArgument` naming every known preset if there is none.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown layout preset {name!r}; known presets: {', '.join(preset_names())}"
        ) from None


def load_layout(spec: str | os.PathLike[str]) -> Layout:
    """Resolve ``spec`` to a layout: a preset name, or a path to a YAML or JSON layout file.

    A preset name wins over a file of the same name. A file holds one mapping with the fields of
    :class:`~kvd.pool.layout.Layout` (what ``layout.model_dump(mode="json")`` writes); ``.json`` files
    are read as JSON, anything else as YAML (a superset of JSON).

    Raises :class:`~kvd.errors.InvalidArgument` when ``spec`` is neither a preset nor a readable
    file, when the file does not parse, or when its content is not a valid layout; every message
    from a file names the file's path, and a validation failure carries pydantic's message.
    """
    text = os.fspath(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if not path.is_file():
        raise InvalidArgument(
            f"layout {text!r} is neither a known preset ({', '.join(preset_names())}) "
            f"nor an existing file"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"layout file {path}: cannot read it: {e}") from e
    data = _parse(path, raw)
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"layout file {path}: expected a mapping of Layout fields at the top level, "
            f"got {type(data).__name__}"
        )
    try:
        return Layout.model_validate(data)
    except ValidationError as e:
        raise InvalidArgument(f"layout file {path}: not a valid layout: {e}") from e


def _parse(path: Path, raw: str) -> Any:
    """Parse ``raw`` as JSON for a ``.json`` path and as YAML otherwise; InvalidArgument on error."""
    try:
        if path.suffix.lower() == ".json":
            return json.loads(raw)
        return yaml.safe_load(raw)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        raise InvalidArgument(f"layout file {path}: not valid {kind}: {e}") from e
