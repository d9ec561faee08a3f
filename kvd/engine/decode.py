"""The decode role, and the handoff as seen from both engines.

The engines are plain synchronous objects driven by a loop (:mod:`kvd.engine.router` runs each in its
own process; tests drive them in one thread). The handoff of one request, as SGLang or vLLM
would do it on top of kvd::

    router          decode engine (daemon B)               prefill engine (daemon A)
      | Admit(r) ──▶ allocate_recv(r, n): allocate + RECV lease
      |              + ticket, one call ──────────────┐
      | ◀────────────────────────────────────────────┘
      | Prefill(r, prompt, ticket) ─────────────────────▶ allocate(r, n, ticket): the transfer begun too
      |                                                    per chunk: forward, write KV, send(r, ticket, chunk)
      | ◀─────────────────────────────── first token ──── (the last send frees r: free=True)
      | Start(r, first token) ──▶ wait_ready(r) -> READY; decode (greedy or speculative)
      | ◀── Completion(r) ───────  free(r)

``wait_ready`` is answered by the daemon the moment the transfer is READY (or FAILED), not
polled: by the time the first token reaches the decode engine the last Send has committed, so
the call normally returns at once; it blocks (up to ``EngineConfig.ready_wait``) only when the
Start overtook the commit.

Decode runs a batch in rounds. One round of one request at committed length ``L`` with next
token ``x``: the draft proposes ``k`` tokens (plain greedy: ``k = 0``), the target scores
``x, d1..dk`` in one pass, the longest prefix of proposals matching the target's greedy choices
is accepted plus the target's own next token. Only then is the request extended by exactly the
accepted count and their KV written -- the allocation never runs ahead of the committed length,
so the pool's sliding-window rule (release SWA pages older than ``old_length - window``) never
drops a page a later query still needs.

Memory pressure (decode side): a new request that does not fit makes the engine retract a
running one (``offload`` to host memory; ``restore`` later, into new pages with the same bytes),
and at step boundaries after retractions or completions it asks the daemon to compact. Live RECV
leases make a plain compaction refuse (``Pinned``); the engine then compacts around them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.engine.model import Models, Pending
from kvd.engine.paged import PagedKV
from kvd.engine.records import Completion, EngineConfig, FirstToken, KVApi, Request
from kvd.errors import CapacityError, KvdError, Pinned
from kvd.records import CompactionResult, IndexVectors

__all__ = ["DecodeEngine", "DecodeStats"]


@dataclass(slots=True)
class _Seq:
    """A request on the decode side."""

    req: Request
    vec: IndexVectors | None = None
    length: int = 0  # committed tokens: positions [0, length) have KV in the arena
    draft_len: int = 0  # positions [0, draft_len) have draft KV in the arena
    tokens: list[int] = field(default_factory=list)  # emitted; tokens[-1] is the next input
    target_trace: float = 0.0
    draft_trace: float = 0.0
    proposed: int = 0
    accepted: int = 0
    retracted: int = 0
    started: bool = False  # the first token arrived (the transfer is then complete or failed)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt)

    def token_at(self, pos: int) -> int:
        return self.req.prompt[pos] if pos < self.prompt_len else self.tokens[pos - self.prompt_len]

    def done(self) -> bool:
        return len(self.tokens) >= self.req.max_new

    def completion(self, error: str = "") -> Completion:
        return Completion(self.req.rid, tuple(self.tokens[: self.req.max_new]), self.target_trace, self.draft_trace,
                          self.proposed, self.accepted, self.retracted, error)


@dataclass
class DecodeStats:
    rounds: int = 0  # request-rounds (one forward of the target per running request)
    tokens: int = 0  # tokens emitted by decode rounds
    busy_s: float = 0.0  # time spent in rounds
    recv_leases: int = 0
    retractions: int = 0
    restores: int = 0
    compactions: int = 0
    compactions_refused: int = 0  # plain compactions refused because leases pinned pages (then done around them)
    pages_moved: int = 0
    deferred: int = 0  # requests whose admission had to wait for memory (nothing left to retract)
    proposed: int = 0
    accepted: int = 0


@dataclass(slots=True)
class _Round:
    s: _Seq
    emitted: list[int]
    target: Pending
    draft: Pending | None
    t_trace: float
    d_trace: float
    proposed: int


class DecodeEngine:
    """Receives requests into its daemon's pool and decodes them in rounds (see the module doc)."""

    def __init__(self, kv: KVApi, paged: PagedKV, models: Models, cfg: EngineConfig) -> None:
        if cfg.spec_k and models.draft is None:
            raise ValueError("spec_k > 0 needs a draft model")
        self.kv = kv
        self.paged = paged
        self.models = models
        self.cfg = cfg
        self.stats = DecodeStats()
        self.awaiting: dict[str, _Seq] = {}  # allocated + leased, KV not yet ready
        self.running: dict[str, _Seq] = {}
        self.retracted: deque[_Seq] = deque()
        self._compact_due = False
        self._since_compact = 0
        self._deferred: set[str] = set()

    # ---- admission ------------------------------------------------------------------------
    def admit(self, req: Request) -> bytes | None:
        """Allocate ``req`` for receiving and return its ticket. If it does not fit, retract
        running requests until it does -- unless retracted requests are already waiting to come
        back (they go first). None: it cannot be admitted now; ask again after a step."""
        while True:
            # An allocation that does not fit changes nothing (all or nothing), so trying it is
            # the check: one round trip per admission, not a shortfall query and then the call.
            try:
                # allocate + RECV lease + its ticket in one round trip (all or nothing)
                vec, lease = self.kv.allocate_recv(req.rid, len(req.prompt), ttl=self.cfg.ticket_ttl)  # type: ignore[attr-defined]
                break
            except CapacityError:
                # Requests already retracted go first: wait for memory rather than retract more.
                if self.retracted or not self._retract_one():
                    self._defer(req.rid)
                    return None
        self.stats.recv_leases += 1
        self.awaiting[req.rid] = _Seq(req, vec, length=len(req.prompt), draft_len=len(req.prompt))
        return lease.ticket

    def _defer(self, rid: str) -> None:
        if rid not in self._deferred:
            self._deferred.add(rid)
            self.stats.deferred += 1
        return None

    def adopt(self, req: Request, first: FirstToken) -> None:
        """Colocated: take over a request the prefill engine computed in this same pool."""
        s = _Seq(req, self.kv.vectors(req.rid), length=len(req.prompt), draft_len=len(req.prompt))
        self._first(s, first)
        self.running[req.rid] = s

    def start(self, first: FirstToken) -> None:
        """The prefill side finished ``first.rid``: its transfer is complete (or failed)."""
        s = self.awaiting[first.rid]
        self._first(s, first)

    def _first(self, s: _Seq, first: FirstToken) -> None:
        s.tokens = [first.token]
        s.target_trace = first.logit
        s.started = True

    def cancel(self, rid: str, reason: str) -> Completion:
        """The prefill side failed: abort the transfer and free the request."""
        s = self.awaiting.pop(rid)
        try:
            self.kv.abort(rid, reason)  # type: ignore[attr-defined]
        except KvdError:
            pass
        self._free(rid)
        return s.completion(error=reason)

    def poll_ready(self, timeout: float | None = None) -> list[Completion]:
        """Move started requests whose KV is READY into the running batch. Returns failures.
        Each started request's ``wait_ready`` is answered when its transfer ends (``timeout``,
        default ``cfg.ready_wait``: how long one may block; still not ready then, it is asked
        again on the next call)."""
        failed = []
        wait = self.cfg.ready_wait if timeout is None else timeout
        for rid, s in list(self.awaiting.items()):
            if not s.started:
                continue
            st = self.kv.wait_ready(rid, timeout=wait)  # type: ignore[attr-defined]
            if st.ready:
                del self.awaiting[rid]
                s.vec = self.kv.vectors(rid)
                self.running[rid] = s
            elif st.state.value == "failed":
                del self.awaiting[rid]
                self._free(rid)
                failed.append(s.completion(error=f"transfer failed: {st.reason}"))
        return failed

    def warm_up(self, lengths: Sequence[int]) -> None:
        """Start-up, before anything is timed: the daemon's page moves once per shape -- offload
        and restore (arena <-> host) and a compaction that moves pages (on a GPU arena: the
        Triton page-move kernels' first compiles) -- on scratch requests, freed afterwards.
        The first of ``lengths`` is freed first, leaving a hole the compaction fills. Not
        counted in :attr:`stats`; leaves the pool as it found it (but for its epoch)."""
        rids = [f"warmup-moves-{i}" for i in range(len(lengths))]
        held: list[str] = []
        try:
            for rid, n in zip(rids, lengths):
                self.kv.allocate(rid, n)
                held.append(rid)
            self.kv.free(held.pop(0))
            for rid in held:
                self.kv.offload(rid)
                self.kv.restore(rid)
            self.kv.compact()
        finally:
            if held:
                self.kv.free(*held)

    # ---- pressure -------------------------------------------------------------------------
    def _retract_one(self, keep: str | None = None) -> bool:
        """Offload the running request holding the most tokens (not ``keep``). False: none left."""
        cands = [s for s in self.running.values() if s.req.rid != keep]
        if not cands:
            return False
        s = max(cands, key=lambda c: c.length)
        self.kv.offload(s.req.rid)
        del self.running[s.req.rid]
        s.vec = None
        s.retracted += 1
        self.retracted.append(s)
        self.stats.retractions += 1
        self._compact_due = True
        return True

    def maintain(self) -> None:
        """Step-boundary work: bring retracted requests back while they fit; compact when due."""
        while self.retracted:
            s = self.retracted[0]
            try:
                s.vec = self.kv.restore(s.req.rid)
            except CapacityError:
                break
            self.retracted.popleft()
            self.running[s.req.rid] = s
            self.stats.restores += 1
        if self._compact_due:
            self.compact()

    def compact(self) -> CompactionResult:
        """Ask the daemon to compact (no round is in flight, so no vector is in use)."""
        try:
            res = self.kv.compact()
        except Pinned:
            # RECV leases of requests still arriving pin their pages: compact around them.
            self.stats.compactions_refused += 1
            res = self.kv.compact(around_pinned=True)
        self.stats.compactions += 1
        self.stats.pages_moved += res.pages_moved
        self._compact_due = False
        self._since_compact = 0
        if res.pages_moved and self.running:
            rids = list(self.running)
            for rid, vec in zip(rids, self.kv.vectors_many(rids)):
                self.running[rid].vec = vec
        return res

    # ---- decoding -------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.running or self.awaiting or self.retracted)

    def step(self) -> list[Completion]:
        """One round for every running request; returns the requests that finished."""
        if not self.running:
            return []
        t0 = time.perf_counter()
        rounds = [self._round(s) for s in self.running.values()]
        while True:
            items = [(r.s.req.rid, len(r.emitted)) for r in rounds]
            if not items:
                break
            try:
                vecs = self.kv.extend_many(items)
                break
            except CapacityError:
                # A running request must give way; its round is dropped (recomputed after restore).
                if not self._retract_one():
                    raise
                rounds = [r for r in rounds if r.s.req.rid in self.running]
        done = []
        for r, vec in zip(rounds, vecs if rounds else []):
            s = r.s
            s.vec = vec
            seq = self.paged.seq(vec)
            r.target.commit(seq, s.length + len(r.emitted))
            if r.draft is not None:
                s.draft_len = min(s.length + len(r.emitted), r.draft.end)
                r.draft.commit(seq, s.draft_len)
            s.length += len(r.emitted)
            s.tokens.extend(r.emitted)
            s.target_trace += r.t_trace
            s.draft_trace += r.d_trace
            s.proposed += r.proposed
            s.accepted += len(r.emitted) - 1
            self.stats.rounds += 1
            self.stats.tokens += len(r.emitted)
            self.stats.proposed += r.proposed
            self.stats.accepted += len(r.emitted) - 1
            if s.done():
                del self.running[s.req.rid]
                self._free(s.req.rid)
                done.append(s.completion())
        self._since_compact += len(done)
        if self._since_compact >= self.cfg.compact_every:
            self._compact_due = True
        self.stats.busy_s += time.perf_counter() - t0
        return done

    def _round(self, s: _Seq) -> _Round:
        """Propose (draft), verify (target) and accept for one request. Reads the arena only."""
        assert s.vec is not None
        seq = self.paged.seq(s.vec)
        L = s.length
        k = min(self.cfg.spec_k, s.req.max_new - len(s.tokens) - 1)
        proposals: list[int] = []
        dpend = None
        d_trace = 0.0
        if k > 0:
            draft = self.models.draft
            assert draft is not None
            dpend = Pending(s.draft_len)
            # catch up on accepted tokens the draft has not seen, then the pending input token
            logits = draft.forward([s.token_at(p) for p in range(s.draft_len, L + 1)], s.draft_len, seq, dpend)
            for i in range(k):
                if i:
                    logits = draft.forward([proposals[-1]], L + i, seq, dpend)
                d = int(logits[-1].argmax())
                d_trace += float(logits[-1, d])
                proposals.append(d)
        tpend = Pending(L)
        logits = self.models.target.forward([s.tokens[-1], *proposals], L, seq, tpend)
        best = logits.argmax(-1).tolist()
        a = 0
        while a < k and proposals[a] == best[a]:
            a += 1
        emitted = proposals[:a] + [best[a]]
        t_trace = float(sum(logits[i, tok] for i, tok in enumerate(emitted)))
        return _Round(s, emitted, tpend, dpend, t_trace, d_trace, k)

    def _free(self, rid: str) -> None:
        try:
            self.kv.free(rid)
        except KvdError:
            pass  # a failed transfer's pages may be fenced; the daemon frees them when the fence ends
