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

The connector's pieces: :mod:`~kvd.connectors.vllm_layout` (the layout),
:mod:`~kvd.connectors.vllm_meta` (the step's saves and loads), :mod:`~kvd.connectors.vllm_ticket_book`
(the decode side's tickets) and :mod:`~kvd.connectors.vllm_ticket_server` (served over HTTP),
:mod:`~kvd.connectors.vllm_blocks` (the copies), :mod:`~kvd.connectors.vllm_stats` (its telemetry).
kvd imports: :mod:`kvd.client` (``Client``), :mod:`kvd.errors`.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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

from kvd.client import Client
from kvd.connectors import vllm_blocks as vb
from kvd.connectors.vllm_layout import LayerSlot, layout_from_vllm
from kvd.connectors.vllm_meta import KvdMetadata, KvdWorkerMetadata, Load, Save
from kvd.connectors.vllm_stats import CopyStats, KvdConnectorStats, KvdPromMetrics, grown
from kvd.connectors.vllm_ticket_book import TicketBook
from kvd.connectors.vllm_ticket_server import TicketServer, serve_tickets
from kvd.errors import AlreadyExists, InvalidArgument, KvdError, LayoutMismatch, SessionGone

__all__ = ["KvdConnector", "CopyStats", "layout_from_vllm", "LayerSlot"]

log = logging.getLogger("kvd.connectors.vllm")
if os.environ.get("KVDCONN_DEBUG"):
    logging.basicConfig()
    log.setLevel(logging.DEBUG)

#: test-only: while the file this names exists, the prefill sender holds each Send (after begin_send:
#: the transfer is open at the decode daemon), so a test can kill the prefill vLLM mid-transfer
HOLD_SEND_ENV = "KVDCONN_TEST_HOLD_FILE"
#: A worker whose daemon forgot its session tries to connect again at most this often.
RECONNECT_S = 1.0
#: Default of ``kvd_sync_load_tokens``: a transfer READY when the decode vLLM admits its request,
#: of at most this many tokens, is copied in the step that computes the request's tail (before
#: that step's forward, which waits for it) instead of one step earlier, on its own.
SYNC_LOAD_TOKENS = 8192


def _connect(address: str, name: str, ttl: float | None) -> Client:
    try:
        return Client.connect(address, name=name, ttl=ttl, timeout=10.0)
    except KvdError as exc:
        raise RuntimeError(
            f"KvdConnector: no kvd daemon answers at {address!r} ({type(exc).__name__}: {exc}); start `kvd serve` "
            "there first, or set kv_connector_extra_config.kvd_address to the daemon beside this vLLM"
        ) from exc


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over the local kvd daemon (see the module doc for the flow)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        address = extra.get("kvd_address")
        if not isinstance(address, str) or not address:
            raise ValueError("KvdConnector: set kv_connector_extra_config.kvd_address (e.g. 'unix:/run/kvd/kvd.sock')")
        self._address: str = address
        ttl = extra.get("kvd_session_ttl_s")
        self._kv_ttl = float(ttl) if ttl else None
        model = str(getattr(vllm_config.model_config, "model", "") or "vllm")
        self._layout, self._slots = layout_from_vllm(kv_cache_config, name=model.rstrip("/").rsplit("/", 1)[-1][:64])
        self._bs = self._layout.page_size
        self._state_groups = {s.vllm_group for s in self._slots.values() if s.group == "state"}
        self._producer = cfg.kv_role in ("kv_producer", "kv_both")
        self._consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self._kv_name = f"vllm-{role.name.lower()}-{os.getpid()}"
        self._kv = _connect(self._address, self._kv_name, self._kv_ttl)
        self._book: TicketBook | None = None
        self._server: TicketServer | None = None
        # scheduler side, producer: requests to save, with their block ids so far
        self._saving: dict[str, dict] = {}
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._views: dict[str, list] = {}
        self._vecs: dict[str, Any] = {}  # producer: by vLLM request, its open kvd request (rid, page ids)
        self._queued: set[str] = set()  # producer: requests whose last chunk is saved, handed to the sender thread
        self._loading: dict[str, torch.cuda.Event | None] = {}  # consumer: loads issued, until their event completes
        self._blocks: dict[str, vb.LayerBlocks] = {}
        self._layer_sets: dict[tuple[str, int], list[str]] = {}  # (kvd group, vLLM group) -> its attention layers
        self._att: Any = None
        self._copy = vb.CopyStream("cpu")
        self._slots_meta: object = None
        self._step_slots: dict[tuple[str, int], vb.DeviceSlots] = {}
        self.copy_stats = CopyStats()
        self._stats_seen: dict[str, Any] = {}  # what get_kv_connector_stats reported last
        self._failed: set[str] = set()  # consumer: loads that failed this step
        self._sync_loads: dict[str, torch.cuda.Event | None] = {}  # consumer: sync loads copied, until reported
        self._invalid: set[int] = set()  # consumer: vLLM blocks of sync loads that failed this step
        self._bad_saves: set[str] = set()  # producer: transfers that could not open
        self._sends: queue.Queue = queue.Queue()
        self._renew_at = 0.0  # no reconnect before (monotonic): the last one failed
        self._probe_at = 0.0  # no KeepAlive probe before (monotonic): the last one failed (_gone)
        self._sender: threading.Thread | None = None
        self._opener: ThreadPoolExecutor | None = None  # producer: opens a step's new requests (handle_preemptions)
        self._opening: Future | None = None  # ... this step's, until the forward thread joins it (_opened)
        if role is KVConnectorRole.SCHEDULER and self._consumer:
            listen = extra.get("kvd_ticket_listen")
            if not isinstance(listen, str) or ":" not in listen:
                raise ValueError("KvdConnector (kv_consumer): set kv_connector_extra_config.kvd_ticket_listen to host:port "
                                 "(the proxy asks this decode instance for tickets there)")
            # vLLM fails a sync load's request by the ids of its failed blocks, which name a block
            # only where the model has one KV cache group: hybrid models load asynchronously.
            groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
            sync_tokens = int(extra.get("kvd_sync_load_tokens", SYNC_LOAD_TOKENS)) if groups == 1 else 0
            workers = int(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)
            self._book = TicketBook(self._kv, float(extra.get("kvd_admit_ttl_s", 30.0)), self._bs, self._layout,
                                     sync_tokens=sync_tokens, workers=workers)
            self._server = serve_tickets(self._book, listen)
            log.info("KvdConnector: tickets on http://%s/v1/kvd/tickets, kvd at %s", listen, self._address)

    # ============================ scheduler side ============================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self._book is not None:
            return self._book.matched(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._book is not None and num_external_tokens > 0:
            self._book.allocated(request, blocks, num_external_tokens)
            return
        params = request.kv_transfer_params or {}
        if not (self._producer and "kvd_ticket" in params) or request.request_id in self._saving:
            return
        n = len(request.prompt_token_ids or [])
        if params.get("kvd_tokens") != n:
            log.error("request %s: its prompt has %d tokens, the ticket is for %r (send the decode side's prompt[:kvd_tokens]); "
                      "not sending its KV", request.request_id, n, params.get("kvd_tokens"))
            return
        try:
            ticket = base64.b64decode(params["kvd_ticket"], validate=True)
        except (ValueError, TypeError):
            log.error("request %s: kvd_ticket is not base64; not sending its KV", request.request_id)
            return
        rid = params.get("kvd_rid")
        if not isinstance(rid, str):
            log.error("request %s: kv_transfer_params has a kvd_ticket but no kvd_rid; not sending its KV", request.request_id)
            return
        self._saving[request.request_id] = {"ticket": ticket, "rid": rid, "tokens": n, "blocks": None, "params": params}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KvdMetadata()
        if self._saving:
            steps = scheduler_output.num_scheduled_tokens
            for r in scheduler_output.scheduled_new_reqs:
                s = self._saving.get(r.req_id)
                if s is not None:
                    s["blocks"] = tuple(list(b) for b in r.block_ids)
                    self._save_step(meta, r.req_id, s, r.num_computed_tokens, steps.get(r.req_id, 0))
            cached = scheduler_output.scheduled_cached_reqs
            resumed = getattr(cached, "resumed_req_ids", ())
            for i, req_id in enumerate(cached.req_ids):
                s = self._saving.get(req_id)
                if s is None or s["blocks"] is None:
                    continue
                new = cached.new_block_ids[i]
                if req_id in resumed:  # preempted, then scheduled again: its blocks are all new
                    s["blocks"] = tuple(list(b) for b in new) if new is not None else s["blocks"]
                elif new is not None:
                    s["blocks"] = tuple(old + list(b) for old, b in zip(s["blocks"], new))
                self._save_step(meta, req_id, s, cached.num_computed_tokens[i], steps.get(req_id, 0))
        if self._book is not None:
            meta.loads = self._book.ready_loads()
        return meta

    def _save_step(self, meta: KvdMetadata, req_id: str, s: dict, computed: int, scheduled: int) -> None:
        # From the first token not saved yet, not from vLLM's first computed one: a prefix-cache
        # hit starts a request's first step past the cached blocks, whose KV (in the request's
        # blocks all the same) must reach the decode side too.
        start, end = s.get("saved", 0), min(computed + scheduled, s["tokens"])
        if end > start and not s.get("sent"):
            last = end >= s["tokens"]
            s["sent"], s["saved"] = last, end
            meta.saves.append(Save(req_id, s["rid"], s["ticket"], s["tokens"], s["blocks"], start, end, last, max(0, computed - start)))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._book is None:
            return
        if connector_output.finished_recving:
            self._book.finished(set(connector_output.finished_recving), set(getattr(connector_output, "failed_recving", None) or ()))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvdWorkerMetadata) and meta.loaded:
            self._book.loaded(meta.loaded)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        s = self._saving.pop(request.request_id, None)
        if self._book is not None:
            self._book.ended(request.request_id)
        if s is None:
            return False, None
        # The KV is in kvd already (copied in save_kv_layer / wait_for_save): vLLM may free its blocks now.
        return False, {"kvd_rid": s["params"].get("kvd_rid"), "kvd_tokens": s["tokens"]}

    # ============================ worker side ============================
    def _attach(self, kv: Client) -> Any:
        """This vLLM's layout proposed to ``kv``'s daemon, and its arena attached (the Attachment).
        A daemon started with layout_from_engine takes the layout; one with another layout refuses
        it, naming both."""
        try:
            kv.propose_layout(self._layout)
        except LayoutMismatch as exc:
            raise LayoutMismatch(
                f"KvdConnector: the kvd daemon at {self._address} refused this vLLM's layout "
                f"(kvd.connectors.vllm.layout_from_vllm): {exc}"
            ) from None
        return kv.attach()

    def _reconnect(self, why: str) -> None:
        """The daemon beside this vLLM forgot this worker's session (it restarted, or reaped the
        session): a new client, the layout proposed again and the arena attached again (a restarted
        daemon's arena is a new one; the old views map memory no daemon reads). What was opened in
        the old session is gone with it: a save opened there writes nothing more (after a reap its
        pages may be another request's) and its queued Send fails; a load is copied only from the
        arena its page ids index (:meth:`start_load_kv`). The old views are dropped once the copy
        stream has drained. Raises (RuntimeError, KvdError) when the daemon does not answer: the
        next call tries again."""
        log.warning("KvdConnector: %s; connecting again to %s", why, self._address)
        self._bad_saves.update(self._vecs)
        self._vecs.clear()
        self._slots_meta, self._step_slots = None, {}
        kv = _connect(self._address, self._kv_name, self._kv_ttl)
        try:
            att = self._attach(kv)
            if self._att is not None and att.tensor.device != self._att.tensor.device:
                raise InvalidArgument(f"KvdConnector: the kvd daemon at {self._address} came back with its arena on "
                                      f"{att.tensor.device}, this vLLM's KV is on {self._att.tensor.device}")
        except BaseException:
            kv.close()
            raise
        if self._copy.stream is not None:
            self._copy.stream.synchronize()  # no copy still reads or writes the old views
        old_kv, old_att = self._kv, self._att
        self._kv, self._att, self._views = kv, att, att.views
        if old_att is not None:
            old_att.close()
        old_kv.close()
        self.copy_stats.reconnects += 1
        log.warning("KvdConnector: connected again to %s (daemon boot %s)", self._address, kv.boot_id)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        att = self._attach(self._kv)
        arena_dev = att.tensor.device
        expect = getattr(getattr(self._vllm_config, "cache_config", None), "kv_cache_layout", None)
        blocks: dict[str, vb.LayerBlocks] = {}
        for ln, slot in self._slots.items():
            t = kv_caches.get(ln)
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"KvdConnector: layer {ln} registered {type(t).__name__}, not one KV tensor")
            if t.device != arena_dev and not (t.device.type == arena_dev.type == "cuda" and t.device.index == arena_dev.index):
                raise InvalidArgument(
                    f"KvdConnector: layer {ln} lives on {t.device}, the kvd daemon's arena on {arena_dev}: start the daemon "
                    f"beside this vLLM with {'--arena cuda --cuda-device ' + str(t.device.index) if t.is_cuda else '--arena shm'}"
                )
            if slot.group == "state":
                vb.state_bytes(t, 0)  # refuses a state block that is not one run of bytes
                continue
            g = self._layout.group(slot.group)
            if t.dtype != self._layout.torch_dtype(g):
                raise InvalidArgument(f"KvdConnector: layer {ln} is {t.dtype}, the layout says {self._layout.dtype}")
            try:
                blocks[ln] = vb.detect_layout(t, num_kv_heads=g.num_kv_heads, block_size=self._bs, head_size=g.head_dim,
                                              head_size_v=g.v_dim, expect=expect if isinstance(expect, str) else None)
            except InvalidArgument as exc:
                raise InvalidArgument(f"KvdConnector: layer {ln}: {exc}") from None
        names = sorted({b.layout.name for b in blocks.values()})
        log.info("KvdConnector: vLLM KV on %s in layout %s; kvd arena on %s", arena_dev, ", ".join(names), arena_dev)
        self._caches = kv_caches
        self._blocks = blocks
        self._layer_sets = {}
        for ln, slot in self._slots.items():  # kvd layer order: one vLLM group's layers are consecutive in its kvd group
            if slot.group != "state":
                self._layer_sets.setdefault((slot.group, slot.vllm_group), []).append(ln)
        self._att = att
        self._views = att.views
        self._copy = vb.CopyStream(arena_dev)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first call of each step, with its metadata, before vLLM prepares the step's
        inputs: a producer opens the step's new requests here, on its opener thread (each
        allocated and its transfer begun, as :meth:`_open_step` and :meth:`_open` do), so that
        the Allocate's round trip overlaps that preparation and the first layers' compute rather
        than holding the forward at its first save. Every other entry point of the worker joins
        that work first (:meth:`_opened`); a vLLM that never calls this leaves the opening to
        the first save, as before."""
        saves = getattr(kv_connector_metadata, "saves", ())
        if not self._producer or self._opening is not None or not self._new(saves):
            return
        if self._opener is None:
            self._opener = ThreadPoolExecutor(1, thread_name_prefix="kvd-opener")
        self._opening = self._opener.submit(self._open_all, saves)

    def _open_all(self, saves: Sequence[Save]) -> None:
        """The opener thread: ``saves``' requests opened, new ones together where there are several."""
        if self._gone():  # its pages are not ours to write: a new session first, as save_kv_layer does
            self._renew("this worker's session is gone")
        self._open_step(saves)
        for sv in saves:
            self._open(sv)

    def _opened(self) -> None:
        """Wait for the opener's work of this step, if any (:meth:`handle_preemptions`): the
        forward thread reads ``_vecs`` and the client only after it. What it raised is raised here,
        where the forward would have met it."""
        f, self._opening = self._opening, None
        if f is not None:
            f.result()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._opened()
        meta = self._get_connector_metadata()
        loads = getattr(meta, "loads", ())
        self.copy_stats.steps += 1
        # Page ids index the arena of the boot that handed them out (the scheduler's client asked
        # the daemon): after a daemon restart, this worker's views map the old arena until it
        # attaches the new one; a load is never copied from another boot's arena.
        if any(not ld.error and ld.boot != self._kv.boot_id for ld in loads) or (loads and self._kv.stale):
            self._renew("the daemon's page ids are of another boot than the arena this worker attached")
        for load in loads:
            if not load.error and load.boot != self._kv.boot_id:
                load.error = (f"its page ids are of daemon boot {load.boot!r}, this worker attached boot {self._kv.boot_id!r} "
                              "(the daemon restarted, and attaching its new arena failed)")
            if load.error:
                if load.aborted:
                    log.info("kvd: request %s ended before its KV was loaded: reported, not copied", load.req_id)
                else:
                    log.error("kvd transfer for request %s failed: %s", load.req_id, load.error)
                self._load_failed(load)
                continue
            t0 = time.perf_counter()
            try:
                with self._copy.after_current():
                    self._load(load)
                    done = self._copy.record()
            except (RuntimeError, IndexError, KvdError) as exc:
                log.error("kvd load for request %s failed: %s", load.req_id, exc)
                self._load_failed(load)
                continue
            self.copy_stats.load_s += time.perf_counter() - t0  # on CUDA: the time to issue the copies
            self.copy_stats.loads += 1
            if load.sync:
                self._after_copies(done)  # this step's forward reads the blocks: vLLM's stream waits for the copy
                self._sync_loads[load.req_id] = done
                self.copy_stats.sync_loads += 1
            else:
                self._loading[load.req_id] = done

    def _load_failed(self, ld: Load) -> None:
        """Report ``ld`` failed, never copied: an async load in ``failed_recving`` (vLLM fails the
        request it holds back); a sync load by its blocks (get_block_ids_with_load_errors: vLLM
        drops what this step's forward computed for the request and fails it), then reported done
        so that its kvd request is freed."""
        if not ld.sync:
            self._failed.add(ld.req_id)
            return
        bs = self._bs
        self._invalid.update(b for b in ld.block_ids[0][ld.start // bs:-(-ld.end // bs)] if b != 0)
        self._sync_loads[ld.req_id] = None
        self.copy_stats.sync_failed += 1

    # -- telemetry (kvd/connectors/vllm_stats.py) --
    def get_kv_connector_stats(self) -> KvdConnectorStats | None:
        """What this side counted since the previous call (vLLM calls it each step on a worker and
        each scheduler step on the scheduler); None when nothing did."""
        if self._book is not None:
            with self._book.lock:
                grew = grown(self._book.stats, self._stats_seen)
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The sync loads whose copies completed (or failed) since the last step: the scheduler
        frees their kvd requests. On CUDA a copy is reported once its event has completed (query:
        never waits), at this or a later step."""
        if not self._sync_loads:
            return None
        done = [r for r, ev in self._sync_loads.items() if ev is None or ev.query()]
        for r in done:
            del self._sync_loads[r]
        return KvdWorkerMetadata({r: 1 for r in done}) if done else None

    def _load(self, ld: Load) -> None:
        """Issue the copies of ``ld``'s kvd pages into vLLM's blocks (on the copy stream): the
        attention layers of one vLLM group share the request's slots and go in one call (one
        kernel launch where their tensors lie a uniform stride apart, as vLLM 0.32 allocates them)."""
        for ln, slot in self._slots.items():
            if slot.group == "state":
                view = self._views[slot.group][slot.layer_index]
                if ld.state is None:
                    raise RuntimeError(f"layer {ln}: the kvd request has no state slot")
                vb.state_bytes(self._caches[ln], _last_real(ld.block_ids[slot.vllm_group], ln)).copy_(view.k[ld.state], non_blocking=True)
                self.copy_stats.load_bytes += view.k[ld.state].numel()
        for (group, vg), names in self._layer_sets.items():
            lbs = [self._blocks[ln] for ln in names]
            pages, first = (ld.full, 0) if group == "full" else (ld.swa, ld.swa_first)
            at = self._copy.slots(vb.token_slots(ld.block_ids[vg], ld.start, ld.end, self._bs, pages, first, what=f"layer {names[0]}"), lbs[0])
            views = [self._views[group][self._slots[ln].layer_index] for ln in names]
            self.copy_stats.load_bytes += vb.load_layers(lbs, at, views)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request: an async one finishes before its request is scheduled, vLLM's stream waits for a sync one

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._opening is not None:
            self._opened()
        slot = self._slots.get(layer_name)
        if slot is None or slot.group == "state":
            return  # state slots are copied once the step's forward is done (wait_for_save)
        meta = self._get_connector_metadata()
        saves = getattr(meta, "saves", ())
        if saves and self._gone():  # its pages are not ours to write
            self._renew("this worker's session is gone")
        if self._slots_meta is not meta:  # a new step: its requests' slots, once per vLLM group
            self._slots_meta, self._step_slots = meta, {}
            self._open_step(saves)
        for sv in saves:
            vec = self._open(sv)
            if vec is None:
                continue
            view, lb = self._views[slot.group][slot.layer_index], self._blocks[layer_name]
            t0 = time.perf_counter()
            with self._copy.after_current():  # after this layer's KV write on vLLM's stream
                key = (sv.req_id, slot.vllm_group)
                at = self._step_slots.get(key)
                if at is None:
                    pages = vec["full"] if slot.group == "full" else vec["swa"]
                    at = self._step_slots[key] = self._copy.slots(
                        vb.token_slots(sv.block_ids[slot.vllm_group], sv.start, sv.end, self._bs, pages, 0, what=f"layer {layer_name}"),
                        lb)
                self.copy_stats.save_bytes += vb.save_layer(lb, at, view)
            self.copy_stats.save_s += time.perf_counter() - t0  # on CUDA: the time to issue the copies
            if log.isEnabledFor(logging.DEBUG):  # a checksum: it waits for the device
                log.debug("save %s %s [%d, %d): %d tokens", sv.req_id, layer_name, sv.start, sv.end, at.tokens)

    def _gone(self) -> bool:
        """Whether this worker's session is gone (the daemon reaped or forgot it, and its pages may
        be other requests' by now): as the heartbeat found, or, where no call was answered for half
        the session's TTL (this process stalled and the heartbeat has not run since), as one
        KeepAlive finds now, before a byte is written. Called for every layer: the KeepAlive is
        tried at most every :data:`RECONNECT_S` (a daemon that hangs must not hold each layer of
        vLLM's forward for a call timeout)."""
        now = time.monotonic()
        if not self._kv.stale and now >= self._probe_at and self._kv.overdue:
            self.copy_stats.session_probes += 1
            try:
                self._kv.keep_alive()
            except KvdError as exc:  # SessionGone marks the client stale (it attached)
                self._probe_at = now + RECONNECT_S
                log.warning("KvdConnector: no call answered for over half the session's %.1f s TTL, and now: %s", self._kv.ttl, exc)
        return bool(self._kv.stale)

    def _renew(self, why: str) -> bool:
        """:meth:`_reconnect`, a failure logged: whether it connected. Tried at most every
        :data:`RECONNECT_S` (a daemon that does not answer must not hold every step of vLLM's
        forward for a connect timeout); meanwhile what needs the daemon fails at once."""
        now = time.monotonic()
        if now < self._renew_at:
            return False
        try:
            self._reconnect(why)
        except (RuntimeError, KvdError) as exc:
            self._renew_at = now + RECONNECT_S
            log.error("KvdConnector: cannot connect to the kvd daemon again (next try in %.0f s): %s", RECONNECT_S, exc)
            return False
        return True

    def _open_step(self, saves: Sequence[Save]) -> None:
        """The step's new requests opened in one Allocate (each allocated and its transfer begun),
        not one call each on the forward thread. All or nothing: where the daemon refuses the
        batch (one bad ticket, no room for all), :meth:`_open` opens each alone, so that only
        the request at fault fails."""
        new = self._new(saves)
        if len(new) < 2:
            return
        specs, tickets = [(sv.rid, sv.tokens) for sv in new], [sv.ticket for sv in new]
        try:
            try:
                vecs = self._kv.allocate_many(specs, tickets=tickets)
            except SessionGone:  # the call ran nowhere: once more on a new session, if one opens
                if not self._renew("the daemon forgot this worker's session"):
                    raise
                vecs = self._kv.allocate_many(specs, tickets=tickets)
        except KvdError as exc:
            self.copy_stats.batches_refused += 1
            log.warning("kvd: the step's %d new requests were refused together (%s); opening each alone", len(new), exc)
            return
        self.copy_stats.opens += 1
        self.copy_stats.opened += len(new)
        for sv, vec in zip(new, vecs):
            self._vecs[sv.req_id] = {"rid": sv.rid, "full": vec.full.tolist(), "swa": vec.swa.tolist(), "state": vec.state}

    def _new(self, saves: Sequence[Save]) -> list[Save]:
        """The saves whose requests are not open yet and have not failed to open."""
        return [sv for sv in saves if sv.req_id not in self._vecs and sv.req_id not in self._bad_saves]

    def _open(self, sv: Save) -> dict | None:
        """The producer's kvd request for ``sv`` (allocated, transfer opened), or None if that failed.

        A refused open leaves nothing to free (an Allocate is all or nothing). One refused because
        the kvd request exists already is either another vLLM request's here with the same ticket
        (a client's retry while the first still computes: that one goes on, untouched, and this
        one sends nothing) or this worker's own, opened by a step's Allocate whose reply was lost
        (:meth:`_open_step`: it carries on with it)."""
        v = self._vecs.get(sv.req_id)
        if v is None and sv.req_id not in self._bad_saves:
            try:
                # allocated and the transfer begun in one call: the decode daemon checks the
                # ticket while the prompt computes, and the first Send collects its answer
                try:
                    vec = self._kv.allocate(sv.rid, sv.tokens, ticket=sv.ticket)
                except SessionGone:  # the call ran nowhere: once more on a new session, if one opens
                    if not self._renew("the daemon forgot this worker's session"):
                        raise
                    vec = self._kv.allocate(sv.rid, sv.tokens, ticket=sv.ticket)
                except AlreadyExists:
                    if any(o["rid"] == sv.rid for o in self._vecs.values()):
                        raise  # another vLLM request's, here: not ours to write, nor to free
                    vec = self._kv.vectors(sv.rid)  # this session's (else PermissionDenied): a lost reply's
                    self.copy_stats.adopted += 1
                v = {"rid": sv.rid, "full": vec.full.tolist(), "swa": vec.swa.tolist(), "state": vec.state}
                self._vecs[sv.req_id] = v
                self.copy_stats.opens += 1
                self.copy_stats.opened += 1
            except KvdError as exc:
                log.error("kvd: cannot open the transfer of request %s: %s", sv.req_id, exc)
                self._bad_saves.add(sv.req_id)
                return None
        return v

    def wait_for_save(self) -> None:
        self._opened()
        meta = self._get_connector_metadata()
        saves = getattr(meta, "saves", ())
        if saves and self._gone():
            self._renew("this worker's session is gone")
        self._open_step(saves)  # a model of state slots only opens its requests here
        waited = False
        for sv in saves:
            self.copy_stats.cached_tokens += sv.cached if sv.req_id in self._vecs else 0
            if not sv.last:
                continue
            if sv.req_id in self._bad_saves:
                self._bad_saves.discard(sv.req_id)
                continue
            v = self._open(sv)
            if v is None:
                continue
            with self._copy.after_current():
                for ln, slot in self._slots.items():
                    if slot.group == "state":
                        t0 = time.perf_counter()
                        dst = self._views["state"][slot.layer_index].k[v["state"]]
                        dst.copy_(vb.state_bytes(self._caches[ln], _last_real(sv.block_ids[slot.vllm_group], ln)), non_blocking=True)
                        self.copy_stats.save_s += time.perf_counter() - t0
                        self.copy_stats.save_bytes += dst.numel()
                done = self._copy.record()  # after every copy of this step (the chunks' too)
            self._after_copies(done)
            waited = True
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name="kvd-sender", daemon=True)
                self._sender.start()
            self._queued.add(sv.req_id)
            self._sends.put((sv, done))
        if saves and not waited:
            # Chunks only: vLLM frees a preempted request's blocks and may write them from the next
            # step on, so its stream waits for this step's reads, as for a request's last chunk.
            self._after_copies(self._copy.record())

    def _after_copies(self, done: torch.cuda.Event | None) -> None:
        """vLLM's stream waits for ``done`` (the copy stream's reads so far): vLLM may reuse the
        blocks a copy reads from the next step on -- a finished request's, a preempted one's.
        A wait on the device only; the host goes on."""
        if done is not None:
            torch.cuda.current_stream(self._copy.device).wait_event(done)

    def _send_loop(self) -> None:
        hold = os.environ.get(HOLD_SEND_ENV)
        while (item := self._sends.get()) is not None:
            sv, done = item
            while hold and os.path.exists(hold):
                time.sleep(0.05)
            try:
                if done is not None:
                    done.synchronize()  # this thread, not the forward: the pages hold the KV before the daemon reads them
                # the daemon frees the request once it is sent: no Free call
                res = self._kv.send(sv.rid, sv.ticket, start=0, end=sv.tokens, last=True, free=True)
                log.debug("kvd: sent %s: %d bytes in %.4f s", sv.req_id, res.nbytes, res.seconds)
                self.copy_stats.send_bytes += res.nbytes
                self.copy_stats.send_s += res.seconds
                self.copy_stats.sends += 1
                freed = "free" in res.phases
            except KvdError as exc:
                log.error("kvd: sending request %s failed: %s", sv.req_id, exc)
                freed = False
                try:
                    self._kv.abort(sv.rid, f"the prefill vLLM's send failed: {exc}")
                except KvdError:
                    pass
            self._drop(sv.req_id, sv.rid, freed=freed)

    def _drop(self, req_id: str, rid: str, *, freed: bool = False) -> None:
        """Forget ``req_id``'s kvd request and free it, unless its Send freed it already."""
        self._vecs.pop(req_id, None)
        self._queued.discard(req_id)  # after the pop: _abandon never sees it open and not queued
        if freed:
            return
        try:
            self._kv.free(rid)
        except KvdError as exc:
            log.debug("free %s: %s", rid, exc)

    def _abandon(self, finished: set[str]) -> None:
        """Producer: what vLLM ended before its last chunk was saved (aborted: a client gone, a
        deadline) has no Send coming. Each opened kvd request among them is aborted (its receiver
        told at once, with the reason) and freed, instead of holding its pages, and the receiver's,
        for as long as this worker's session lives."""
        for req_id in finished:
            self._bad_saves.discard(req_id)
            v = self._vecs.get(req_id)
            if v is None or req_id in self._queued:
                continue
            log.info("kvd: request %s ended before its prompt was computed: its transfer is aborted", req_id)
            try:
                self._kv.abort(v["rid"], "the prefill vLLM ended the request before its prompt was computed (aborted)")
            except KvdError as exc:
                log.debug("abort %s: %s", v["rid"], exc)
            self._drop(req_id, v["rid"])
            self.copy_stats.abandoned += 1

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._opened()
        if finished_req_ids and self._vecs:
            self._abandon(finished_req_ids)
        # A failed receive is reported in both sets: vLLM then fails the request (kv_load_failure_policy
        # "fail", the default) instead of waiting for it; 0.32 refuses block-level errors with HMA groups.
        landed = {r for r, ev in self._loading.items() if ev is None or ev.query()}  # query: never waits
        for r in landed:
            del self._loading[r]
        done, failed = landed | self._failed, self._failed
        self._failed = set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        if self._opener is not None:
            self._opener.shutdown(wait=True)
        if self._sender is not None:
            self._sends.put(None)
            self._sender.join(timeout=30)
        if self._server is not None:
            self._server.close()  # its port free again (shutdown alone held it)
        if self._book is not None:
            self._book.close()
        self._kv.close()


def _last_real(ids: list[int], ln: str) -> int:
    real = [b for b in ids if b != 0]
    if not real:
        raise RuntimeError(f"layer {ln}: vLLM gave the request no state block")
    return real[-1]
