"""The reference engine's handoff takes the short flow (issue 16): the decode side's allocate +
RECV lease + ticket in one call, the prefill side's last Send freeing the request, and no Free
or AcquireLease round trip left; and the decode engine's start-up warm-up of the page moves."""

from __future__ import annotations

from collections import Counter

from engine_kit import pd_pair, requests, run_pd

from kvd.engine.decode import DecodeEngine
from kvd.engine.local import LocalKV
from kvd.engine.paged import PagedKV
from kvd.engine.records import EngineConfig
from kvd.engine.reference import compare
from kvd.engine.warmup import MOVE_LENGTHS, warmup_requests


class _Counted:
    """A client whose method calls are counted by name."""

    def __init__(self, client, calls: Counter) -> None:
        self._client, self._calls = client, calls

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def counted(*a, **kw):
            self._calls[name] += 1
            return attr(*a, **kw)

        return counted


def test_the_handoff_takes_the_short_flow(models, reference):
    cfg = EngineConfig(chunk=32, spec_k=3)
    reqs = requests((5, 33, 100), max_new=12, seed=3, prefix="s")
    ref = reference(reqs, cfg)
    pre_calls, dec_calls = Counter(), Counter()
    with pd_pair(models) as pair:
        pair.prefill.client = _Counted(pair.prefill.client, pre_calls)  # type: ignore[assignment]
        pair.decode.client = _Counted(pair.decode.client, dec_calls)  # type: ignore[assignment]
        got, stats = run_pd(pair, models, reqs, cfg)
        # pd_pair's exit checks both pools: no request and no lease left on either node
    assert compare(got, ref) == []
    assert dec_calls["allocate_recv"] == len(reqs) and dec_calls["acquire_lease"] == 0 and stats.recv_leases == len(reqs)
    assert dec_calls["wait_ready"] == len(reqs)  # answered on READY: one call each, not a poll loop
    assert pre_calls["free"] == 0, pre_calls  # the last Send freed each request
    assert pre_calls["send"] == sum(-(-len(r.prompt) // 32) for r in reqs)


def test_tickets_live_as_long_as_the_engine_asks(models, reference):
    """``EngineConfig.ticket_ttl``: each admitted request's RECV lease lives that long (the
    daemons here keep a 30 s lease TTL for everything else)."""
    cfg = EngineConfig(chunk=32, ticket_ttl=45.0)
    reqs = requests((9, 40), max_new=4, seed=5, prefix="ttl")
    ref = reference(reqs, cfg)
    leases = []
    with pd_pair(models) as pair:
        client = pair.decode.client

        class _Recording:
            def __getattr__(self, name):
                return getattr(client, name)

            def allocate_recv(self, rid, tokens, *, ttl=None):
                vec, lease = client.allocate_recv(rid, tokens, ttl=ttl)
                leases.append(lease)
                return vec, lease

        pair.decode.client = _Recording()  # type: ignore[assignment]
        got, _ = run_pd(pair, models, reqs, cfg)
    assert compare(got, ref) == []
    assert len(leases) == len(reqs) and all(40.0 < le.expires_in <= 45.0 for le in leases), leases


def test_warm_up_moves_pages_and_leaves_the_pool_as_it_was(models):
    kv = LocalKV(models.layout, 8 << 20)
    try:
        dec = DecodeEngine(kv, PagedKV(models.layout, kv.views), models, EngineConfig(spec_k=3))
        done = kv.pool.stats().compactions_done
        dec.warm_up(MOVE_LENGTHS)
        st = kv.pool.stats()
        assert st.compactions_done == done + 1 and st.pages_moved > 0  # the compaction had pages to move
        assert not kv.pool.request_ids and st.requests_offloaded == 0
        kv.pool.check()
        assert dec.stats.compactions == 0 and dec.stats.retractions == 0  # not counted as the engine's own
    finally:
        kv.close()


def test_the_warm_up_set_spans_the_workloads_shapes():
    from kvd.demo.run import workload
    from kvd.engine.model import TargetConfig

    cfg = EngineConfig(chunk=64, spec_k=3)
    warm = warmup_requests(cfg)
    lens = [len(r.prompt) for r in warm]
    w = TargetConfig().window
    work = [len(r.prompt) for r in workload(64, 0)]
    assert min(lens) < w <= max(lens) and max(lens) >= max(work)  # below the window .. the longest prompt
    assert {-(-n // 64) for n in work} <= {-(-n // 64) for n in lens}  # every chunk count the workload meets
    assert all(r.max_new > 2 * (cfg.spec_k + 1) for r in warm)  # full speculative rounds, then the shortened ones
    assert len({r.rid for r in warm}) == len(warm) and all(r.rid.startswith("warmup-") for r in warm)
