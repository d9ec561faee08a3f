"""Tiny random-weight Hugging Face checkpoints built locally (no hub): config, seeded weights and a
byte-level BPE tokenizer trained here. What the vLLM tier runs on (float32, a few layers).

    python tests/vllm/tiny_models.py OUTDIR [family ...]     families: see CONFIGS
"""

from __future__ import annotations

import os
import sys

VOCAB = 512
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3

COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
              pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.1,
              tie_word_embeddings=False)

CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", num_hidden_layers=2),
    # sliding window 16, 3 local : 1 global (Gemma 3's pattern, shrunk)
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=4, sliding_window=16,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=32),
    # Mamba2 + attention + MoE
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=4,
                             layer_types=["mamba", "attention", "mamba", "attention"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128,
                             mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
                             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32),
}


def _corpus() -> list[str]:
    words = ("the quick brown fox jumps over a lazy dog while prefill and decode nodes move key value "
             "cache blocks between processes kernel tensor layer token block slot page daemon engine").split()
    return [" ".join(words[(i * 13 + j * 5) % len(words)] for j in range(5 + (i * 7) % 11)) + f" {i}" for i in range(2000)]


def _tokenizer(outdir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(outdir)


def build(family: str, root: str) -> str:
    """Write ``root/family`` (once) and return its path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    outdir = os.path.join(root, family)
    if os.path.exists(os.path.join(outdir, "tokenizer.json")):
        return outdir
    os.makedirs(outdir, exist_ok=True)
    spec = dict(COMMON, **CONFIGS[family])
    mt = spec.pop("model_type")
    if mt == "granitemoehybrid":
        spec.pop("head_dim")  # derived from hidden / heads
    cfg = AutoConfig.for_model(mt, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.save_pretrained(outdir)
    _tokenizer(outdir)
    return outdir


if __name__ == "__main__":
    for fam in sys.argv[2:] or list(CONFIGS):
        print(build(fam, sys.argv[1]))
