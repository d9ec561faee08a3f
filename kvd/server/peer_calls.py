"""The Peer service's semantics, once for both transports.

The gRPC servicer (:class:`kvd.server.service.PeerService`) and the same-host peer socket
(:mod:`kvd.server.peer_socket`) both call :class:`PeerCalls`: a v1 request message in, the v1
response message out, a kvd exception for a refusal. Each transport maps that exception to a
status with :func:`kvd.rpc.status.to_status` and authenticates its caller with :meth:`authorize`
(per call over gRPC, once per connection on the socket), so a ticket is accepted or refused in
the same words whichever way it came.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from kvd.errors import FailedPrecondition, PermissionDenied
from kvd.handoff.outbox import Outbox
from kvd.handoff.inbox import inbox_of
from kvd.daemon.node import Node
from kvd.handoff.ticket import Issuer, Tickets
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import TOKEN_KEY, ref_from_pb

__all__ = ["PeerCalls", "token_ok"]


def token_ok(configured: str | None, presented: str) -> bool:
    """Whether a caller presenting ``presented`` is a peer: it is the ``configured`` peer token,
    or none is configured. Constant-time: the socket answers a wrong token at once, so timing
    must not leak a prefix."""
    return not configured or hmac.compare_digest(presented.encode(), configured.encode())


class PeerCalls:
    """What a peer daemon may ask of this one. ``token``: the shared ``peer_token`` (None: peers
    are not authenticated); ``outbox``: this daemon's sending side (None without a backend);
    ``tickets``: this daemon's tickets, the ones its engine-facing service mints (None: a new
    :class:`~kvd.handoff.ticket.Tickets`, which only tickets it minted itself pass)."""

    def __init__(self, node: Node, token: str | None = None, outbox: Outbox | None = None, tickets: Tickets | None = None) -> None:
        self.node = node
        self.token = token
        self.outbox = outbox
        self.tickets = tickets if tickets is not None else Tickets(node, Issuer())

    def authorize(self, presented: str) -> None:
        """PermissionDenied unless ``presented`` is the configured peer token (anything goes
        when none is configured). Changes nothing."""
        if not token_ok(self.token, presented):
            raise PermissionDenied(
                f"peer call without the right peer token ({TOKEN_KEY!r} metadata over gRPC, the hello over the peer "
                "socket); configure the same peer_token on both daemons"
            )

    def check_ticket(self, request: pb.CheckTicketRequest) -> pb.CheckTicketResponse:
        """Validate a ticket this daemon issued (:meth:`kvd.handoff.ticket.Tickets.check`: the seal, then every
        field); with a sender, the transfer begins (RECEIVING)."""
        t, lease = self.tickets.check(request.ticket)
        if request.sender:
            inbox_of(self.node).begin(t.ref, request.sender)
        return pb.CheckTicketResponse(expires_in_seconds=max(0.0, lease.expires_at - self.node.clock()))

    def commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        """A chunk's writes completed; the last one makes the transfer READY. Only from the
        sender that began it (:meth:`kvd.handoff.inbox.Inbox.commit`)."""
        inbox_of(self.node).commit(ref_from_pb(request.ref), request.last, request.bytes, request.sender)
        return pb.CommitResponse()

    def commit_then(self, request: pb.CommitRequest) -> tuple[pb.CommitResponse, Callable[[], None]]:
        """:meth:`commit`, and what wakes the decode engine's WaitReady: the transport calls it
        once the Commit reply is on its way (the peer socket: the sender's reply first, then the
        engine's, each without the other's thread in its way)."""
        wake = inbox_of(self.node).commit(ref_from_pb(request.ref), request.last, request.bytes, request.sender, defer_wake=True)
        return pb.CommitResponse(), wake

    def abort_receive(self, request: pb.PeerAbortRequest) -> pb.PeerAbortResponse:
        """The sender gave up on a transfer into this daemon (only the one that began it may:
        :meth:`kvd.handoff.inbox.Inbox.abort`)."""
        inbox_of(self.node).abort(ref_from_pb(request.ref), request.reason or "no reason given", request.drained, request.sender)
        return pb.PeerAbortResponse()

    def abort_send(self, request: pb.PeerAbortRequest) -> pb.PeerAbortResponse:
        """The receiver aborted a transfer this daemon sends: stop at the next batch."""
        if self.outbox is not None:
            self.outbox.abort_remote(ref_from_pb(request.ref), request.reason or "no reason given")
        return pb.PeerAbortResponse()

    def transfer_metadata(self, request: pb.TransferMetadataRequest) -> pb.TransferMetadataResponse:
        """This daemon's backend metadata for a sender (backend=nixl); FailedPrecondition when
        its backend has none to give."""
        backend = self.outbox.backend if self.outbox is not None else None
        metadata = getattr(backend, "metadata", None)
        if metadata is None:
            raise FailedPrecondition(
                f"this daemon's backend ({backend.name if backend else 'none'}) has no transfer metadata to give; "
                "configure both daemons with backend=nixl"
            )
        return pb.TransferMetadataResponse(metadata=metadata(request.agent))

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """The sender is alive; answers the transfers this daemon no longer accepts."""
        dead = inbox_of(self.node).heartbeat(request.sender, [ref_from_pb(r) for r in request.refs])
        return pb.HeartbeatResponse(dead_lease_ids=dead)
