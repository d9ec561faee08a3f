"""The decode side's ticket book (the connector's scheduler role): tickets minted on the decode
daemon for requests the decode vLLM has not admitted yet (allocate + RECV lease, several asked for
at once minted in one call), their transfers watched (one thread reads every doorbell; over gRPC one
thread's WaitEnded calls answer them all), matched to the vLLM request that comes with the
ticket's prompt, and handed to the workers as loads. The ticket server (:mod:`kvd.connectors.vllm_ticket_server`) serves :meth:`TicketBook.mint`
over HTTP; :class:`kvd.connectors.vllm.KvdConnector` drives the rest.

kvd imports: :mod:`kvd.client` (``Client``), :mod:`kvd.errors`, :mod:`kvd.pool.layout`.
"""

from __future__ import annotations

import array
import base64
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kvd.client import Client
from kvd.connectors.vllm_meta import Load
from kvd.connectors.vllm_stats import TicketStats
from kvd.errors import FailedPrecondition, InvalidArgument, KvdError, SessionGone
from kvd.pool.layout import Layout

__all__ = ["ALIVE_S", "BELL_POLL_S", "CALL_WAIT_S", "TicketBook", "token_ids"]

log = logging.getLogger("kvd.connectors.vllm")
T = TypeVar("T")
#: How often the decode side reads its pending transfers' doorbells (kvd.memory.doorbells): a
#: READY transfer is seen within this, with no call to the daemon (~1 us of Python a transfer).
BELL_POLL_S = 0.002
#: How often, while transfers are pending, the decode side checks its daemon still answers.
ALIVE_S = 0.5
#: The longest one WaitEnded of the gRPC watcher waits: how late a transfer past its deadline may
#: fail, and the book's close may take.
CALL_WAIT_S = 1.0


def token_ids(ids: Iterable[int]) -> array.array:
    """A prompt's token ids as the ticket book keeps and compares them: int64s, in C (a 32k-token
    prompt in ~0.2 ms; through a tensor and a hash it took ~1.8). OverflowError past int64."""
    return array.array("q", ids)


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
    prefix: array.array  # prompt[:tokens] (token_ids): the admitted request's prompt must begin with it
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


class TicketBook:
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
        # per pending request).
        self._rung: set[str] = set()
        self._ring = threading.Event()  # set when _rung gains a transfer
        self._bells = threading.Thread(target=self._watch_bells, name="kvd-ticket-doorbells", daemon=True)
        self._bells.start()
        # Transfers with no doorbell to read (gRPC): one thread's WaitEnded calls answer them all
        # (a WaitReady each held a thread here and one of the daemon's 8 gRPC waits, the rest
        # refused and sent again every 0.2 s). Started with the first such transfer.
        self._called: set[str] = set()
        self._call_ring = threading.Event()  # set when _called gains a transfer
        self._rescan = False  # a transfer that may have ended before the watcher's cursor joined _called
        self._caller: threading.Thread | None = None

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
            prefix = token_ids(prompt)[:n]
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
            self._call(rid, fresh=True)
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

    def _call(self, rid: str, *, fresh: bool) -> None:
        """Watch ``rid``'s transfer with WaitEnded calls (:meth:`_watch_calls`). ``fresh``: its
        ticket is not out yet, so it cannot have ended; otherwise the watcher looks from cursor 0
        once, lest it ended before it joined (its end already behind the watcher's cursor)."""
        with self.lock:
            self._called.add(rid)
            self._rescan |= not fresh
            if self._caller is None:
                self._caller = threading.Thread(target=self._watch_calls, name="kvd-ticket-waits", daemon=True)
                self._caller.start()
        self._call_ring.set()

    def _late(self) -> str:
        """Why a transfer past its deadline failed (both watchers say it the same way)."""
        return f"no KV arrived within {self.admit_ttl:.1f} s of the ticket"

    def _watch_calls(self) -> None:
        """Transfers with no doorbell (:attr:`_called`): one WaitEnded at a time, at most
        :data:`CALL_WAIT_S` long, answers every transfer of this client's session that ended
        since the last; those watched take their state from it, and one past its deadline fails
        here. A call that fails (the daemon gone, restarted: the session or the cursor is not
        its) fails every transfer watched, as their waits would have."""
        cursor = 0
        while not self._stop.is_set():
            with self.lock:
                waiting = bool(self._called)
                after = 0 if self._rescan else cursor
                self._rescan = False
            if not waiting:
                self._call_ring.wait(0.5)
                self._call_ring.clear()
                continue
            ends: dict[str, tuple[str, str]] = {}
            gone = ""
            try:
                got = self.kv.wait_ended(after, CALL_WAIT_S)
            except KvdError as exc:
                gone, cursor = f"{type(exc).__name__}: {exc}", 0
            else:
                cursor = got.cursor
                ends = {t.rid: (t.state.name, t.reason) for t in got.transfers}
            now = time.monotonic()
            with self.lock:
                for rid in list(self._called):
                    p = self.pending.get(rid)
                    end = ("FAILED", gone) if gone else ends.get(rid)
                    if end is None and p is not None and now < p.xfer_deadline:
                        continue
                    if end is None:
                        end = ("FAILED", self._late())
                    if p is not None and p.state == "WAITING":
                        p.state, p.reason = end
                    self._called.discard(rid)
            if gone:
                self._stop.wait(0.1)  # a daemon that does not answer is not asked in a tight loop

    def _watch_bells(self) -> None:
        """Every :data:`BELL_POLL_S`, the doorbell of each transfer in :attr:`_rung`: READY is
        taken as it is; FAILED is asked of the daemon for its reason; a transfer past its
        deadline fails here. A transfer whose doorbell this client no longer reads (the daemon
        gone or restarted: the client's heartbeat drops the board) is asked of the daemon too,
        and one still pending there is watched with calls (:meth:`_call`). Every :data:`ALIVE_S` while any is
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
                            p.state, p.reason = "FAILED", self._late()
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
                if state not in ("READY", "FAILED"):  # pending, but no doorbell to read: watched with calls
                    self._call(rid, fresh=False)
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
            ids = token_ids(request.prompt_token_ids or ())
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

    def ready_loads(self) -> list[Load]:
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
            load = Load(p.req_id, p.block_ids, p.start, p.tokens, error=p.reason if p.state != "READY" else "", sync=p.sync,
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
        self._call_ring.set()
