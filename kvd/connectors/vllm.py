"""kvd as vLLM's KV connector (vLLM v1, pinned to 0.32: the connector API moves between releases).

Start each vLLM next to its own kvd daemon::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.connectors.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kvd_address": "unix:/run/kvd/kvd.sock"}}'

The decode instance (``kv_consumer``) also names ``kvd_ticket_listen`` (``host:port``): the
connector serves tickets there. One request, push mode (the decode daemon holds the KV before
the decode vLLM admits the request; the prefill side never waits for decode's free blocks)::

    proxy ── POST /v1/kvd/tickets {prompt_token_ids} ──▶ decode connector (scheduler side)
          ◀── {kvd_rid, kvd_tokens: L, kvd_ticket} ──── allocate_recv(rid, L, ttl): allocate + RECV lease
    proxy ── prompt[:L], max_tokens=1, kv_transfer_params {kvd_ticket, kvd_rid, kvd_tokens} ──▶ prefill vLLM
             prefill connector (worker): allocate(req, L, ticket) (the transfer begun too); save_kv_layer writes
             each layer's KV of the request into its kvd pages; wait_for_save: Mamba state slots,
             then Send(free) on a background thread (vLLM frees its blocks at once)
    proxy ── prompt, kv_transfer_params {kvd_rid} ──▶ decode vLLM
             landed already (the doorbell says READY), at most kvd_sync_load_tokens, one KV cache
             group: get_num_new_matched_tokens -> (L, load_async=False); the worker copies kvd
             pages into vLLM's blocks before the forward of the step that computes the tail
             (vLLM's stream waits for the copy), reports it done in build_connector_worker_meta
             (the scheduler frees the kvd request) or failed in get_block_ids_with_load_errors
             (vLLM fails the request). Else (L, load_async=True); one watcher thread reads every
             pending transfer's doorbell (no call; over gRPC: one thread's WaitEnded calls); once
             READY the worker copies kvd pages into vLLM's blocks
             (start_load_kv) and reports the request in get_transfer_results; FAILED: in
             failed_recving (vLLM's load-error path: the request fails, never garbage)

``L``: the prompt's whole blocks short of its last token; the decode vLLM computes the tail itself
(so a recurrent state handed over is exactly the state after ``L`` tokens; a ticket for a prompt
shorter than one block plus one is refused: serve it on the decode instance alone). What ``kv_transfer_params`` carry is
small and capability-like: a sealed ticket (checked by the decode daemon that minted it: nobody
can redirect its bytes) and a random request name bound to the prompt's hash on the decode side.

Layout: :func:`layout_from_vllm` derives kvd's :class:`~kvd.pool.layout.Layout` from vLLM's own
``KVCacheConfig`` (full-attention groups -> ``full``, sliding-window -> ``swa`` with the window,
Mamba -> ``state`` slots of the state's bytes; page size = vLLM's attention block size); the
worker proposes it to its daemon when it registers its KV caches: a daemon started with
``layout_from_engine`` takes it, one serving another layout refuses it, naming both.

KV tensors: CPU or CUDA, in any layout :mod:`kvd.connectors.vllm_blocks` knows (vLLM 0.32's
``KVCacheLayout`` orders, told from each registered tensor's strides and checked against the one
vLLM resolved; the legacy 5-D FlashAttention / FlashInfer layouts), the daemon's arena on the
same device (``kvd serve --arena cuda --cuda-device N`` beside a GPU vLLM). On CUDA every copy runs
on the connector's own stream: saves wait for vLLM's current stream and vLLM's stream waits for
them at the end of the step (its blocks may be reused after); the sender waits for the step's copy
event before the Send; a load is reported finished once its event has completed
(``event.query()``). No copy waits for the device.

A daemon restarted (or a worker's session reaped) under a running vLLM needs no engine restart:
the worker, whose client attached the arena and so refuses every call from then on, connects a
new client, proposes the layout again and attaches the new arena at its next save (a SessionGone)
or its next load (page ids of a boot other than the arena it attached: a load is never copied from
the old arena, which would hand vLLM another request's KV, or none, as if it were this one's); the
scheduler's client opens a new session by itself, and proposes the layout to a daemon that has
none. Requests in flight across the restart fail through vLLM's load-error path.

:class:`KvdConnector` is what vLLM loads; it reads its settings and hands each hook to a piece:
:mod:`~kvd.connectors.vllm_scheduler` (the scheduler side: saves per step, the ticket book's
loads), :mod:`~kvd.connectors.vllm_worker` (a worker's client, arena and registered KV caches),
:mod:`~kvd.connectors.vllm_saver` (a producer worker's opens, copies and Sends),
:mod:`~kvd.connectors.vllm_loader` (a consumer worker's loads). Beside them:
:mod:`~kvd.connectors.vllm_layout` (the layout), :mod:`~kvd.connectors.vllm_meta` (the step's
saves and loads), :mod:`~kvd.connectors.vllm_ticket_book` (the decode side's tickets) and
:mod:`~kvd.connectors.vllm_ticket_server` (served over HTTP), :mod:`~kvd.connectors.vllm_blocks`
(the copies), :mod:`~kvd.connectors.vllm_stats` (its telemetry).
kvd imports: :mod:`kvd.client` (``Client``), :mod:`kvd.errors`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvd.connectors.vllm_layout import LayerSlot, layout_from_vllm
from kvd.connectors.vllm_loader import Loader
from kvd.connectors.vllm_saver import Saver
from kvd.connectors.vllm_scheduler import Scheduler
from kvd.connectors.vllm_stats import CopyStats, KvdConnectorStats, KvdPromMetrics, grown
from kvd.connectors.vllm_ticket_book import TicketBook
from kvd.connectors.vllm_ticket_server import TicketServer, serve_tickets
from kvd.connectors.vllm_worker import Worker, connect

__all__ = ["KvdConnector", "CopyStats", "layout_from_vllm", "LayerSlot"]

log = logging.getLogger("kvd.connectors.vllm")
if os.environ.get("KVDCONN_DEBUG"):
    logging.basicConfig()
    log.setLevel(logging.DEBUG)

#: Default of ``kvd_sync_load_tokens``: a transfer READY when the decode vLLM admits its request,
#: of at most this many tokens, is copied in the step that computes the request's tail (before
#: that step's forward, which waits for it) instead of one step earlier, on its own.
SYNC_LOAD_TOKENS = 8192


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over the local kvd daemon (see the module doc for the flow). Each hook
    is one piece's method of the same name: the scheduler side's (:attr:`sched`) or a worker's
    (:attr:`saver`, :attr:`loader`, over :attr:`worker`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        address = extra.get("kvd_address")
        if not isinstance(address, str) or not address:
            raise ValueError("KvdConnector: set kv_connector_extra_config.kvd_address (e.g. 'unix:/run/kvd/kvd.sock')")
        ttl = extra.get("kvd_session_ttl_s")
        kv_ttl = float(ttl) if ttl else None
        model = str(getattr(vllm_config.model_config, "model", "") or "vllm")
        layout, slots = layout_from_vllm(kv_cache_config, name=model.rstrip("/").rsplit("/", 1)[-1][:64])
        producer = cfg.kv_role in ("kv_producer", "kv_both")
        consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        name = f"vllm-{role.name.lower()}-{os.getpid()}"
        self.worker = Worker(connect(address, name, kv_ttl), address, name, kv_ttl, layout, slots)
        self.saver = Saver(self.worker, producer)
        self.loader = Loader(self.worker)
        self.copy_stats: CopyStats = self.worker.copy_stats
        self._stats_seen: dict[str, Any] = {}  # what get_kv_connector_stats reported last
        book: TicketBook | None = None
        self._server: TicketServer | None = None
        if role is KVConnectorRole.SCHEDULER and consumer:
            listen = extra.get("kvd_ticket_listen")
            if not isinstance(listen, str) or ":" not in listen:
                raise ValueError("KvdConnector (kv_consumer): set kv_connector_extra_config.kvd_ticket_listen to host:port "
                                 "(the proxy asks this decode instance for tickets there)")
            # vLLM fails a sync load's request by the ids of its failed blocks, which name a block
            # only where the model has one KV cache group: hybrid models load asynchronously.
            groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
            sync_tokens = int(extra.get("kvd_sync_load_tokens", SYNC_LOAD_TOKENS)) if groups == 1 else 0
            workers = int(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)
            book = TicketBook(self.worker.kv, float(extra.get("kvd_admit_ttl_s", 30.0)), layout.page_size, layout,
                              sync_tokens=sync_tokens, workers=workers)
            self._server = serve_tickets(book, listen)
            log.info("KvdConnector: tickets on http://%s/v1/kvd/tickets, kvd at %s", listen, address)
        self.sched = Scheduler(producer, book)

    # ============================ scheduler side ============================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.sched.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.sched.request_finished_all_groups(request, block_ids)

    # ============================ worker side ============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        expect = getattr(getattr(self._vllm_config, "cache_config", None), "kv_cache_layout", None)
        self.worker.register_kv_caches(kv_caches, expect if isinstance(expect, str) else None)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.saver.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.saver.opened()
        self.loader.start_load_kv(getattr(self._get_connector_metadata(), "loads", ()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request: an async one finishes before its request is scheduled, vLLM's stream waits for a sync one

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.saver.save_kv_layer(layer_name, self._get_connector_metadata)

    def wait_for_save(self) -> None:
        self.saver.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loader.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.loader.build_connector_worker_meta()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self.saver.opened()
        if finished_req_ids and self.saver.vecs:
            self.saver.abandon(finished_req_ids)
        done, failed = self.loader.results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    # -- telemetry (kvd/connectors/vllm_stats.py) --
    def get_kv_connector_stats(self) -> KvdConnectorStats | None:
        """What this side counted since the previous call (vLLM calls it each step on a worker and
        each scheduler step on the scheduler); None when nothing did."""
        book = self.sched.book
        if book is not None:
            with book.lock:
                grew = grown(book.stats, self._stats_seen)
        elif self.role is KVConnectorRole.WORKER:
            grew = grown(self.copy_stats, self._stats_seen)
        else:
            return None
        return KvdConnectorStats(data=grew) if grew else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdConnectorStats:
        return KvdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvdPromMetrics:
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self.saver.close()
        if self._server is not None:
            self._server.close()  # its port free again (shutdown alone held it)
        if self.sched.book is not None:
            self.sched.book.close()
        self.worker.kv.close()
