"""The gRPC implementation of :class:`kvd.handoff.PeerLink`: how this daemon calls another.

Channels are cached per address. Every call has a short deadline so a dead peer is noticed in
about a second, never after a long fixed timeout; errors come back as kvd exceptions.
"""

from __future__ import annotations

import threading

import grpc

from kvd.handoff import TransferRef
from kvd.status import from_rpc_error
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.wire import TOKEN_KEY, grpc_target, ref_to_pb

__all__ = ["GrpcPeerLink"]


class GrpcPeerLink:
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

    def _stub(self, address: str) -> pb_grpc.PeerStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = grpc.insecure_channel(grpc_target(address), options=self._options)
                self._channels.append(ch)
                stub = self._stubs[address] = pb_grpc.PeerStub(ch)
            return stub

    def _call(self, address: str, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub(address), method)(request, metadata=self._md, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def check_ticket(self, address: str, ticket: bytes, sender: str) -> None:
        self._call(address, "CheckTicket", pb.CheckTicketRequest(ticket=ticket, sender=sender))

    def commit(self, address: str, ref: TransferRef, last: bool, nbytes: int) -> None:
        self._call(address, "Commit", pb.CommitRequest(ref=ref_to_pb(ref), last=last, bytes=nbytes))

    def abort_receive(self, address: str, ref: TransferRef, reason: str, drained: bool) -> None:
        self._call(address, "AbortReceive", pb.PeerAbortRequest(ref=ref_to_pb(ref), reason=reason, drained=drained))

    def abort_send(self, address: str, ref: TransferRef, reason: str) -> None:
        self._call(address, "AbortSend", pb.PeerAbortRequest(ref=ref_to_pb(ref), reason=reason))

    def heartbeat(self, address: str, sender: str, refs: list[TransferRef]) -> list[int]:
        r = self._call(address, "Heartbeat", pb.HeartbeatRequest(sender=sender, refs=[ref_to_pb(x) for x in refs]))
        return list(r.dead_lease_ids)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
