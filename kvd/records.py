"""The records kvd passes between its layers and over its boundaries: what a pool hands out
(index vectors, envelopes, allocation specs, compaction results), what it counts (pool and
group stats), what a daemon reports (node stats, sessions), lease kinds, and the records of a
handoff (transfer states and refs, parsed tickets, Send results). Plain values, no behaviour
beyond small derived properties; every layer may import them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = [
    "GroupStats",
    "PoolStats",
    "IndexVectors",
    "Envelope",
    "CompactionResult",
    "AllocSpec",
    "SessionInfo",
    "NodeStats",
    "TransferState",
    "TransferRef",
    "SocketRoute",
    "TicketInfo",
    "SEND_PHASES",
    "SendResult",
    "Ends",
    "Status",
    "LeaseKind",
]


@dataclass(slots=True)
class GroupStats:
    name: str
    direction: str  # up | down | float
    page_bytes: int
    capacity_pages: int  # pages if the group had the whole backed arena
    used_pages: int
    free_pages: int  # capacity - used (invariant); the shared gap is counted by every group
    hole_pages: int  # free pages inside the group's region: what compaction/trim would give back
    region_lo_bytes: int
    region_hi_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes


@dataclass(slots=True)
class PoolStats:
    boot_id: str
    epoch: int
    reserved_bytes: int
    backed_bytes: int
    sink_bytes: int
    gap_bytes: int  # free bytes between the groups' regions
    finalized: bool
    requests_live: int
    requests_offloaded: int
    compactions_done: int
    compactions_refused: int
    pages_moved: int
    bytes_moved: int
    groups: list[GroupStats] = field(default_factory=list)


class IndexVectors(NamedTuple):
    """Physical page ids of one request, valid while ``epoch`` is fresh for it.

    ``full`` and ``draft`` cover every page of the request in token order; ``swa`` covers
    request pages ``[swa_first_page, len(full))`` as *physical SWA page ids*; ``state`` is the
    physical slot or None. Tensors are int32 copies: mutating them changes nothing."""

    rid: str
    boot_id: str
    epoch: int
    tokens: int
    full: torch.Tensor
    swa_first_page: int
    swa: torch.Tensor
    state: int | None
    draft: torch.Tensor
    #: The request's page-mapping version in this pool (0: unknown, e.g. vectors read off the
    #: wire): two vectors of one boot and request with the same nonzero version are equal.
    version: int = 0


class Envelope(NamedTuple):
    """What a transfer engine registers for one group. Page ``p`` lives at ``base + p * page_bytes``;
    only pages ``first_page..last_page`` (inclusive) are valid, all inside the backed prefix."""

    group: str
    region_id: str
    base: int
    backed_bytes: int
    page_bytes: int
    first_page: int
    last_page: int


class CompactionResult(NamedTuple):
    """``pages_moved``: distinct pages whose physical id changed; ``bytes_moved``: bytes copied
    (a float packed and then slid copies some pages twice)."""

    pages_moved: int
    bytes_moved: int
    gap_gained_bytes: int
    epoch: int


class AllocSpec(NamedTuple):
    """One request of a batched allocation. ``receive=True``: the KV will arrive by transfer,
    so only the SWA window tail is bound (nothing computes the older tokens here)."""

    rid: str
    tokens: int
    receive: bool = False


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    name: str
    ttl: float
    last_seen: float
    rids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class NodeStats:
    pool: PoolStats
    layout_name: str
    leases_live: int
    leases_expired_total: int
    stale_refusals_total: int
    sessions_live: int
    sessions_expired_total: int
    transfers_in_ready_total: int = 0
    transfers_in_failed_total: int = 0
    transfer_in_bytes_total: int = 0


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


class LeaseKind(enum.Enum):
    SEND = "send"
    RECV = "recv"
