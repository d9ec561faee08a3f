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
             pending transfer's doorbell (no call; over gRPC: a WaitReady per transfer); once
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

kvd imports: :mod:`kvd.client` (``Client``), :mod:`kvd.errors`, :mod:`kvd.pool.layout`.
"""

from __future__ import annotations

import array
import base64
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from kvd.client import Client
from kvd.connectors import vllm_blocks as vb
from kvd.connectors.vllm_stats import CopyStats, KvdConnectorStats, KvdPromMetrics, TicketStats, grown
from kvd.connectors.vllm_ticket_server import TicketServer, serve_tickets
from kvd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KvdError, LayoutMismatch, SessionGone
from kvd.pool.layout import DTYPES, GroupKind, GroupSpec, Layout

__all__ = ["KvdConnector", "CopyStats", "layout_from_vllm", "LayerSlot"]

log = logging.getLogger("kvd.connectors.vllm")
T = TypeVar("T")
if os.environ.get("KVDCONN_DEBUG"):
    logging.basicConfig()
    log.setLevel(logging.DEBUG)

#: test-only: while the file this names exists, the prefill sender holds each Send (after begin_send:
#: the transfer is open at the decode daemon), so a test can kill the prefill vLLM mid-transfer
HOLD_SEND_ENV = "KVDCONN_TEST_HOLD_FILE"
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: How often the decode side reads its pending transfers' doorbells (kvd.memory.doorbells): a
#: READY transfer is seen within this, with no call to the daemon (~1 us of Python a transfer).
BELL_POLL_S = 0.002
#: How often, while transfers are pending, the decode side checks its daemon still answers.
ALIVE_S = 0.5
#: A worker whose daemon forgot its session tries to connect again at most this often.
RECONNECT_S = 1.0
#: Default of ``kvd_sync_load_tokens``: a transfer READY when the decode vLLM admits its request,
#: of at most this many tokens, is copied in the step that computes the request's tail (before
#: that step's forward, which waits for it) instead of one step earlier, on its own.
SYNC_LOAD_TOKENS = 8192


class LayerSlot(NamedTuple):
    """Where one vLLM layer lives in kvd: group name, layer index in that group, vLLM group index."""

    group: str
    layer_index: int  # not ``index``: that would shadow tuple.index
    vllm_group: int


def layout_from_vllm(kv_cache_config: Any, *, name: str = "vllm") -> tuple[Layout, dict[str, LayerSlot]]:
    """kvd's layout for a vLLM ``KVCacheConfig``, and each layer's place in it.

    Full-attention groups become one ``full`` group, sliding-window groups one ``swa`` group
    (one window for all), Mamba groups one ``state`` group whose slot holds a layer's state bytes
    (``uint8``). Raises InvalidArgument for what kvd cannot carry (MLA, mixed head shapes or
    windows, block sizes that differ between attention groups, no full-attention layer)."""
    layers: dict[str, list[tuple[str, int]]] = {"full": [], "swa": [], "state": []}
    attn: dict[str, set] = {"full": set(), "swa": set()}
    windows: set[int] = set()
    state_bytes: set[int] = set()
    block_sizes: set[int] = set()
    dtypes: set[str] = set()
    for gi, grp in enumerate(kv_cache_config.kv_cache_groups):
        spec = grp.kv_cache_spec
        if type(spec) is MambaSpec:
            kind = "state"
            state_bytes.add(spec.real_page_size_bytes)
        elif type(spec) in (FullAttentionSpec, SlidingWindowSpec):
            kind = "swa" if type(spec) is SlidingWindowSpec else "full"
            if kind == "swa":
                windows.add(int(spec.sliding_window))
            elif spec.sliding_window is not None:
                raise InvalidArgument(f"kv cache group {gi}: a full-attention spec with a sliding window is not supported by kvd")
            dt = _DTYPE_NAMES.get(spec.dtype)
            if dt is None:
                raise InvalidArgument(f"kv cache group {gi}: dtype {spec.dtype} is not one kvd carries ({sorted(DTYPES)})")
            dtypes.add(dt)
            block_sizes.add(int(spec.block_size))
            attn[kind].add((int(spec.num_kv_heads), int(spec.head_size), int(spec.head_size_v or spec.head_size), dt))
        else:
            raise InvalidArgument(
                f"kv cache group {gi} is a {type(spec).__name__}; kvd's vLLM connector carries full attention, "
                "sliding window and Mamba groups"
            )
        layers[kind].extend((ln, gi) for ln in grp.layer_names)
    for kind, shapes in attn.items():
        if len(shapes) > 1:
            raise InvalidArgument(f"{kind}-attention layers differ in (kv heads, head size, v head size, dtype): {sorted(shapes)}")
    if len(windows) > 1 or len(state_bytes) > 1 or len(block_sizes) > 1 or len(dtypes) > 1:
        raise InvalidArgument(
            f"kvd needs one window ({sorted(windows)}), one state size ({sorted(state_bytes)}), one attention "
            f"block size ({sorted(block_sizes)}) and one dtype ({sorted(dtypes)}) per model"
        )
    if not layers["full"]:
        raise InvalidArgument("the model has no full-attention layer; kvd's layout needs a full group (it owns the page ids)")
    groups = []
    for kind in ("full", "swa"):
        if layers[kind]:
            h, d, dv, _ = next(iter(attn[kind]))
            groups.append(GroupSpec(kind=GroupKind(kind), num_layers=len(layers[kind]), num_kv_heads=h, head_dim=d,
                                    v_head_dim=dv, window=windows.pop() if kind == "swa" else None))
    if layers["state"]:
        groups.append(GroupSpec(kind=GroupKind.STATE, num_layers=len(layers["state"]), state_elems=state_bytes.pop(), dtype="uint8"))
    layout = Layout(name=name, page_size=block_sizes.pop(), dtype=dtypes.pop(), groups=tuple(groups),
                    source="vLLM KVCacheConfig (kvd.connectors.vllm.layout_from_vllm)")
    slots = {ln: LayerSlot(kind, i, gi) for kind, ls in layers.items() for i, (ln, gi) in enumerate(ls)}
    return layout, slots


def _token_ids(ids: Iterable[int]) -> array.array:
    """A prompt's token ids as the ticket book keeps and compares them: int64s, in C (a 32k-token
    prompt in ~0.2 ms; through a tensor and a hash it took ~1.8). OverflowError past int64."""
    return array.array("q", ids)


# ---- metadata: scheduler -> worker (plain values: it may be pickled between processes) ------------
@dataclass
class _Save:
    req_id: str
    rid: str  # the kvd request: the ticket's (both daemons name the request alike)
    ticket: bytes
    tokens: int  # L: the request's prompt length, all of it sent
    block_ids: tuple[list[int], ...]
    start: int  # tokens saved in this step: [start, end)
    end: int
    last: bool
    cached: int = 0  # ... of which vLLM's prefix cache held the first ``cached`` (computed in no step)


@dataclass
class _Load:
    req_id: str
    block_ids: tuple[list[int], ...]
    start: int  # load tokens [start, end) (start: vLLM's own prefix-cache hit)
    end: int
    full: list[int] = field(default_factory=list)
    swa_first: int = 0
    swa: list[int] = field(default_factory=list)
    state: int | None = None
    boot: str = ""  # the daemon boot whose arena the page ids index (IndexVectors.boot_id)
    error: str = ""  # the transfer failed: report, never copy
    sync: bool = False  # copied before this step's forward, which computes the request's tail
    aborted: bool = False  # vLLM ended the request first: reported (for vLLM to free its blocks), never copied


@dataclass
class _KvdMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


@dataclass
class _KvdWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: the sync loads each worker finished copying (or failed),
    by vLLM request, counted per worker (vLLM aggregates the workers' objects of a step with
    :meth:`aggregate`; the scheduler sums across steps and frees a kvd request once every
    worker reported it)."""

    loaded: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, _KvdWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with kvd's worker metadata")
        merged = dict(self.loaded)
        for req_id, n in other.loaded.items():
            merged[req_id] = merged.get(req_id, 0) + n
        return _KvdWorkerMetadata(merged)


# ---- the decode side's ticket book (scheduler role) ----------------------------------------------
@dataclass
class _Mint:
    """One ticket's allocate + RECV lease, waiting for the call that mints it (maybe with others)."""

    rid: str
    tokens: int
    lease: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class _Pending:
    rid: str
    tokens: int
    prefix: array.array  # prompt[:tokens] (_token_ids): the admitted request's prompt must begin with it
    deadline: float  # freed if not admitted by then
    xfer_deadline: float  # FAILED if the KV has not arrived by then (admitted or not)
    state: str = "WAITING"  # WAITING | READY | FAILED | ABORTED (vLLM ended its request before the load)
    reason: str = ""
    req_id: str | None = None
    block_ids: tuple[list[int], ...] | None = None
    start: int = 0
    dispatched: bool = False
    sync: bool = False  # admitted READY: loaded in the step that computes the tail (vLLM's sync load)
    loaded: int = 0  # workers that reported its sync load done (all of them: the kvd request is freed)


class _TicketBook:
    """Tickets minted on the decode daemon for requests the decode vLLM has not admitted yet."""

    def __init__(self, kv: Client, admit_ttl: float, block_size: int, layout: Layout, *, sync_tokens: int = 0,
                 workers: int = 1, coalesce: bool = True) -> None:
        self.kv = kv
        # Tickets asked for while a mint's call is out go together in the next call (one Allocate
        # for all of them, not one each): the leader of _minting takes whatever _mints holds.
        self.coalesce = coalesce
        self._mints: list[_Mint] = []
        self._mints_lock = threading.Lock()
        self._minting = threading.Lock()
        self.layout = layout
        self.admit_ttl = admit_ttl
        self.block_size = block_size
        self.sync_tokens = sync_tokens  # 0: every load asynchronous
        self.workers = workers  # each reports a sync load done; the kvd request is freed after the last
        self.lock = threading.Lock()
        self.stats = TicketStats()  # counted under the lock
        self.pending: dict[str, _Pending] = {}
        self.by_req: dict[str, str] = {}
        self.recomputing: dict[str, int] = {}  # vLLM request -> its preemptions counted (until it ends)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kvd-ticket-reaper", daemon=True)
        self._reaper.start()
        # Transfers whose doorbell this client reads: one thread polls them all, no call per
        # transfer (a blocking WaitReady each would hold a thread and an engine-socket connection
        # per pending request). Without a doorbell (gRPC) a transfer gets a waiting thread.
        self._rung: set[str] = set()
        self._ring = threading.Event()  # set when _rung gains a transfer
        self._bells = threading.Thread(target=self._watch_bells, name="kvd-ticket-doorbells", daemon=True)
        self._bells.start()

    def mint(self, prompt: object) -> dict:
        """A ticket for ``prompt`` (the ``prompt_token_ids`` of a ticket request, unchecked JSON)."""
        if not isinstance(prompt, list) or len(prompt) < 2 or set(map(type, prompt)) != {int}:  # no bool, no float
            raise InvalidArgument("prompt_token_ids: give the prompt's token ids (at least 2 ints)")
        # Whole blocks only, and never the last prompt token (the decode vLLM computes the tail
        # itself, so a recurrent state handed over is exactly the state after n tokens): with a
        # partly filled last block loaded, vLLM 0.32 (CPU) gave a different first token.
        n = (len(prompt) - 1) // self.block_size * self.block_size
        if n == 0:
            raise InvalidArgument(f"prompt of {len(prompt)} tokens: shorter than one block ({self.block_size}) plus one; "
                                  "serve it on the decode instance alone")
        try:
            prefix = _token_ids(prompt)[:n]
        except OverflowError:
            raise InvalidArgument("prompt_token_ids: a token id out of range (each must fit 64 bits)") from None
        rid = "vllm-" + secrets.token_urlsafe(12)
        lease = self._allocate_recv(rid, n)
        with self.lock:
            now = time.monotonic()
            self.pending[rid] = _Pending(rid, n, prefix, now + self.admit_ttl, now + self.admit_ttl)
            self.stats.tickets_minted += 1
        if self.kv.doorbell(rid) is not None:
            with self.lock:
                self._rung.add(rid)
            self._ring.set()
        else:
            threading.Thread(target=self._watch, args=(rid,), name=f"kvd-watch-{rid}", daemon=True).start()
        return {"kvd_rid": rid, "kvd_tokens": n, "kvd_ticket": base64.b64encode(lease.ticket).decode()}

    def _allocate_recv(self, rid: str, n: int) -> Any:
        """``rid`` allocated and RECV-leased, the lease as long as admission may take: its
        LeaseInfo. Tickets asked for while another mint's call is out are minted together, in the
        next single call (all or nothing; where the daemon refuses that call, each alone, so a
        refusal -- one that does not fit -- is only its own)."""
        m = _Mint(rid, n)
        if not self.coalesce:
            self._mint([m])
        else:
            with self._mints_lock:
                self._mints.append(m)
            with self._minting:
                if not m.done:  # no other leader's call took it: this thread calls for all waiting
                    with self._mints_lock:
                        batch, self._mints = self._mints, []
                    self._mint(batch)
        if m.error is not None:
            raise m.error
        return m.lease

    def _mint(self, batch: list[_Mint]) -> None:
        """Each of ``batch`` minted (``lease``) or refused (``error``), then ``done``."""
        calls = 1

        def alone(m: _Mint) -> Any:
            return self._retrying(partial(self.kv.allocate_recv, m.rid, m.tokens, ttl=self.admit_ttl))[1]

        try:
            if len(batch) == 1:
                batch[0].lease = alone(batch[0])
            else:
                got = self._retrying(lambda: self.kv.allocate_recv_many([(m.rid, m.tokens) for m in batch], ttl=self.admit_ttl))
                for m, (_, lease) in zip(batch, got):
                    m.lease = lease
        except KvdError as exc:
            if len(batch) == 1:
                batch[0].error = exc
            else:
                log.debug("minting %d tickets in one call: %s; each alone", len(batch), exc)
                for m in batch:
                    calls += 1
                    try:
                        m.lease = alone(m)
                    except KvdError as one:
                        m.error = one
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter, each raises it
            for m in batch:
                m.error = exc
        finally:
            with self.lock:
                self.stats.mint_calls += calls
            for m in batch:
                m.done = True

    def _retrying(self, call: Callable[[], T]) -> T:
        """``call()`` (an Allocate). A restarted daemon first says SessionGone (the client opened a
        new session: the call ran nowhere, so it is sent again) and, one that takes its layout from
        the engine, that it has none yet (the worker proposed it once, at start: proposed again
        here, the same one)."""
        for left in (2, 1, 0):
            try:
                return call()
            except SessionGone:
                if not left:
                    raise
            except FailedPrecondition:
                if not left:
                    raise
                self.kv.propose_layout(self.layout)  # LayoutMismatch: another engine's layout came first
        raise AssertionError("unreachable")

    def status(self, rid: str) -> dict | None:
        with self.lock:
            p = self.pending.get(rid)
            return None if p is None else {"kvd_rid": rid, "state": p.state, "reason": p.reason, "admitted": p.req_id is not None}

    def cancel(self, rid: str) -> tuple[int, str]:
        """Give back the pages of a ticket whose request will not come (HTTP status, why): 200
        freed (its transfer aborted first if one is under way: the daemon keeps the pages
        fenced until no sender can write them); 404 no such ticket here; 409 the decode vLLM
        admitted its request already (the request frees it when it finishes)."""
        with self.lock:
            p = self.pending.get(rid)
            if p is None:
                return 404, "no such ticket on this decode instance (freed, expired, or never minted)"
            if p.req_id is not None:
                return 409, f"the decode vLLM admitted it as request {p.req_id}; it is freed when that request ends"
            del self.pending[rid]
            self._rung.discard(rid)
            self.stats.tickets_released += 1
        self._free(rid)
        return 200, "freed"

    def _watch(self, rid: str) -> None:
        while not self._stop.is_set():
            with self.lock:
                p = self.pending.get(rid)
                if p is None:
                    return
                left = p.xfer_deadline - time.monotonic()
                if left <= 0:
                    if p.state == "WAITING":
                        p.state, p.reason = "FAILED", f"no KV arrived within {self.admit_ttl:.1f} s of the ticket"
                    return
            try:
                st = self.kv.wait_ready(rid, timeout=min(left, 5.0))
            except KvdError as exc:
                state, reason = "FAILED", f"{type(exc).__name__}: {exc}"
            else:
                if st.state.name not in ("READY", "FAILED"):
                    continue
                state, reason = st.state.name, st.reason
            with self.lock:
                p = self.pending.get(rid)
                if p is not None and p.state == "WAITING":
                    p.state, p.reason = state, reason
            return

    def _watch_bells(self) -> None:
        """Every :data:`BELL_POLL_S`, the doorbell of each transfer in :attr:`_rung`: READY is
        taken as it is; FAILED is asked of the daemon for its reason; a transfer past its
        deadline fails here. A transfer whose doorbell this client no longer reads (the daemon
        gone or restarted: the client's heartbeat drops the board) is asked of the daemon too,
        and one still pending there goes to a waiting thread. Every :data:`ALIVE_S` while any is
        pending, one Echo: a daemon that stopped answering fails them all at once (its board
        would show them pending for ever). The RECV lease needs no renewal meanwhile: it was
        taken for ``admit_ttl``, the deadline's length."""
        alive_at = 0.0
        while not self._stop.is_set():
            with self.lock:
                rids = list(self._rung)
            if not rids:
                self._ring.wait(0.5)
                self._ring.clear()
                continue
            now = time.monotonic()
            gone = ""
            if now >= alive_at:
                alive_at = now + ALIVE_S
                try:
                    self.kv.echo()
                except KvdError as exc:
                    gone = f"the decode daemon is unreachable: {type(exc).__name__}: {exc}"
            for rid in rids:
                st = None if gone else self.kv.doorbell(rid)
                if st is not None and st.name in ("WAITING", "RECEIVING"):
                    with self.lock:
                        p = self.pending.get(rid)
                        if p is not None and now < p.xfer_deadline:
                            continue
                        if p is not None and p.state == "WAITING":
                            p.state, p.reason = "FAILED", f"no KV arrived within {self.admit_ttl:.1f} s of the ticket"
                        self._rung.discard(rid)
                    continue
                state, reason = ("READY", "") if st is not None and st.name == "READY" else ("FAILED", gone)
                if not gone and state != "READY":
                    try:  # the daemon says why (FAILED), that the request is gone, or that it is still pending
                        got = self.kv.wait_ready(rid, timeout=0)
                        state, reason = got.state.name, got.reason
                    except KvdError as exc:
                        state, reason = "FAILED", f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self._rung.discard(rid)
                    p = self.pending.get(rid)
                    if p is not None and p.state == "WAITING" and state in ("READY", "FAILED"):
                        p.state, p.reason = state, reason
                if state not in ("READY", "FAILED"):  # pending, but no doorbell to read: a waiter of its own
                    threading.Thread(target=self._watch, args=(rid,), name=f"kvd-watch-{rid}", daemon=True).start()
            self._stop.wait(BELL_POLL_S)

    def _reap(self) -> None:
        """Free what the decode vLLM never admitted, once its admission window passed."""
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self.lock:
                dead = [p for p in self.pending.values() if p.req_id is None and p.deadline <= now]
                for p in dead:
                    del self.pending[p.rid]
                self.stats.tickets_expired += len(dead)
            for p in dead:
                log.warning("kvd request %s was never admitted by this vLLM within %.1f s: freed", p.rid, self.admit_ttl)
                self._free(p.rid)

    def _free(self, rid: str) -> None:
        """``rid``'s pages back: one call for a transfer that landed (READY released its RECV
        lease); one still pinned by its lease (waiting, or receiving) is aborted first."""
        try:
            try:
                self.kv.free(rid)
            except FailedPrecondition:  # pinned by its RECV lease: the transfer is not over
                try:
                    self.kv.abort(rid, "the decode vLLM is done with it")
                except KvdError:
                    pass  # it ended meanwhile
                self.kv.free(rid)
        except KvdError as exc:  # gone already (its session or daemon), or still fenced: the daemon frees it
            log.debug("free %s: %s", rid, exc)

    # -- scheduler hooks --
    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        rid = params.get("kvd_rid")
        if not isinstance(rid, str) or "kvd_ticket" in params:
            return 0, False
        with self.lock:
            p = self.pending.get(rid)
            if p is None and self.by_req.get(request.request_id) == rid:
                # its ticket given back already: vLLM's own prefix cache held it all, or its load
                # failed and vLLM computes the request itself
                return 0, False
            preempted = getattr(request, "num_preemptions", 0)
            if (p is None or p.dispatched) and preempted > 0:
                # Preempted after its load: vLLM freed the blocks the KV was loaded into and computes
                # prompt and output again. Its kvd request is freed once loaded (or being freed):
                # never a second load. Counted once a preemption, however often vLLM asks.
                if self.recomputing.get(request.request_id, 0) < preempted:
                    self.recomputing[request.request_id] = preempted
                    self.stats.recomputed += 1
                return 0, False
            if p is None:
                log.warning("request %s names kvd request %r, which this connector does not hold (expired?): computing locally",
                            request.request_id, rid)
                self.stats.not_matched += 1
                return 0, False
            if p.req_id not in (None, request.request_id):
                log.warning("kvd request %r is already admitted as %s; computing %s locally", rid, p.req_id, request.request_id)
                self.stats.not_matched += 1
                return 0, False
            if p.req_id is None and not self._same_prefix(request, p):  # checked once: vLLM asks again while it waits for blocks
                log.warning("request %s: its prompt is not the one kvd request %r was minted for: computing locally",
                            request.request_id, rid)
                self.stats.not_matched += 1
                return 0, False
            # vLLM asks again each step a request waits for blocks: admitted once.
            self.stats.admitted += p.req_id is None
            p.req_id = request.request_id
            p.deadline = float("inf")
            self.by_req[request.request_id] = rid
            if p.tokens <= num_computed:
                # vLLM's own prefix cache holds every ticketed token: nothing to load, and the pages
                # go back now rather than when the request ends (its transfer aborted if under way).
                del self.pending[rid]
                self._rung.discard(rid)
                self.stats.cached += 1
                cached = True
            else:
                cached = False
                # READY already: loaded before the forward of the step that computes the tail (vLLM's
                # sync load), not in a step of its own first. Only where vLLM can fail such a load's
                # request (one KV cache group: it names failed blocks by id), and only a short one
                # (the whole batch's forward waits for the copy).
                p.sync = 0 < p.tokens - num_computed <= self.sync_tokens and self._ready(p)
        if cached:
            self._free(rid)
            return 0, False
        return p.tokens - num_computed, not p.sync

    @staticmethod
    def _same_prefix(request: Any, p: _Pending) -> bool:
        """Whether ``request``'s prompt is longer than ``p``'s tokens and begins with them."""
        try:
            ids = _token_ids(request.prompt_token_ids or ())
        except (OverflowError, TypeError):
            return False
        return len(ids) > p.tokens and ids[: p.tokens] == p.prefix

    def _ready(self, p: _Pending) -> bool:
        """Whether ``p``'s KV has landed, its doorbell read now (no call) if the watcher has not
        seen it yet. Called under :attr:`lock`."""
        if p.state == "WAITING":
            st = self.kv.doorbell(p.rid)
            if st is not None and st.name == "READY":
                p.state = "READY"
                self._rung.discard(p.rid)
        return p.state == "READY"

    def allocated(self, request: Any, blocks: Any, n_external: int) -> None:
        if n_external <= 0:
            return
        with self.lock:
            rid = self.by_req.get(request.request_id)
            p = self.pending.get(rid) if rid else None
            if p is not None and not p.dispatched:
                p.block_ids = tuple(list(b) for b in blocks.get_block_ids())
                p.start = p.tokens - n_external

    def ready_loads(self) -> list[_Load]:
        out = []
        with self.lock:
            todo = [p for p in self.pending.values() if p.block_ids is not None and not p.dispatched and p.state in ("READY", "FAILED", "ABORTED")]
            for p in todo:
                p.dispatched = True
                self.stats.transfers_failed += p.state == "FAILED"
                self.stats.admitted_landed += p.sync and p.state == "READY"
        vecs = self._vectors([p.rid for p in todo if p.state == "READY"])
        for p in todo:
            if p.req_id is None or p.block_ids is None:  # allocated() sets block_ids only on an admitted request
                raise RuntimeError(f"kvd request {p.rid}: dispatched with no admitted vLLM request or no blocks")
            load = _Load(p.req_id, p.block_ids, p.start, p.tokens, error=p.reason if p.state != "READY" else "", sync=p.sync,
                         aborted=p.state == "ABORTED")
            if not load.error:
                v = vecs[p.rid]
                if isinstance(v, KvdError):
                    load.error = f"{type(v).__name__}: {v}"
                else:
                    load.full, load.swa_first, load.swa, load.state = v.full.tolist(), v.swa_first_page, v.swa.tolist(), v.state
                    load.boot = v.boot_id
            out.append(load)
        return out

    def _vectors(self, rids: list[str]) -> dict[str, Any]:
        """The page ids of ``rids``, by rid, in one call (the scheduler's thread waits for it); a
        request the daemon refuses (gone) maps to its error, the others asked again one by one."""
        if not rids:
            return {}
        try:
            return dict(zip(rids, self.kv.vectors_many(rids)))
        except KvdError as exc:
            if len(rids) == 1:
                return {rids[0]: exc}
        out: dict[str, Any] = {}
        for rid in rids:
            try:
                out[rid] = self.kv.vectors(rid)
            except KvdError as exc:
                out[rid] = exc
        return out

    def loaded(self, counts: dict[str, int]) -> None:
        """Workers' reports of sync loads copied (or failed), by vLLM request: a kvd request is
        freed once all :attr:`workers` reported it (each copies its own part)."""
        done = set()
        with self.lock:
            for req_id, n in counts.items():
                rid = self.by_req.get(req_id)
                p = self.pending.get(rid) if rid is not None else None
                if p is None:
                    continue
                p.loaded += n
                if p.loaded >= self.workers:
                    done.add(req_id)
        self.finished(done)

    def finished(self, req_ids: set[str], failed: set[str] | frozenset[str] = frozenset()) -> None:
        """The worker copied (or failed) these requests: their kvd pages go back, in one call (on
        the scheduler's thread); where the daemon refuses the batch (one still pinned by its
        lease, one gone), each alone. A request in ``failed`` stays known by its ticket until it
        ends: vLLM may compute it again (kv_load_failure_policy "recompute") and asks once more."""
        rids: list[str] = []
        with self.lock:
            for req_id in req_ids:
                rid = self.by_req.get(req_id)
                p = self.pending.pop(rid, None) if rid is not None else None
                # A failed load's request may be computed again and asks once more: known by its
                # ticket until it ends -- unless it ended already (aborted while it waited).
                if req_id not in failed or p is None or p.state == "ABORTED":
                    self.by_req.pop(req_id, None)
                if p is not None:  # not given back already
                    rids.append(p.rid)
        if len(rids) > 1:
            try:
                self.kv.free(*rids)
                return
            except KvdError as exc:  # all or nothing: none was freed
                log.debug("free %s together: %s; one by one", rids, exc)
        for rid in rids:
            self._free(rid)

    def ended(self, req_id: str) -> None:
        """vLLM finished (or aborted) ``req_id``. Its load dispatched: the worker's report frees the
        kvd request. Admitted to wait for its KV and not dispatched yet: vLLM keeps the request's
        blocks until the worker reports its load finished (it frees them on nothing else), so the
        load goes out at the next step as aborted -- reported, never copied -- and the kvd request
        is freed with that report. Otherwise freed now."""
        if req_id not in self.by_req and req_id not in self.recomputing:
            return  # no ticket (most requests): no lock. Both are written on this, the scheduler's, thread
        with self.lock:
            self.recomputing.pop(req_id, None)
            rid = self.by_req.get(req_id)
            if rid is None:
                return
            p = self.pending.get(rid)
            if p is not None and p.dispatched:
                return
            if p is not None and p.block_ids is not None:
                p.state, p.reason = "ABORTED", "the decode vLLM ended the request before its KV was loaded"
                self._rung.discard(rid)
                self.stats.aborted += 1
                return
        self.finished({req_id})

    def close(self) -> None:
        self._stop.set()
        self._ring.set()


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
        self._book: _TicketBook | None = None
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
            self._book = _TicketBook(self._kv, float(extra.get("kvd_admit_ttl_s", 30.0)), self._bs, self._layout,
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
        meta = _KvdMetadata()
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

    def _save_step(self, meta: _KvdMetadata, req_id: str, s: dict, computed: int, scheduled: int) -> None:
        # From the first token not saved yet, not from vLLM's first computed one: a prefix-cache
        # hit starts a request's first step past the cached blocks, whose KV (in the request's
        # blocks all the same) must reach the decode side too.
        start, end = s.get("saved", 0), min(computed + scheduled, s["tokens"])
        if end > start and not s.get("sent"):
            last = end >= s["tokens"]
            s["sent"], s["saved"] = last, end
            meta.saves.append(_Save(req_id, s["rid"], s["ticket"], s["tokens"], s["blocks"], start, end, last, max(0, computed - start)))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._book is None:
            return
        if connector_output.finished_recving:
            self._book.finished(set(connector_output.finished_recving), set(getattr(connector_output, "failed_recving", None) or ()))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, _KvdWorkerMetadata) and meta.loaded:
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

    def _open_all(self, saves: Sequence[_Save]) -> None:
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

    def _load_failed(self, ld: _Load) -> None:
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
        return _KvdWorkerMetadata({r: 1 for r in done}) if done else None

    def _load(self, ld: _Load) -> None:
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

    def _open_step(self, saves: Sequence[_Save]) -> None:
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

    def _new(self, saves: Sequence[_Save]) -> list[_Save]:
        """The saves whose requests are not open yet and have not failed to open."""
        return [sv for sv in saves if sv.req_id not in self._vecs and sv.req_id not in self._bad_saves]

    def _open(self, sv: _Save) -> dict | None:
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
