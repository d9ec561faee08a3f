"""What :class:`~kvd.handoff.ticket.Tickets` remembers of the tickets it minted (pure core): a
body it minted is checked without parsing it into records, and without gathering the request's
pages while they are unchanged. Here a daemon that remembers and one that remembers nothing
(the same key, the same node) check the same bytes -- the ticket as minted, with bits flipped,
cut short, fields rewritten under the old seal or sealed again with the key -- after the request
stayed, changed, lost its lease or was freed: both must answer alike, refusal for refusal.

Minted bytes are also the bytes protobuf gives for the whole body at once (mint joins fields
serialised apart)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pool_testkit as pk
from kvd.daemon.node import Node
from kvd.errors import KvdError
from kvd.handoff.inbox import Inbox
from kvd.handoff.ticket import Issuer, Tickets
from kvd.pool.pool import Pool
from kvd.records import AllocSpec, LeaseKind, TicketInfo
from kvd.v1 import kvd_pb2 as pb

KEY = b"k" * 32
ISSUERS = [Issuer("decode:1", "/dev/shm/kvd-x", "local", "/tmp/d.sock.peer"), Issuer("/tmp/d.sock", "", "local"), Issuer("d")]


class World:
    """A decode node with request ``r`` (RECV lease, its ticket minted by ``mem``) beside ``v``."""

    def __init__(self, tokens: int, issuer: Issuer) -> None:
        s = pk.sizings()["tiny-hybrid"]
        self.arena = pk.arena_for(s)
        self.node = Node(Pool(s.layout, self.arena))
        Inbox.attach(self.node)
        self.mem, self.bare = Tickets(self.node, issuer, key=KEY), Tickets(self.node, issuer, key=KEY)
        self.sid = self.node.open_session("decode").session_id
        self.node.allocate(self.sid, [AllocSpec("v", 8, receive=True), AllocSpec("r", tokens, receive=True)])
        self.victim = self.node.vectors(self.sid, ["v"])[0]
        self.lease, vec = self.node.acquire_lease(self.sid, "r", LeaseKind.RECV)
        with self.node.lock:
            self.raw = self.mem.mint(self.lease, vec)

    def close(self) -> None:
        self.arena.close()


def _vectors(info: TicketInfo) -> tuple:
    v = info.vectors
    return v.rid, v.boot_id, v.epoch, v.tokens, v.full.tolist(), v.swa_first_page, v.swa.tolist(), v.state, v.draft.tolist()


def _outcome(t: Tickets, blob: bytes) -> tuple:
    try:
        info, lease = t.check(blob)
    except KvdError as exc:
        return type(exc).__name__, str(exc)
    fields = {k: getattr(info, k) for k in TicketInfo.__slots__ if k != "vectors"}
    return "ok", fields, _vectors(info), lease.lease_id


def _edit(w: World, r: random.Random, t: pb.Ticket) -> None:
    """One field of ``t`` rewritten (its vectors pointed at the victim's pages among them)."""
    name = r.choice(["version", "peer_address", "boot_id", "epoch", "lease_id", "rid", "layout_fingerprint", "envelopes",
                     "transfer_endpoint", "backend", "peer_socket", "full", "swa", "state", "draft", "tokens", "vrid", "victim"])
    v, vic = t.vectors, w.victim
    if name in ("epoch", "lease_id", "version"):
        setattr(t, name, getattr(t, name) + r.choice([1, -1 if getattr(t, name) else 2]))
    elif name in ("peer_address", "boot_id", "rid", "layout_fingerprint", "transfer_endpoint", "backend", "peer_socket"):
        setattr(t, name, r.choice(["", "v", getattr(t, name) + "x"]))
    elif name == "envelopes":
        e = t.envelopes[r.randrange(len(t.envelopes))]
        e.last_page += r.choice([1, -1])
    elif name in ("full", "swa", "draft") and len(getattr(v, name)):
        getattr(v, name)[r.randrange(len(getattr(v, name)))] += r.choice([1, -1])
    elif name == "state":
        v.state = vic.state
    elif name == "tokens":
        v.tokens += 1
    elif name == "vrid":
        v.rid = "v"
    elif name == "victim":
        del v.full[:], v.swa[:], v.draft[:]
        v.full.extend(vic.full.tolist()), v.swa.extend(vic.swa.tolist()), v.draft.extend(vic.draft.tolist())


def _blob(w: World, r: random.Random, how: str) -> bytes:
    raw = w.raw
    if how == "as minted":
        return raw
    if how == "bit flipped":
        b = bytearray(raw)
        b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        return bytes(b)
    if how == "cut short":
        return raw[: r.randrange(len(raw))]
    sealed = pb.SealedTicket.FromString(raw)
    t = pb.Ticket.FromString(sealed.body)
    _edit(w, r, t)
    if how == "resealed":
        return w.bare.seal(t)
    return pb.SealedTicket(body=t.SerializeToString(), seal=sealed.seal).SerializeToString()


def _change(w: World, how: str) -> None:
    node, sid = w.node, w.sid
    if how == "extended":
        node.extend(sid, [("r", node.vectors(sid, ["r"])[0].tokens + 4)])
    elif how == "lease released":
        node.release_lease(sid, w.lease.lease_id)
    elif how == "freed, pages reused":
        node.release_lease(sid, w.lease.lease_id)
        node.free(sid, ["r"])
        node.allocate(sid, [AllocSpec("n", 24, receive=True)])
        node.acquire_lease(sid, "n", LeaseKind.RECV)
    elif how == "freed, rid reused":
        node.release_lease(sid, w.lease.lease_id)
        node.free(sid, ["r"])
        node.allocate(sid, [AllocSpec("r", 24, receive=True)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(1, 40),
    issuer=st.sampled_from(ISSUERS),
    change=st.sampled_from(["none", "extended", "lease released", "freed, pages reused", "freed, rid reused"]),
    how=st.sampled_from(["as minted", "as minted", "bit flipped", "cut short", "rewritten", "resealed", "resealed"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_remembering_answers_as_reading_the_bytes(tokens, issuer, change, how, seed):
    w = World(tokens, issuer)
    try:
        r = random.Random(seed)
        blob = _blob(w, r, how)
        _change(w, change)
        got, want = _outcome(w.mem, blob), _outcome(w.bare, blob)
        assert got == want, (how, change)
        if how == "as minted" and change == "none":
            assert got[0] == "ok"
    finally:
        w.close()


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 80), issuer=st.sampled_from(ISSUERS))
def test_minted_bytes_are_the_body_serialised_at_once(tokens, issuer):
    from kvd.handoff.ticket import TICKET_VERSION
    from kvd.rpc.convert import envelope_to_pb, vectors_to_pb

    w = World(min(tokens, 40), issuer)
    try:
        sealed = pb.SealedTicket.FromString(w.raw)
        # Built here field by field from the node, as a body is defined: every field of Ticket
        # must be set (a field added to the message and not to the minting fails here); ids packed.
        pool, vec = w.node.pool, w.node.vectors(w.sid, ["r"])[0]
        want = pb.Ticket(
            version=TICKET_VERSION, peer_address=issuer.peer_address, boot_id=pool.boot_id, epoch=vec.epoch,
            lease_id=w.lease.lease_id, rid="r", layout_fingerprint=pool.layout.fingerprint,
            envelopes=[envelope_to_pb(e) for e in pool.envelopes()], vectors=vectors_to_pb(vec, packed=True),
            transfer_endpoint=issuer.transfer_endpoint, backend=issuer.backend, peer_socket=issuer.peer_socket,
        )
        assert {f.name for f in pb.Ticket.DESCRIPTOR.fields} == {
            "version", "peer_address", "boot_id", "epoch", "lease_id", "rid", "layout_fingerprint", "envelopes", "vectors",
            "transfer_endpoint", "backend", "peer_socket",
        }, "a Ticket field was added: set it above, and in Tickets.mint"
        assert sealed.body == want.SerializeToString()
        assert w.bare.seal(want) == w.raw
    finally:
        w.close()


def test_it_remembers_a_bounded_number(monkeypatch):
    import kvd.handoff.ticket as ticket

    monkeypatch.setattr(ticket, "REMEMBER", 3)
    w = World(8, ISSUERS[0])
    try:
        node, sid = w.node, w.sid
        raws = [w.raw]
        for i in range(5):
            node.allocate(sid, [AllocSpec(f"x{i}", 8, receive=True)])
            lease, vec = node.acquire_lease(sid, f"x{i}", LeaseKind.RECV)
            with node.lock:
                raws.append(w.mem.mint(lease, vec))
        assert len(w.mem._minted) == 3
        for raw in raws:  # the forgotten ones are checked from their bytes, as before
            assert _outcome(w.mem, raw) == _outcome(w.bare, raw)
            assert _outcome(w.mem, raw)[0] == "ok"
    finally:
        w.close()


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
