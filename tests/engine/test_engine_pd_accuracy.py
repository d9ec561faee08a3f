"""Prefill on one daemon, decode on another: outputs equal the colocated reference token for
token, with bit-identical logit traces, for prompts crossing the SWA window boundary."""

from __future__ import annotations

import pytest
from engine_kit import engines, pd_pair, requests, run_pd

from kvd.engine.records import EngineConfig
from kvd.engine.reference import compare


@pytest.mark.parametrize("chunk", [None, 13], ids=["whole-prompt", "chunked-13"])
@pytest.mark.parametrize("spec_k", [0, 3], ids=["greedy", "speculative-3"])
def test_pd_equals_colocated(models, reference, chunk, spec_k):
    cfg = EngineConfig(chunk=chunk, spec_k=spec_k)
    reqs = requests()
    ref = reference(reqs, cfg)
    with pd_pair(models) as pair:
        got, stats = run_pd(pair, models, reqs, cfg)
        outbox = pair.prefill.daemon.outbox
    assert compare(got, ref) == []
    assert stats.recv_leases == len(reqs)
    # The prefill engine opens each transfer with its chunk: every Send used the plan BeginSend made.
    assert outbox is not None and outbox.items_total > 0 and outbox.planned_ahead_total == outbox.items_total
    if spec_k:
        assert stats.proposed > 0 and 0 < stats.accepted < stats.proposed


def test_pd_under_memory_pressure_retracts_restores_and_compacts(models, reference):
    """A decode pool that holds about two requests: admissions retract running requests to host
    memory, they come back into new pages, the engine compacts between rounds (around the pins
    of requests still arriving) -- and the outputs do not change."""
    cfg = EngineConfig(chunk=32, spec_k=3, compact_every=2)
    reqs = requests((150, 230, 200, 100, 180, 64, 210, 120), max_new=36, seed=11, prefix="p")
    ref = reference(reqs, cfg)
    with pd_pair(models, decode_bytes=400 << 10) as pair:
        got, stats = run_pd(pair, models, reqs, cfg, inflight=4)
        node = pair.decode.daemon.node.stats()
    assert compare(got, ref) == []
    assert stats.retractions >= 1 and stats.restores == stats.retractions
    assert stats.compactions >= 1 and node.pool.compactions_done == stats.compactions
    assert node.stale_refusals_total == 0


def test_compaction_refused_while_a_lease_pins_pages_then_done_around_them(models, reference):
    """Request b is admitted (its RECV lease live, its KV not sent yet) below request a; a
    finishes and leaves holes. A plain compaction would move b's pinned pages: refused. The
    engine compacts around them; b's ticket stays valid and its output is still exact."""
    cfg = EngineConfig(chunk=16)
    a, b = requests((120, 90), max_new=32, prefix="pin")
    ref = reference([a, b], cfg)
    with pd_pair(models) as pair:
        pre, dec = engines(pair, models, cfg)
        dec.start(pre.prefill(a, dec.admit(a)))
        assert dec.poll_ready(timeout=5) == [] and a.rid in dec.running
        ticket_b = dec.admit(b)
        got = {}
        while a.rid in dec.running:
            got.update((c.rid, c) for c in dec.step())
        res = dec.compact()
        assert dec.stats.compactions_refused == 1 and dec.stats.compactions == 1 and res.gap_gained_bytes > 0
        dec.start(pre.prefill(b, ticket_b))
        assert dec.poll_ready(timeout=5) == []
        while dec.busy:
            got.update((c.rid, c) for c in dec.step())
        assert pair.decode.daemon.node.stats().stale_refusals_total == 0
    assert compare(got, ref) == []


def test_pd_post_capture_engines_finalize_before_serving(models, reference):
    cfg = EngineConfig(chunk=16, spec_k=2)
    reqs = requests((33, 90), max_new=32, prefix="pc")
    ref = reference(reqs, cfg)
    with pd_pair(models, post_capture=True) as pair:
        for n in (pair.prefill, pair.decode):
            info = n.client.info()
            assert info.finalized and info.reserved_bytes > n.att.tensor.numel()
        got, _ = run_pd(pair, models, reqs, cfg)
    assert compare(got, ref) == []


def test_pd_over_mooncake_tcp(models, reference):
    pytest.importorskip("mooncake.engine")
    cfg = EngineConfig(chunk=24, spec_k=3)
    reqs = requests((31, 65, 150), max_new=32, prefix="mc")
    ref = reference(reqs, cfg)
    with pd_pair(models, backend="mooncake") as pair:
        got, _ = run_pd(pair, models, reqs, cfg)
    assert compare(got, ref) == []
