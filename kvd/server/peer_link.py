"""The daemon's :class:`kvd.handoff.link.PeerLink`: how this daemon calls another.

gRPC for every call; a sender's calls to a receiver -- CheckTicket and Commit, the two on a
Send's critical path, and with them Heartbeat and AbortReceive -- over the receiver's peer socket
instead when the ticket offered one and the daemon there proved to be the ticket's
(:mod:`kvd.server.peer_conns`). AbortSend (receiver to sender) stays on gRPC. Channels are cached per address. Every call has a short
deadline so a dead peer is noticed in about a second, never after a long fixed timeout; errors
come back as kvd exceptions, the same classes and messages whichever way a call went.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import cast

import grpc
from google.protobuf.message import Message

from kvd.records import PeerLinkStats, SocketRoute, TransferRef
from kvd.errors import ERROR_KEY, DeadlineExceeded, InvalidArgument, KvdError, Unavailable
from kvd.limits import MAX_REASON_BYTES, clip, quote
from kvd.server.peer_conns import PeerConnections
from kvd.rpc.status import from_rpc_error
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.rpc.convert import TOKEN_KEY, grpc_target, ref_to_pb

__all__ = ["DaemonPeerLink", "HEARTBEAT_REFS", "PATHS"]

#: How a call went: the label of ``kvd_peer_calls_total``.
PATHS = ("socket", "grpc")
#: Transfers named per Heartbeat call: as many of the longest refs (~300 bytes) take ~1.3 MB,
#: under the least request a receiver may be set to read (max_request_bytes: 2 MiB).
HEARTBEAT_REFS = 4096


class DaemonPeerLink:
    """``token``: this daemon's ``peer_token``; ``timeout``: each call's deadline (seconds)."""

    def __init__(self, *, token: str | None = None, timeout: float = 1.0) -> None:
        self.timeout = timeout
        # gRPC backs off reconnecting to a peer that refused (up to 2 minutes by default), and
        # heartbeats to a dead peer keep it backing off: a peer restarted on the same address
        # would look dead that long. Retry at least every `timeout` seconds instead.
        self._options = (
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max(100, int(timeout * 1000))),
        )
        self._md = ((TOKEN_KEY, token),) if token else ()
        self._stubs: dict[str, pb_grpc.PeerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        self.sockets = PeerConnections(token=token, timeout=timeout)
        self._calls: dict[tuple[str, str], int] = {}  # (method, path) -> calls made

    def calls(self) -> dict[tuple[str, str], int]:
        """Calls made so far by ``(method, path)``, path one of :data:`PATHS`."""
        with self._lock:
            return dict(self._calls)

    def stats(self) -> PeerLinkStats:
        """:meth:`calls` as a record (what the exporter reads)."""
        return PeerLinkStats(self.calls())

    def _count(self, method: str, path: str) -> None:
        with self._lock:
            self._calls[(method, path)] = self._calls.get((method, path), 0) + 1

    def _stub(self, address: str) -> pb_grpc.PeerStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = grpc.insecure_channel(grpc_target(address), options=self._options)
                self._channels.append(ch)
                stub = self._stubs[address] = pb_grpc.PeerStub(ch)
            return stub

    def _start(
        self, address: str, method: str, request: Message, via: SocketRoute | None = None, *, wait_for_ready: bool = False
    ) -> Callable[[], Message]:
        """Send ``request`` now, over the route's socket when it is usable, else over gRPC; the
        returned function waits for the reply (kvd exceptions either way). ``wait_for_ready``: a
        channel still backing off from an earlier refusal waits (within ``timeout``) for the peer
        instead of failing at once -- for idempotent reads only."""
        conn = self.sockets.checkout(via) if via is not None else None
        if conn is not None:
            self._count(method, "socket")
            return self.sockets.start(conn, method, request)
        self._count(method, "grpc")
        # A full timeout even after a socket hello that went unanswered: on a loaded host a slow
        # hello is not a hung daemon, and a check that times out here may still be accepted there.
        future = getattr(self._stub(address), method).future(
            request, metadata=self._md, timeout=self.timeout, wait_for_ready=wait_for_ready
        )

        def wait() -> Message:
            try:
                return future.result()
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNKNOWN and "target uri is not valid" in (exc.details() or ""):
                    # gRPC could not make a channel of the address (a ticket's peer_address): the
                    # caller's input, not a fault of the peer
                    raise InvalidArgument(
                        f"{method}: peer address {quote(address)} is not a valid gRPC target "
                        "(host:port, [v6]:port, unix:/path or /path); check the ticket's peer_address"
                    ) from exc
                raise self._transport_error(method, address, exc) from exc

        return wait

    def _transport_error(self, method: str, address: str, exc: grpc.RpcError) -> KvdError:
        """The kvd error of a failed gRPC call to a peer: the peer's own refusal as it is; gRPC's
        own deadline or unavailability (no kvd error metadata) saying which call to which daemon,
        and what to look at."""
        err = from_rpc_error(exc)
        try:
            md = dict(cast("Iterable[tuple[str, str]]", exc.trailing_metadata() or ()))
        except Exception:  # noqa: BLE001 -- some transport errors carry no metadata
            md = {}
        if ERROR_KEY in md:
            return err
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(
                f"{method} to the daemon at {quote(address)}: no reply within {self.timeout:g} s (peer_timeout_s): "
                "it is hung, overloaded or unreachable"
            )
        if isinstance(err, Unavailable):
            return Unavailable(f"{method} to the daemon at {quote(address)}: {err}")
        return err

    def _call(self, address: str, method: str, request: Message, via: SocketRoute | None = None) -> Message:
        return self._start(address, method, request, via)()

    def start_check(self, address: str, ticket: bytes, sender: str, via: SocketRoute | None = None) -> Callable[[], object]:
        return self._start(address, "CheckTicket", pb.CheckTicketRequest(ticket=ticket, sender=sender), via)

    def commit(self, address: str, ref: TransferRef, last: bool, nbytes: int, sender: str, via: SocketRoute | None = None) -> None:
        self._call(address, "Commit", pb.CommitRequest(ref=ref_to_pb(ref), last=last, bytes=nbytes, sender=sender), via)

    # A reason is often an error's message (up to MAX_MESSAGE_BYTES) behind a prefix: cut to the
    # bound the peer holds it to, or the peer refuses the abort and never learns of it.
    def abort_receive(
        self, address: str, ref: TransferRef, reason: str, drained: bool, sender: str, via: SocketRoute | None = None
    ) -> None:
        request = pb.PeerAbortRequest(ref=ref_to_pb(ref), reason=clip(reason, MAX_REASON_BYTES), drained=drained, sender=sender)
        self._call(address, "AbortReceive", request, via)

    def abort_send(self, address: str, ref: TransferRef, reason: str) -> None:
        self._call(address, "AbortSend", pb.PeerAbortRequest(ref=ref_to_pb(ref), reason=clip(reason, MAX_REASON_BYTES)))

    def heartbeat(self, address: str, sender: str, refs: list[TransferRef], via: SocketRoute | None = None) -> list[int]:
        """One Heartbeat call per :data:`HEARTBEAT_REFS` of ``refs`` (one call when there are none):
        the dead leases of them all."""
        dead: list[int] = []
        for i in range(0, max(len(refs), 1), HEARTBEAT_REFS):
            req = pb.HeartbeatRequest(sender=sender, refs=[ref_to_pb(x) for x in refs[i:i + HEARTBEAT_REFS]])
            dead.extend(cast(pb.HeartbeatResponse, self._call(address, "Heartbeat", req, via)).dead_lease_ids)
        return dead

    def transfer_metadata(self, address: str, agent: str) -> bytes:
        """The receiver's data-plane metadata for ``agent`` (backend=nixl), over gRPC."""
        # Over gRPC alone, and a read: a peer restarted on an address this daemon's channel saw
        # refuse (its reconnect backoff) is waited for, not reported unreachable.
        req = pb.TransferMetadataRequest(agent=agent)
        r = cast(pb.TransferMetadataResponse, self._start(address, "TransferMetadata", req, wait_for_ready=True)())
        return r.metadata

    def close(self) -> None:
        self.sockets.close()
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
