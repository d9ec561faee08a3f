"""Layouts from Hugging Face configs (kvd.pool.models): one config per family, written here (no hub
downloads), with the bytes per token vLLM / SGLang compute for it; refusals name what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvd.errors import InvalidArgument
from kvd.pool.layout import GroupKind
from kvd.pool.models import layout_from_config, load_model
from kvd.pool.presets import (
    GEMMA4_31B_CONFIG,
    GEMMA4_E2B_CONFIG,
    GPT_OSS_20B_CONFIG,
    PRESETS,
    QWEN35_0_8B_CONFIG,
)

BF16 = 2

LLAMA_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
            "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
QWEN3_8B = {"model_type": "qwen3", "torch_dtype": "bfloat16", "num_hidden_layers": 36, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "sliding_window": None,
            "use_sliding_window": False}
GEMMA2_9B = {"model_type": "gemma2", "torch_dtype": "bfloat16", "num_hidden_layers": 42, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096, "hidden_size": 3584}
GEMMA3_27B = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62,
              "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
              "sliding_window_pattern": 6}, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16",
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "hidden_size": 7168}
GRANITE_4 = {"model_type": "granitemoehybrid", "torch_dtype": "bfloat16", "num_hidden_layers": 8, "hidden_size": 1536,
             "num_attention_heads": 12, "num_key_value_heads": 4, "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
             "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_n_groups": 1,
             "mamba_expand": 2}
FALCON_H1 = {"model_type": "falcon_h1", "torch_dtype": "bfloat16", "num_hidden_layers": 24, "hidden_size": 1024,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "mamba_d_ssm": 1536, "mamba_n_heads": 24,
             "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_n_groups": 1}
NEMOTRON_H = {"model_type": "nemotron_h", "torch_dtype": "bfloat16", "num_hidden_layers": 8, "hidden_size": 4096,
              "hybrid_override_pattern": "M-M*-M-M*", "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "conv_kernel": 4,
              "n_groups": 8, "expand": 2}
QWEN3_NEXT = {"model_type": "qwen3_next", "torch_dtype": "bfloat16", "num_hidden_layers": 48, "hidden_size": 2048,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
              "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _e(layout, kind):
    return layout.entry_bytes(layout.group(kind))


def test_full_attention_llama_and_qwen3():
    l = layout_from_config(LLAMA_8B, tp=2)
    assert l.group_names == ["full"] and _e(l, "full") == 32 * (8 // 2) * 2 * (4096 // 32) * BF16  # head_dim from hidden
    q = layout_from_config(QWEN3_8B)
    assert q.group_names == ["full"] and _e(q, "full") == 36 * 8 * 2 * 128 * BF16  # use_sliding_window false: no swa


def test_sliding_gemma2_alternates_and_gemma3_every_sixth_is_full():
    g2 = layout_from_config(GEMMA2_9B)
    assert (g2.group("full").num_layers, g2.group("swa").num_layers, g2.group("swa").window) == (21, 21, 4096)
    g3 = layout_from_config(GEMMA3_27B, tp=2)  # text_config read
    assert (g3.group("full").num_layers, g3.group("swa").num_layers) == (10, 52)
    assert _e(g3, "swa") == 52 * 8 * 2 * 128 * BF16


def test_gemma4_full_layers_have_their_own_heads_and_seed004_ratios():
    g = layout_from_config(GEMMA4_31B_CONFIG, tp=2)
    assert (g.group("full").num_layers, g.group("full").num_kv_heads, g.group("full").head_dim) == (10, 2, 512)
    assert (g.group("swa").num_layers, g.group("swa").num_kv_heads, g.group("swa").window) == (50, 8, 1024)
    assert _e(g, "full") == 40_960 and _e(g, "swa") == 409_600  # 10:1 -> 2,065,601 : 206,561
    e2b = layout_from_config(GEMMA4_E2B_CONFIG)
    assert _e(e2b, "swa") == 2 * _e(e2b, "full")  # 7 full to 28 sliding, 2:1 in pages
    oss = layout_from_config(GPT_OSS_20B_CONFIG)
    assert _e(oss, "swa") == _e(oss, "full") == 12 * 8 * 128 * BF16  # 1:1


@pytest.mark.parametrize("config,tp,name", [(GEMMA4_31B_CONFIG, 2, "gemma-4-31b-it-tp2"), (GEMMA4_E2B_CONFIG, 1, "gemma-4-e2b-it"),
                                            (GPT_OSS_20B_CONFIG, 1, "gpt-oss-20b"), (QWEN35_0_8B_CONFIG, 1, "qwen3.5-0.8b")])
def test_presets_are_their_configs(config, tp, name, tmp_path):
    """A preset and `kvd serve --model its-config.json` give byte-compatible layouts."""
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    derived = load_model(path, tp=tp)
    assert derived.fingerprint == PRESETS[name].fingerprint
    assert derived.groups == PRESETS[name].groups


def test_mla_one_latent_per_token_no_v_same_on_every_rank():
    for tp in (1, 8):
        d = layout_from_config(DEEPSEEK_V3, tp=tp)
        f = d.group("full")
        assert (f.num_layers, f.num_kv_heads, f.head_dim, f.v_dim) == (61, 1, 576, 0)
        assert _e(d, "full") == 61 * (512 + 64) * BF16


def test_mamba2_granite_state_slot():
    g = layout_from_config(GRANITE_4, ssm_dtype="float32")
    assert g.group("full").num_layers == 2 and g.group("state").num_layers == 6
    conv = (4 - 1) * (48 * 64 + 2 * 1 * 128) * BF16  # bf16 conv state
    ssm = 48 * 64 * 128 * 4  # float32 ssm state
    assert _e(g, "state") == 6 * (conv + ssm)
    # TP2: heads split, the single group replicated to 2 (vLLM's extra_groups_for_head_shards)
    g2 = layout_from_config(GRANITE_4, tp=2, ssm_dtype="bfloat16")
    assert g2.group("state").state_elems == (4 - 1) * (48 * 64 + 2 * 2 * 128) // 2 + 24 * 64 * 128


def test_falcon_h1_every_layer_has_attention_and_mamba():
    f = layout_from_config(FALCON_H1, ssm_dtype="bfloat16")
    assert f.group("full").num_layers == f.group("state").num_layers == 24
    assert f.group("state").state_elems == 3 * (1536 + 2 * 128) + 24 * 64 * 128


def test_nemotron_h_pattern():
    n = layout_from_config(NEMOTRON_H, tp=2, ssm_dtype="bfloat16")
    assert n.group("full").num_layers == 2 and n.group("state").num_layers == 4
    assert n.group("state").state_elems == 3 * (128 * 64 + 2 * 8 * 128) // 2 + 64 * 64 * 128


def test_qwen3_next_gated_deltanet():
    q = layout_from_config(QWEN3_NEXT, tp=2)
    assert q.group("full").num_layers == 12 and q.group("state").num_layers == 36
    conv = 3 * (2 * 16 * 128 + 32 * 128) // 2  # bf16, per rank
    ssm = 16 * 128 * 128  # 32 v-heads / 2, float32
    assert q.group("state").state_elems == ssm + conv * 2 // 4
    assert q.group("state").dtype == "float32" and q.group("full").num_kv_heads == 1


def test_draft_model_becomes_the_draft_group(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(LLAMA_8B))
    small = {**LLAMA_8B, "num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4}
    (tmp_path / "d.json").write_text(json.dumps(small))
    l = load_model(tmp_path / "t.json", tp=2, draft=tmp_path / "d.json")
    d = l.group("draft")
    assert (d.num_layers, d.num_kv_heads, d.head_dim) == (2, 2, 128)
    (tmp_path / "g.json").write_text(json.dumps(GEMMA2_9B))
    with pytest.raises(InvalidArgument, match=r"draft config .*g\.json.*full attention only"):
        load_model(tmp_path / "t.json", draft=tmp_path / "g.json")


def test_unknown_architecture_is_refused_naming_missing_fields(tmp_path):
    rwkv = {"model_type": "rwkv", "architectures": ["RwkvForCausalLM"], "num_hidden_layers": 24, "hidden_size": 2048,
            "attention_hidden_size": 2048}
    with pytest.raises(InvalidArgument) as e:
        layout_from_config(rwkv)
    msg = str(e.value)
    assert "'rwkv'" in msg and "RwkvForCausalLM" in msg and "num_key_value_heads" in msg and "num_attention_heads" in msg
    with pytest.raises(InvalidArgument, match="missing field.*num_hidden_layers"):
        layout_from_config({"model_type": "mystery"})
    with pytest.raises(InvalidArgument, match="missing field.*qk_rope_head_dim"):
        layout_from_config({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"})
    with pytest.raises(InvalidArgument, match="missing field.*mamba_d_state"):
        layout_from_config({k: v for k, v in GRANITE_4.items() if k != "mamba_d_state"})
    with pytest.raises(InvalidArgument, match="missing field.*linear_conv_kernel_dim"):
        layout_from_config({k: v for k, v in QWEN3_NEXT.items() if k != "linear_conv_kernel_dim"})
    with pytest.raises(InvalidArgument, match=r"layer types \['chunked_attention'\]"):
        layout_from_config({**LLAMA_8B, "num_hidden_layers": 2, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(InvalidArgument, match="no full-attention layer"):
        layout_from_config({**GRANITE_4, "layer_types": ["mamba"] * 8})
    with pytest.raises(InvalidArgument, match="do not split across tp=3"):
        layout_from_config(LLAMA_8B, tp=3)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="cannot read it as JSON"):
        load_model(tmp_path)  # a directory: its config.json
    with pytest.raises(InvalidArgument, match="is not a file"):
        load_model(tmp_path / "absent.json")


def test_settings_model_tp_draft(tmp_path):
    from kvd.config import load_settings
    from kvd.server.app import validate

    (tmp_path / "config.json").write_text(json.dumps(GEMMA4_31B_CONFIG))
    s = load_settings(model=str(tmp_path), tp=2, listen_unix=str(tmp_path / "s"))
    assert validate(s).fingerprint == PRESETS["gemma-4-31b-it-tp2"].fingerprint
    with pytest.raises(InvalidArgument, match="both model .* and layout"):
        load_settings(model=str(tmp_path), layout="gpt-oss-20b")
    with pytest.raises(InvalidArgument, match="set model"):
        load_settings(tp=2)
