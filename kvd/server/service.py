"""Thin gRPC servicers: parse the message, call the node, build the reply.

No policy lives here. Every handler runs through :meth:`_Base._run`, which reads the session
from metadata, maps any exception to a status in one place (:func:`kvd.rpc.status.to_status`), and
aborts the call with the kvd error class in the trailing metadata. :func:`add_to_server`
registers a servicer with every request parsed by :func:`kvd.rpc.convert.parse_request`: bytes that do
not parse and strings over their bounds are refused through the same ``_run``, as
INVALID_ARGUMENT naming the method, before the handler runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import grpc

from kvd import __version__
from kvd.errors import FailedPrecondition, InvalidArgument, KvdError, NotFound, Unavailable
from kvd.handoff.link import PeerLink
from kvd.limits import MAX_ID_BYTES, quote, too_long
from kvd.handoff.flight import BeginItem, SendItem, check_batch_size
from kvd.handoff.outbox import Outbox
from kvd.handoff.inbox import inbox_of
from kvd.daemon.node import Node
from kvd.pool.layout import Layout
from kvd.records import AllocSpec, LeaseKind, TransferState
from kvd.server.peer_calls import PeerCalls
from kvd.rpc.status import to_status
from kvd.handoff.ticket import Issuer, Tickets
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.rpc.convert import (
    SESSION_KEY,
    TOKEN_KEY,
    envelope_to_pb,
    lease_kind_from_pb,
    parse_request,
    lease_kind_to_pb,
    send_result_to_pb,
    state_to_pb,
    status_to_pb,
    stats_to_pb,
    activity_to_pb,
    vectors_into,
    vectors_to_pb,
    IDS_KEY,
    IDS_LE,
)

__all__ = ["GRPC_WAIT_SLOTS", "GRPC_WORKERS", "KvdService", "PeerService", "SESSION_KEY", "TOKEN_KEY", "Endpoint", "add_to_server"]

log = logging.getLogger("kvd.server")

#: Threads serving the engine-facing Kvd service over gRPC (health, reflection and Peer calls
#: have lanes of their own: kvd.server.lanes).
GRPC_WORKERS = 16
#: Of those, at most this many block in a WaitReady at once. Every wait beyond them is refused
#: (Unavailable, retry after GRPC_WAIT_RETRY_S) unless its transfer is over already: before, 16
#: blocked waits took every thread, and engines' other calls and heartbeats (sessions reaped for
#: silence) waited behind them.
GRPC_WAIT_SLOTS = 8
GRPC_WAIT_RETRY_S = 0.2
T = TypeVar("T")
M = TypeVar("M")
R = TypeVar("R")
_UINT64_MAX = 2**64 - 1


class Endpoint:
    """How the outside world reaches this daemon: written into PoolInfo and tickets."""

    def __init__(
        self,
        peer_address: str = "",
        backend: str = "none",
        transfer_endpoint: str = "",
        capabilities: tuple[str, ...] = (),
        handle_socket: str = "",
        peer_socket: str = "",
    ):
        self.peer_address = peer_address
        self.backend = backend
        self.transfer_endpoint = transfer_endpoint
        self.capabilities = capabilities
        self.handle_socket = handle_socket  # where a CUDA arena's fds are handed out ("" for shm)
        self.peer_socket = peer_socket  # where a same-host sender calls this daemon without gRPC ("" when off)
        self.engine_socket = ""  # where engines call without gRPC (set once it serves; "" when off): Session, PoolInfo

    @property
    def issuer(self) -> Issuer:
        """How this daemon's tickets name it."""
        return Issuer(self.peer_address, self.transfer_endpoint, self.backend, self.peer_socket)


class _Base:
    def __init__(self, node: Node, endpoint: Endpoint) -> None:
        self.node = node
        self.endpoint = endpoint

    def _run(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- mapped to a status in one place
            code, msg, md = to_status(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("internal error in %s", type(self).__name__)
            context.set_trailing_metadata(md)
            context.abort(code, msg)
            raise  # unreachable: abort raises

    @staticmethod
    def _meta(context: grpc.ServicerContext, key: str) -> str:
        for k, v in context.invocation_metadata() or ():
            if k == key and isinstance(v, str):  # bytes only under -bin keys, which kvd does not use
                return v
        return ""

    def _packed(self, context: grpc.ServicerContext) -> bool:
        """Whether the caller reads packed ids (metadata :data:`IDS_KEY`: the engine socket always says so)."""
        return self._meta(context, IDS_KEY) == IDS_LE

    def _session(self, context: grpc.ServicerContext) -> str:
        sid = self._meta(context, SESSION_KEY)
        if not sid:
            raise InvalidArgument(f"no session: call OpenSession first and send its id as metadata {SESSION_KEY!r}")
        if n := too_long(sid, MAX_ID_BYTES):
            raise InvalidArgument(f"metadata {SESSION_KEY!r} is {n:,d} bytes, over the limit of {MAX_ID_BYTES}: send the id OpenSession returned")
        return sid


class KvdService(_Base, pb_grpc.KvdServicer):
    """The engine-facing service."""

    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        outbox: Outbox | None = None,
        link: PeerLink | None = None,
        tickets: Tickets | None = None,
    ) -> None:
        super().__init__(node, endpoint)
        self.outbox = outbox
        self.link = link
        #: mints the RECV leases' tickets; the Peer service checks them with the same object
        self.tickets = tickets if tickets is not None else Tickets(node, endpoint.issuer)
        self._grpc_waits = threading.BoundedSemaphore(GRPC_WAIT_SLOTS)

    # ---- sessions ---------------------------------------------------------------------------
    def OpenSession(self, request: pb.OpenSessionRequest, context):
        def go():
            s = self.node.open_session(request.name, request.ttl_seconds or None)
            return pb.Session(session_id=s.session_id, ttl_seconds=s.ttl, boot_id=self.node.pool.boot_id,
                              engine_socket=self.endpoint.engine_socket)

        return self._run(context, go)

    def KeepAlive(self, request, context):
        return self._run(context, lambda: pb.KeepAliveResponse(ttl_seconds=self.node.touch(self._session(context)).ttl))

    def CloseSession(self, request: pb.CloseSessionRequest, context):
        def go():
            freed, released = self.node.close_session(self._session(context), request.free_requests)
            return pb.CloseSessionResponse(requests_freed=freed, leases_released=released)

        return self._run(context, go)

    # ---- description ------------------------------------------------------------------------
    def info(self) -> pb.PoolInfo:
        pool = self.node.pool
        return pb.PoolInfo(
            boot_id=pool.boot_id,
            epoch=pool.epoch,
            layout_json=pool.layout.model_dump_json(),
            layout_fingerprint=pool.layout.fingerprint,
            envelopes=[envelope_to_pb(e) for e in pool.envelopes()],
            backend=self.endpoint.backend,
            capabilities=list(self.endpoint.capabilities),
            finalized=pool.finalized,
            reserved_bytes=pool.arena.reserved,
            version=__version__,
            peer_address=self.endpoint.peer_address,
            engine_socket=self.endpoint.engine_socket,
        )

    def GetInfo(self, request, context):
        def go():
            self.node.require_layout()
            return self.info()

        return self._run(context, lambda: self._with_session(context, go))

    def ProposeLayout(self, request: pb.ProposeLayoutRequest, context):
        def go():
            try:
                layout = Layout.model_validate_json(request.layout_json)
            except ValueError as exc:
                raise InvalidArgument(f"layout_json is not a kvd layout ({str(exc)[:1500]}); send Layout.model_dump_json()") from None
            with self.node.lock:  # the adopted layout and the info that reports it, as one picture
                self.node.propose_layout(self._session(context), layout)
                return self.info()

        return self._run(context, go)

    def _with_session(self, context, fn: Callable[[], T]) -> T:
        self.node.touch(self._session(context))
        with self.node.lock:
            return fn()

    def GetStats(self, request, context):
        # Stats need no session: `kvd status` and dashboards read them.
        return self._run(context, lambda: stats_to_pb(self.node.stats()))

    def GetActivity(self, request: pb.GetActivityRequest, context):
        # Read-only, no session (kvd top): the node reads its tables under its lock once.
        def go():
            limit = request.limit or 20
            if limit > 1000:
                raise InvalidArgument(f"GetActivity: limit {limit} is over 1000; ask for fewer entries")
            out = self.outbox
            return activity_to_pb(self.node.activity(
                limit, out.open_transfers() if out else (), out.bytes_total if out else 0))

        return self._run(context, go)

    def Attach(self, request, context):
        # shm: the path of the arena file. cuda-vmm: the handle socket, where the client fetches
        # the chunk fds with its session id (kvd.ipc.fdpass); only the backed prefix is exported.
        def go():
            self.node.require_layout()  # the views follow the layout
            h = self.node.pool.arena.handle()
            path = h.path
            if h.kind == "cuda-vmm":
                if not self.endpoint.handle_socket:
                    raise FailedPrecondition(f"arena {h.region_id} is in GPU memory but this daemon serves no handle socket")
                path = self.endpoint.handle_socket
            return pb.AttachResponse(
                kind=h.kind, path=path, backed_bytes=h.backed, region_id=h.region_id, layout_json=self.node.layout.model_dump_json()
            )

        return self._run(context, lambda: self._with_session(context, go))

    # ---- requests ---------------------------------------------------------------------------
    def Allocate(self, request: pb.AllocateRequest, context):
        def go():
            specs = [AllocSpec(s.rid, s.tokens, s.receive) for s in request.requests]
            session = self._session(context)
            packed = self._packed(context)
            for s in request.requests:
                if s.lease_ttl_seconds and not s.lease:
                    raise InvalidArgument(
                        f"allocate {quote(s.rid)}: lease_ttl_seconds is the TTL of the RECV lease that lease=true takes (decode "
                        + ("side); a request with a ticket takes none: leave it 0" if s.ticket else "side): set lease=true too, or leave it 0")
                    )
                if s.chunk_tokens and not s.ticket:
                    raise InvalidArgument(
                        f"allocate {quote(s.rid)}: chunk_tokens is the prefill chunk of the transfer a ticket begins (prefill "
                        "side): pass the decode daemon's ticket too, or leave it 0"
                    )
            if any(s.ticket for s in request.requests):
                return self._allocate_sending(session, specs, request.requests, packed, getattr(context, "defer", None))
            if not any(s.lease for s in request.requests):
                r = pb.AllocateResponse()
                vectors_into(r.vectors, self.node.allocate(session, specs), packed)
                return r
            return self._allocate_leased(session, specs, [(s.lease, s.lease_ttl_seconds or None) for s in request.requests], packed)

        return self._run(context, go)

    def _allocate_leased(
        self, session: str, specs: list[AllocSpec], lease: list[tuple[bool, float | None]], packed: bool
    ) -> pb.AllocateResponse:
        """Allocate ``specs`` and take a RECV lease (its ticket minted) on each one ``lease``
        marks ``(True, ttl)`` (None: the daemon's TTL), all under the node's lock: all or nothing
        (a failure releases what it leased and frees what it allocated, then raises; a TTL out of
        range is refused before anything is allocated). ``packed``: the reply's ids as bytes."""
        for want, ttl in lease:
            if want:
                self.node.leases.check_ttl(ttl)
        with self.node.lock:
            vecs = self.node.allocate(session, specs)
            reply = pb.AllocateResponse()
            vectors_into(reply.vectors, vecs, packed)
            wire = reply.vectors
            leases: list[pb.Lease] = []
            try:
                for spec, v, m, (want, ttl) in zip(specs, vecs, wire, lease):
                    if want:
                        got, vec = self.node.acquire_lease(
                            session, spec.rid, LeaseKind.RECV, ttl=ttl, boot_id=v.boot_id, epoch=v.epoch, known=v
                        )
                        # a ticket's vectors are packed: the reply's message serves when it is too
                        leases.append(self._lease_pb(got, vec, m if vec is v and packed else None))
            except BaseException:
                for le in leases:
                    self.node.release_lease(session, le.lease_id)
                self.node.free(session, [s.rid for s in specs])
                raise
            reply.leases.extend(leases)
            return reply

    def _allocate_sending(
        self, session: str, specs: list[AllocSpec], wire: Sequence[pb.AllocSpec], packed: bool,
        defer: Callable[[Callable[[], None]], None] | None,
    ) -> pb.AllocateResponse:
        """Prefill side: allocate ``specs`` and begin the transfer of each one that carries a
        ticket (:meth:`Outbox.begin_many`: the receivers' checks are not waited for; over the
        engine socket, ``defer``, they are not even sent before the reply is out, nor are the
        Sends planned: the caller goes on meanwhile). Every ticket is read and checked against
        this daemon first, so that a refusal there leaves nothing allocated and no receiver
        asked. A refusal once allocated (a ticket whose transfer is still listed here: another
        session's, or an ended request's whose check is not answered yet) comes before any
        check is sent or deferred: this call's requests are freed with no receiver to tell."""
        if self.outbox is None:
            raise FailedPrecondition("allocate with a ticket: this daemon has no transfer backend (backend=none); start it with backend=mooncake or local")
        outbox = self.outbox
        seen: dict[bytes, str] = {}
        begins: list[BeginItem] = []
        for s in wire:
            if not s.ticket:
                continue
            if s.receive or s.lease:
                raise InvalidArgument(
                    f"allocate {quote(s.rid)}: a ticket is for the prefill side (the request is computed here and sent to the "
                    "ticket's receiver); it cannot be allocated with receive or lease"
                )
            if s.ticket in seen:
                raise InvalidArgument(f"allocate: requests {quote(seen[s.ticket])} and {quote(s.rid)} carry the same ticket; each request has its own")
            seen[s.ticket] = s.rid
            info = outbox.read_ticket(s.ticket)
            outbox.precheck(s.rid, info, s.chunk_tokens)
            begins.append(BeginItem(s.rid, info, s.ticket, s.chunk_tokens))
        if any(s.lease for s in wire):
            raise InvalidArgument("allocate: RECV leases (decode side) and tickets (prefill side) go in separate calls")
        vecs = self.node.allocate(session, specs)
        try:
            outbox.begin_many(session, begins, defer)
        except BaseException:
            self.node.free(session, [s.rid for s in specs])
            raise
        r = pb.AllocateResponse()
        vectors_into(r.vectors, vecs, packed)
        return r

    def CanAllocate(self, request: pb.CanAllocateRequest, context):
        def go():
            specs = [AllocSpec(s.rid, s.tokens, s.receive) for s in request.requests]
            short = self.node.can_allocate(self._session(context), specs)
            # uint64 on the wire: an absurd request (2**62 tokens) saturates instead of failing as INTERNAL.
            return pb.CanAllocateResponse(fits=short == 0, shortfall_bytes=min(short, _UINT64_MAX))

        return self._run(context, go)

    def Extend(self, request: pb.ExtendRequest, context):
        def go():
            items = [(i.rid, i.tokens) for i in request.items]
            packed = self._packed(context)
            r = pb.ExtendResponse()
            vectors_into(r.vectors, self.node.extend(self._session(context), items), packed)
            return r

        return self._run(context, go)

    def Free(self, request: pb.FreeRequest, context):
        return self._run(context, lambda: pb.FreeResponse(freed=self.node.free(self._session(context), list(request.rids))))

    def GetVectors(self, request: pb.GetVectorsRequest, context):
        def go():
            vecs = self.node.vectors(self._session(context), list(request.rids))
            packed = self._packed(context)
            r = pb.GetVectorsResponse()
            vectors_into(r.vectors, vecs, packed)
            return r

        return self._run(context, go)

    # ---- leases -----------------------------------------------------------------------------
    def _lease_pb(self, lease, vec=None, vec_pb=None) -> pb.Lease:
        """``lease`` on the wire, with its ticket when it is a RECV lease on ``vec`` (``vec_pb``:
        ``vec`` on the wire, when the caller has it), and its doorbell slot."""
        recv = lease.kind is LeaseKind.RECV
        ticket = self.tickets.mint(lease, vec, vec_pb) if vec is not None and recv else b""
        return pb.Lease(
            lease_id=lease.lease_id,
            rid=lease.rid,
            kind=lease_kind_to_pb(lease.kind),
            boot_id=lease.boot_id,
            epoch=lease.epoch,
            expires_in_seconds=max(0.0, lease.expires_at - self.node.clock()),
            ticket=ticket,
            bell=self.node.inbox.bell(lease.rid) + 1 if recv else 0,
        )

    def AcquireLease(self, request: pb.AcquireLeaseRequest, context):
        def go():
            kind = lease_kind_from_pb(request.kind)
            lease, vec = self.node.acquire_lease(
                self._session(context),
                request.rid,
                kind,
                ttl=request.ttl_seconds or None,
                boot_id=request.boot_id,
                epoch=request.epoch,
            )
            with self.node.lock:
                return self._lease_pb(lease, vec)

        return self._run(context, go)

    def RenewLease(self, request: pb.RenewLeaseRequest, context):
        return self._run(
            context, lambda: self._lease_pb(self.node.renew_lease(self._session(context), request.lease_id, request.ttl_seconds or None))
        )

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context):
        def go():
            self.node.release_lease(self._session(context), request.lease_id)
            return pb.ReleaseLeaseResponse()

        return self._run(context, go)

    # ---- maintenance ------------------------------------------------------------------------
    def Compact(self, request: pb.CompactRequest, context):
        def go():
            r = self.node.compact(self._session(context), request.around_pinned)
            return pb.CompactResponse(pages_moved=r.pages_moved, bytes_moved=r.bytes_moved, gap_gained_bytes=r.gap_gained_bytes, epoch=r.epoch)

        return self._run(context, go)

    def Finalize(self, request: pb.FinalizeRequest, context):
        def go():
            self.node.finalize(self._session(context), request.bytes if request.has_bytes else None, request.resize)
            with self.node.lock:
                return pb.FinalizeResponse(info=self.info())

        return self._run(context, go)

    def Offload(self, request: pb.OffloadRequest, context):
        return self._run(context, lambda: pb.OffloadResponse(bytes=self.node.offload(self._session(context), request.rid)))

    def Restore(self, request: pb.RestoreRequest, context):
        return self._run(
            context, lambda: pb.RestoreResponse(vectors=vectors_to_pb(self.node.restore(self._session(context), request.rid), self._packed(context)))
        )

    def Echo(self, request: pb.EchoRequest, context):
        return pb.EchoResponse(payload=request.payload)

    # ---- handoff ----------------------------------------------------------------------------
    def BeginSend(self, request: pb.BeginSendRequest, context):
        def go():
            session, outbox = self._sender(context)
            opened = outbox.begin(
                session, request.rid, outbox.read_ticket(request.ticket), request.ticket, chunk_tokens=request.chunk_tokens
            )
            return pb.BeginSendResponse(opened=opened)

        return self._run(context, go)

    def Send(self, request: pb.SendRequest, context):
        def go():
            t0 = time.perf_counter()
            if request.free and not request.last:
                raise InvalidArgument(f"Send of {quote(request.rid)}: free=true needs last=true (a request is freed after its last chunk)")
            session, outbox = self._sender(context)
            t1 = time.perf_counter()
            ticket = outbox.read_ticket(request.ticket)
            t2 = time.perf_counter()
            r = outbox.send(session, request.rid, ticket, request.ticket, request.token_start, request.token_end or None, request.last)
            reply = send_result_to_pb(r)
            reply.phase_seconds["ticket"] = t2 - t1
            if request.free:
                self._free_sent(session, request.rid, reply)
            reply.phase_seconds["call"] = time.perf_counter() - t0
            return reply

        return self._run(context, go)

    def _free_sent(self, session: str, rid: str, reply: pb.SendResponse) -> None:
        """Free ``rid``, sent (Send or a SendMany item with ``free``): ``"free"`` in the reply's
        phases when freed; when it cannot be (another lease pins it), the Send still succeeded
        and the engine frees it later."""
        t0 = time.perf_counter()
        try:
            self.node.free(session, [rid])
            reply.phase_seconds["free"] = time.perf_counter() - t0
        except KvdError as exc:  # the Send succeeded: say so; the engine frees it later
            log.info("Send of %s: sent, but not freed: %s", quote(rid), exc)

    def SendMany(self, request: pb.SendManyRequest, context: grpc.ServicerContext) -> pb.SendManyResponse:
        def go() -> pb.SendManyResponse:
            t0 = time.perf_counter()
            session, outbox = self._sender(context)
            check_batch_size(len(request.items))
            items: list[SendItem | KvdError] = []
            for it in request.items:
                try:  # a ticket that does not parse is that item's failure alone
                    if it.free and not it.last:
                        raise InvalidArgument(f"SendMany item {quote(it.rid)}: free=true needs last=true (a request is freed after its last chunk)")
                    info = outbox.read_ticket(it.ticket)
                except KvdError as exc:
                    items.append(exc)
                    continue
                items.append(SendItem(it.rid, info, it.ticket, it.token_start, it.token_end or None, it.last))
            outcomes = []
            for it, r in zip(request.items, outbox.send_many(session, items)):
                if isinstance(r, KvdError):
                    outcomes.append(pb.SendOutcome(error=status_to_pb(r)))
                    continue
                reply = send_result_to_pb(r)
                if it.free:  # each item once all were sent: a free never delays another item's writes
                    self._free_sent(session, it.rid, reply)
                outcomes.append(pb.SendOutcome(result=reply))
            return pb.SendManyResponse(outcomes=outcomes, seconds=time.perf_counter() - t0)

        return self._run(context, go)

    def _sender(self, context) -> tuple[str, Outbox]:
        """The calling session (touched) and the outbox; FailedPrecondition on a daemon that
        cannot send."""
        session = self._session(context)
        self.node.touch(session)
        if self.outbox is None:
            raise FailedPrecondition("this daemon has no transfer backend (backend=none); start it with backend=mooncake or local")
        return session, self.outbox

    def WaitReady(self, request: pb.WaitRequest, context):
        def go():
            session = self._session(context)
            self.node.own(session, request.rid)
            inbox = inbox_of(self.node)
            st = self._wait(
                context, request.timeout_seconds, lambda t, active: inbox.wait(request.rid, t, active),
                lambda st: st.state in (TransferState.READY, TransferState.FAILED), f"WaitReady of {quote(request.rid)}",
            )
            return pb.TransferStatus(rid=request.rid, state=state_to_pb(st.state), reason=st.reason, bytes=st.nbytes)

        return self._run(context, go)

    def WaitEnded(self, request: pb.WaitEndedRequest, context):
        def go():
            session = self._session(context)
            mine = self.node.mine(session)
            inbox = inbox_of(self.node)
            ended, cursor = self._wait(
                context, request.timeout_seconds, lambda t, active: inbox.wait_ended(request.after, t, mine, active),
                lambda got: bool(got[0]), "WaitEnded",
            )
            return pb.WaitEndedResponse(
                ended=[pb.TransferStatus(rid=rid, state=state_to_pb(st.state), reason=st.reason, bytes=st.nbytes) for rid, st in ended],
                cursor=cursor,
            )

        return self._run(context, go)

    def _wait(self, context: grpc.ServicerContext, timeout: float, wait: Callable[[float, Callable[[], bool]], T],
              over: Callable[[T], bool], what: str) -> T:
        """``wait(timeout, active)`` -- never past the caller's own deadline, ended early once
        nobody can hear the answer (the caller hung up, the server stops). Over gRPC a wait holds
        one of its GRPC_WORKERS threads, so at most GRPC_WAIT_SLOTS block at once: beyond them, a
        call whose answer now is final (``over``) gets it; the others are refused Unavailable with
        a retry hint. The engine socket's waits hold their connection's own thread."""
        left = context.time_remaining()
        timeout = timeout if left is None else min(timeout, max(0.0, left - 0.05))
        slots = self._grpc_waits if isinstance(context, grpc.ServicerContext) and timeout > 0 else None
        if slots is not None and not slots.acquire(blocking=False):
            got = wait(0, context.is_active)
            if not over(got):
                raise Unavailable(
                    f"{what}: all {GRPC_WAIT_SLOTS} of this daemon's waits over gRPC are taken "
                    f"(the other calls keep the rest of its {GRPC_WORKERS} threads); call again after the retry hint (kvd's "
                    "clients do so within the wait's timeout), or wait over the engine socket (transport 'fast': its "
                    "doorbells need no call)", retry_after_s=GRPC_WAIT_RETRY_S,
                )
            return got
        try:
            return wait(timeout, context.is_active)
        finally:
            if slots is not None:
                slots.release()

    def Abort(self, request: pb.AbortRequest, context):
        def go():
            session = self._session(context)
            self.node.own(session, request.rid)
            reason = request.reason or "no reason given"
            notified = False
            if self.outbox is not None and self.outbox.abort_local(session, request.rid, reason):
                notified = True
            try:
                target = inbox_of(self.node).abort_local(request.rid, reason)
            except NotFound:
                target = None
                if not notified:
                    raise NotFound(f"abort: request {quote(request.rid)} has no transfer in progress on this daemon") from None
            if target is not None and self.link is not None:
                sender, ref = target
                try:
                    self.link.abort_send(sender, ref, reason)
                    notified = True
                except KvdError as exc:  # the sender is gone: its heartbeat loss already fails it
                    log.info("abort of %s: could not reach sender %s: %s", request.rid, sender, exc)
            return pb.AbortResponse(notified_peer=notified)

        return self._run(context, go)


class PeerService(_Base, pb_grpc.PeerServicer):
    """The daemon-to-daemon service over gRPC: :class:`~kvd.server.peer_calls.PeerCalls` behind
    the token in metadata (the peer socket serves a same-host sender from the same calls)."""

    def __init__(self, node: Node, endpoint: Endpoint, calls: PeerCalls) -> None:
        super().__init__(node, endpoint)
        self.calls = calls

    def _peer(self, context, fn: Callable[[M], R], request: M) -> R:
        def go():
            self.calls.authorize(self._meta(context, TOKEN_KEY))
            return fn(request)

        return self._run(context, go)

    def CheckTicket(self, request: pb.CheckTicketRequest, context):
        return self._peer(context, self.calls.check_ticket, request)

    def Commit(self, request: pb.CommitRequest, context):
        return self._peer(context, self.calls.commit, request)

    def AbortReceive(self, request: pb.PeerAbortRequest, context):
        return self._peer(context, self.calls.abort_receive, request)

    def AbortSend(self, request: pb.PeerAbortRequest, context):
        return self._peer(context, self.calls.abort_send, request)

    def Heartbeat(self, request: pb.HeartbeatRequest, context):
        return self._peer(context, self.calls.heartbeat, request)

    def TransferMetadata(self, request: pb.TransferMetadataRequest, context):
        return self._peer(context, self.calls.transfer_metadata, request)

# ---- registration: every request parsed in one place ------------------------------------------


class _Refused(NamedTuple):
    """What the deserializer hands the handler for a request it refused: gRPC answers a
    deserializer that raises with its own INTERNAL, so the refusal travels as a value."""

    error: BaseException


def _deserializer(method: str, cls: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return parse_request(method, cls, data)
        except Exception as exc:  # noqa: BLE001 -- answered by the handler, through _run
            return _Refused(exc)

    return parse


def _raise(exc: BaseException) -> None:
    raise exc


def _guarded(servicer: _Base, handler: Callable) -> Callable:
    def handle(request, context):
        if isinstance(request, _Refused):
            return servicer._run(context, lambda: _raise(request.error))
        return handler(request, context)

    return handle


def add_to_server(server: grpc.Server, servicer: _Base, service: str) -> None:
    """Serve ``servicer`` as ``kvd.v1.<service>`` on ``server`` (what the generated
    ``add_<service>Servicer_to_server`` does), every request parsed by
    :func:`kvd.rpc.convert.parse_request`. The methods are read from the service descriptor, so a
    method added to the proto is served this way too (a streaming one is refused here: kvd has
    none, and its requests would need the same guard per message)."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for m in desc.methods:
        if m.client_streaming or m.server_streaming:
            raise TypeError(f"{desc.full_name}/{m.name} streams; add_to_server serves unary methods only")
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            _guarded(servicer, getattr(servicer, m.name)),
            request_deserializer=_deserializer(m.name, getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)
