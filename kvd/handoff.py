"""The handoff: moving one request's KV from a prefill daemon to a decode daemon.

Core logic, no gRPC, no sockets: the other daemon is reached through a :class:`PeerLink` (the
server package implements it over gRPC, with a same-host peer socket for the two calls on a
Send's critical path) and bytes move through a :class:`~kvd.backends.base.Backend`.

Receiving side (:class:`Inbox`, owned by the decode node)::

    RECV lease ──▶ WAITING ──CheckTicket(sender)──▶ RECEIVING ──Commit(last)──▶ READY
                      │                                 │
                      └── lease expired / Abort ────────┴── Abort / no heartbeat for
                                                             peer_timeout ──▶ FAILED

  * READY and a sender's drained abort release the RECV lease at once: no write is in flight.
  * A sender that stopped answering may still have writes in flight (a partition, not a
    crash), so its lease is kept for ``fence_s`` more seconds before the pages can be reused;
    an engine that frees the request meanwhile gets the free deferred, not refused.
  * A receiving request that ends while its sender is mid-way (its session closed or reaped,
    its RECV lease released: :meth:`Inbox.end`) fails the same way, fenced, and its sender is
    told (``AbortSend``, off the node's lock: :class:`Ends`) so that its next Send is refused
    before it writes.

Sending side (:class:`kvd.outbox.Outbox`, owned by the prefill daemon): ``send`` validates the ticket with
the receiver before the first byte, pins its own pages with a SEND lease, plans the blocks
(:func:`kvd.transfer.plan_chunk`), writes them in bounded batches checking for an abort between
batches, commits, and releases its lease only after its writes returned. ``send_many`` does the
same for many independent requests at once, pipelined: one request's copies run while the
daemon commits the one before and prepares the one after (``send`` is ``send_many`` of one).
A heartbeat thread tells each receiver the sender is alive and learns of aborts on the
receiving side.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvd.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, StaleEpoch
from kvd.limits import quote
from kvd.pool import Envelope, IndexVectors

if TYPE_CHECKING:
    from kvd.node import Node

__all__ = [
    "TransferState", "TransferRef", "SocketRoute", "TicketInfo", "SendResult", "SEND_PHASES", "PeerLink", "Inbox", "Status",
    "Ends", "run_every",
]

log = logging.getLogger("kvd.handoff")


class TransferState(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferRef:
    """Names one inbound transfer on the receiving daemon."""

    boot_id: str
    lease_id: int
    rid: str


class SocketRoute(NamedTuple):
    """A same-host way to the daemon that issued a ticket: its peer socket, and the boot that must
    answer there. A link may use it only after that daemon proved to be ``boot_id``: the same
    path on another host, or in another container, belongs to another daemon."""

    path: str
    boot_id: str


@dataclass(frozen=True, slots=True)
class TicketInfo:
    """A parsed ticket (see ``Ticket`` in the proto): what the sender needs to write."""

    peer_address: str
    boot_id: str
    epoch: int
    lease_id: int
    rid: str
    layout_fingerprint: str
    envelopes: list[Envelope]
    vectors: IndexVectors
    transfer_endpoint: str
    backend: str
    peer_socket: str = ""  # the issuer's peer socket path ("" when it offers none)

    @property
    def ref(self) -> TransferRef:
        return TransferRef(self.boot_id, self.lease_id, self.rid)

    @property
    def via(self) -> SocketRoute | None:
        """The same-host route the ticket offers, if any (see :class:`SocketRoute`)."""
        return SocketRoute(self.peer_socket, self.boot_id) if self.peer_socket else None


#: The steps of a Send, in the order they run (SendResult.phases keeps this order).
SEND_PHASES = ("lease", "plan", "check", "issue", "write", "commit")


@dataclass(frozen=True, slots=True)
class SendResult:
    nbytes: int
    blocks: int
    seconds: float
    pages: dict[str, int] = field(default_factory=dict)
    #: seconds per step of the Send, in order: lease, plan, check (first chunk only: the wait for the
    #: CheckTicket answer left after lease and plan, which run while the receiver checks), issue
    #: (the writes handed to the backend: on a GPU, the copies queued), write (from then until
    #: they all landed: in a send_many, the next item's lease, plan and check and the previous
    #: item's commit run meanwhile), commit
    phases: dict[str, float] = field(default_factory=dict)


class PeerLink(Protocol):
    """How one daemon reaches another. Errors are kvd exceptions (Unavailable when unreachable,
    or when the connection broke during the call: a commit is never sent twice).

    ``via``: the same-host route the ticket offered. A sender's calls to the receiver may take it
    instead of ``address``, with the same outcome and errors: CheckTicket and Commit are the
    critical path of every Send, and the heartbeat and the abort go the same way so that the
    receiver's liveness is judged on the path the transfer uses. ``abort_send`` (receiver to
    sender) knows the sender by its address only."""

    def start_check(self, address: str, ticket: bytes, sender: str, via: SocketRoute | None = None) -> Callable[[], object]:
        """Send CheckTicket now; the returned function waits for the answer (raising the
        receiver's refusal). Call it exactly once: it returns the connection."""
        ...

    def commit(self, address: str, ref: TransferRef, last: bool, nbytes: int, via: SocketRoute | None = None) -> None: ...

    def abort_receive(self, address: str, ref: TransferRef, reason: str, drained: bool, via: SocketRoute | None = None) -> None: ...

    def abort_send(self, address: str, ref: TransferRef, reason: str) -> None: ...

    def heartbeat(self, address: str, sender: str, refs: list[TransferRef], via: SocketRoute | None = None) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Ends:
    """What ended on a node in one step, for other daemons to hear of (the node's ``on_ended``
    hooks get it under the node's lock and must not block: the daemon's Outbox makes the peer
    calls on a thread of its own).

    ``rids``: requests of ``session`` that ended (freed, their session closed or reaped): a
    transfer one of them still sends is aborted toward its receiver. ``senders``: inbound
    transfers given up mid-way because their receiving request or RECV lease ended, as
    ``(sender address, ref)``: each sender is told (AbortSend) and stops before its next write.
    ``reason``: why, for both."""

    session: str
    reason: str
    rids: tuple[str, ...] = ()
    senders: tuple[tuple[str, TransferRef], ...] = ()


class Status(NamedTuple):
    """State of an inbound transfer, its failure reason, and the bytes committed so far."""

    state: TransferState
    reason: str
    nbytes: int


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


class Inbox:
    """Inbound transfers of one (decode) node. Every method runs under the node's lock."""

    def __init__(self, node: Node, *, peer_timeout: float = 1.0, fence_s: float = 1.0) -> None:
        self.node = node
        self.peer_timeout = peer_timeout
        self.fence_s = fence_s
        self._by_rid: dict[str, _Inbound] = {}
        self._cond = threading.Condition(node.lock)
        self.ready_total = 0
        self.failed_total = 0
        self.bytes_total = 0

    # -- called by the node -------------------------------------------------------------------
    def expect(self, rid: str, lease_id: int) -> None:
        """A RECV lease was granted for ``rid``: a sender may now begin."""
        now = self.node.clock()
        self._by_rid[rid] = _Inbound(rid, lease_id, last_seen=now, started=now)

    def inbound(self) -> list[tuple[str, str, str, int, float]]:
        """``(rid, sender, state, bytes committed, started)`` of every inbound transfer (kvd top)."""
        return [(ib.rid, ib.sender, ib.state.value, ib.nbytes, ib.started) for ib in self._by_rid.values()]

    def forget(self, rid: str) -> None:
        self._by_rid.pop(rid, None)

    def fenced(self, rid: str) -> bool:
        """Whether ``rid`` failed while a sender may still be writing (its free must wait)."""
        ib = self._by_rid.get(rid)
        return ib is not None and ib.state is TransferState.FAILED and ib.fence_until is not None

    # -- called by a sender (Peer service) ------------------------------------------------------
    def _match(self, ref: TransferRef) -> _Inbound | None:
        """The transfer ``ref`` names, if it names one here: same boot (lease ids start again at
        every boot), same rid, same lease."""
        ib = self._by_rid.get(ref.rid)
        if ref.boot_id != self.node.pool.boot_id or ib is None or ib.lease_id != ref.lease_id:
            return None
        return ib

    def _find(self, ref: TransferRef) -> _Inbound:
        if ref.boot_id != self.node.pool.boot_id:
            self.node.stale_refusals += 1
            raise StaleEpoch(f"transfer names boot {quote(ref.boot_id)}; this daemon is boot {self.node.pool.boot_id!r} (it restarted)")
        ib = self._match(ref)
        if ib is None:
            raise NotFound(f"no transfer of {quote(ref.rid)} under lease {ref.lease_id} here (released, aborted or never issued)")
        if ib.state is TransferState.FAILED:
            raise Aborted(f"transfer of {quote(ref.rid)} was aborted here: {ib.reason}")
        if ib.state is TransferState.READY:
            raise FailedPrecondition(f"transfer of {quote(ref.rid)} is already complete")
        return ib

    def begin(self, ref: TransferRef, sender: str) -> None:
        with self._cond:
            ib = self._find(ref)
            ib.state, ib.sender, ib.last_seen = TransferState.RECEIVING, sender, self.node.clock()
            self.node.leases.renew(ib.lease_id)

    def commit(self, ref: TransferRef, last: bool, nbytes: int) -> None:
        with self._cond:
            ib = self._find(ref)
            self.node.leases.get(ib.lease_id)  # the fence: a commit under a dead lease is refused
            ib.nbytes += nbytes
            self.bytes_total += nbytes
            ib.last_seen = self.node.clock()
            if last:
                ib.state = TransferState.READY
                self.node.leases.drop(ib.lease_id)  # the sender's writes have all returned
                self.ready_total += 1
                self._cond.notify_all()
            else:
                self.node.leases.renew(ib.lease_id)

    def abort(self, ref: TransferRef, reason: str, drained: bool) -> None:
        """The sender gave up. A transfer already over keeps its outcome and reason (READY stays
        READY); a FAILED one only learns that the sender's writes have drained, which ends its
        fence. A reference from another boot names nothing here, even if rid and lease id match
        (lease ids start again at every boot)."""
        with self._cond:
            ib = self._match(ref)
            if ib is None:
                return  # nothing to abort: already gone
            if ib.state is TransferState.READY:
                return
            if ib.state is TransferState.FAILED:
                if drained and ib.fence_until is not None:
                    self.node.leases.drop(ib.lease_id)
                    ib.fence_until = None
                return
            self._fail(ib, f"sender aborted: {reason}", drained)

    def heartbeat(self, sender: str, refs: list[TransferRef]) -> list[int]:
        dead = []
        with self._cond:
            now = self.node.clock()
            for ref in refs:
                ib = self._match(ref)
                if ib is None or ib.state in (TransferState.FAILED, TransferState.READY):
                    if ib is not None and ib.fence_until is not None:
                        # A failed transfer the sender still names has writes in flight (it
                        # drains them, then says so): the fence must not run out meanwhile.
                        ib.fence_until = max(ib.fence_until, now + self.fence_s)
                        with contextlib.suppress(NotFound):
                            self.node.leases.renew(ib.lease_id, self.fence_s + 1.0)
                    dead.append(ref.lease_id)
                    continue
                # Only CheckTicket begins a transfer: a heartbeat naming a WAITING one (a sender
                # whose ticket was refused, or that has not reached the receiver yet) keeps the
                # lease alive but must not make it look like writes have started.
                ib.last_seen = now
                self.node.leases.renew(ib.lease_id)
        return dead

    # -- called by the local (decode) engine ------------------------------------------------------
    def status(self, rid: str) -> Status:
        ib = self._by_rid.get(rid)
        if ib is None:
            raise NotFound(f"no inbound transfer for {quote(rid)}: acquire a RECV lease first")
        return Status(ib.state, ib.reason, ib.nbytes)

    def wait(self, rid: str, timeout: float) -> Status:
        """Block until ``rid`` is READY or FAILED or ``timeout`` passes; returns the state then.
        While the engine waits and no sender has begun, its RECV lease is kept renewed."""
        if not (0 <= timeout <= 3600):
            raise InvalidArgument(f"wait timeout must be in [0, 3600] seconds, got {timeout}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                ib = self._by_rid.get(rid)
                if ib is None:
                    raise NotFound(f"no inbound transfer for {quote(rid)}: acquire a RECV lease first")
                if ib.state in (TransferState.READY, TransferState.FAILED):
                    return Status(ib.state, ib.reason, ib.nbytes)
                if ib.state is TransferState.WAITING:
                    try:
                        self.node.leases.renew(ib.lease_id)
                    except NotFound:
                        self._fail(ib, "the RECV lease expired before any sender began", drained=True)
                        continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return Status(ib.state, ib.reason, ib.nbytes)
                self._cond.wait(min(left, 0.1))

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
            return (sender, TransferRef(self.node.pool.boot_id, ib.lease_id, rid)) if sender else None

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
            return True, (ib.sender, TransferRef(self.node.pool.boot_id, ib.lease_id, rid))
        return self.fenced(rid), None

    # -- housekeeping ---------------------------------------------------------------------------
    def _fail(self, ib: _Inbound, reason: str, drained: bool) -> None:
        ib.state, ib.reason = TransferState.FAILED, reason
        self.failed_total += 1
        if drained:
            self.node.leases.drop(ib.lease_id)
            ib.fence_until = None
        else:
            ib.fence_until = self.node.clock() + self.fence_s
            try:  # the lease is the fence: it must not run out before the fence does
                self.node.leases.renew(ib.lease_id, self.fence_s + 1.0)
            except NotFound:
                pass
        self._cond.notify_all()

    def sweep(self) -> list[str]:
        """Fail transfers whose sender went silent or whose lease expired; end fences that ran
        out (their pages become reusable). Returns rids whose fence ended."""
        now = self.node.clock()
        ended = []
        with self._cond:
            for ib in list(self._by_rid.values()):
                if ib.state is TransferState.RECEIVING and now - ib.last_seen > self.peer_timeout:
                    self._fail(ib, f"sender {ib.sender} stopped answering for {now - ib.last_seen:.1f} s", drained=False)
                elif ib.state is TransferState.WAITING and not self.node.leases.live(ib.lease_id):
                    self._fail(ib, "the RECV lease expired before any sender began", drained=True)
                if ib.state is TransferState.FAILED and ib.fence_until is not None and now >= ib.fence_until:
                    self.node.leases.drop(ib.lease_id)
                    ib.fence_until = None
                    ended.append(ib.rid)
        return ended


def run_every(interval: float, stop: threading.Event, fn: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread calling ``fn`` every ``interval`` seconds until ``stop`` is set."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                fn()
            except Exception:  # a housekeeping loop must never die
                log.exception("%s", name)

    t = threading.Thread(target=loop, name=name, daemon=True)
    t.start()
    return t
