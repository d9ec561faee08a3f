"""Conversions between core records and the v1 wire messages, shared by server and client.

Index vectors travel as packed int32; the client turns them back into torch tensors. Tickets are
minted, sealed, read and checked in :mod:`kvd.handoff.ticket`. Every request a daemon
serves is parsed by :func:`parse_request`, whichever transport brought it: bytes that do not
parse, or a string over its bound (:mod:`kvd.limits`), are INVALID_ARGUMENT naming the method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from kvd import errors as E
from kvd.errors import InvalidArgument, KvdError
from kvd.records import (
    SEND_PHASES,
    Activity,
    Envelope,
    GroupStats,
    IndexVectors,
    LeaseActivity,
    LeaseKind,
    NodeStats,
    PoolStats,
    RequestActivity,
    SendResult,
    TransferActivity,
    TransferRef,
    TransferState,
)
from kvd.limits import MAX_ID_BYTES, MAX_LAYOUT_BYTES, MAX_REASON_BYTES, QUOTE_CHARS, quote, too_long
from kvd.v1 import kvd_pb2 as pb

__all__ = [
    "vectors_to_pb",
    "vectors_from_pb",
    "vectors_fill",
    "vectors_into",
    "IDS_KEY",
    "IDS_LE",
    "envelope_to_pb",
    "envelope_from_pb",
    "lease_kind_from_pb",
    "lease_kind_to_pb",
    "SESSION_KEY",
    "TOKEN_KEY",
    "stats_to_pb",
    "activity_to_pb",
    "activity_from_pb",
    "ref_to_pb",
    "ref_from_pb",
    "state_to_pb",
    "state_from_pb",
    "send_result_to_pb",
    "send_result_from_pb",
    "status_to_pb",
    "status_from_pb",
    "parse_request",
    "check_strings",
    "STRING_LIMITS",
    "grpc_target",
]

M = TypeVar("M", bound=Message)
#: metadata key carrying the client session id on every Kvd call but OpenSession
SESSION_KEY = "kvd-session"
#: metadata key carrying the shared peer token on Peer calls (when configured)
TOKEN_KEY = "kvd-token"


#: Metadata key by which a gRPC call asks for packed ids (:data:`IDS_LE`): IndexVectors replies
#: then carry ``*_le`` bytes instead of repeated int32 (the engine socket always does).
IDS_KEY = "kvd-ids"
IDS_LE = "le"
_LE = np.dtype("<i4")


def _le(ids: torch.Tensor) -> bytes:
    a = ids.numpy()
    return (a if a.dtype == _LE else a.astype(_LE)).tobytes()


def vectors_to_pb(v: IndexVectors, packed: bool = False) -> pb.IndexVectors:
    """``v`` as a message; ``packed``: its ids as little-endian bytes (``full_le``, ``swa_le``,
    ``draft_le``), written without a per-id step, for readers that asked (see :data:`IDS_KEY`)."""
    m = pb.IndexVectors()
    vectors_fill(m, v, packed)
    return m


def vectors_fill(m: pb.IndexVectors, v: IndexVectors, packed: bool) -> None:
    """Write ``v`` into ``m`` (an empty message, typically a reply's ``vectors.add()``), as
    :func:`vectors_to_pb` would build it: a reply built in place, not built and then copied."""
    m.rid, m.boot_id, m.epoch, m.tokens, m.swa_first_page = v.rid, v.boot_id, v.epoch, v.tokens, v.swa_first_page
    m.state = -1 if v.state is None else v.state
    if packed:
        m.full_le, m.swa_le, m.draft_le = _le(v.full), _le(v.swa), _le(v.draft)
    else:
        m.full.extend(v.full.tolist())
        m.swa.extend(v.swa.tolist())
        m.draft.extend(v.draft.tolist())


def vectors_into(out: Any, vecs: Sequence[IndexVectors], packed: bool) -> None:
    """Append each of ``vecs`` to a reply's repeated ``vectors`` field ``out``, in place."""
    for v in vecs:
        vectors_fill(out.add(), v, packed)


def _ids(name: str, xs: Sequence[int], le: bytes) -> torch.Tensor:
    """One vector of a message: its repeated field or its little-endian bytes (never both).
    Both copy, so the tensor owns fresh, writable int32 memory."""
    if le:
        if xs or len(le) % 4:
            raise InvalidArgument(
                f"IndexVectors.{name}: " + (f"both {name} and {name}_le are set; send one" if xs else
                                            f"{name}_le holds {len(le):,d} bytes, not a whole number of int32 ids")
            )
        return torch.from_numpy(np.frombuffer(le, _LE).astype(np.int32))
    # numpy reads the repeated field ~8x faster than torch.tensor(list(xs)); a short one faster
    # still item by item (np.array: ~2.4 us whatever the length, fromiter ~1.3 up to 32).
    n = len(xs)
    return torch.from_numpy(np.fromiter(xs, np.int32, n) if n <= 32 else np.array(xs, dtype=np.int32))


def vectors_from_pb(m: pb.IndexVectors) -> IndexVectors:
    """The record of a message in either form (:func:`vectors_to_pb`); InvalidArgument when a
    vector is in both forms or its bytes are no whole number of ids."""
    return IndexVectors(
        m.rid, m.boot_id, m.epoch, m.tokens, _ids("full", m.full, m.full_le), m.swa_first_page, _ids("swa", m.swa, m.swa_le),
        None if m.state < 0 else m.state, _ids("draft", m.draft, m.draft_le),
    )


def envelope_to_pb(e: Envelope) -> pb.Envelope:
    return pb.Envelope(
        group=e.group,
        region_id=e.region_id,
        base=e.base,
        backed_bytes=e.backed_bytes,
        page_bytes=e.page_bytes,
        first_page=e.first_page,
        last_page=e.last_page,
    )


def envelope_from_pb(m: pb.Envelope) -> Envelope:
    return Envelope(m.group, m.region_id, m.base, m.backed_bytes, m.page_bytes, m.first_page, m.last_page)


def grpc_target(address: str) -> str:
    """A gRPC target for a daemon address: ``/path.sock`` is shorthand for ``unix:/path.sock``."""
    return f"unix:{address}" if address.startswith("/") else address


def lease_kind_from_pb(k: int) -> LeaseKind:
    if k == pb.SEND:
        return LeaseKind.SEND
    if k == pb.RECV:
        return LeaseKind.RECV
    raise InvalidArgument(f"lease kind must be SEND or RECV, got {k}")


def lease_kind_to_pb(k: LeaseKind) -> pb.LeaseKind.ValueType:
    return pb.SEND if k is LeaseKind.SEND else pb.RECV


def activity_to_pb(a: Activity) -> pb.Activity:
    return pb.Activity(
        requests_total=a.requests_total, leases_total=a.leases_total, transfers_total=a.transfers_total,
        allocations_total=a.allocations_total, bytes_sent_total=a.bytes_sent_total,
        bytes_received_total=a.bytes_received_total, compactions_done=a.compactions_done, pinned_pages=a.pinned_pages,
        requests=[pb.RequestActivity(rid=r.rid, session=r.session, tokens=r.tokens, full_pages=r.full_pages,
                                     swa_pages=r.swa_pages, age_s=r.age_s, leased=r.leased) for r in a.requests],
        leases=[pb.LeaseActivity(lease_id=x.lease_id, rid=x.rid, kind=x.kind, age_s=x.age_s, expires_in_s=x.expires_in_s)
                for x in a.leases],
        transfers=[pb.TransferActivity(rid=t.rid, direction=t.direction, state=t.state, peer=t.peer, bytes=t.nbytes,
                                       age_s=t.age_s) for t in a.transfers],
    )


def activity_from_pb(m: pb.Activity) -> Activity:
    return Activity(
        m.requests_total, m.leases_total, m.transfers_total, m.allocations_total, m.bytes_sent_total,
        m.bytes_received_total, m.compactions_done, dict(m.pinned_pages),
        [RequestActivity(r.rid, r.session, r.tokens, r.full_pages, r.swa_pages, r.age_s, r.leased) for r in m.requests],
        [LeaseActivity(x.lease_id, x.rid, x.kind, x.age_s, x.expires_in_s) for x in m.leases],
        [TransferActivity(t.rid, t.direction, t.state, t.peer, t.bytes, t.age_s) for t in m.transfers],
    )


def stats_to_pb(s: NodeStats) -> pb.Stats:
    p: PoolStats = s.pool
    return pb.Stats(
        boot_id=p.boot_id,
        epoch=p.epoch,
        reserved_bytes=p.reserved_bytes,
        backed_bytes=p.backed_bytes,
        sink_bytes=p.sink_bytes,
        gap_bytes=p.gap_bytes,
        finalized=p.finalized,
        requests_live=p.requests_live,
        requests_offloaded=p.requests_offloaded,
        compactions_done=p.compactions_done,
        compactions_refused=p.compactions_refused,
        pages_moved=p.pages_moved,
        bytes_moved=p.bytes_moved,
        groups=[pb.GroupStats(**{f: getattr(g, f) for f in GroupStats.__slots__}) for g in p.groups],
        leases_live=s.leases_live,
        leases_expired_total=s.leases_expired_total,
        stale_refusals_total=s.stale_refusals_total,
        sessions_live=s.sessions_live,
        sessions_expired_total=s.sessions_expired_total,
        layout_name=s.layout_name,
    )


def ref_to_pb(r: TransferRef) -> pb.TransferRef:
    return pb.TransferRef(boot_id=r.boot_id, lease_id=r.lease_id, rid=r.rid)


def ref_from_pb(m: pb.TransferRef) -> TransferRef:
    if not m.boot_id or not m.lease_id or not m.rid:
        raise InvalidArgument("transfer reference needs boot_id, lease_id and rid (copy them from the ticket)")
    return TransferRef(m.boot_id, m.lease_id, m.rid)


_STATES = {
    TransferState.WAITING: pb.WAITING,
    TransferState.RECEIVING: pb.RECEIVING,
    TransferState.READY: pb.READY,
    TransferState.FAILED: pb.FAILED,
}


def state_to_pb(s: TransferState) -> int:
    return _STATES[s]


def state_from_pb(v: int) -> TransferState:
    for k, x in _STATES.items():
        if x == v:
            return k
    raise InvalidArgument(f"unknown transfer state {v}")


def send_result_to_pb(r: SendResult) -> pb.SendResponse:
    m = pb.SendResponse(bytes=r.nbytes, blocks=r.blocks, seconds=r.seconds)
    # Key by key: a map given to the constructor is filled through MutableMapping.update, ~2x slower.
    pages, phases = m.pages, m.phase_seconds
    for k, n in r.pages.items():
        pages[k] = n
    for k, v in r.phases.items():
        phases[k] = v
    return m


def send_result_from_pb(m: pb.SendResponse) -> SendResult:
    """The SendResult of a Send reply, its step timings in the order the steps ran (a protobuf
    map has no order)."""
    got = dict(m.phase_seconds)  # one copy out of the map: a lookup per key costs more than the copy
    phases = {k: got.pop(k) for k in SEND_PHASES if k in got}
    phases.update(sorted(got.items()))  # the backend's parts and the handler's, by name
    return SendResult(m.bytes, m.blocks, m.seconds, dict(m.pages), phases)


def status_to_pb(exc: BaseException) -> pb.PeerStatus:
    """An exception as a status message (:func:`kvd.errors.to_status`: code, message, metadata):
    a peer socket refusal, a SendMany item's failure."""
    code, msg, md = E.to_status(exc)
    return pb.PeerStatus(code=code, message=msg, metadata=dict(md))


def status_from_pb(m: pb.PeerStatus) -> KvdError:
    """The kvd exception a status message stands for (the inverse of :func:`status_to_pb`)."""
    return E.from_status(m.code, m.message, dict(m.metadata))


# ---- requests: parsed and bounded in one place -------------------------------------------------

#: The bound (bytes of UTF-8) of a request's string field, by field name; every other string
#: field of a request (request ids, session names, boot ids, senders): MAX_ID_BYTES.
STRING_LIMITS: dict[str, int] = {"reason": MAX_REASON_BYTES, "layout_json": MAX_LAYOUT_BYTES}

# Per message type: (field, bound or 0, repeated, map entry's value plan or None, nested plan or
# None) for each field that holds a string somewhere below it.
_Plan = tuple["_Row", ...]
_Row = tuple[FieldDescriptor, int, bool, "_Entry | None", "_Plan | None"]
_Entry = tuple[FieldDescriptor, FieldDescriptor, "_Plan | None"]  # a map's key and value fields, the value's plan
_PLANS: dict[str, _Plan] = {}


def _plan(d: Descriptor) -> _Plan:
    got = _PLANS.get(d.full_name)
    if got is not None:
        return got
    _PLANS[d.full_name] = ()  # while it is planned: a type that contains itself is checked one level deep
    rows: list[_Row] = []
    for f in d.fields:
        repeated = f.is_repeated
        if f.type == FieldDescriptor.TYPE_STRING:
            rows.append((f, STRING_LIMITS.get(f.name, MAX_ID_BYTES), repeated, None, None))
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            mt = cast(Descriptor, f.message_type)  # set on every message field
            if mt.GetOptions().map_entry:  # keys and values: both bounded
                key, value = mt.fields_by_name["key"], mt.fields_by_name["value"]
                vplan = _plan(cast(Descriptor, value.message_type)) if value.type == FieldDescriptor.TYPE_MESSAGE else None
                if key.type == FieldDescriptor.TYPE_STRING or value.type == FieldDescriptor.TYPE_STRING or vplan:
                    rows.append((f, STRING_LIMITS.get(f.name, MAX_ID_BYTES), False, (key, value, vplan), None))
            else:
                sub = _plan(mt)
                if sub:
                    rows.append((f, 0, repeated, None, sub))
    plan = _PLANS[d.full_name] = tuple(rows)
    return plan


def _over(msg: Message, plan: _Plan) -> tuple[str, str, int, int] | None:
    """The first string of ``msg`` over its bound: (its path, the string, its length, the
    bound), or None. The path is built only for that one (this runs on every call)."""
    for f, limit, repeated, entry, sub in plan:
        value = getattr(msg, f.name)
        if entry is not None:
            key, vfield, vplan = entry
            for k, v in value.items():
                if key.type == FieldDescriptor.TYPE_STRING and (n := too_long(k, limit)):
                    return f"{f.name}[{quote(k)}] (key)", k, n, limit
                if vfield.type == FieldDescriptor.TYPE_STRING and (n := too_long(v, limit)):
                    return f"{f.name}[{quote(k)}]", v, n, limit
                if vplan and (hit := _over(v, vplan)):
                    return (f"{f.name}[{quote(k)}].{hit[0]}", *hit[1:])
        elif sub is None:
            # len(s) * 4 first: no string of that many characters is longer in UTF-8 (the common case, inline)
            if not repeated:
                if len(value) * 4 > limit and (n := too_long(value, limit)):
                    return f.name, value, n, limit
            else:
                for i, x in enumerate(value):
                    if len(x) * 4 > limit and (n := too_long(x, limit)):
                        return f"{f.name}[{i}]", x, n, limit
        elif not repeated:
            if msg.HasField(f.name) and (hit := _over(value, sub)):
                return (f"{f.name}.{hit[0]}", *hit[1:])
        else:
            for i, x in enumerate(value):
                if hit := _over(x, sub):
                    return (f"{f.name}[{i}].{hit[0]}", *hit[1:])
    return None


def check_strings(method: str, msg: Message) -> None:
    """InvalidArgument unless every string field of request ``msg`` (nested and repeated ones too)
    is within its bound (:data:`STRING_LIMITS`, else :data:`~kvd.limits.MAX_ID_BYTES`). The
    message names ``method``, the field's path, its length and the limit. Changes nothing."""
    hit = _over(msg, _plan(cast(Descriptor, msg.DESCRIPTOR)))
    if hit is not None:
        path, value, n, limit = hit
        raise InvalidArgument(
            f"{method}: {path} is {n:,d} bytes of UTF-8, over the limit of {limit:,d}: use a shorter one (it begins {value[:QUOTE_CHARS]!r})"
        )


def parse_request(method: str, cls: type[M], data: bytes) -> M:
    """The request of rpc ``method`` in ``data``, a serialised ``cls``: InvalidArgument naming
    the method when the bytes do not parse as one, or a string in it is over its bound
    (:func:`check_strings`). Every transport a daemon serves parses its requests here."""
    try:
        msg = cls.FromString(data)
    except DecodeError as exc:
        name = cls.DESCRIPTOR.full_name
        raise InvalidArgument(f"{method}: the request did not parse as {name} ({exc}); send a serialized {name}") from exc
    check_strings(method, msg)
    return msg
