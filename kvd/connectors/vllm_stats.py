"""What KvdConnector counts, in vLLM's own telemetry: its periodic "KV Transfer metrics" log line
and its Prometheus ``/metrics`` (``vllm:kvd_*_total``, with vLLM's engine labels).

Each side keeps running totals (:class:`CopyStats` on a worker: the copies and Sends it made;
:class:`TicketStats` on the scheduler: the tickets it minted and what became of them).
``KvdConnector.get_kv_connector_stats`` hands vLLM what grew since its previous call
(:func:`grown`); vLLM sums the workers' and the scheduler's (:meth:`KvdConnectorStats.aggregate`),
logs the sum of an interval (:meth:`KvdConnectorStats.reduce`) and adds each step's to the
counters (:class:`KvdPromMetrics`). Imports vLLM (its connector metrics API, 0.32).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "CopyStats", "KvdConnectorStats", "KvdPromMetrics", "TicketStats", "grown"]


@dataclass
class CopyStats:
    """What the worker side of a connector copied and sent so far (bytes, seconds): ``save`` is
    vLLM's blocks -> kvd pages (prefill, in save_kv_layer / wait_for_save), ``send`` the kvd Sends
    (prefill daemon -> decode daemon, as SendResult reports them), ``load`` kvd pages -> vLLM's
    blocks (decode, start_load_kv)."""

    save_bytes: int = 0
    save_s: float = 0.0
    send_bytes: int = 0
    send_s: float = 0.0
    sends: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    loads: int = 0
    reconnects: int = 0  # the daemon forgot this worker's session (restart, reap): a new client and arena
    opens: int = 0  # Allocate calls that opened requests (allocated, transfer begun) on the forward thread
    opened: int = 0  # ... the requests they opened (more than ``opens``: a step's new requests share a call)
    batches_refused: int = 0  # a step's shared Allocate refused: its requests were opened one call each
    cached_tokens: int = 0  # tokens saved that vLLM did not compute (its prefix cache held them)
    abandoned: int = 0  # opened requests vLLM ended before their last chunk (aborted): aborted and freed in kvd
    steps: int = 0  # engine steps this worker ran (start_load_kv is called once a step)
    session_probes: int = 0  # KeepAlives sent before writing: no call had been answered for half the session's TTL
    adopted: int = 0  # requests a step's Allocate opened though its reply was lost: carried on, not opened twice
    sync_loads: int = 0  # loads copied in the step that computes their request's tail (READY when admitted)
    sync_failed: int = 0  # ... that failed: their blocks reported (vLLM fails the request), nothing copied


@dataclass
class TicketStats:
    """What the decode scheduler's ticket book saw so far."""

    tickets_minted: int = 0
    mint_calls: int = 0  # Allocate calls that minted them (tickets asked for together share one)
    tickets_released: int = 0  # given back before admission (the proxy's prefill failed)
    tickets_expired: int = 0  # never admitted within kvd_admit_ttl_s: freed
    admitted: int = 0  # a vLLM request matched its ticket: its KV loaded, not computed
    admitted_landed: int = 0  # ... whose KV had landed already (a sync load, where the model allows)
    not_matched: int = 0  # a request named a ticket this book does not hold, or its prompt differs: computed locally
    transfers_failed: int = 0  # a ticket's transfer FAILED (a dead prefill, an abort, no KV in time)
    recomputed: int = 0  # admitted requests vLLM preempted after their load: computed again, not loaded again
    cached: int = 0  # admitted requests whose ticketed tokens vLLM's own prefix cache held: given back at once
    aborted: int = 0  # admitted requests vLLM ended while they waited for their KV: blocks and pages given back


#: Prometheus counters (name under ``vllm:kvd_``, ``_total`` added) -> (the stats' field, help).
#: Fields not listed here (``save_s``...) still reach the log line.
COUNTERS: dict[str, tuple[str, str]] = {
    "save_bytes": ("save_bytes", "Bytes of KV the prefill workers copied from vLLM's blocks into kvd pages"),
    "sends": ("sends", "kvd Sends the prefill workers made (requests handed to a decode daemon)"),
    "send_bytes": ("send_bytes", "Bytes of KV the prefill workers' Sends moved to decode daemons"),
    "send_seconds": ("send_s", "Seconds the prefill workers' Sends took (the daemons' own time)"),
    "loads": ("loads", "Loads the decode workers copied from kvd pages into vLLM's blocks"),
    "load_bytes": ("load_bytes", "Bytes of KV the decode workers loaded from kvd pages"),
    "sync_loads": ("sync_loads", "Loads copied in the step that computes their request's tail (no step of their own)"),
    "load_failures": ("sync_failed", "Sync loads that failed (vLLM failed their requests by their blocks)"),
    "reconnects": ("reconnects", "Times a worker found its kvd daemon had forgotten it (restart, reap) and connected again"),
    "requests_abandoned": ("abandoned", "Prefill requests vLLM ended before their KV was sent (aborted and freed in kvd)"),
    "tickets_minted": ("tickets_minted", "Tickets minted by the decode connector (pages allocated and leased)"),
    "ticket_allocates": ("mint_calls", "Allocate calls the decode connector made to mint tickets (tickets asked for together share one)"),
    "tickets_released": ("tickets_released", "Tickets given back before admission (the proxy's prefill failed)"),
    "tickets_expired": ("tickets_expired", "Tickets never admitted within kvd_admit_ttl_s (their pages freed)"),
    "admitted": ("admitted", "Decode requests admitted with their ticket's KV"),
    "admitted_landed": ("admitted_landed", "... whose KV had landed before admission"),
    "not_matched": ("not_matched", "Decode requests whose ticket was unknown or whose prompt differed: computed locally"),
    "transfers_failed": ("transfers_failed", "Tickets whose transfer failed (dead prefill, abort, no KV in time)"),
    "recomputed": ("recomputed", "Admitted decode requests vLLM preempted after their load: computed again, not loaded again"),
    "tickets_cached": ("cached", "Admitted decode requests whose ticketed tokens vLLM's prefix cache held (pages given back at once)"),
    "requests_aborted": ("aborted", "Admitted decode requests vLLM ended while they waited for their KV (blocks and pages given back)"),
}


def grown(now: CopyStats | TicketStats, before: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``now`` that grew since ``before`` (a previous :func:`dataclasses.asdict`
    of it), by how much; ``before`` is updated to ``now``. Empty: nothing happened."""
    cur = asdict(now)
    out = {k: v - before.get(k, 0) for k, v in cur.items() if v != before.get(k, 0)}
    before.clear()
    before.update(cur)
    return out


class KvdConnectorStats(KVConnectorStats):
    """Counts that grew, by field (ints, and float seconds). Summed across workers, the scheduler
    and steps; what vLLM logs each interval is that sum (seconds rounded to ms)."""

    data: dict[str, Any]

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvdConnectorStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = out.get(k, 0) + v
        return KvdConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvdPromMetrics(KVConnectorPromMetrics):
    """One counter per :data:`COUNTERS` entry, a child per engine (vLLM's labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, (field_name, doc) in COUNTERS.items():
            c = self._counter_cls(name=f"vllm:kvd_{name}", documentation=doc, labelnames=labelnames)
            self._counters[field_name] = create_metric_per_engine(c, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field_name, v in transfer_stats_data.items():
            per_engine = self._counters.get(field_name)
            if per_engine is not None and v > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
