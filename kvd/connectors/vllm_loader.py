"""A consumer (decode) worker's loads: kvd pages copied into vLLM's blocks, and what it reports
of each to vLLM.

The scheduler side's ticket book hands a step's loads to the workers in the step's metadata
(:class:`~kvd.connectors.vllm_meta.Load`). :meth:`Loader.start_load_kv` issues each one's copies
on the worker's copy stream. What vLLM hears, by kind:

* an asynchronous load: finished once its copy event has completed (:meth:`Loader.results`, for
  ``get_transfer_results``), or failed (in both ``finished_recving`` and ``failed_recving``:
  vLLM fails the request it holds back, never computes on garbage);
* a sync load (copied in the step that computes the request's tail; vLLM's stream waits for
  it): done in the worker's metadata once its event completed (the scheduler frees its kvd
  request), or failed by its blocks (``get_block_ids_with_load_errors``).

A load whose page ids are of another daemon boot than the arena attached is never copied (it
would hand vLLM another request's KV as this one's): the worker renews its session first, and a
load it still cannot read fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvd.connectors import vllm_blocks as vb
from kvd.connectors.vllm_meta import KvdWorkerMetadata, Load
from kvd.connectors.vllm_worker import Worker, last_real
from kvd.errors import KvdError

__all__ = ["Loader"]

log = logging.getLogger("kvd.connectors.vllm")


class Loader:
    """The loads of one worker ``w`` in flight and to report. Mutates ``w.copy_stats``."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.loading: dict[str, torch.cuda.Event | None] = {}  # loads issued, until their event completes
        self.failed: set[str] = set()  # loads that failed this step
        self.sync_loads: dict[str, torch.cuda.Event | None] = {}  # sync loads copied, until reported
        self.invalid: set[int] = set()  # vLLM blocks of sync loads that failed this step

    def start_load_kv(self, loads: Sequence[Load]) -> None:
        """Issue the copies of this step's ``loads`` (the step's metadata): each one copied, or
        reported failed, never both."""
        w = self.w
        w.copy_stats.steps += 1
        # Page ids index the arena of the boot that handed them out (the scheduler's client asked
        # the daemon): after a daemon restart, this worker's views map the old arena until it
        # attaches the new one; a load is never copied from another boot's arena.
        if any(not ld.error and ld.boot != w.kv.boot_id for ld in loads) or (loads and w.kv.stale):
            w.renew("the daemon's page ids are of another boot than the arena this worker attached")
        for load in loads:
            if not load.error and load.boot != w.kv.boot_id:
                load.error = (f"its page ids are of daemon boot {load.boot!r}, this worker attached boot {w.kv.boot_id!r} "
                              "(the daemon restarted, and attaching its new arena failed)")
            if load.error:
                if load.aborted:
                    log.info("kvd: request %s ended before its KV was loaded: reported, not copied", load.req_id)
                else:
                    log.error("kvd transfer for request %s failed: %s", load.req_id, load.error)
                self.load_failed(load)
                continue
            t0 = time.perf_counter()
            try:
                with w.copy.after_current():
                    self._load(load)
                    done = w.copy.record()
            except (RuntimeError, IndexError, KvdError) as exc:
                log.error("kvd load for request %s failed: %s", load.req_id, exc)
                self.load_failed(load)
                continue
            w.copy_stats.load_s += time.perf_counter() - t0  # on CUDA: the time to issue the copies
            w.copy_stats.loads += 1
            if load.sync:
                w.after_copies(done)  # this step's forward reads the blocks: vLLM's stream waits for the copy
                self.sync_loads[load.req_id] = done
                w.copy_stats.sync_loads += 1
            else:
                self.loading[load.req_id] = done

    def load_failed(self, ld: Load) -> None:
        """Report ``ld`` failed, never copied: an async load in ``failed_recving`` (vLLM fails the
        request it holds back); a sync load by its blocks (get_block_ids_with_load_errors: vLLM
        drops what this step's forward computed for the request and fails it), then reported done
        so that its kvd request is freed."""
        if not ld.sync:
            self.failed.add(ld.req_id)
            return
        bs = self.w.bs
        self.invalid.update(b for b in ld.block_ids[0][ld.start // bs:-(-ld.end // bs)] if b != 0)
        self.sync_loads[ld.req_id] = None
        self.w.copy_stats.sync_failed += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of the sync loads that failed since the last call (each reported once)."""
        out, self.invalid = self.invalid, set()
        return out

    def build_connector_worker_meta(self) -> KvdWorkerMetadata | None:
        """The sync loads whose copies completed (or failed) since the last step: the scheduler
        frees their kvd requests. On CUDA a copy is reported once its event has completed (query:
        never waits), at this or a later step."""
        if not self.sync_loads:
            return None
        done = [r for r, ev in self.sync_loads.items() if ev is None or ev.query()]
        for r in done:
            del self.sync_loads[r]
        return KvdWorkerMetadata({r: 1 for r in done}) if done else None

    def results(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` since the last call: the async loads whose
        copies completed, and those that failed (in both sets: vLLM then fails the request,
        kv_load_failure_policy "fail", the default, instead of waiting for it; 0.32 refuses
        block-level errors with HMA groups)."""
        landed = {r for r, ev in self.loading.items() if ev is None or ev.query()}  # query: never waits
        for r in landed:
            del self.loading[r]
        failed, self.failed = self.failed, set()
        return landed | failed, failed

    def _load(self, ld: Load) -> None:
        """Issue the copies of ``ld``'s kvd pages into vLLM's blocks (on the copy stream): the
        attention layers of one vLLM group share the request's slots and go in one call (one
        kernel launch where their tensors lie a uniform stride apart, as vLLM 0.32 allocates them)."""
        w = self.w
        for ln, slot in w.slots.items():
            if slot.group == "state":
                view = w.views[slot.group][slot.layer_index]
                if ld.state is None:
                    raise RuntimeError(f"layer {ln}: the kvd request has no state slot")
                vb.state_bytes(w.caches[ln], last_real(ld.block_ids[slot.vllm_group], ln)).copy_(view.k[ld.state], non_blocking=True)
                w.copy_stats.load_bytes += view.k[ld.state].numel()
        for (group, vg), names in w.layer_sets.items():
            lbs = [w.blocks[ln] for ln in names]
            pages, first = (ld.full, 0) if group == "full" else (ld.swa, ld.swa_first)
            at = w.copy.slots(vb.token_slots(ld.block_ids[vg], ld.start, ld.end, w.bs, pages, first, what=f"layer {names[0]}"), lbs[0])
            views = [w.views[group][w.slots[ln].layer_index] for ln in names]
            w.copy_stats.load_bytes += vb.load_layers(lbs, at, views)
