"""The producer connector's scheduler side, step by step, on vLLM's own scheduler records: which
tokens of a request each step saves into kvd and from which vLLM blocks -- across chunked
prefill, a prefix-cache hit, and a preemption that gives the request all new blocks. No engine:
the hook runs on hand-built scheduler outputs (vLLM 0.32's CachedRequestData)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# Not "vllm": with tests/ on sys.path (rootdir conftest), tests/vllm imports as a namespace package.
pytest.importorskip("vllm.config", reason="the vLLM tier runs in .venv-vllm (make venv-vllm)")

from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402

from kvd.connectors.vllm_scheduler import Scheduler  # noqa: E402

R = "req-0"
TOKENS = 200  # block 32: 7 blocks


def _producer() -> Scheduler:
    """The scheduler-side state ``build_connector_meta`` reads: a request with a ticket, as
    ``update_state_after_alloc`` records it (the hook alone: no vLLM config, no daemon)."""
    c = Scheduler(producer=True, book=None)
    c.saving = {R: {"ticket": b"t", "rid": "kvd-0", "tokens": TOKENS, "blocks": None, "params": {}}}
    return c


def _step(new: list, cached: CachedRequestData, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs, out.scheduled_cached_reqs, out.num_scheduled_tokens = new, cached, {R: scheduled}
    return out


def _new(blocks: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    # NewRequestData's fields the hook reads (the rest are the model's inputs)
    return _step([SimpleNamespace(req_id=R, block_ids=(blocks,), num_computed_tokens=computed)], CachedRequestData.make_empty(), scheduled)


def _cached(new_blocks: list[int] | None, computed: int, scheduled: int, *, resumed: bool = False) -> SchedulerOutput:
    cached = CachedRequestData(req_ids=[R], resumed_req_ids={R} if resumed else set(), new_token_ids=[], all_token_ids={},
                               new_block_ids=[(new_blocks,) if new_blocks is not None else None], num_computed_tokens=[computed],
                               num_output_tokens=[0])
    return _step([], cached, scheduled)


def _saves(c: Scheduler, out: SchedulerOutput) -> list[tuple[int, int, bool, int, list[int]]]:
    return [(s.start, s.end, s.last, s.cached, s.block_ids[0]) for s in c.build_connector_meta(out).saves]


def test_chunked_prefill_saves_each_chunk_once():
    c = _producer()
    assert _saves(c, _new([1, 2], 0, 64)) == [(0, 64, False, 0, [1, 2])]
    assert _saves(c, _cached([3, 4], 64, 64)) == [(64, 128, False, 0, [1, 2, 3, 4])]
    assert _saves(c, _cached([5, 6, 7], 128, 72)) == [(128, 200, True, 0, [1, 2, 3, 4, 5, 6, 7])]
    assert _saves(c, _cached(None, 200, 1)) == []  # decoding: nothing more to save


def test_a_prefix_cache_hit_is_saved_with_the_first_chunk():
    """vLLM's first step starts past the cached blocks: the save starts at token 0."""
    c = _producer()
    assert _saves(c, _new([9, 8, 3], 64, 32)) == [(0, 96, False, 64, [9, 8, 3])]
    assert _saves(c, _cached([4, 5, 6, 7], 96, 104)) == [(96, 200, True, 0, [9, 8, 3, 4, 5, 6, 7])]


def test_a_preempted_request_saves_on_from_its_new_blocks():
    """Preempted after 128 tokens were saved, then scheduled again with all new blocks (vLLM's
    resumed_req_ids): the recomputed tokens are not saved twice, and the rest are read from the
    new blocks -- not from the old list with the new one appended."""
    c = _producer()
    _saves(c, _new([1, 2], 0, 64))
    _saves(c, _cached([3, 4], 64, 64))
    assert _saves(c, _cached([7, 8, 9], 0, 96, resumed=True)) == []  # recomputing what kvd holds
    assert _saves(c, _cached([10, 11], 96, 64)) == [(128, 160, False, 0, [7, 8, 9, 10, 11])]
    assert _saves(c, _cached([12, 13], 160, 40)) == [(160, 200, True, 0, [7, 8, 9, 10, 11, 12, 13])]
