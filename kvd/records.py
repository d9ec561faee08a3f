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
    "OutboxStats",
    "PeerLinkStats",
    "LaneStats",
    "PeerSocketStats",
    "TransferState",
    "TransferRef",
    "SocketRoute",
    "TicketInfo",
    "SEND_PHASES",
    "SendResult",
    "Ends",
    "Status",
    "LeaseKind",
    "RequestActivity",
    "LeaseActivity",
    "TransferActivity",
    "Activity",
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
    physical slot or None. Tensors are int32 copies: mutating them changes nothing (a group the
    layout lacks reads as one empty tensor shared by every vector: never resize it in place)."""

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


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """What a sending daemon's :class:`~kvd.handoff.outbox.Outbox` has done (``*_total``: since start)."""

    sent_total: int  # transfers completed (their last Send committed)
    failed_total: int  # Send items that failed
    bytes_total: int  # KV bytes those Sends wrote
    open: int  # outbound transfers in progress (one aborted while idle no longer counts)
    calls_total: int  # Send and SendMany calls
    items_total: int  # items those calls carried
    planned_ahead_total: int  # items whose plan BeginSend made (still valid at the Send)


@dataclass(frozen=True, slots=True)
class PeerLinkStats:
    """Calls this daemon made to peer daemons, by ``(method, path)`` (path: ``socket`` or ``grpc``)."""

    calls: dict[tuple[str, str], int]


@dataclass(frozen=True, slots=True)
class LaneStats:
    """One lane of the gRPC server's threads (:mod:`kvd.server.lanes`) now: its ``threads`` at
    most, how many hold a call (``busy``: reading its request, running or replying) and how many
    calls wait for one (``queued``)."""

    lane: str
    threads: int
    busy: int
    queued: int


@dataclass(frozen=True, slots=True)
class PeerSocketStats:
    """What this daemon's peer socket served: calls by ``(method, status code name)``, and the
    connections open now."""

    answered: dict[tuple[str, str], int]
    connections: int


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
SEND_PHASES = ("prep", "lease", "plan", "check", "issue", "write", "commit", "release")


@dataclass(frozen=True, slots=True)
class SendResult:
    nbytes: int
    blocks: int
    seconds: float
    pages: dict[str, int] = field(default_factory=dict)
    #: seconds per step of the Send, in order: prep (the ticket's own checks, ownership, the
    #: transfer entered, the receiver's check sent), lease, plan, check (first chunk only: the
    #: wait for the CheckTicket answer left after lease and plan, which run while the receiver
    #: checks), issue (the writes handed to the backend: on a GPU, the copies queued), write
    #: (from then until they all landed: in a send_many, the next item's lease, plan and check
    #: and the previous item's commit run meanwhile), commit (the receiver's answer), release
    #: (the SEND lease). They add up to ``seconds``. Then, where a backend says, parts of issue
    #: and write (``"issue:<part>"``, ``"write:<part>"``: the CUDA local backend's peer check,
    #: copy call, event, wait), and what the daemon's handler adds outside ``seconds``
    #: (``"ticket"``: reading the ticket, ``"free"``, ``"call"``: the whole handler).
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


# ---- what a daemon is doing now (kvd top: GetActivity): the limit oldest entries of each list, the
# total count beside it; ages in seconds on the daemon's clock


@dataclass(slots=True)
class RequestActivity:
    rid: str
    session: str  # the owner session's name (what the engine called itself)
    tokens: int
    full_pages: int
    swa_pages: int  # pages bound on the swa group (the window tail)
    age_s: float
    leased: bool  # a live lease pins its pages


@dataclass(slots=True)
class LeaseActivity:
    lease_id: int
    rid: str
    kind: str  # send | recv
    age_s: float  # since granted
    expires_in_s: float


@dataclass(slots=True)
class TransferActivity:
    rid: str
    direction: str  # in (this daemon receives) | out (it sends)
    state: str  # in: waiting | receiving | ready | failed; out: sending | idle
    peer: str  # the other daemon's address
    nbytes: int  # committed so far
    age_s: float


@dataclass(slots=True)
class Activity:
    requests_total: int
    leases_total: int
    transfers_total: int
    allocations_total: int  # requests allocated since boot
    bytes_sent_total: int
    bytes_received_total: int
    compactions_done: int
    pinned_pages: dict[str, int] = field(default_factory=dict)  # group -> pages live leases pin
    requests: list[RequestActivity] = field(default_factory=list)
    leases: list[LeaseActivity] = field(default_factory=list)
    transfers: list[TransferActivity] = field(default_factory=list)
