"""What a daemon is doing now, for ``kvd top``: requests, leases and transfers in flight, with ages.

Plain records the node fills under its lock (:meth:`kvd.node.Node.activity`); the RPC layer
carries them (``GetActivity``). Each list holds the ``limit`` oldest entries, with the total
count beside it, so a daemon with thousands of live requests answers in one small message.
Ages are seconds on the daemon's own clock."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RequestActivity", "LeaseActivity", "TransferActivity", "Activity"]


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
