"""The colocated reference: the same engine code, prefill and decode in ONE pool, no transfer.

A prefill-decode run is correct exactly when every request's :class:`Completion` equals the
reference's (:meth:`Completion.same_as`: same tokens, bit-identical traces). Both sides run the
same :class:`~kvd.engine.prefill.PrefillEngine` and :class:`~kvd.engine.decode.DecodeEngine`
with the same :class:`~kvd.engine.records.EngineConfig`, so the only difference left is the
handoff between the two daemons.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvd.engine.decode import DecodeEngine
from kvd.engine.prefill import PrefillEngine
from kvd.engine.records import Completion, EngineConfig, Request
from kvd.engine.local import LocalKV
from kvd.engine.model import Models, Pending
from kvd.engine.paged import PagedKV

__all__ = ["run_colocated", "compare", "recompute"]


def run_colocated(requests: Iterable[Request], models: Models, cfg: EngineConfig, *, arena_bytes: int = 64 << 20,
                  warmup: Iterable[Request] = (), ttft: dict[str, float] | None = None) -> dict[str, Completion]:
    """Run every request to completion in one in-process pool, one at a time. The pool's arena is
    on the models' device (a CUDA arena for models on a GPU), so the reference computes and reads
    KV where a prefill-decode pair on that device does.

    ``warmup`` (:func:`kvd.engine.warmup.warmup_requests`) runs first, through the same pool, and
    is left out of the result. ``ttft``: filled with each request's time to first token here
    (its prefill alone: :attr:`FirstToken.prefill_s`, nothing queued before it)."""
    kv = LocalKV(models.layout, arena_bytes, device=models.device)
    try:
        paged = PagedKV(models.layout, kv.views)
        pre = PrefillEngine(kv, paged, models, cfg)
        dec = DecodeEngine(kv, paged, models, cfg)
        out: dict[str, Completion] = {}
        for timed, batch in ((False, warmup), (True, requests)):
            for req in batch:
                first = pre.prefill(req, None)
                if first.error:
                    raise RuntimeError(f"colocated prefill of {req.rid!r} failed: {first.error}")
                if timed and ttft is not None:
                    ttft[req.rid] = first.prefill_s
                dec.adopt(req, first)
                while dec.running:
                    for c in dec.step():
                        if timed:
                            out[c.rid] = c
        kv.pool.check()
        if kv.pool.request_ids:
            raise RuntimeError(f"colocated reference leaked requests {kv.pool.request_ids}")
        return out
    finally:
        kv.close()


def compare(got: dict[str, Completion], want: dict[str, Completion]) -> list[str]:
    """Request ids whose PD completion differs from the reference (or is missing / failed)."""
    return sorted(rid for rid, ref in want.items() if rid not in got or not got[rid].same_as(ref))


def recompute(models: Models, prompt: tuple[int, ...], max_new: int) -> tuple[tuple[int, ...], float]:
    """Greedy tokens and target trace with no cache at all: every step recomputes the whole
    sequence from position 0 (quadratic; an oracle for the paged engine, kvd not involved)."""
    toks = list(prompt)
    out: list[int] = []
    trace = 0.0
    for _ in range(max_new):
        logits = models.target.forward(toks, 0, None, Pending(0))  # type: ignore[arg-type]  # nothing to read
        t = int(logits[-1].argmax())
        trace += float(logits[-1, t])
        out.append(t)
        toks.append(t)
    return tuple(out), trace
