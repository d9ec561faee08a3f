"""The handoff: moving one request's KV from a prefill daemon to a decode daemon.

Core logic, no gRPC, no sockets: the other daemon is reached through a :class:`PeerLink` (the
server package implements it over gRPC, with a same-host peer socket for the two calls on a
Send's critical path) and bytes move through a :class:`~kvd.backends.base.Backend`.

Receiving side (:class:`Inbox`, owned by the decode node)::

    RECV lease ──▶ WAITING ──CheckTicket(sender)──▶ RECEIVING ──Commit(last)──▶ READY
                      │                                 │
                      └── lease expired / Abort ────────┴── Abort / lease expired / no
                                                             heartbeat for peer_timeout ──▶ FAILED

  * READY and a sender's drained abort release the RECV lease at once: no write is in flight.
  * A sender that stopped answering may still have writes in flight (a partition, not a
    crash), so its lease is kept for ``fence_s`` more seconds before the pages can be reused;
    an engine that frees the request meanwhile gets the free deferred, not refused.
  * A receiving request that ends while its sender is mid-way (its session closed or reaped,
    its RECV lease released: :meth:`Inbox.end`) fails the same way, fenced, and its sender is
    told (``AbortSend``, off the node's lock: :class:`Ends`) so that its next Send is refused
    before it writes.
  * A RECV lease that runs out on its TTL while RECEIVING fails that transfer alone, fenced the
    same way (the lease is held past its TTL as the fence); the sender's next heartbeat hears
    its lease is dead, the other transfers it names carry on.

Sending side (:class:`kvd.handoff.outbox.Outbox`, owned by the prefill daemon): ``send`` validates the ticket with
the receiver before the first byte, pins its own pages with a SEND lease, plans the blocks
(:func:`kvd.handoff.plan.plan_chunk`), writes them in bounded batches checking for an abort between
batches, commits, and releases its lease only after its writes returned. ``send_many`` does the
same for many independent requests at once, pipelined: one request's copies run while the
daemon commits the one before and prepares the one after (``send`` is ``send_many`` of one).
A heartbeat thread tells each receiver the sender is alive and learns of aborts on the
receiving side.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.errors import Aborted, FailedPrecondition, InternalError, InvalidArgument, NotFound, StaleEpoch
from kvd.limits import quote
from kvd.records import Status, TransferRef, TransferState

from kvd.daemon.leases import LeaseTable
from kvd.memory.doorbells import Doorbells

if TYPE_CHECKING:
    from kvd.daemon.node import Node

__all__ = ["Inbox", "inbox_of"]

log = logging.getLogger("kvd.handoff.inbox")


@dataclass(slots=True)
class _Inbound:
    rid: str
    lease_id: int
    state: TransferState = TransferState.WAITING
    sender: str = ""
    last_seen: float = 0.0
    reason: str = ""
    nbytes: int = 0
    fence_until: float | None = None  # FAILED with writes possibly in flight: keep the lease until then
    started: float = 0.0  # when the RECV lease was granted (kvd top's ages)
    bell: int = -1  # its doorbell slot (kvd.memory.doorbells), -1: none
    ended: int = 0  # the inbox's count of ended transfers when this one ended (READY, FAILED); 0 before


class Inbox:
    """Inbound transfers of one (decode) node. Every method runs under the node's lock.

    It is given only what it needs of the node: its lock, its lease table (the RECV leases are
    the fences), its boot id and clock, and where to count a stale refusal. The node sees it as
    :class:`kvd.daemon.inbound.Inbound` and never imports it; :meth:`attach` wires the two.

    ``doorbells``: the board on which every state change of a transfer is written as it
    happens, for engines that read it instead of asking (None: no board)."""

    #: Ends remembered for :meth:`wait_ended`; a cursor older than these is served by a scan.
    LOG_ENDS = 4096

    def __init__(
        self,
        lock: threading.RLock,
        leases: LeaseTable,
        *,
        boot_id: str,
        clock: Callable[[], float],
        on_stale: Callable[[], None],
        peer_timeout: float = 1.0,
        fence_s: float = 1.0,
        doorbells: Doorbells | None = None,
    ) -> None:
        self._leases = leases
        self.doorbells = doorbells
        self._clock = clock
        self._on_stale = on_stale
        self.boot_id = boot_id
        self.peer_timeout = peer_timeout
        self.fence_s = fence_s
        self._by_rid: dict[str, _Inbound] = {}
        self._cond = threading.Condition(lock)
        self._ends = 0  # transfers that ended (READY or FAILED) so far: the cursor of wait_ended
        # The latest ends, (count, rid): a wait looks at those since it last looked, not at
        # every transfer (one watcher per engine, each woken by every end).
        self._log: deque[tuple[int, str]] = deque(maxlen=self.LOG_ENDS)
        self.ready_total = 0
        self.failed_total = 0
        self.bytes_total = 0

    @classmethod
    def attach(cls, node: Node, *, peer_timeout: float = 1.0, fence_s: float = 1.0, doorbells: Doorbells | None = None) -> Inbox:
        """The inbox of ``node``, built from the node's lock, leases, boot id and clock, and set
        as ``node.inbox`` (before any RECV lease is granted: the node's own is a no-op)."""
        inbox = cls(
            node.lock, node.leases, boot_id=node.pool.boot_id, clock=node.clock, on_stale=node.count_stale,
            peer_timeout=peer_timeout, fence_s=fence_s, doorbells=doorbells,
        )
        node.inbox = inbox
        return inbox

    # -- called by the node -------------------------------------------------------------------
    def expect(self, rid: str, lease_id: int) -> None:
        """A RECV lease was granted for ``rid``: a sender may now begin."""
        now = self._clock()
        self.forget(rid)  # a transfer under an earlier lease of rid, over: its doorbell goes
        ib = self._by_rid[rid] = _Inbound(rid, lease_id, last_seen=now, started=now)
        if self.doorbells is not None:
            ib.bell = self.doorbells.take(lease_id)

    def bell(self, rid: str) -> int:
        """The doorbell slot of ``rid``'s transfer, -1 for none."""
        ib = self._by_rid.get(rid)
        return -1 if ib is None else ib.bell

    def _ring(self, ib: _Inbound) -> None:
        """Write ``ib``'s state and bytes on its doorbell (every state change calls this)."""
        if ib.bell >= 0 and self.doorbells is not None:
            self.doorbells.ring(ib.bell, ib.lease_id, ib.state, ib.nbytes)

    def inbound(self) -> list[tuple[str, str, str, int, float]]:
        """``(rid, sender, state, bytes committed, started)`` of every inbound transfer (kvd top)."""
        return [(ib.rid, ib.sender, ib.state.value, ib.nbytes, ib.started) for ib in self._by_rid.values()]

    def forget(self, rid: str) -> None:
        ib = self._by_rid.pop(rid, None)
        if ib is not None and ib.bell >= 0 and self.doorbells is not None:
            self.doorbells.give(ib.bell)

    def fenced(self, rid: str) -> bool:
        """Whether ``rid`` failed while a sender may still be writing (its free must wait)."""
        ib = self._by_rid.get(rid)
        return ib is not None and ib.state is TransferState.FAILED and ib.fence_until is not None

    # -- called by a sender (Peer service) ------------------------------------------------------
    def _match(self, ref: TransferRef) -> _Inbound | None:
        """The transfer ``ref`` names, if it names one here: same boot (lease ids start again at
        every boot), same rid, same lease."""
        ib = self._by_rid.get(ref.rid)
        if ref.boot_id != self.boot_id or ib is None or ib.lease_id != ref.lease_id:
            return None
        return ib

    def _find(self, ref: TransferRef) -> _Inbound:
        if ref.boot_id != self.boot_id:
            self._on_stale()
            raise StaleEpoch(f"transfer names boot {quote(ref.boot_id)}; this daemon is boot {self.boot_id!r} (it restarted)")
        ib = self._match(ref)
        if ib is None:
            raise NotFound(f"no transfer of {quote(ref.rid)} under lease {ref.lease_id} here (released, aborted or never issued)")
        if ib.state is TransferState.FAILED:
            raise Aborted(f"transfer of {quote(ref.rid)} was aborted here: {ib.reason}")
        if ib.state is TransferState.READY:
            raise FailedPrecondition(f"transfer of {quote(ref.rid)} is already complete")
        return ib

    def begin(self, ref: TransferRef, sender: str) -> None:
        """A sender whose ticket checked begins (RECEIVING). One sender per transfer: the one that
        began it may begin it again (it forgot the transfer: an unreachable receiver), another
        is refused (FailedPrecondition), nothing changed."""
        with self._cond:
            ib = self._find(ref)
            if ib.state is TransferState.RECEIVING and ib.sender != sender:
                raise FailedPrecondition(
                    f"transfer of {quote(ib.rid)} is being sent by {quote(ib.sender)}, not {quote(sender)}: one sender per "
                    "request (the decode engine acquires another RECV lease for another)"
                )
            ib.state, ib.sender, ib.last_seen = TransferState.RECEIVING, sender, self._clock()
            self._leases.renew(ib.lease_id)
            self._ring(ib)

    def _begun_by(self, ib: _Inbound, sender: str, what: str) -> None:
        """FailedPrecondition unless ``sender`` is the sender that began ``ib`` (CheckTicket with a
        sender): only it can have written the pages, so only it may commit or abort them."""
        if not ib.sender:
            raise FailedPrecondition(
                f"{what}: no sender has begun the transfer of {quote(ib.rid)} (it is {ib.state.value}); a sender begins "
                "it with CheckTicket naming itself"
            )
        if ib.sender != sender:
            raise FailedPrecondition(
                f"{what}: the transfer of {quote(ib.rid)} was begun by sender {quote(ib.sender)}, not {quote(sender)}; only "
                "the sender that began it may"
            )

    def commit(self, ref: TransferRef, last: bool, nbytes: int, sender: str, *, defer_wake: bool = False) -> Callable[[], None]:
        """The writes of a chunk by ``sender`` have all returned; ``last`` makes the transfer
        READY. Refused (FailedPrecondition, nothing changed) unless the transfer is RECEIVING,
        begun by this very sender: a WAITING transfer has no data, and another sender's commit
        would mark someone else's pages ready.

        Returns what wakes the engine's :meth:`wait` on a READY transfer (a no-op otherwise),
        already called unless ``defer_wake``: then the caller calls it once it has answered the
        sender. Woken inside the commit, the waiting thread competes for this process's GIL and
        the node's lock with the thread still answering the Commit, and the sender's reply
        waited for it (~0.25 ms a Send, measured on CPU); woken after, both answers overlap. A
        wake never called costs the waiter at most its 0.1 s poll (it reads the state then)."""
        with self._cond:
            ib = self._find(ref)
            self._begun_by(ib, sender, "commit")
            self._leases.get(ib.lease_id)  # the fence: a commit under a dead lease is refused
            ib.nbytes += nbytes
            self.bytes_total += nbytes
            ib.last_seen = self._clock()
            if not last:
                self._leases.renew(ib.lease_id)
                self._ring(ib)
                return _no_wake
            ib.state = TransferState.READY
            self._ended(ib)
            self._leases.drop(ib.lease_id)  # the sender's writes have all returned
            self.ready_total += 1
            self._ring(ib)  # an engine reading its doorbell needs no wake
            if not defer_wake:
                self._cond.notify_all()
                return _no_wake
        return self._wake

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def abort(self, ref: TransferRef, reason: str, drained: bool, sender: str) -> None:
        """The sender gave up. A transfer already over keeps its outcome and reason (READY stays
        READY); a FAILED one only learns that the sender's writes have drained, which ends its
        fence. A reference from another boot names nothing here, even if rid and lease id match
        (lease ids start again at every boot).

        Only the sender that began the transfer may abort it (or end its fence): another
        sender, or any peer for a transfer no sender began (WAITING: nothing can be in flight,
        and its decode engine may still get a sender), is refused (FailedPrecondition),
        nothing changed. A sender refused before it began has nothing to undo here."""
        with self._cond:
            ib = self._match(ref)
            if ib is None:
                return  # nothing to abort: already gone
            if ib.state is TransferState.READY:
                return
            self._begun_by(ib, sender, "abort")
            if ib.state is TransferState.FAILED:
                if drained and ib.fence_until is not None:
                    self._leases.drop(ib.lease_id)
                    ib.fence_until = None
                return
            self._fail(ib, f"sender aborted: {reason}", drained)

    def heartbeat(self, sender: str, refs: list[TransferRef]) -> list[int]:
        dead = []
        with self._cond:
            now = self._clock()
            for ref in refs:
                ib = self._match(ref)
                if ib is not None and ib.sender and ib.sender != sender:
                    dead.append(ref.lease_id)  # another sender's transfer: not this one's to keep
                    continue
                if ib is None or ib.state in (TransferState.FAILED, TransferState.READY):
                    if ib is not None and ib.fence_until is not None:
                        # A failed transfer the sender still names has writes in flight (it
                        # drains them, then says so): the fence must not run out meanwhile.
                        ib.fence_until = max(ib.fence_until, now + self.fence_s)
                        with contextlib.suppress(NotFound):
                            self._leases.renew(ib.lease_id, self.fence_s + 1.0)
                    dead.append(ref.lease_id)
                    continue
                # Only CheckTicket begins a transfer: a heartbeat naming a WAITING one (a sender
                # whose ticket was refused, or that has not reached the receiver yet) keeps the
                # lease alive but must not make it look like writes have started.
                try:
                    self._leases.renew(ib.lease_id)
                except NotFound:
                    # This transfer's lease ran out (a TTL shorter than the beat): it alone is
                    # dead; the others named in the same beat are kept.
                    self._lapsed(ib)
                    dead.append(ref.lease_id)
                    continue
                ib.last_seen = now
        return dead

    # -- called by the local (decode) engine ------------------------------------------------------
    def status(self, rid: str) -> Status:
        ib = self._by_rid.get(rid)
        if ib is None:
            raise NotFound(f"no inbound transfer for {quote(rid)}: acquire a RECV lease first")
        return Status(ib.state, ib.reason, ib.nbytes)

    def wait(self, rid: str, timeout: float, active: Callable[[], bool] | None = None) -> Status:
        """Block until ``rid`` is READY or FAILED or ``timeout`` passes; returns the state then.
        While the engine waits and no sender has begun, its RECV lease is kept renewed.
        ``active``: asked at each wake-up (at least every 0.1 s, never before the first wait,
        under the node's lock: it must be quick); once False (the caller hung up, the server
        stops) the wait ends with the state then, so an abandoned wait frees its thread."""
        if not (0 <= timeout <= 3600):
            raise InvalidArgument(f"wait timeout must be in [0, 3600] seconds, got {timeout}")
        deadline = time.monotonic() + timeout
        woken = False
        with self._cond:
            while True:
                ib = self._by_rid.get(rid)
                if ib is None:
                    raise NotFound(f"no inbound transfer for {quote(rid)}: acquire a RECV lease first")
                if ib.state in (TransferState.READY, TransferState.FAILED):
                    return Status(ib.state, ib.reason, ib.nbytes)
                if ib.state is TransferState.WAITING:
                    try:
                        self._leases.renew(ib.lease_id)
                    except NotFound:
                        self._fail(ib, "the RECV lease expired before any sender began", drained=True)
                        continue
                left = deadline - time.monotonic()
                if left <= 0 or (woken and active is not None and not active()):
                    return Status(ib.state, ib.reason, ib.nbytes)
                self._cond.wait(min(left, 0.1))
                woken = True

    def wait_ended(
        self, after: int, timeout: float, mine: Callable[[str], bool], active: Callable[[], bool] | None = None
    ) -> tuple[list[tuple[str, Status]], int]:
        """Block until a transfer for which ``mine(rid)`` holds ended (READY or FAILED) after
        cursor ``after``, or ``timeout`` passes. Returns those transfers (``(rid, status)``, in the
        order they ended) and the cursor to pass next; none when the wait timed out. Cursor 0:
        every such transfer the inbox holds that is over. A transfer ends once, so each is
        answered once for cursors moved on this way; one forgotten (its request freed, a new
        RECV lease) is not answered. Keeps no lease alive (:meth:`wait` does, for one transfer).
        ``mine`` and ``active`` run under the node's lock: they must be quick (``active`` as in
        :meth:`wait`). Changes nothing."""
        if not (0 <= timeout <= 3600):
            raise InvalidArgument(f"wait timeout must be in [0, 3600] seconds, got {timeout}")
        if after < 0:
            raise InvalidArgument(f"cursor must be 0 or one this daemon returned, got {after}")
        deadline = time.monotonic() + timeout
        woken = False
        seen = after  # transfers that ended up to here were looked at: none of them is ours
        with self._cond:
            if after > self._ends:
                raise InvalidArgument(f"cursor {after} is past this daemon's {self._ends} ended transfers (one from before it "
                                      "restarted?): wait from cursor 0")
            while True:
                if self._ends > seen:
                    got = self._ours_since(seen, mine)
                    if got:
                        return [(ib.rid, Status(ib.state, ib.reason, ib.nbytes)) for ib in got], self._ends
                    seen = self._ends
                left = deadline - time.monotonic()
                if left <= 0 or (woken and active is not None and not active()):
                    return [], self._ends
                self._cond.wait(min(left, 0.1))
                woken = True

    def _ours_since(self, seen: int, mine: Callable[[str], bool]) -> list[_Inbound]:
        """The transfers held that ended after count ``seen`` and are ``mine``, in the order they
        ended: from the log of ends where it reaches back that far, else by a scan."""
        log = self._log
        if log and log[0][0] <= seen + 1:
            got = []
            for n, rid in reversed(log):
                if n <= seen:
                    break
                ib = self._by_rid.get(rid)
                if ib is not None and ib.ended == n and mine(rid):  # not forgotten, nor under a later lease
                    got.append(ib)
            got.reverse()
            return got
        return sorted((ib for ib in self._by_rid.values() if ib.ended > seen and mine(ib.rid)), key=lambda ib: ib.ended)

    def abort_local(self, rid: str, reason: str) -> tuple[str, TransferRef] | None:
        """The decode engine aborts. Returns ``(sender address, ref)`` to notify, if a sender began."""
        with self._cond:
            ib = self._by_rid.get(rid)
            if ib is None:
                raise NotFound(f"no inbound transfer for {quote(rid)}")
            if ib.state in (TransferState.READY, TransferState.FAILED):
                return None
            sender = ib.sender
            # A sender that began may have writes in flight: fence; one that never began has none.
            self._fail(ib, f"aborted by the decode engine: {reason}", drained=not sender)
            return (sender, TransferRef(self.boot_id, ib.lease_id, rid)) if sender else None

    def end(self, rid: str, reason: str) -> tuple[bool, tuple[str, TransferRef] | None]:
        """The receiving request ``rid``, or its RECV lease, ends (its engine's session closed or
        reaped, the lease released). Returns ``(fenced, tell)``: ``fenced`` when a sender may
        still write its pages (they must not be reused until the fence ends: the RECV lease,
        kept), ``tell`` the ``(sender address, ref)`` to notify when this ended a transfer in
        progress. A transfer RECEIVING fails (``reason``) and is fenced; one that already
        failed keeps its fence; one WAITING or READY has no writer: nothing to keep."""
        ib = self._by_rid.get(rid)
        if ib is None or ib.state in (TransferState.WAITING, TransferState.READY):
            return False, None
        if ib.state is TransferState.RECEIVING:
            self._fail(ib, f"the receiving request ended mid-transfer: {reason}", drained=False)
            return True, (ib.sender, TransferRef(self.boot_id, ib.lease_id, rid))
        return self.fenced(rid), None

    # -- housekeeping ---------------------------------------------------------------------------
    def _lapsed(self, ib: _Inbound) -> None:
        """``ib``'s RECV lease ran out on its TTL. WAITING: no sender began, nothing can be in
        flight: it fails, its lease left to the table's expiry. RECEIVING: its sender may still
        be writing, so it fails fenced -- the lease, past its TTL but not yet expired out of the
        table (the node sweeps the inbox first), is held as the fence. Anything else is over."""
        if ib.state is TransferState.WAITING:
            self._fail(ib, "the RECV lease expired before any sender began", drained=True)
        elif ib.state is TransferState.RECEIVING:
            self._fail(ib, "the RECV lease expired mid-transfer", drained=False)

    def _ended(self, ib: _Inbound) -> None:
        self._ends += 1
        ib.ended = self._ends
        self._log.append((self._ends, ib.rid))

    def _fail(self, ib: _Inbound, reason: str, drained: bool) -> None:
        ib.state, ib.reason = TransferState.FAILED, reason
        self.failed_total += 1
        self._ended(ib)
        self._ring(ib)
        if drained:
            if self._leases.live(ib.lease_id):  # one past its TTL is the table's to expire (and count)
                self._leases.drop(ib.lease_id)
            ib.fence_until = None
        else:
            ib.fence_until = self._clock() + self.fence_s
            # The lease is the fence: it must not run out before the fence does, even when its
            # own TTL ran out first (held, not renewed: a renew refuses a lease past its TTL).
            self._leases.hold(ib.lease_id, self.fence_s + 1.0)
        self._cond.notify_all()

    def lapse(self, rid: str) -> None:
        """If ``rid``'s RECV lease ran out, fail its transfer now as :meth:`sweep` would (the
        node asks before a new RECV lease for ``rid`` could forget it): one request, not all."""
        with self._cond:
            ib = self._by_rid.get(rid)
            if ib is not None and not self._leases.live(ib.lease_id):
                self._lapsed(ib)

    def excuse(self, stalled_s: float) -> None:
        """This process did not run for ``stalled_s`` (paused, CPU-throttled, descheduled): a
        sender's beats sent meanwhile wait unread in its socket, so that time is not its silence.
        Each receiving transfer's silence is counted as if the clock had stopped (never past now).
        Fences are not moved: they wait for writes on the sender's side, which did not stop."""
        now = self._clock()
        for ib in self._by_rid.values():
            if ib.state is TransferState.RECEIVING:
                ib.last_seen = min(now, ib.last_seen + stalled_s)

    def sweep(self) -> list[str]:
        """Fail transfers whose sender went silent or whose lease expired; end fences that ran
        out (their pages become reusable). Returns rids whose fence ended."""
        now = self._clock()
        ended = []
        with self._cond:
            for ib in list(self._by_rid.values()):
                if ib.state is TransferState.RECEIVING and now - ib.last_seen > self.peer_timeout:
                    self._fail(ib, f"sender {ib.sender} stopped answering for {now - ib.last_seen:.1f} s", drained=False)
                elif not self._leases.live(ib.lease_id):
                    self._lapsed(ib)
                if ib.state is TransferState.FAILED and ib.fence_until is not None and now >= ib.fence_until:
                    self._leases.drop(ib.lease_id)
                    ib.fence_until = None
                    ended.append(ib.rid)
        return ended


def _no_wake() -> None:
    """Nothing to wake (:meth:`Inbox.commit` of a chunk that is not the last, or woken already)."""


def inbox_of(node: Node) -> Inbox:
    """``node``'s :class:`Inbox` (:meth:`Inbox.attach`), for the servicers that speak to its
    senders and its engine; InternalError for a node that was given none (a wiring bug)."""
    inbox = node.inbox
    if not isinstance(inbox, Inbox):
        raise InternalError("this node has no inbox attached (a bug in how the daemon was assembled)")
    return inbox
