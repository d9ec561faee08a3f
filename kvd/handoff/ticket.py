"""The ticket, in one module: minted, sealed, read and checked here and nowhere else.

A ticket is the capability a decode daemon hands out with a RECV lease: whoever holds it may write
the leased request's pages. It passes through hands kvd does not trust (a router, the prefill
engine, anyone on the path), so its bytes are a ``SealedTicket`` (proto): ``body``, a serialised
``Ticket``, and ``seal``, HMAC-SHA256 of the body under a key the minting daemon draws at start
(:mod:`secrets`) and never gives out. Only the minter can seal, so only the minter can check::

    decode daemon                        anyone on the path          prefill daemon
    Tickets.mint(lease, vectors) ──▶ sealed bytes (opaque) ──▶ read(bytes): the body, unverified
          ▲                                                         │ (its own checks: layout,
          └───────────── CheckTicket(bytes), before the first byte ◀┘  backend, rid: check_for_sender)
    Tickets.check(bytes): the boot named, the seal, then field by field against this daemon

:meth:`Tickets.check` refuses, in this order and changing nothing:

* bytes that do not parse as a ``SealedTicket`` and its ``Ticket`` body: InvalidArgument;
* a ticket naming another boot (this daemon restarted, or another daemon minted it): StaleEpoch;
* a seal that does not verify (any field, any bit changed after minting, or a truncation):
  PermissionDenied;
* a body that is not a whole ticket of :data:`TICKET_VERSION`: InvalidArgument;
* then every field against this daemon: where the bytes go (backend, transfer endpoint) and
  (:func:`check_fields`) the layout; the lease live, RECV, for the ticket's request, at the ticket's epoch (NotFound for a
  lease gone: a replay after the request was freed); the request's pages unmoved since
  (StaleEpoch); the envelopes this arena's; and the destination vectors exactly the request's
  current pages in every group -- full, the SWA tail, the state slot, draft (FailedPrecondition).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from google.protobuf.message import DecodeError

from kvd.errors import FailedPrecondition, InvalidArgument, LayoutMismatch, NotFound, PermissionDenied, StaleEpoch
from kvd.records import Envelope, IndexVectors, LeaseKind, TicketInfo
from kvd.daemon.leases import Lease
from kvd.limits import quote
from kvd.daemon.node import Node
from kvd.pool.layout import Layout
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import envelope_from_pb, envelope_to_pb, vectors_from_pb, vectors_to_pb

__all__ = ["TICKET_VERSION", "REMEMBER", "REMEMBER_BYTES", "Issuer", "Tickets", "read", "check_for_sender", "check_fields"]

#: The body's version: 2 is the sealed ticket (1 travelled bare).
TICKET_VERSION = 2
_MAC = hashlib.sha256
_SEAL_BYTES = _MAC().digest_size
_M = TypeVar("_M", pb.SealedTicket, pb.Ticket)


class Issuer(NamedTuple):
    """Where the minting daemon is reached, as its tickets state it."""

    peer_address: str = ""  # its Peer service
    transfer_endpoint: str = ""  # its backend's data-plane address
    backend: str = "none"
    peer_socket: str = ""  # its same-host peer socket ("" when it serves none)


def _sealed(blob: bytes) -> pb.SealedTicket:
    if not blob:
        raise InvalidArgument("ticket is empty; pass the bytes the decode daemon's RECV lease returned")
    return _parse(pb.SealedTicket, bytes(blob))


def _body(body: bytes) -> pb.Ticket:
    return _parse(pb.Ticket, body)


def _parse(cls: type[_M], data: bytes) -> _M:
    m = cls()
    try:
        m.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidArgument(f"ticket bytes do not parse as a kvd ticket ({exc}); pass the lease's ticket unchanged") from exc
    return m


def _seal_of(sealed: pb.SealedTicket) -> tuple[bytes, bytes]:
    """The body bytes and the seal; InvalidArgument when either is missing. Verifies nothing."""
    if not sealed.body or len(sealed.seal) != _SEAL_BYTES:
        raise InvalidArgument(
            f"ticket is not sealed (body of {len(sealed.body)} bytes, seal of {len(sealed.seal)} bytes, not {_SEAL_BYTES}); "
            "pass the bytes the decode daemon's RECV lease returned, unchanged"
        )
    return sealed.body, sealed.seal


def _complete(version: int, t: pb.Ticket | TicketInfo, has_vectors: bool) -> None:
    """InvalidArgument unless ``t`` (a body, or what one reads as) is a whole ticket of
    :data:`TICKET_VERSION`."""
    if version != TICKET_VERSION:
        raise InvalidArgument(f"ticket version {version} is not supported (this daemon speaks {TICKET_VERSION})")
    if not (t.peer_address and t.boot_id and t.rid and t.layout_fingerprint and t.lease_id and has_vectors):
        missing = [f for f in ("peer_address", "boot_id", "rid", "layout_fingerprint") if not getattr(t, f)]
        raise InvalidArgument(f"ticket is incomplete (missing {missing or ['lease_id/vectors']}); pass it unchanged")


def _info(t: pb.Ticket) -> TicketInfo:
    return TicketInfo(
        peer_address=t.peer_address,
        boot_id=t.boot_id,
        epoch=t.epoch,
        lease_id=t.lease_id,
        rid=t.rid,
        layout_fingerprint=t.layout_fingerprint,
        envelopes=[envelope_from_pb(e) for e in t.envelopes],
        vectors=vectors_from_pb(t.vectors),
        transfer_endpoint=t.transfer_endpoint,
        backend=t.backend,
        peer_socket=t.peer_socket,
    )


def read(blob: bytes) -> TicketInfo:
    """What a sender reads from a ticket (its body), without verifying the seal: only the minter
    can. InvalidArgument for bytes that are no ticket. The minter checks the same bytes
    (:meth:`Tickets.check`) before the sender writes a byte."""
    sealed = _sealed(blob)
    t = _body(sealed.body)
    _seal_of(sealed)
    _complete(t.version, t, t.HasField("vectors"))
    return _info(t)


class _Minted(NamedTuple):
    """A ticket :meth:`Tickets.mint` made: its seal, and what its body reads as (``vectors``: the
    very vectors it was minted from, their mapping version known)."""

    seal: bytes
    info: TicketInfo


class _Here(NamedTuple):
    """What every ticket of one daemon states that changes only with its layout and backing:
    the fingerprint and envelopes, and the body's fields around a ticket's own serialised --
    ``head`` (fields 1-3), ``middle`` (7-8), ``tail`` (10-12). Protobuf serialises a message
    field by field in field-number order, so these and a ticket's own fields (4-6, 9) joined in
    that order are the bytes of the whole body serialised at once."""

    issuer: Issuer
    fingerprint: str
    envelopes: list[Envelope]
    head: bytes
    middle: bytes
    tail: bytes


#: The most minted tickets :class:`Tickets` remembers, and their bodies' bytes in all; the oldest
#: go first. One it no longer remembers is checked all the same, from its bytes.
REMEMBER = 1024
REMEMBER_BYTES = 4 << 20


class Tickets:
    """One daemon's tickets: minted and sealed with a key of this instance (one per boot, never
    leaving the process; ``key`` for tests only), and checked when a sender presents them.
    Thread-safe.

    It remembers what it minted (the newest :data:`REMEMBER`): a presented body that is one of
    them reads as what was minted, so :meth:`check` skips parsing it into records and, while the
    request's pages are unchanged (:meth:`kvd.pool.pool.Pool.unchanged`), gathering and comparing
    them. Every refusal stands as for any other ticket: the seal is compared, every field checked."""

    def __init__(self, node: Node, issuer: Issuer, *, key: bytes | None = None) -> None:
        self.node = node
        self.issuer = issuer
        # Keyed once; each MAC starts from a copy (hmac.new per ticket re-derives the pads).
        self._hmac = hmac.new(key if key is not None else secrets.token_bytes(32), digestmod=_MAC)
        self._here: _Here | None = None
        self._lock = threading.Lock()
        self._minted: dict[bytes, _Minted] = {}  # by body bytes, oldest first
        self._minted_bytes = 0

    def _mac(self, body: bytes) -> bytes:
        h = self._hmac.copy()
        h.update(body)
        return h.digest()

    def _shape(self) -> _Here:
        """What this daemon's tickets state of it now: built again when its envelopes (its pool,
        boot or backing: a new list from :meth:`~kvd.pool.pool.Pool.envelopes`) or the issuer changed."""
        env, who = self.node.pool.envelopes(), self.issuer
        here = self._here
        if here is None or here.envelopes is not env or here.issuer != who:
            pool = self.node.pool
            fp = pool.layout.fingerprint
            here = self._here = _Here(
                who, fp, env,
                pb.Ticket(version=TICKET_VERSION, peer_address=who.peer_address, boot_id=pool.boot_id).SerializeToString(),
                pb.Ticket(layout_fingerprint=fp, envelopes=[envelope_to_pb(e) for e in env]).SerializeToString(),
                pb.Ticket(transfer_endpoint=who.transfer_endpoint, backend=who.backend, peer_socket=who.peer_socket).SerializeToString(),
            )
        return here

    def seal(self, body: pb.Ticket) -> bytes:
        """``body`` sealed with this daemon's key: the ticket bytes (what :meth:`mint` returns)."""
        raw = body.SerializeToString()
        return pb.SealedTicket(body=raw, seal=self._mac(raw)).SerializeToString()

    def mint(self, lease: Lease, vec: IndexVectors, vec_pb: pb.IndexVectors | None = None) -> bytes:
        """The sealed ticket of RECV lease ``lease``, naming ``vec`` (the request's vectors the
        lease pins) as the destination (packed ids); ``vec_pb``: ``vectors_to_pb(vec, packed=True)``, when the caller has
        it already. Call under the node's lock, with the lease just granted."""
        here, who = self._shape(), self.issuer
        raw = b"".join((
            here.head,
            pb.Ticket(epoch=vec.epoch, lease_id=lease.lease_id, rid=lease.rid).SerializeToString(),
            here.middle,
            pb.Ticket(vectors=vectors_to_pb(vec, packed=True) if vec_pb is None else vec_pb).SerializeToString(),
            here.tail,
        ))
        seal = self._mac(raw)
        info = TicketInfo(
            who.peer_address, self.node.pool.boot_id, vec.epoch, lease.lease_id, lease.rid, here.fingerprint, here.envelopes,
            vec, who.transfer_endpoint, who.backend, who.peer_socket,
        )
        with self._lock:
            if self._minted.pop(raw, None) is not None:
                self._minted_bytes -= len(raw)
            self._minted[raw] = _Minted(seal, info)
            self._minted_bytes += len(raw)
            while len(self._minted) > REMEMBER or self._minted_bytes > REMEMBER_BYTES:
                old = next(iter(self._minted))
                del self._minted[old]
                self._minted_bytes -= len(old)
        return pb.SealedTicket(body=raw, seal=seal).SerializeToString()

    def check(self, blob: bytes) -> tuple[TicketInfo, Lease]:
        """The ticket a sender presents, checked before the first byte (the order and the
        refusals are in the module docstring); returns it and the RECV lease it names."""
        sealed = _sealed(blob)
        # A body minted here parses and reads as what was minted.
        minted = self._minted.get(sealed.body)
        t = minted.info if minted is not None else _body(sealed.body)
        body, seal = _seal_of(sealed)
        boot = self.node.pool.boot_id
        if t.boot_id and t.boot_id != boot:  # before the seal: another boot's key sealed it, and the sender should learn why
            self.node.count_stale()
            raise StaleEpoch(
                f"ticket from boot {quote(t.boot_id)}, but this daemon is boot {boot!r} (it restarted, or another daemon "
                "issued the ticket); the decode side must allocate again and issue a new ticket"
            )
        # ... and verifies against the seal it got then: the MAC is a function of the body.
        if not hmac.compare_digest(self._mac(body) if minted is None else minted.seal, seal):
            raise PermissionDenied(
                f"ticket for {quote(t.rid)} does not carry this daemon's seal: its bytes were changed after it was issued "
                "(or it was truncated, or sealed by another daemon); pass the bytes of the RECV lease unchanged"
            )
        if isinstance(t, TicketInfo):
            _complete(TICKET_VERSION, t, True)
            info = t
        else:
            _complete(t.version, t, t.HasField("vectors"))
            info = _info(t)
        with self.node.lock:
            # Where the bytes go must be here. The routes of the calls (peer_address, peer_socket)
            # reached this daemon already, and the seal vouches for them.
            if (info.transfer_endpoint, info.backend) != (self.issuer.transfer_endpoint, self.issuer.backend):
                raise InvalidArgument(
                    f"ticket sends the bytes to {info.backend!r} endpoint {info.transfer_endpoint!r}, but this daemon's "
                    f"is {self.issuer.backend!r} endpoint {self.issuer.transfer_endpoint!r}"
                )
            return info, check_fields(self.node, info)


def check_for_sender(info: TicketInfo, rid: str, layout: Layout, backend: str) -> None:
    """What the sending daemon alone can refuse in a ticket it read (:func:`read`) to send ``rid``
    from a pool of ``layout`` over ``backend``: another layout, backend or request. The seal and
    the rest are the minter's to check (:meth:`Tickets.check`)."""
    if info.layout_fingerprint != layout.fingerprint:
        raise LayoutMismatch(
            f"ticket layout fingerprint {info.layout_fingerprint} differs from this daemon's "
            f"{layout.fingerprint}: prefill and decode must run the same layout (page size, dtype, groups)"
        )
    if info.backend != backend:
        raise InvalidArgument(f"ticket asks for backend {info.backend!r} but this daemon runs {backend!r}; configure both the same")
    if info.rid != rid:
        raise InvalidArgument(f"ticket is for request {quote(info.rid)}, not {quote(rid)}")


def check_fields(node: Node, info: TicketInfo) -> Lease:
    """Check a ticket's fields against ``node``, the daemon that issued it (boot, layout, lease,
    epoch, envelopes, destination vectors; see the module docstring) and return its RECV lease.
    The seal is :meth:`Tickets.check`'s; this is the check the seal does not replace."""
    with node.lock:
        pool = node.pool
        if info.boot_id != pool.boot_id:
            node.count_stale()
            raise StaleEpoch(
                f"ticket from boot {info.boot_id!r}, but this daemon is boot {pool.boot_id!r} (it restarted); "
                "the decode side must allocate again and issue a new ticket"
            )
        if info.layout_fingerprint != pool.layout.fingerprint:
            raise LayoutMismatch(
                f"ticket layout fingerprint {info.layout_fingerprint!r} does not match this daemon's {pool.layout.fingerprint!r}"
            )
        try:
            lease = node.leases.get(info.lease_id)
        except NotFound:
            raise NotFound(
                f"ticket for {quote(info.rid)}: lease {info.lease_id} is not live here (the transfer ended, or the "
                "request was freed or its lease released or expired); the decode side must issue a new ticket"
            ) from None
        if lease.kind is not LeaseKind.RECV or lease.rid != info.rid:
            raise InvalidArgument(
                f"ticket names lease {info.lease_id} for {quote(info.rid)}, but that lease is a {lease.kind.value} lease on {quote(lease.rid)}"
            )
        if info.epoch != lease.epoch:
            node.count_stale()
            raise StaleEpoch(
                f"ticket for {quote(info.rid)}: epoch {info.epoch} is stale (its lease was granted at epoch {lease.epoch}); "
                "the decode side must issue a new ticket"
            )
        try:
            pool.require_fresh(info.rid, info.epoch, info.boot_id)
        except StaleEpoch:
            node.count_stale()
            raise
        here = pool.envelopes()
        if info.envelopes != here:
            raise FailedPrecondition(
                f"ticket for {quote(info.rid)} names envelopes {info.envelopes} but this arena's are {here}; "
                "the decode side must issue a new ticket"
            )
        # Vectors of this pool whose request is unchanged since are its pages (a ticket minted
        # here reads as the very vectors it was minted from): no gather, no comparison.
        got = info.vectors
        wrong = _vectors_differ(got, got if pool.unchanged(got) else pool.vectors(info.rid), info)
        if wrong:
            raise FailedPrecondition(
                f"ticket's destination vectors are not request {quote(info.rid)}'s pages: {wrong}; the decode side must "
                "acquire a new RECV lease (a new ticket) for the request's current pages"
            )
        return lease


def _vectors_differ(got: IndexVectors, want: IndexVectors, info: TicketInfo) -> str:
    """What differs between a ticket's destination vectors and the request's own ('' if nothing)."""
    for name, a, b in (("rid", got.rid, info.rid), ("boot_id", got.boot_id, info.boot_id), ("epoch", got.epoch, info.epoch)):
        if a != b:
            return f"the vectors' {name} is {a!r}, the ticket's {b!r}"
    if got is want:
        return ""
    for name in ("tokens", "swa_first_page", "state"):
        if getattr(got, name) != getattr(want, name):
            return f"{name} {getattr(got, name)!r}, the request's is {getattr(want, name)!r}"
    for name in ("full", "swa", "draft"):
        at = _first_difference(getattr(got, name), getattr(want, name))
        if at:
            return f"group {name}: {at}"
    return ""


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    a, b = got.numpy(), want.numpy()
    if a.shape != b.shape:
        return f"{a.size} pages named, the request holds {b.size}"
    diff = np.flatnonzero(a != b)
    if diff.size:
        i = int(diff[0])
        return f"{diff.size} page(s) differ, first at index {i} (ticket names physical page {int(a[i])}, the request holds {int(b[i])})"
    return ""
