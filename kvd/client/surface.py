"""Every call of the engine-facing API, once (:class:`Surface`): each builds its request message,
checks what the wire cannot carry, and names the parser of its reply. :class:`~kvd.client.client.Client`
and :class:`~kvd.client.client.AsyncClient` supply the transport (``_call``): a parsed value, or an
awaitable of it. Also a session's doorbells and the state that says a session may be gone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvd.client import fast as _fast
from kvd.client.attach import Attachment, _attach
from kvd.client.bells import Bells
from kvd.client.replies import (
    Ended, LeaseInfo, PoolInfo, SendOutcomes, SendSpec, TransferStatus, parse_info, parse_lease, parse_outcomes, parse_stats,
    parse_status,
)
from kvd.errors import InvalidArgument
from kvd.memory.doorbells import DoorbellView
from kvd.pool.layout import Layout
from kvd.records import Activity, AllocSpec, CompactionResult, IndexVectors, LeaseKind, NodeStats, SendResult, TransferState
from kvd.rpc.convert import IDS_KEY, IDS_LE, SESSION_KEY, activity_from_pb, lease_kind_to_pb, send_result_from_pb, vectors_from_pb
from kvd.v1 import kvd_pb2 as pb

__all__ = ["Surface"]

log = logging.getLogger("kvd.client")

T = TypeVar("T")


def _send_request(s: SendSpec) -> pb.SendRequest:
    return pb.SendRequest(rid=s.rid, ticket=s.ticket, token_start=s.start, token_end=s.end or 0, last=s.last, free=s.free)


def _tokens(n: object, what: str) -> int:
    """A token count the wire can carry; the daemon judges its value (0, negative, too big)."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidArgument(f"{what}: token count must be an int, got {n!r}")
    if not -(2**63) <= n < 2**63:
        raise InvalidArgument(f"{what}: token count {n} does not fit in 64 bits")
    return n


def _chunk_tokens(n: object) -> int:
    """BeginSend's chunk size as the wire carries it (uint32)."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidArgument(f"begin_send: chunk_tokens must be an int, got {n!r}")
    if not 0 <= n < 2**32:
        raise InvalidArgument(f"begin_send: chunk_tokens {n} must be 0 (one Send of the whole request) or the prefill chunk in tokens")
    return n


def _ticket(t: object) -> bytes:
    """A ticket as the wire carries it: the decode daemon's bytes, unchanged."""
    if not isinstance(t, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"allocate: ticket must be the bytes of the decode daemon's RECV lease, got {type(t).__name__}")
    return bytes(t)


def _specs(specs: Sequence[AllocSpec | tuple]) -> list[pb.AllocSpec]:
    out = []
    for s in specs:
        s = s if isinstance(s, AllocSpec) else AllocSpec(*s)
        if not isinstance(s.rid, str):
            raise InvalidArgument(f"allocate: request id must be a string, got {s.rid!r}")
        out.append(pb.AllocSpec(rid=s.rid, tokens=_tokens(s.tokens, "allocate"), receive=bool(s.receive)))
    return out


def _recv_specs(items: Sequence[tuple[str, int]], ttl: float | None) -> list[pb.AllocSpec]:
    """Decode-side specs: each request allocated to receive, with a RECV lease (``ttl``: None, the
    daemon's)."""
    wire = _specs([AllocSpec(r, n, True) for r, n in items])
    for spec in wire:
        spec.lease = True
        if ttl is not None:
            spec.lease_ttl_seconds = ttl
    return wire


def _kind(kind: LeaseKind | str) -> pb.LeaseKind.ValueType:
    try:
        return lease_kind_to_pb(kind if isinstance(kind, LeaseKind) else LeaseKind(str(kind).lower()))
    except ValueError as exc:
        raise InvalidArgument(f"lease kind must be 'send' or 'recv', got {kind!r}") from exc


class Surface:
    """The engine-facing API, once. ``_call`` is the transport's (sync value or awaitable);
    ``_now`` makes a value the transport's kind of result without a call.

    Doorbells: over the engine socket a client maps its daemon's doorbell board on its first RECV
    lease (:mod:`kvd.client.bells`) and remembers each such lease's slot; :meth:`wait_ready` of a
    transfer its doorbell shows READY returns without a call. Anything else asks the daemon."""

    session_id: str  # set by the transport on connect, and again on a reopen
    boot_id: str  # the daemon's boot the session is on
    ttl: float
    name: str
    timeout: float | None
    reopened: int
    _md: tuple[tuple[str, str], ...]
    _bells: Bells
    _fast: Any  # the engine socket: a FastChannel (Client), an AsyncFastChannel (AsyncClient); None: gRPC
    _attached = False  # this client mapped its daemon's arena (attach)
    _stale = ""  # why every call is refused: the daemon forgot the session of a client that attached
    _ok_at = float("inf")  # monotonic: when the last call the daemon answered was sent (inf: none yet)

    def _adopt(self, session_id: str, ttl: float, boot_id: str) -> None:
        """Act for ``session_id`` from now on (its doorbell board mapped at its first RECV lease;
        by the asyncio client in the event loop's thread: one local round trip, once)."""
        self.session_id = session_id
        self.boot_id = boot_id
        self.ttl = ttl
        self._ok_at = time.monotonic()  # just opened (or found alive)
        self._md = ((SESSION_KEY, session_id), (IDS_KEY, IDS_LE))  # packed ids: no per-id work either side
        self._bells = Bells(_board_fetch(self._fast, session_id, self.timeout))

    @property
    def stale(self) -> str:
        """Why every call of this client is refused ('' while it acts for a live session): set once
        the daemon forgot the session of a client that attached its arena. The heartbeat finds out
        within a third of the TTL, a call at once; an engine that sees it ends what it held in that
        session and connects a new client (the vLLM connector does)."""
        return self._stale

    @property
    def overdue(self) -> bool:
        """Whether the session may be gone without this client knowing yet: the last call the
        daemon answered was sent more than half the session's TTL ago. The heartbeat sends one
        every third of it, so this means the process stalled (stopped, swapped, a long pause):
        the daemon may have reaped the session and handed its pages to other requests, and the
        heartbeat that would find out has not run yet. An engine about to write into pages of this
        session calls :meth:`keep_alive` first: the session touched, or SessionGone (and
        :attr:`stale` set, for a client that attached)."""
        return time.monotonic() - self._ok_at > self.ttl / 2

    def _mapped(self, att: Attachment) -> Attachment:
        self._attached = True
        return att

    def _stays(self, gone: str) -> bool:
        """Whether a client whose daemon forgot session ``gone`` must not open another: it attached
        the arena. Its engine's KV tensors are views of that arena, indexed by pages of requests the
        daemon has freed (a reap) or never had (a restart: a new arena the views do not map), while
        its in-flight requests may still use them; a new session's pages would be written and read
        under them (wrong output, no error). Only the engine can end those requests, so every call
        is refused from then on (SessionGone, saying to reconnect and attach)."""
        if not self._attached:
            return False
        self._stale = (
            f"the daemon forgot this client's session {gone} (it restarted, or reaped the session after its TTL) after the "
            "client attached its arena: the requests, pages and views it holds are no longer the daemon's; end every request "
            "that used them, close this client, connect a new one and attach again"
        )
        self._bells.close()
        log.error("kvd client %r: %s", self.name, self._stale)
        return True

    def _reopened(self, gone: str, s: pb.Session | None, exc: BaseException | None = None) -> None:
        """After a reopen's OpenSession: act for the new session ``s`` (None: none could be
        opened, ``exc`` says why; the next call tries again)."""
        if s is None:
            log.warning("kvd client %r: session %s is gone and no new one could be opened yet: %s", self.name, gone, exc)
            return
        self._adopt(s.session_id, s.ttl_seconds, s.boot_id)
        self.reopened += 1
        log.warning("kvd client %r: session %s is gone (the daemon restarted or reaped it: its requests and leases with it); "
                    "opened session %s", self.name, gone, s.session_id)

    def _call(self, method: str, request: Any, parse: Callable[[Any], T]) -> T:  # pragma: no cover - abstract
        raise NotImplementedError

    def _now(self, value: T) -> T:  # pragma: no cover - abstract
        raise NotImplementedError

    def _note(self, lease: LeaseInfo) -> LeaseInfo:
        """Remember ``lease``'s doorbell, when it names one."""
        self._bells.note(lease.rid, lease.bell, lease.lease_id, lease.boot_id)
        return lease

    def doorbell(self, rid: str) -> TransferState | None:
        """The state of ``rid``'s inbound transfer as its doorbell shows it now, read from shared
        memory: no call, never blocks, the same for the sync and the asyncio client. None when
        this client has no doorbell for it (gRPC, a RECV lease taken by another client, the
        daemon's board full, the request freed, the daemon gone). A watcher of many transfers
        polls this and asks :meth:`wait_ready` only for what it needs the daemon for: a failure's
        reason, and, while a transfer waits for its sender, keeping the RECV lease alive (a wait
        does). A daemon that died leaves its board as it was until this client's heartbeat finds
        out: a watcher also calls the daemon now and then (any call raises Unavailable then)."""
        got = self._bells.state(rid)
        return None if got is None else got[0]

    # -- description --
    def info(self) -> PoolInfo:
        return self._call("GetInfo", pb.GetInfoRequest(), parse_info)

    def propose_layout(self, layout: Layout) -> PoolInfo:
        """Offer this engine's layout: a daemon started with ``layout_from_engine`` and no layout
        yet takes it; otherwise LayoutMismatch (naming both) unless it is compatible with the
        daemon's. Returns the daemon's info (its layout)."""
        return self._call("ProposeLayout", pb.ProposeLayoutRequest(layout_json=layout.model_dump_json()), parse_info)

    def stats(self) -> NodeStats:
        return self._call("GetStats", pb.GetStatsRequest(), parse_stats)

    def activity(self, limit: int = 20) -> Activity:
        """Requests, leases and transfers in flight, the ``limit`` oldest of each (kvd top)."""
        return self._call("GetActivity", pb.GetActivityRequest(limit=limit), activity_from_pb)

    def attach(self) -> Attachment:
        """Map the daemon's arena into this process (same host) and build per-layer views.

        A shm arena is mapped by its file path; a CUDA arena's chunk fds come over the daemon's
        handle socket, authorized by this client's session (this process needs CUDA and
        cuda-python: Unavailable otherwise, saying which is missing). A client that attached never
        opens a new session by itself when the daemon forgets its session (a restart, a reap): its
        views and the pages its engine uses are the old session's, so every call is refused
        (SessionGone) until the engine reconnects and attaches again."""
        return self._call("Attach", pb.AttachRequest(), lambda r: self._mapped(_attach(r, self.session_id)))

    def echo(self, payload: bytes = b"") -> bytes:
        return self._call("Echo", pb.EchoRequest(payload=payload), lambda r: r.payload)

    # -- requests --
    def allocate(self, rid: str, tokens: int, *, receive: bool = False, ticket: bytes | None = None, chunk_tokens: int = 0) -> IndexVectors:
        """Room for ``rid`` (``tokens`` tokens): its physical index vectors. ``receive``: its KV
        arrives by transfer (decode side). ``ticket`` (prefill side, the decode daemon's ticket
        for ``rid``): the transfer is also begun, as :meth:`begin_send` ``(rid, ticket,
        chunk_tokens)`` begins it, in this same call, without waiting for the decode daemon's
        check: that runs while the prompt computes, and the first :meth:`send` reports its
        refusal (a stale or foreign ticket) before writing. What the ticket shows on its own
        (another layout, backend or request) is refused here, and nothing is allocated then."""
        (spec,) = _specs([AllocSpec(rid, tokens, receive)])
        if ticket is not None:
            spec.ticket, spec.chunk_tokens = _ticket(ticket), _chunk_tokens(chunk_tokens)
        elif chunk_tokens:
            # Sent on so the daemon refuses it (InvalidArgument): dropped here, it was silently ignored.
            spec.chunk_tokens = _chunk_tokens(chunk_tokens)
        return self._call("Allocate", pb.AllocateRequest(requests=[spec]), lambda r: vectors_from_pb(r.vectors[0]))

    def allocate_recv(self, rid: str, tokens: int, *, ttl: float | None = None) -> tuple[IndexVectors, LeaseInfo]:
        """Decode side, in one call: :meth:`allocate` ``rid`` with ``receive=True`` and
        :meth:`acquire_lease` a RECV lease on those vectors (``lease.ticket``: for the prefill
        side), of ``ttl`` seconds (None: the daemon's lease TTL; as ``acquire_lease``'s, so
        InvalidArgument outside ``(0, the daemon's maximum]``). All or nothing: a refusal of
        either leaves nothing allocated or leased."""
        return self._call(
            "Allocate", pb.AllocateRequest(requests=_recv_specs([(rid, tokens)], ttl)),
            lambda r: (vectors_from_pb(r.vectors[0]), self._note(parse_lease(r.leases[0]))),
        )

    def allocate_recv_many(self, items: Sequence[tuple[str, int]], *, ttl: float | None = None) -> list[tuple[IndexVectors, LeaseInfo]]:
        """:meth:`allocate_recv` of each ``(rid, tokens)``, in one call, in order: all or nothing
        (a refusal of any leaves none of them allocated or leased; CapacityError carries
        ``shortfall_bytes``). A decode side admitting several requests at once."""
        return self._call(
            "Allocate", pb.AllocateRequest(requests=_recv_specs(items, ttl)),
            lambda r: [(vectors_from_pb(v), self._note(parse_lease(le))) for v, le in zip(r.vectors, r.leases)],
        )

    def allocate_many(
        self, specs: Sequence[AllocSpec | tuple], *, tickets: Sequence[bytes | None] | None = None, chunk_tokens: int = 0
    ) -> list[IndexVectors]:
        """All or nothing; CapacityError carries ``shortfall_bytes``. ``tickets`` (prefill side),
        one per spec in order (None: that request has none): each ticketed request's transfer is
        also begun, as :meth:`allocate` ``(rid, tokens, ticket=, chunk_tokens=)`` begins it -- a
        prefill step's new requests in one call. A ticket refused for what it shows refuses the
        whole call: nothing is allocated and no receiver hears of any of them."""
        wire = _specs(specs)
        if tickets is not None:
            if isinstance(tickets, (bytes, bytearray, memoryview)) or len(tickets) != len(wire):
                raise InvalidArgument(
                    f"allocate_many: tickets must be a sequence of one ticket (or None) per spec, {len(wire)} in all"
                )
            n = _chunk_tokens(chunk_tokens)
            for spec, t in zip(wire, tickets):
                if t is not None:
                    spec.ticket, spec.chunk_tokens = _ticket(t), n
        elif chunk_tokens:
            raise InvalidArgument("allocate_many: chunk_tokens is the prefill chunk of the transfers tickets begin: pass tickets too")
        return self._call("Allocate", pb.AllocateRequest(requests=wire), lambda r: [vectors_from_pb(v) for v in r.vectors])

    def shortfall(self, specs: Sequence[AllocSpec | tuple]) -> int:
        """Bytes missing to allocate ``specs`` now (0: it fits). Changes nothing."""
        return self._call("CanAllocate", pb.CanAllocateRequest(requests=_specs(specs)), lambda r: r.shortfall_bytes)

    def extend(self, rid: str, tokens: int) -> IndexVectors:
        req = pb.ExtendRequest(items=[pb.ExtendItem(rid=rid, tokens=_tokens(tokens, "extend"))])
        return self._call("Extend", req, lambda r: vectors_from_pb(r.vectors[0]))

    def extend_many(self, items: Sequence[tuple[str, int]]) -> list[IndexVectors]:
        req = pb.ExtendRequest(items=[pb.ExtendItem(rid=rid, tokens=_tokens(n, "extend")) for rid, n in items])
        return self._call("Extend", req, lambda r: [vectors_from_pb(v) for v in r.vectors])

    def free(self, *rids: str) -> int:
        self._bells.forget(rids)
        return self._call("Free", pb.FreeRequest(rids=list(rids)), lambda r: r.freed)

    def vectors(self, rid: str) -> IndexVectors:
        return self._call("GetVectors", pb.GetVectorsRequest(rids=[rid]), lambda r: vectors_from_pb(r.vectors[0]))

    def vectors_many(self, rids: Sequence[str]) -> list[IndexVectors]:
        return self._call("GetVectors", pb.GetVectorsRequest(rids=list(rids)), lambda r: [vectors_from_pb(v) for v in r.vectors])

    # -- leases --
    def acquire_lease(
        self, rid: str, kind: LeaseKind | str, *, ttl: float | None = None, vectors: IndexVectors | None = None
    ) -> LeaseInfo:
        """Pin ``rid`` for a transfer. Passing the ``vectors`` you act on makes the daemon refuse
        (StaleEpoch) if the pages moved since they were fetched."""
        req = pb.AcquireLeaseRequest(
            rid=rid, kind=_kind(kind), ttl_seconds=ttl or 0,
            boot_id=vectors.boot_id if vectors else "", epoch=vectors.epoch if vectors else 0,
        )
        return self._call("AcquireLease", req, lambda r: self._note(parse_lease(r)))

    def renew_lease(self, lease_id: int, ttl: float | None = None) -> LeaseInfo:
        return self._call("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id, ttl_seconds=ttl or 0), parse_lease)

    def release_lease(self, lease_id: int) -> None:
        return self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id), lambda r: None)

    # -- maintenance --
    def compact(self, *, around_pinned: bool = False) -> CompactionResult:
        return self._call(
            "Compact", pb.CompactRequest(around_pinned=around_pinned),
            lambda r: CompactionResult(r.pages_moved, r.bytes_moved, r.gap_gained_bytes, r.epoch),
        )

    def finalize(self, nbytes: int | None) -> PoolInfo:
        """Post-capture sizing: back ``nbytes`` in place (None: refused with INVALID_ARGUMENT)."""
        req = pb.FinalizeRequest(has_bytes=nbytes is not None, bytes=max(0, nbytes or 0))
        return self._call("Finalize", req, lambda r: parse_info(r.info))

    def resize(self, nbytes: int | None) -> PoolInfo:
        req = pb.FinalizeRequest(has_bytes=nbytes is not None, bytes=max(0, nbytes or 0), resize=True)
        return self._call("Finalize", req, lambda r: parse_info(r.info))

    def offload(self, rid: str) -> int:
        return self._call("Offload", pb.OffloadRequest(rid=rid), lambda r: r.bytes)

    def restore(self, rid: str) -> IndexVectors:
        return self._call("Restore", pb.RestoreRequest(rid=rid), lambda r: vectors_from_pb(r.vectors))

    # -- handoff --
    def begin_send(self, rid: str, ticket: bytes, *, chunk_tokens: int = 0) -> bool:
        """Prefill side: open ``rid``'s transfer to the decode daemon that issued ``ticket`` now,
        when the ticket arrives and the prompt has not been computed yet. The decode daemon
        checks the ticket here instead of in the first :meth:`send`, which then starts writing
        at once, and this daemon plans the Sends that will follow: one of the whole request, or
        with ``chunk_tokens`` one per chunk of that many tokens (the prefill chunk; at most 1,024
        chunks). Returns False when it was open already. Raises what the first ``send`` would
        raise before any write (a stale or foreign ticket, a lease gone), and NotFound /
        PermissionDenied for a request this session does not hold; nothing changes then."""
        req = pb.BeginSendRequest(rid=rid, ticket=ticket, chunk_tokens=_chunk_tokens(chunk_tokens))
        return self._call("BeginSend", req, lambda r: r.opened)

    def send(
        self, rid: str, ticket: bytes, *, start: int = 0, end: int | None = None, last: bool = True, free: bool = False
    ) -> SendResult:
        """Prefill side: move tokens ``[start, end)`` of ``rid`` (whose KV is written) to the
        decode daemon that issued ``ticket``. Call once per chunk; ``last`` moves the state and
        makes the request ready there. Raises before any write when the ticket is stale, for
        another layout, or its lease is gone. ``free`` (with ``last``): the daemon also frees
        ``rid`` once the Send succeeded, saving the :meth:`free` call; the result's ``phases``
        then has ``"free"`` (absent: it could not be freed, e.g. another lease pins it, and stays
        allocated: free it later)."""
        req = _send_request(SendSpec(rid, ticket, start, end, last))
        req.free = free
        return self._call("Send", req, send_result_from_pb)

    def send_many(self, items: Sequence[SendSpec | tuple]) -> SendOutcomes:
        """Prefill side: many independent :meth:`send` calls in one, e.g. every request one
        forward pass finished. ``items``: :class:`SendSpec` or tuples ``(rid, ticket[, start[,
        end[, last[, free]]]])``, at most 1024, each request once. The daemon pipelines them (one
        request's copies run while it commits the one before and prepares the one after).

        Returns, per item in order, its :class:`SendResult` or the kvd error its own ``send``
        would have raised: one failing item leaves the others alone. Raises only for the whole
        call (nothing sent): InvalidArgument for no item, too many, or one request twice."""
        specs = [s if isinstance(s, SendSpec) else SendSpec(*s) for s in items]
        return self._call("SendMany", pb.SendManyRequest(items=[_send_request(s) for s in specs]), parse_outcomes)

    def wait_ready(self, rid: str, timeout: float = 30.0) -> TransferStatus:
        """Decode side: block until ``rid``'s KV is READY or the transfer FAILED, or ``timeout``
        passes (then the state is still WAITING/RECEIVING). A transfer READY on its doorbell
        returns at once, without a call (its ``reason`` is empty, as the daemon's would be)."""
        got = self._bells.state(rid)
        if got is not None and got[0] is TransferState.READY:  # final; anything else: the daemon's to say
            return self._now(TransferStatus(rid, TransferState.READY, "", got[1]))
        return self._call("WaitReady", pb.WaitRequest(rid=rid, timeout_seconds=timeout), parse_status)

    def wait_ended(self, after: int = 0, timeout: float = 30.0) -> Ended:
        """Decode side: this session's inbound transfers that ended (READY or FAILED) since cursor
        ``after`` -- as soon as one has, or none once ``timeout`` passes -- and the cursor to pass
        next. ``after=0``: every one the daemon holds that is over. One call watches all of the
        session's transfers, those whose RECV lease comes later included, where :meth:`wait_ready`
        waits for one (over gRPC: a server thread each, at most 8 at once). Keeps no RECV lease
        alive. A cursor is valid for the daemon boot that returned it (InvalidArgument past it)."""
        req = pb.WaitEndedRequest(after=after, timeout_seconds=timeout)
        return self._call("WaitEnded", req, lambda r: Ended([parse_status(t) for t in r.ended], r.cursor))

    def abort(self, rid: str, reason: str = "") -> bool:
        """Abort ``rid``'s transfer on this side; the other daemon learns at once. Returns whether
        the peer was notified."""
        return self._call("Abort", pb.AbortRequest(rid=rid, reason=reason), lambda r: r.notified_peer)


def _board_fetch(fast: _fast.FastChannel | _fast.AsyncFastChannel | None, session_id: str,
                 timeout: float | None) -> Callable[[], tuple[DoorbellView, str]] | None:
    """How a client maps its daemon's doorbell board: over the engine socket only."""
    if fast is None:
        return None
    path = fast.path
    return lambda: _fast.fetch_doorbells(path, session_id, timeout)
