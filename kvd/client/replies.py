"""The records the client's calls return beyond :mod:`kvd.records` (the daemon's pool, a lease,
a transfer's status, what a batch of Sends came to), and how each is read off its reply message.
Immutable; nothing here holds a connection."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvd.pool.layout import Layout
from kvd.records import Envelope, GroupStats, LeaseKind, NodeStats, PoolStats, TransferState
from kvd.rpc.convert import envelope_from_pb, lease_kind_from_pb, send_result_from_pb, state_from_pb, status_from_pb
from kvd.v1 import kvd_pb2 as pb

__all__ = ["Ended", "LeaseInfo", "PoolInfo", "SendOutcomes", "SendSpec", "TransferStatus", "parse_info", "parse_lease",
           "parse_outcomes", "parse_stats", "parse_status"]


class PoolInfo(NamedTuple):
    boot_id: str
    epoch: int
    layout: Layout
    envelopes: list[Envelope]
    backend: str
    capabilities: list[str]
    finalized: bool
    reserved_bytes: int
    version: str
    peer_address: str
    engine_socket: str = ""  # the daemon's engine socket ("" when it serves none)


class TransferStatus(NamedTuple):
    rid: str
    state: TransferState
    reason: str
    nbytes: int

    @property
    def ready(self) -> bool:
        return self.state is TransferState.READY


class Ended(NamedTuple):
    """What :meth:`Client.wait_ended` answers: transfers that ended since the cursor given, in
    the order they ended, and the cursor to give next."""

    transfers: list[TransferStatus]
    cursor: int


class LeaseInfo(NamedTuple):
    lease_id: int
    rid: str
    kind: LeaseKind
    boot_id: str
    epoch: int
    expires_in: float
    ticket: bytes  # RECV leases: hand these bytes to the prefill side unchanged
    bell: int = 0  # RECV leases: 1 + the transfer's doorbell slot on the daemon (0: none)


class SendSpec(NamedTuple):
    """One item of :meth:`~kvd.client.surface.Surface.send_many`: what :meth:`~kvd.client.surface.Surface.send` takes (``end`` None:
    up to the request's length; ``last`` moves the state and makes the request ready there;
    ``free``, with ``last``: freed here once sent, its result's ``phases`` then has ``"free"``)."""

    rid: str
    ticket: bytes
    start: int = 0
    end: int | None = None
    last: bool = True
    free: bool = False


class SendOutcomes(list):
    """What :meth:`~kvd.client.surface.Surface.send_many` returns: per item, in order, its :class:`SendResult` or
    the :class:`~kvd.errors.KvdError` it failed with; ``seconds``: the whole call inside the
    daemon (the items overlap in time there, so their own ``seconds`` do not add up to it)."""

    seconds: float = 0.0


def parse_status(r: Any) -> TransferStatus:
    return TransferStatus(r.rid, state_from_pb(r.state), r.reason, r.bytes)


def parse_outcomes(r: pb.SendManyResponse) -> SendOutcomes:
    out = SendOutcomes(status_from_pb(o.error) if o.WhichOneof("outcome") == "error" else send_result_from_pb(o.result) for o in r.outcomes)
    out.seconds = r.seconds
    return out


def parse_info(r: pb.PoolInfo) -> PoolInfo:
    return PoolInfo(
        r.boot_id, r.epoch, Layout.model_validate_json(r.layout_json), [envelope_from_pb(e) for e in r.envelopes],
        r.backend, list(r.capabilities), r.finalized, r.reserved_bytes, r.version, r.peer_address, r.engine_socket,
    )


def parse_lease(r: pb.Lease) -> LeaseInfo:
    kind = lease_kind_from_pb(r.kind)
    return LeaseInfo(r.lease_id, r.rid, kind, r.boot_id, r.epoch, r.expires_in_seconds, bytes(r.ticket), r.bell)


def parse_stats(r: pb.Stats) -> NodeStats:
    groups = [GroupStats(**{f: getattr(g, f) for f in GroupStats.__slots__}) for g in r.groups]
    pool = PoolStats(
        r.boot_id, r.epoch, r.reserved_bytes, r.backed_bytes, r.sink_bytes, r.gap_bytes, r.finalized, r.requests_live,
        r.requests_offloaded, r.compactions_done, r.compactions_refused, r.pages_moved, r.bytes_moved, groups,
    )
    return NodeStats(pool, r.layout_name, r.leases_live, r.leases_expired_total, r.stale_refusals_total, r.sessions_live, r.sessions_expired_total)
