"""The node: one daemon's state -- the pool, client sessions, ownership, leases -- behind a lock.

This is the core's top layer and the only object the gRPC servicer talks to. It has no gRPC and
no Prometheus in it: it raises :mod:`kvd.errors` and fills plain stats.

Rules it enforces on top of the pool:

* a request belongs to the client session that allocated it; other sessions get
  :class:`~kvd.errors.PermissionDenied`;
* a session that makes no call for its TTL is dead: its leases are released and its requests
  (live or offloaded) freed by :meth:`Node.sweep`;
* a request with a live lease cannot be freed or offloaded, and compaction refuses to move its
  pages (or moves around them, when asked);
* vectors and leases quote ``(boot_id, epoch)``; a stale pair is refused and counted.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvd.records import (
    Activity,
    AllocSpec,
    CompactionResult,
    Ends,
    IndexVectors,
    LeaseActivity,
    LeaseKind,
    NodeStats,
    PoolStats,
    RequestActivity,
    SessionInfo,
    TransferActivity,
    TransferRef,
)
from kvd.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    LayoutMismatch,
    LimitReached,
    NotFound,
    SessionGone,
    PermissionDenied,
    StaleEpoch,
)
from kvd.pool.layout import Layout
from kvd.limits import quote
from kvd.daemon.inbound import Inbound, NoInbound
from kvd.daemon.leases import Lease, LeaseTable
from kvd.pool.pool import Pool

__all__ = ["Node", "MAX_SESSION_TTL", "MAX_HANDED", "MAX_SESSIONS", "MAX_LEASES_PER_REQUEST"]

#: Upper bound of a client-chosen session TTL (the same cap as the session_ttl_s setting).
MAX_SESSION_TTL = 3600.0
#: Requests whose handed-out vectors a node keeps for their SEND lease (Node.acquire_lease).
MAX_HANDED = 256
#: Sessions live at once. A node's engines hold a few each (a scheduler's, each worker's); a
#: client opening sessions in a loop would otherwise grow the daemon's memory, and every sweep,
#: for as long as their TTL (up to an hour) -- LimitReached instead.
MAX_SESSIONS = 4096
#: Live leases on one request. A request has a RECV lease, or a SEND lease per Send in flight
#: and the few an engine takes itself; leases taken in a loop would grow without bound for their
#: TTL, and every lease, free and Send of the request scans them -- LimitReached instead.
MAX_LEASES_PER_REQUEST = 64

log = logging.getLogger("kvd.daemon.node")


class Node:
    """Thread-safe facade over one pool. Every public method takes the lock once."""

    def __init__(
        self,
        pool: Pool,
        *,
        session_ttl: float = 10.0,
        lease_ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        layout_from_engine: bool = False,
    ) -> None:
        self.pool = pool
        #: the pool's layout is a placeholder until the first engine proposes its own
        #: (:meth:`propose_layout`); allocations wait for it
        self.layout_pending = layout_from_engine
        self.clock = clock
        self.session_ttl = session_ttl
        self.leases = LeaseTable(default_ttl=lease_ttl, clock=clock)
        self._sessions: dict[str, SessionInfo] = {}
        self._owner: dict[str, str] = {}  # rid -> session id
        self._born: dict[str, float] = {}  # rid -> when it was allocated (kvd top's ages)
        # rid -> the vectors last handed out for it (allocate, extend), the newest MAX_HANDED: a
        # SEND lease takes them while they still are the request's instead of gathering again
        self._handed: dict[str, IndexVectors] = {}
        self.allocations_total = 0  # requests allocated since boot (kvd top's rate)
        self._lock = threading.RLock()
        self.stale_refusals = 0
        self.sessions_expired = 0
        self.stalls_excused = 0  # sweeps that found this process had not run (sweep's stalled_s) ...
        self.stalled_seconds = 0.0  # ... and for how long in all
        # Requests the engine freed while a failed sender might still write them: freed for
        # real once their fence (the RECV lease) ends.
        self._doomed: set[str] = set()
        #: the inbound transfers its RECV leases admit: attached by whoever assembles the daemon
        #: (:meth:`kvd.handoff.inbox.Inbox.attach`); until then there are none
        self.inbox: Inbound = NoInbound()
        #: called (under the lock) after finalize/resize changed the backed size: re-registration
        self.on_backing_change: list[Callable[[], None]] = []
        #: called (under the lock; must not block) when requests ended or inbound transfers were
        #: given up (:meth:`_end`): the Outbox tells the other daemons
        self.on_ended: list[Callable[[Ends], None]] = []

    @property
    def lock(self) -> threading.RLock:
        """The node's lock, for callers that read several fields as one consistent picture."""
        return self._lock

    def count_stale(self) -> None:
        """Count one call refused for quoting a stale boot id or epoch (:attr:`NodeStats.stale_refusals_total`)."""
        with self._lock:
            self.stale_refusals += 1

    @property
    def layout(self) -> Layout:
        return self.pool.layout

    def propose_layout(self, session_id: str, layout: Layout) -> Layout:
        """An engine's layout. A daemon started with ``layout_from_engine`` and no layout yet takes
        it (the pool is rebuilt over the same arena: nothing was allocated, allocations wait for
        it); otherwise the proposal must be compatible with the pool's layout: LayoutMismatch
        naming both layouts if not, the pool unchanged. Returns the layout the daemon serves."""
        with self._lock:
            self._touch(session_id)
            if self.layout_pending:
                pool = Pool(layout, self.pool.arena, post_capture=self.pool.post_capture)
                pool.boot_id = self.pool.boot_id  # the same boot: sessions and tickets quote it
                self.pool = pool
                self.layout_pending = False
                log.info("layout taken from the first engine (session %s):\n%s", session_id, layout.describe())
                return layout
            try:
                self.pool.layout.require_compatible(layout)
            except LayoutMismatch as exc:
                raise LayoutMismatch(
                    f"this daemon serves another layout than the engine's ({exc}; 'here' is the daemon).\n"
                    f"the daemon:\n{self.pool.layout.describe()}\nthe engine:\n{layout.describe()}\n"
                    "start the daemon with the engine's layout, or with layout_from_engine=true and no engine yet"
                ) from None
            return self.pool.layout

    def require_layout(self) -> None:
        """FailedPrecondition while the layout waits for the first engine (layout_from_engine)."""
        if self.layout_pending:
            raise FailedPrecondition(
                "this daemon takes its layout from the first engine (layout_from_engine=true) and none has proposed one "
                "yet: call ProposeLayout first (kvd's vLLM connector does when it registers its KV caches)"
            )

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self, name: str = "", ttl: float | None = None) -> SessionInfo:
        if ttl is not None and not (0 <= ttl <= MAX_SESSION_TTL):
            raise InvalidArgument(
                f"session ttl must be in [0, {MAX_SESSION_TTL:.0f}] seconds (0: the daemon's default), got {ttl}; "
                "a longer TTL would keep a dead client's pages"
            )
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                raise LimitReached(
                    f"this daemon holds {len(self._sessions):,d} sessions, its limit: close the clients no longer used "
                    "(Client.close); a session whose client died ends after its TTL"
                )
            s = SessionInfo(uuid.uuid4().hex, name, ttl or self.session_ttl, self.clock())
            self._sessions[s.session_id] = s
            return s

    def touch(self, session_id: str) -> SessionInfo:
        """Mark the session alive (every call does this) and return it."""
        with self._lock:
            return self._touch(session_id)

    def _touch(self, session_id: str) -> SessionInfo:
        """:meth:`touch`, the lock held."""
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionGone(
                f"session {quote(session_id)} is unknown or expired (this daemon restarted, or no call came within its TTL): "
                "its requests and leases are gone; open a new session (kvd's clients do so at once)"
            )
        s.last_seen = self.clock()
        return s

    def close_session(self, session_id: str, free_requests: bool = True) -> tuple[int, int]:
        """End a session: release its leases and free its requests. Returns (freed, released).
        A request fenced after a failed transfer keeps its RECV lease until the fence ends and
        is freed then (see :meth:`_end`), and so does one still receiving: its transfer is
        aborted toward the sender first.

        With ``free_requests=False`` the requests are kept, and so is the session record that
        owns them, until the session's TTL runs out from now; then :meth:`sweep` frees them as
        for a dead client. A request never outlives every session that could free it. Its RECV
        leases are released all the same: one under a transfer in progress ends it as
        :meth:`release_lease` does (aborted toward the sender, fenced)."""
        with self._lock:
            s = self._touch(session_id)
            if free_requests or not s.rids:
                return self._reap(s, "its engine closed its session")
            released = 0
            senders = []
            for lease in self.leases.for_session(session_id):
                fenced, tell = self._end_lease(lease, "its engine closed its session")
                released += not fenced
                senders += [tell] if tell else []
            self._announce(session_id, "its engine closed its session", (), senders)
            return 0, released

    def _reap(self, s: SessionInfo, reason: str) -> tuple[int, int]:
        """End a session and every request it holds (:meth:`_end`); its leases on requests not
        fenced go with them. Returns (requests freed, leases released)."""
        rids = sorted(s.rids)
        held = {lease.lease_id for lease in self.leases.for_session(s.session_id)}
        self._end(s, rids, reason)
        for lease in self.leases.for_session(s.session_id):
            if not self.inbox.fenced(lease.rid):
                self.leases.drop(lease.lease_id)
        kept = {lease.lease_id for lease in self.leases.for_session(s.session_id)}
        del self._sessions[s.session_id]
        return len(rids), len(held - kept)

    def _end(self, s: SessionInfo, rids: Sequence[str], reason: str) -> None:
        """The one way requests of session ``s`` end -- its engine's free, its session closed with
        its requests, or reaped after its TTL -- and what each end owes the transfers in
        progress:

        * receiving: a request whose sender is mid-way is not freed outright. Its transfer fails
          and is aborted toward the sender (:meth:`Inbound.end`); its pages stay pinned (fenced by
          its RECV lease) until the sender says its writes drained or the fence runs out, and
          the request is freed then (:meth:`_bury`). The others are freed now, with every lease
          on them (a session's own, or another's: the pages are going away);
        * sending: the hooks hear of every ended request (:class:`~kvd.records.Ends`) and the
          Outbox aborts the transfers it still sends toward their receivers."""
        fenced: set[str] = set()
        now: list[str] = []
        senders = []
        leases, inbox = self.leases, self.inbox
        for rid in rids:
            fence, tell = inbox.end(rid, reason)
            if tell:
                senders.append(tell)
            if fence:
                fenced.add(rid)
            else:
                now.append(rid)
                for lease in leases.for_rid(rid):
                    leases.drop(lease.lease_id)
        if now:  # freeing bumps the pool's epoch: not for nothing
            self.pool.free_many(now)
        self._doomed.update(fenced)
        owner, born, mine, handed = self._owner, self._born, s.rids, self._handed
        for rid in rids:
            owner.pop(rid, None)
            born.pop(rid, None)
            handed.pop(rid, None)
            mine.discard(rid)
            if rid not in fenced:
                inbox.forget(rid)
        self._announce(s.session_id, reason, rids, senders)

    def _end_lease(self, lease: Lease, reason: str) -> tuple[bool, tuple[str, TransferRef] | None]:
        """Release ``lease`` on behalf of its holder. A RECV lease under a transfer in progress
        is the fence of its pages: the transfer fails (:meth:`Inbound.end`) and the lease stays
        until the fence ends. Returns ``(fenced, the sender to tell)``."""
        if lease.kind is LeaseKind.RECV:
            fenced, tell = self.inbox.end(lease.rid, reason)
            if fenced:
                return True, tell
            self.inbox.forget(lease.rid)  # a later commit under this lease finds nothing
        self.leases.drop(lease.lease_id)
        return False, None

    def _announce(self, session_id: str, reason: str, rids: Sequence[str], senders: Sequence[tuple[str, TransferRef]]) -> None:
        if not (rids or senders):
            return
        ends = Ends(session_id, reason, tuple(rids), tuple(senders))
        for fn in self.on_ended:
            try:
                fn(ends)
            except Exception:  # a hook's bug must not leave the node half-changed
                log.exception("on_ended hook")

    def sweep(self, stalled_s: float = 0.0) -> tuple[list[Lease], list[str]]:
        """Expire leases past their TTL and reap sessions silent for longer than theirs.
        Returns the expired leases and the reaped session ids.

        ``stalled_s``: how long this process did not run before this sweep (the sweeper woke that
        much later than due: paused, CPU-throttled, descheduled). Clients' and senders' beats and
        renewals sent meanwhile wait unread in their sockets, and a sweep that ran first would
        take them for dead: the sessions' silences, the leases' deadlines and the inbound
        transfers' silences are first moved on by that much, as if the clock had stopped."""
        with self._lock:
            if stalled_s > 0:
                self._excuse(stalled_s)
            # The inbox first: a RECV lease past its TTL under a transfer still receiving is
            # held as its fence, which it can no longer be once expire() has removed it.
            self.inbox.sweep()
            expired = self.leases.expire()
            self._bury()
            now = self.clock()
            dead = [s for s in self._sessions.values() if now - s.last_seen > s.ttl]
            for s in dead:
                self._reap(s, f"its session expired (no call for {s.ttl:g} s)")
            self.sessions_expired += len(dead)
            return expired, [s.session_id for s in dead]

    def _excuse(self, stalled_s: float) -> None:
        now = self.clock()
        for s in self._sessions.values():
            s.last_seen = min(now, s.last_seen + stalled_s)
        self.leases.postpone(stalled_s)
        self.inbox.excuse(stalled_s)
        self.stalls_excused += 1
        self.stalled_seconds += stalled_s

    def _bury(self) -> None:
        """Free doomed requests whose fence has ended (no lease pins them any more)."""
        done = [rid for rid in self._doomed if not self.leases.for_rid(rid)]
        if done:
            self.pool.free_many(done)
            for rid in done:
                self._doomed.discard(rid)
                self.inbox.forget(rid)

    # ---- ownership --------------------------------------------------------------------------
    def own(self, session_id: str, rid: str) -> None:
        """Keep ``session_id`` alive and raise unless it created ``rid`` (NotFound / PermissionDenied),
        as every other call naming a request does."""
        with self._lock:
            self._touch(session_id)
            self._own(session_id, rid)

    def mine(self, session_id: str) -> Callable[[str], bool]:
        """A test of whether a request is ``session_id``'s, reading the owners as they are when it
        is called (call it under :attr:`lock`): what a wait over a session's transfers filters
        them by. Keeps ``session_id`` alive (SessionGone for one that is not)."""
        with self._lock:
            self._touch(session_id)
        owner = self._owner
        return lambda rid: owner.get(rid) == session_id

    def _own(self, session_id: str, rid: str) -> None:
        owner = self._owner.get(rid)
        if owner is None:
            raise NotFound(f"request {quote(rid)} is not allocated on this node (freed, expired, or never allocated)")
        if owner != session_id:
            raise PermissionDenied(f"request {quote(rid)} belongs to another client session; only its creator may use it")

    def _no_leases(self, rid: str, what: str) -> None:
        held = self.leases.for_rid(rid)
        if held:
            names = ", ".join(lease.label() for lease in held)
            raise FailedPrecondition(f"{what} {quote(rid)}: pinned by {names}; release the lease(s) first")

    # ---- requests ---------------------------------------------------------------------------
    def allocate(self, session_id: str, specs: Sequence[AllocSpec]) -> list[IndexVectors]:
        with self._lock:
            s = self._touch(session_id)
            self.require_layout()
            out = self.pool.allocate_many(specs)
            now = self.clock()
            for spec in specs:
                self._owner[spec.rid] = session_id
                self._born[spec.rid] = now
                s.rids.add(spec.rid)
            self.allocations_total += len(specs)
            self._hand(out)
            return out

    def _hand(self, vecs: list[IndexVectors]) -> list[IndexVectors]:
        """Remember ``vecs`` as handed out (the newest :data:`MAX_HANDED`); returns them."""
        handed = self._handed
        for v in vecs:
            handed.pop(v.rid, None)
            handed[v.rid] = v
        while len(handed) > MAX_HANDED:
            del handed[next(iter(handed))]
        return vecs

    def can_allocate(self, session_id: str, specs: Sequence[AllocSpec]) -> int:
        """Shortfall in bytes (0: fits). Changes nothing."""
        with self._lock:
            self._touch(session_id)
            self.require_layout()
            return self.pool.shortfall_bytes(specs)

    def extend(self, session_id: str, items: Sequence[tuple[str, int]]) -> list[IndexVectors]:
        with self._lock:
            self._touch(session_id)
            for rid, _ in items:
                self._own(session_id, rid)
            return self._hand(self.pool.extend_many(items))

    def free(self, session_id: str, rids: Sequence[str]) -> int:
        with self._lock:
            s = self._touch(session_id)
            if len(set(rids)) != len(rids):
                raise InvalidArgument("free: a request id appears twice in one batch")
            for rid in rids:
                self._own(session_id, rid)
                if not self.inbox.fenced(rid):
                    self._no_leases(rid, "free")
            # A request whose failed sender may still write it is freed once the fence ends.
            self._end(s, rids, "its engine freed it")
            return len(rids)

    def vectors(self, session_id: str, rids: Sequence[str]) -> list[IndexVectors]:
        with self._lock:
            self._touch(session_id)
            for rid in rids:
                self._own(session_id, rid)
            return [self.pool.vectors(rid) for rid in rids]

    # ---- leases -----------------------------------------------------------------------------
    def acquire_lease(
        self,
        session_id: str,
        rid: str,
        kind: LeaseKind,
        *,
        ttl: float | None = None,
        boot_id: str = "",
        epoch: int = 0,
        known: IndexVectors | None = None,
    ) -> tuple[Lease, IndexVectors]:
        """Pin ``rid``. If ``boot_id`` is given, the caller's vectors (``epoch``) must be fresh.
        Returns the lease and the request's current vectors (what the lease pins): ``known``
        itself when those still are the request's vectors (:meth:`Pool.unchanged`; the gather is
        skipped), so ``vec is known`` tells the caller nothing moved since it read them. A SEND
        lease given no ``known`` tries the vectors last handed out for ``rid`` (allocate, extend)."""
        with self._lock:
            self._touch(session_id)
            self._own(session_id, rid)
            if boot_id:
                self._fresh(rid, epoch, boot_id)
            if known is None and kind is LeaseKind.SEND:
                known = self._handed.get(rid)
            vec = known if known is not None and self.pool.unchanged(known) else self.pool.vectors(rid)
            if kind is LeaseKind.RECV:
                # A transfer whose RECV lease just ran out is fenced (its lease held) before a
                # new lease could forget it while its sender may still write (this request's
                # only: the hot path of every decode-side allocate).
                self.inbox.lapse(rid)
            if kind is LeaseKind.RECV and any(lease.kind is LeaseKind.RECV for lease in self.leases.for_rid(rid)):
                raise FailedPrecondition(f"request {quote(rid)} already has a live RECV lease: one sender per request")
            held = self.leases.count(rid)  # no scan: a Send's path
            if held >= MAX_LEASES_PER_REQUEST:
                raise LimitReached(
                    f"request {quote(rid)} holds {held:,d} leases, the limit of one request: release the leases no longer "
                    "used (each Send releases its own)"
                )
            lease = self.leases.acquire(rid, kind, session=session_id, boot_id=self.pool.boot_id, epoch=vec.epoch, ttl=ttl)
            if kind is LeaseKind.RECV:
                self.inbox.expect(rid, lease.lease_id)
            return lease, vec

    def renew_lease(self, session_id: str, lease_id: int, ttl: float | None = None) -> Lease:
        with self._lock:
            self._touch(session_id)
            self._lease_of(session_id, lease_id)
            return self.leases.renew(lease_id, ttl)

    def release_lease(self, session_id: str, lease_id: int) -> Lease:
        with self._lock:
            self._touch(session_id)
            lease = self._lease_of(session_id, lease_id)
            reason = "its engine released the RECV lease"
            fenced, tell = self._end_lease(lease, reason)
            if tell:
                self._announce(session_id, reason, (), [tell])
            return lease

    def _lease_of(self, session_id: str, lease_id: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease.session != session_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another client session")
        return lease

    def _fresh(self, rid: str, epoch: int, boot_id: str) -> None:
        try:
            self.pool.require_fresh(rid, epoch, boot_id)
        except StaleEpoch:
            self.count_stale()
            raise

    # ---- maintenance ------------------------------------------------------------------------
    def compact(self, session_id: str, around_pinned: bool = False) -> CompactionResult:
        with self._lock:
            self._touch(session_id)
            self.inbox.sweep()  # a receiving request whose RECV lease just ran out is fenced, not movable
            return self.pool.compact(self.leases.pinned(), around_pinned=around_pinned)

    def finalize(self, session_id: str, nbytes: int | None, resize: bool = False) -> None:
        with self._lock:
            self._touch(session_id)
            (self.pool.resize if resize else self.pool.finalize)(nbytes)
            for fn in self.on_backing_change:
                fn()

    def offload(self, session_id: str, rid: str) -> int:
        with self._lock:
            self._touch(session_id)
            self._own(session_id, rid)
            self.inbox.lapse(rid)  # a receiving request whose RECV lease just ran out is fenced
            self._no_leases(rid, "offload")
            return self.pool.offload(rid)

    def restore(self, session_id: str, rid: str) -> IndexVectors:
        with self._lock:
            self._touch(session_id)
            self._own(session_id, rid)
            return self.pool.restore(rid)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> NodeStats:
        with self._lock:
            return NodeStats(
                pool=self.pool.stats(),
                layout_name="(from the first engine)" if self.layout_pending else self.pool.layout.name,
                leases_live=len(self.leases),
                leases_expired_total=self.leases.expired_total,
                stale_refusals_total=self.stale_refusals,
                sessions_live=len(self._sessions),
                sessions_expired_total=self.sessions_expired,
                transfers_in_ready_total=self.inbox.ready_total,
                transfers_in_failed_total=self.inbox.failed_total,
                transfer_in_bytes_total=self.inbox.bytes_total,
            )

    def activity(self, limit: int = 20, outbound: Sequence[tuple[str, str, str, int, float]] = (),
                 bytes_sent_total: int = 0) -> Activity:
        """Requests, leases and transfers in flight, the ``limit`` oldest of each, with their ages
        (kvd top). ``outbound``: the daemon's outbox's open transfers (:meth:`Outbox.open_transfers`,
        taken before this call: the outbox has a lock of its own). Read-only."""
        import heapq

        with self._lock:
            now = self.clock()
            leases = [lease for lease in self.leases.all() if lease.expires_at > now]
            pinned = {lease.rid for lease in leases}
            names = {sid: s.name for sid, s in self._sessions.items()}
            pinned_pages: dict[str, int] = {}
            for rid in pinned:
                try:
                    _, full, swa = self.pool.footprint(rid)
                except NotFound:
                    continue
                for g, n in (("full", full), ("swa", swa), ("state", 1)):  # draft pages: not counted
                    if n and self.layout.has(g):
                        pinned_pages[g] = pinned_pages.get(g, 0) + n
            reqs = []
            for rid, born in heapq.nsmallest(limit, self._born.items(), key=lambda kv: kv[1]):
                try:
                    tokens, full, swa = self.pool.footprint(rid)
                except NotFound:
                    continue  # offloaded: it holds no pages now
                reqs.append(RequestActivity(rid, names.get(self._owner.get(rid, ""), ""), tokens, full, swa, now - born,
                                            rid in pinned))
            oldest = heapq.nsmallest(limit, leases, key=lambda lease: lease.granted_at)
            inbound = self.inbox.inbound()
            transfers = [TransferActivity(rid, "in", state, peer, n, now - t) for rid, peer, state, n, t in inbound]
            # The outbox stamps its transfers on the monotonic clock, the node on its own (the same
            # one outside tests).
            mono = time.monotonic()
            transfers += [TransferActivity(rid, "out", state, peer, n, mono - t) for rid, peer, state, n, t in outbound]
            transfers = sorted(transfers, key=lambda t: -t.age_s)
            return Activity(
                requests_total=len(self._owner),
                leases_total=len(leases),
                transfers_total=len(transfers),
                allocations_total=self.allocations_total,
                bytes_sent_total=bytes_sent_total,
                bytes_received_total=self.inbox.bytes_total,
                compactions_done=self.pool.compactions_done,
                pinned_pages=pinned_pages,
                requests=reqs,
                leases=[LeaseActivity(x.lease_id, x.rid, x.kind.value, now - x.granted_at, x.expires_at - now) for x in oldest],
                transfers=transfers[:limit],
            )

    def check(self) -> None:
        """The pool's invariants plus the node's: every live request has exactly one owner
        session that lists it, and every live lease names a live request. (A lease past its TTL
        pins nothing and may outlive its request until the sweeper counts it as expired.)"""
        with self._lock:
            self.pool.check()
            self.leases.check()
            rids = set(self.pool.request_ids) | set(self.pool.offloaded_ids)
            if set(self._owner) | self._doomed != rids or set(self._owner) & self._doomed:
                raise InternalError(f"node invariant broken: owners {sorted(self._owner)} vs requests {sorted(rids)}")
            for rid, sid in self._owner.items():
                s = self._sessions.get(sid)
                if s is None or rid not in s.rids:
                    raise InternalError(f"node invariant broken: {quote(rid)} not listed by its session")
            now = self.clock()
            for lease in self.leases.all():
                if lease.expires_at > now and lease.rid not in rids:
                    raise InternalError(f"node invariant broken: {lease.label()} names a freed request")
