"""The reference engine without a transfer: its layout is kvd's tiny-hybrid preset, its paged
KV path equals recomputing from scratch, and chunking or speculation never change a token."""

from __future__ import annotations

import pytest
from engine_kit import requests

from kvd.engine.records import EngineConfig
from kvd.engine.model import DraftConfig, TargetConfig, layout_for
from kvd.engine.reference import compare, recompute
from kvd.pool.presets import preset


def test_layout_from_the_model_configs_is_the_tiny_hybrid_preset(models):
    tiny = preset("tiny-hybrid")
    assert models.layout.fingerprint == tiny.fingerprint
    assert layout_for(TargetConfig(), DraftConfig()).canonical() == tiny.canonical()
    # GQA, a window shorter than most prompts, a state layer, a draft with its own page size
    t = TargetConfig()
    assert t.n_heads > t.n_kv_heads and t.window < 64 and "state" in t.layers
    assert DraftConfig().page_size != t.page_size


def test_paged_colocated_run_equals_recomputing_from_scratch(models, reference):
    """The oracle knows nothing of pages, windows in the pool or state slots: every step
    recomputes the whole sequence. Tokens must match exactly. The trace only within 1e-9
    relative: the oracle multiplies other shapes (the whole sequence, not one step's rows), and
    the CPU's kernels (AVX2 or AVX-512, Intel or AMD, one thread or two) may block a reduction of
    another shape differently, so the last bits of a float sum are not the same claim on every
    x86-64 CPU. Bit-exactness is asserted where it is sound: PD against colocated, same kernels
    on the same shapes (test_engine_pd_accuracy)."""
    reqs = requests((5, 31, 33, 36, 70), max_new=12)
    ref = reference(reqs, EngineConfig(chunk=16))
    for r in reqs:
        tokens, trace = recompute(models, r.prompt, r.max_new)
        assert ref[r.rid].tokens == tokens, r.rid
        assert ref[r.rid].target_trace == pytest.approx(trace, rel=1e-9, abs=1e-9), r.rid


@pytest.mark.parametrize("chunk", [7, 32, 64])
def test_chunked_prefill_gives_the_same_tokens(reference, chunk):
    reqs = requests()
    whole = reference(reqs, EngineConfig())
    chunked = reference(reqs, EngineConfig(chunk=chunk))
    assert {r: c.tokens for r, c in chunked.items()} == {r: c.tokens for r, c in whole.items()}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_decoding_equals_plain_greedy(reference, k):
    """Greedy verification: the output is the target's greedy output whatever the draft says."""
    reqs = requests()
    plain = reference(reqs, EngineConfig(chunk=16))
    spec = reference(reqs, EngineConfig(chunk=16, spec_k=k))
    assert {r: c.tokens for r, c in spec.items()} == {r: c.tokens for r, c in plain.items()}
    accepted = sum(c.accepted for c in spec.values())
    proposed = sum(c.proposed for c in spec.values())
    assert 0 < accepted < proposed, "the draft should be right sometimes and wrong sometimes"
    # fewer target passes than tokens: speculation did something
    assert sum(len(c.tokens) for c in spec.values()) - accepted < sum(len(c.tokens) for c in plain.values())


def test_traces_tell_runs_apart(reference):
    """compare() is not vacuous: different prompts give different completions."""
    a = reference(requests(seed=1, prefix="x"), EngineConfig())
    b = reference(requests(seed=2, prefix="x"), EngineConfig())
    assert compare(a, b) == sorted(a)
