"""Pure-core tests of the handoff state machines (:mod:`kvd.handoff.inbox`): two in-process nodes, a
peer link into the receiving node that checks tickets as its daemon would
(``link_kit.CheckingLink``), no gRPC. The loopback tier in
``tests/handoff`` runs the same protocol between daemons; these pin down orderings that the
loopback tier can only hit by chance (a heartbeat landing inside a Send)."""

from __future__ import annotations

import dataclasses

import pytest

import pool_testkit as pk
from link_kit import CheckingLink
from kvd.backends.local import LocalBackend
from kvd.errors import Aborted, InvalidArgument, LayoutMismatch, NotFound, PermissionDenied, StaleEpoch
from kvd.records import AllocSpec, LeaseKind, TicketInfo, TransferRef, TransferState
from kvd.daemon.node import MAX_HANDED
from kvd.handoff.outbox import Outbox
from kvd.daemon.node import Node
from kvd.handoff.inbox import Inbox
from kvd.pool.pool import Pool

TOKENS = 20


def _node() -> tuple[Node, str]:
    s = pk.sizings()["two-group"]
    node = Node(Pool(s.layout, pk.arena_for(s)))
    Inbox.attach(node)
    return node, node.open_session("engine").session_id


@pytest.fixture
def pair():
    (p, ps), (d, ds) = _node(), _node()
    rid = "req-1"
    p.allocate(ps, [AllocSpec(rid, TOKENS)])
    d.allocate(ds, [AllocSpec(rid, TOKENS, receive=True)])
    lease, vec = d.acquire_lease(ds, rid, LeaseKind.RECV)
    ticket = TicketInfo(
        peer_address="decode", boot_id=d.pool.boot_id, epoch=vec.epoch, lease_id=lease.lease_id, rid=rid,
        layout_fingerprint=d.layout.fingerprint, envelopes=d.pool.envelopes(), vectors=vec,
        transfer_endpoint="unused", backend="local",
    )
    yield p, ps, d, ds, rid, ticket
    p.check()
    d.check()


def _writing_outbox(p: Node, d: Node, ticket: TicketInfo) -> tuple[Outbox, CheckingLink, TicketInfo, bytes]:
    """An Outbox of ``p`` whose shm backend really writes into ``d``'s arena, its link, and the
    ticket (pointed at that arena) with the raw bytes that stand for it."""
    ticket = dataclasses.replace(ticket, transfer_endpoint=d.pool.arena.path)
    link = CheckingLink(d)
    backend = LocalBackend()
    backend.register(p.pool.arena)
    return Outbox(p, backend, link, address="prefill"), link, ticket, link.register(ticket)


def test_heartbeat_inside_a_refused_send_leaves_the_receiver_waiting(pair):
    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    ob = Outbox(p, LocalBackend(), link, address="prefill")

    def heartbeat_then_refuse():  # the heartbeat thread fires while the ticket is checked
        ob.heartbeat_once()
        raise LayoutMismatch("group swa: page bytes differ (refused by the receiver)")

    link.before_check[rid] = heartbeat_then_refuse
    with pytest.raises(LayoutMismatch):
        ob.send(ps, rid, ticket, link.register(ticket), 0, None, last=True)
    # The receiver never accepted the ticket: no heartbeat named it, it still waits, and the
    # sender holds nothing open and no lease.
    assert link.events == [("check", rid)]
    assert d.inbox.status(rid).state is TransferState.WAITING
    assert ob.open_count() == 0 and len(p.leases) == 0


def test_a_receiver_heartbeat_never_begins_a_waiting_transfer(pair):
    _, _, d, _, rid, ticket = pair
    assert d.inbox.heartbeat("prefill", [ticket.ref]) == []
    assert d.inbox.status(rid).state is TransferState.WAITING
    # A reference from another boot is reported dead and changes nothing.
    assert d.inbox.heartbeat("prefill", [TransferRef("other-boot", ticket.lease_id, rid)]) == [ticket.lease_id]
    assert d.inbox.status(rid).state is TransferState.WAITING


def test_a_send_refused_after_the_receiver_accepted_tells_the_receiver_at_once(pair):
    """The receiver checks the ticket while the sender leases and plans. When the plan then
    refuses (here: the prefill request is shorter than the receiver's), nothing was written and
    the receiver, which accepted the ticket, is told at once with drained=True: its transfer
    fails now, and freeing the request is not deferred behind a fence."""
    p, ps, d, ds, rid, ticket = pair
    link = CheckingLink(d)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    p.free(ps, [rid])
    p.allocate(ps, [AllocSpec(rid, TOKENS - 5)])
    with pytest.raises(InvalidArgument, match="allocate the same length"):
        ob.send(ps, rid, ticket, link.register(ticket), 0, None, last=True)
    assert link.events == [("check", rid), ("abort", rid)]
    assert link.aborts[0][2] is True  # drained: nothing was written
    st = d.inbox.status(rid)
    assert st.state is TransferState.FAILED and "allocate the same length" in st.reason
    assert ob.open_count() == 0 and len(p.leases) == 0
    d.free(ds, [rid])
    assert rid not in d.pool.request_ids


def test_a_range_the_ticket_shows_is_wrong_is_refused_before_the_receiver_hears(pair):
    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    with pytest.raises(InvalidArgument, match="not inside the request"):
        ob.send(ps, rid, ticket, link.register(ticket), 5, TOKENS + 1, last=True)
    assert link.events == [] and d.inbox.status(rid).state is TransferState.WAITING
    assert ob.open_count() == 0 and len(p.leases) == 0


def test_a_heartbeat_that_overtakes_the_receivers_abort_keeps_the_transfer_listed(pair):
    """The heartbeat (peer socket) can learn that the receiver dropped a transfer before the
    receiver's AbortSend (gRPC) arrives. The idle transfer stays listed, so the engine's next Send
    hears why instead of starting over with a ticket whose lease is gone; the receiver's own
    reason replaces the heartbeat's once it arrives."""
    p, ps, d, _, rid, ticket = pair
    ob, link, ticket, raw = _writing_outbox(p, d, ticket)
    ob.send(ps, rid, ticket, raw, 0, TOKENS // 2, last=False)
    d.inbox.abort_local(rid, "engine preempted it")
    ob.heartbeat_once()
    assert ob.open_count() == 0  # aborted while idle: still listed, no longer in progress
    with pytest.raises(Aborted, match="no longer accepts"):
        ob.send(ps, rid, ticket, raw, TOKENS // 2, None, last=True)
    ob.abort_remote(ticket.ref, "aborted by the decode engine: engine preempted it")
    with pytest.raises(Aborted, match="receiver aborted: aborted by the decode engine: engine preempted it"):
        ob.send(ps, rid, ticket, raw, TOKENS // 2, None, last=True)
    # Idle (nothing in flight): the sender answers the receiver's abort with a drained one, which
    # ends the receiver's fence at once.
    assert link.events == [("check", rid), ("commit", rid), ("heartbeat", rid), ("abort", rid)]
    assert link.aborts[-1][2] is True and len(d.leases) == 0
    assert len(p.leases) == 0
    ob.backend.close()


# ---- BeginSend: the receiver's check ahead of the first Send ----------------------------------


def test_begin_checks_the_ticket_once_and_every_send_then_skips_the_check(pair):
    p, ps, d, _, rid, ticket = pair
    ob, link, ticket, raw = _writing_outbox(p, d, ticket)
    assert ob.begin(ps, rid, ticket, raw) is True
    assert d.inbox.status(rid).state is TransferState.RECEIVING  # accepted: the transfer began there
    assert ob.begin(ps, rid, ticket, raw) is False  # open already: nothing asked
    assert len(p.leases) == 0  # begin pins nothing on the sender
    ob.heartbeat_once()  # an open transfer is kept alive like one between chunks
    first = ob.send(ps, rid, ticket, raw, 0, TOKENS // 2, last=False)
    last = ob.send(ps, rid, ticket, raw, TOKENS // 2, None, last=True)
    assert "check" not in first.phases and "check" not in last.phases
    assert link.events == [("check", rid), ("heartbeat", rid), ("commit", rid), ("commit", rid)]
    assert d.inbox.status(rid).state is TransferState.READY
    assert ob.open_count() == 0 and len(p.leases) == 0
    ob.backend.close()


def test_a_begin_the_receiver_refuses_leaves_both_sides_as_they_were(pair):
    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    raw = link.register(dataclasses.replace(ticket, epoch=ticket.epoch + 1))  # an epoch the receiver never issued
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    stale = link.tickets[raw]
    with pytest.raises(StaleEpoch):
        ob.begin(ps, rid, stale, raw)
    assert d.inbox.status(rid).state is TransferState.WAITING
    assert ob.open_count() == 0 and len(p.leases) == 0
    with pytest.raises(StaleEpoch):  # the next Send asks again: nothing was remembered
        ob.send(ps, rid, stale, raw, 0, None, last=True)
    assert link.events == [("check", rid), ("check", rid)]


def test_begin_refuses_a_request_the_session_does_not_hold_before_the_receiver_hears(pair):
    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    raw = link.register(ticket)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    other = p.open_session("another engine").session_id
    with pytest.raises(PermissionDenied, match="another client session"):
        ob.begin(other, rid, ticket, raw)
    p.free(ps, [rid])
    with pytest.raises(NotFound, match="not allocated on this node"):
        ob.begin(ps, rid, ticket, raw)
    with pytest.raises(InvalidArgument, match="not 'req-2'"):
        ob.begin(ps, "req-2", ticket, raw)
    assert link.events == [] and d.inbox.status(rid).state is TransferState.WAITING
    assert ob.open_count() == 0


def test_a_send_failing_after_begin_tells_the_receiver_though_it_checked_nothing(pair):
    """The receiver accepted the ticket at begin; the Send then fails in planning (the prefill
    request is shorter than the receiver's) before any byte: the receiver learns at once."""
    p, ps, d, ds, rid, ticket = pair
    link = CheckingLink(d)
    raw = link.register(ticket)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    p.free(ps, [rid])
    p.allocate(ps, [AllocSpec(rid, TOKENS - 5)])
    ob.begin(ps, rid, ticket, raw)
    with pytest.raises(InvalidArgument, match="allocate the same length"):
        ob.send(ps, rid, ticket, raw, 0, None, last=True)
    assert link.events == [("check", rid), ("abort", rid)]
    assert link.aborts[0][2] is True  # drained: nothing was written
    assert d.inbox.status(rid).state is TransferState.FAILED
    assert ob.open_count() == 0 and len(p.leases) == 0
    d.free(ds, [rid])


def test_an_engine_abort_after_begin_reaches_the_receiver(pair):
    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    raw = link.register(ticket)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    ob.begin(ps, rid, ticket, raw)
    assert ob.abort_local(ps, rid, "the client went away") is True
    st = d.inbox.status(rid)
    assert st.state is TransferState.FAILED and "the client went away" in st.reason
    assert ob.open_count() == 0
    with pytest.raises(NotFound, match="is not live"):  # the abort ended the receiver's lease too
        ob.begin(ps, rid, ticket, raw)


def _keyed(p: Node, d: Node, rid: str) -> pk.Patterns:
    """Key every page of ``rid`` on the prefill node; returns the patterns to verify the
    receiver's copy of it with."""
    src = pk.Patterns(p.pool)
    src.write_new(p.pool.vectors(rid))
    return pk.Patterns(d.pool, uids=dict(src.uids))


def test_the_whole_request_send_uses_the_plan_begin_made(pair):
    p, ps, d, _, rid, ticket = pair
    ob, _, ticket, raw = _writing_outbox(p, d, ticket)
    keys = _keyed(p, d, rid)
    ob.begin(ps, rid, ticket, raw)
    r = ob.send(ps, rid, ticket, raw, 0, None, last=True)
    assert ob.planned_ahead_total == 1
    assert r.blocks >= 1 and r.nbytes > 0
    keys.verify(d.pool.vectors(rid))
    assert d.inbox.status(rid).state is TransferState.READY
    assert ob.open_count() == 0 and len(p.leases) == 0
    ob.backend.close()


def test_a_request_compacted_after_begin_is_planned_again_at_the_send(pair):
    """Compaction on the prefill node moves the request between BeginSend and Send: the plan
    begin made points at the old pages; the Send must notice and write from the new ones."""
    p, ps, d, _, rid, ticket = pair
    ob, _, ticket, raw = _writing_outbox(p, d, ticket)
    p.free(ps, [rid])
    p.allocate(ps, [AllocSpec("filler", TOKENS), AllocSpec(rid, TOKENS)])
    keys = _keyed(p, d, rid)
    ob.begin(ps, rid, ticket, raw)
    before = pk.phys_key(p.pool.vectors(rid))
    p.free(ps, ["filler"])
    p.compact(ps)
    assert pk.phys_key(p.pool.vectors(rid)) != before  # it moved: the plan made ahead is stale
    ob.send(ps, rid, ticket, raw, 0, None, last=True)
    assert ob.planned_ahead_total == 0
    keys.verify(d.pool.vectors(rid))
    assert d.inbox.status(rid).state is TransferState.READY
    ob.backend.close()


@pytest.mark.parametrize("then", ["nothing", "compacted", "extended", "freed and allocated again"])
def test_a_send_leases_the_vectors_handed_out_while_they_are_the_requests(pair, monkeypatch, then):
    """Vectors the node handed its engine (Node.allocate, Node.extend) are what the Send leases
    and plans from while the request's pages are unchanged -- no gather; once they moved, grew or
    belong to a new request of that id, the Send gathers the request's own and writes from those."""
    p, ps, d, _, rid, ticket = pair
    ob, _, ticket, raw = _writing_outbox(p, d, ticket)
    if then == "compacted":
        p.free(ps, [rid])
        p.allocate(ps, [AllocSpec("filler", TOKENS), AllocSpec(rid, TOKENS)])
    assert rid in p._handed  # the fixture allocated it through the node
    if then == "compacted":
        before = pk.phys_key(p.pool.vectors(rid))
        p.free(ps, ["filler"])
        p.compact(ps)
        assert pk.phys_key(p.pool.vectors(rid)) != before
    elif then == "extended":  # in the pool, behind the node: what it handed out is stale now
        p.pool.extend(rid, 4)
    elif then == "freed and allocated again":
        p.pool.free(rid)
        p.allocate(ps, [AllocSpec("filler", TOKENS)])  # on rid's old pages
        p.pool.allocate_many([AllocSpec(rid, TOKENS)])
    keys = _keyed(p, d, rid)
    gathers = []
    real = p.pool.vectors
    monkeypatch.setattr(p.pool, "vectors", lambda r: gathers.append(r) or real(r))
    if then == "extended":  # more tokens than the receiver holds: refused before any byte, after the gather
        with pytest.raises(InvalidArgument, match="tokens here but the receiver allocated"):
            ob.send(ps, rid, ticket, raw, 0, None, last=True)
        assert gathers == [rid] and len(p.leases) == 0
        ob.backend.close()
        return
    ob.send(ps, rid, ticket, raw, 0, None, last=True)
    assert gathers == ([] if then == "nothing" else [rid])
    keys.verify(d.pool.vectors(rid))
    assert d.inbox.status(rid).state is TransferState.READY
    p.free(ps, [rid])
    assert rid not in p._handed  # a request's end forgets them
    ob.backend.close()


def test_handed_vectors_are_bounded_and_follow_what_the_node_hands_out(pair):
    p, ps, d, _, rid, ticket = pair
    (v,) = p.extend(ps, [(rid, 4)])
    assert p._handed[rid] is v  # the newest vectors of the request
    p._hand([v._replace(rid=f"h{i}") for i in range(MAX_HANDED + 10)])
    assert len(p._handed) == MAX_HANDED and "h9" not in p._handed and f"h{MAX_HANDED + 9}" in p._handed


def test_a_request_freed_after_begin_ends_its_transfer_at_both_ends(pair):
    """Issue 13 part 3: a sending request freed before its last Send aborts the open transfer
    toward the receiver (told drained: nothing is in flight, so no fence), and the same rid
    allocated again (other pages) cannot resume it with the old ticket: refused, nothing written."""
    p, ps, d, _, rid, ticket = pair
    ob, link, ticket, raw = _writing_outbox(p, d, ticket)
    ob.begin(ps, rid, ticket, raw)
    assert d.inbox.status(rid).state is TransferState.RECEIVING
    p.free(ps, [rid])
    st = d.inbox.wait(rid, 2.0)  # the abort goes out on the outbox's notice thread
    assert st.state is TransferState.FAILED and "ended at the sender" in st.reason and "freed it" in st.reason, st
    assert link.aborts == [(rid, link.aborts[0][1], True)]
    assert ob.open_count() == 0 and len(d.leases) == 0  # drained: the receiver's pages are free to reuse
    p.allocate(ps, [AllocSpec("filler", TOKENS)])  # takes the freed pages
    p.allocate(ps, [AllocSpec(rid, TOKENS)])
    # The transfer is gone at the sender too: the Send asks the receiver again, which refuses it.
    with pytest.raises(NotFound, match="not live"):
        ob.send(ps, rid, ticket, raw, 0, None, last=True)
    assert ("commit", rid) not in link.events and len(p.leases) == 0
    ob.close()
    ob.backend.close()


@pytest.mark.parametrize(
    ("chunk_tokens", "cuts", "planned"),
    [
        (0, (10,), 0),  # begin planned the whole request, not these chunks: they plan themselves
        (8, (8, 16), 3),  # begin planned [0, 8), [8, 16), [16, 20): every chunk uses its plan
        (8, (10,), 0),  # other chunks than begin's: they plan themselves
    ],
)
def test_chunk_sends_use_the_plans_begin_made_for_exactly_those_chunks(pair, chunk_tokens, cuts, planned):
    p, ps, d, _, rid, ticket = pair
    ob, _, ticket, raw = _writing_outbox(p, d, ticket)
    keys = _keyed(p, d, rid)
    ob.begin(ps, rid, ticket, raw, chunk_tokens=chunk_tokens)
    for t0, t1 in zip((0, *cuts), (*cuts, TOKENS)):
        ob.send(ps, rid, ticket, raw, t0, t1, last=t1 == TOKENS)
    assert ob.planned_ahead_total == planned
    keys.verify(d.pool.vectors(rid))
    assert d.inbox.status(rid).state is TransferState.READY
    ob.backend.close()


def test_too_many_chunks_to_plan_are_refused_before_the_receiver_hears(pair, monkeypatch):
    import kvd.handoff.outbox as outbox_mod

    p, ps, d, _, rid, ticket = pair
    link = CheckingLink(d)
    raw = link.register(ticket)
    ob = Outbox(p, LocalBackend(), link, address="prefill")
    monkeypatch.setattr(outbox_mod, "MAX_AHEAD_CHUNKS", 4)
    with pytest.raises(InvalidArgument, match="cut the request's 20 tokens into 7 chunks; at most 4"):
        ob.begin(ps, rid, ticket, raw, chunk_tokens=3)
    assert link.events == [] and d.inbox.status(rid).state is TransferState.WAITING and ob.open_count() == 0
    assert ob.begin(ps, rid, ticket, raw, chunk_tokens=5) is True  # 4 chunks: planned


def _clocked_receiver() -> tuple[Node, str, list[float], TransferRef, list]:
    """A decode node on a hand-driven clock with one transfer RECEIVING from "prefill", and the
    Ends its hook heard."""
    s = pk.sizings()["two-group"]
    now = [0.0]
    d = Node(Pool(s.layout, pk.arena_for(s)), clock=lambda: now[0])
    Inbox.attach(d, fence_s=1.0, peer_timeout=10.0)
    heard: list = []
    d.on_ended.append(heard.append)
    ds = d.open_session("decode").session_id
    d.allocate(ds, [AllocSpec("r", TOKENS, receive=True)])
    lease, _ = d.acquire_lease(ds, "r", LeaseKind.RECV)
    ref = TransferRef(d.pool.boot_id, lease.lease_id, "r")
    d.inbox.begin(ref, "prefill")
    return d, ds, now, ref, heard


def test_a_stall_of_the_daemon_itself_is_nobodys_silence():
    """Node.sweep(stalled_s): the daemon did not run for that long (paused, CPU-throttled), so its
    sender's beats, its clients' calls and renewals waited unread. Their silences and deadlines move
    on by the stall, as if the clock had stopped; what was silent before it stays counted, and a
    real silence after it still fails the transfer, reaps the session and expires the lease."""
    d, ds, now, ref, _ = _clocked_receiver()  # peer timeout 10 s; the session's TTL and the lease's 10 s too
    lease = d.leases.get(ref.lease_id)
    now[0] = 4.0
    d.sweep()
    now[0] = 34.0  # a 30 s stall: far past the peer timeout, the session's TTL and the lease's
    d.sweep(stalled_s=30.0)
    assert d.inbox.status("r").state is TransferState.RECEIVING
    assert d.leases.live(ref.lease_id) and lease.expires_at == pytest.approx(40.0)
    assert d.stats().sessions_live == 1 and d.stalls_excused == 1 and d.stalled_seconds == 30.0
    d.check()
    now[0] = 39.0  # 9 s of silence in all that the daemon was running to hear: not yet
    d.sweep()
    assert d.inbox.status("r").state is TransferState.RECEIVING and d.stats().sessions_live == 1
    now[0] = 40.5  # 10.5 s: the sender is silent past its timeout, the session past its TTL
    d.sweep()
    st = d.inbox.status("r")
    assert st.state is TransferState.FAILED and "stopped answering for 10.5 s" in st.reason, st  # 4 s before the stall, 6.5 after
    assert d.stats().sessions_live == 0
    now[0] = 42.0  # the RECV lease was the failed transfer's fence (1 s): gone with it
    d.sweep()
    assert not d.leases.live(ref.lease_id) and "r" not in d.pool.request_ids
    d.check()


def test_a_stall_does_not_revive_what_had_run_out_before_it():
    """A lease whose TTL ran out before the stall stays expired once the stall is excused (its
    deadline moves by the stall, still before now)."""
    d, ds, now, ref, _ = _clocked_receiver()
    other, _ = d.acquire_lease(ds, "r", LeaseKind.SEND, ttl=1.0)
    now[0] = 3.0  # expired at 1.0, not swept yet
    d.sweep(stalled_s=1.5)
    assert not d.leases.live(other.lease_id) and d.leases.live(ref.lease_id)
    d.check()


@pytest.mark.parametrize("how", ["close", "release"])
def test_a_receiving_request_ended_mid_transfer_is_fenced_and_its_sender_told(how):
    """Issue 13 part 3b: closing the session (or releasing the RECV lease) of a request still
    receiving fails the transfer, keeps its pages (the RECV lease is the fence) and names the
    sender to tell; a sender heartbeat naming it (a Send still draining) extends the fence; with
    no word from the sender the fence runs out and the pages are free."""
    d, ds, now, ref, heard = _clocked_receiver()
    if how == "close":
        assert d.close_session(ds) == (1, 0)  # freed (deferred), no lease released: it is the fence
    else:
        d.release_lease(ds, ref.lease_id)
    st = d.inbox.status("r")
    assert st.state is TransferState.FAILED and "ended mid-transfer" in st.reason
    assert [e.senders for e in heard] == [(("prefill", ref),)]
    assert d.leases.live(ref.lease_id) and "r" in d.pool.request_ids
    now[0] = 0.9
    assert d.inbox.heartbeat("prefill", [ref]) == [ref.lease_id]  # dead to the sender, fence kept
    now[0] = 1.5
    d.sweep()
    assert "r" in d.pool.request_ids, "the fence ran out while the sender still named the transfer"
    now[0] = 2.0
    d.sweep()
    if how == "release":
        assert "r" in d.pool.request_ids  # released, not freed: the engine frees it, at once now
        d.free(ds, ["r"])
    assert "r" not in d.pool.request_ids and len(d.leases) == 0
    d.check()


@pytest.mark.parametrize("log_ends", [Inbox.LOG_ENDS, 2])
def test_wait_ended_answers_a_sessions_ends_once_in_order_whatever_the_cursor(monkeypatch, log_ends):
    """Inbox.wait_ended: the transfers of one session that ended after a cursor, in the order they
    ended, none of another session's, none forgotten (freed; an id allocated again ends anew); the
    same from the log of recent ends
    as from a scan of every transfer (a log of 2 ends: most cursors are older than it)."""
    import random

    monkeypatch.setattr(Inbox, "LOG_ENDS", log_ends)
    s = pk.sizings()["two-group"]
    d = Node(Pool(s.layout, pk.arena_for(s)))
    Inbox.attach(d)
    sessions = [d.open_session(f"decode-{i}").session_id for i in range(2)]
    rnd = random.Random(7)
    owner: dict[str, str] = {}
    for i in range(24):
        sid = sessions[i % 2]
        rid = f"r{i}"
        d.allocate(sid, [AllocSpec(rid, 4, receive=True)])
        d.acquire_lease(sid, rid, LeaseKind.RECV)
        owner[rid] = sid
    order = list(owner)
    rnd.shuffle(order)
    ended: list[tuple[int, str]] = []  # (the inbox's count of ends, rid), in the order they ended
    for n, rid in enumerate(order[:18], start=1):
        d.inbox.abort_local(rid, "test")
        ended.append((n, rid))
    freed = ended[3][1]  # ended, then freed: forgotten; then its id allocated again, and that one ends
    assert d.free(owner[freed], [freed]) == 1
    ended.remove(ended[3])
    d.allocate(owner[freed], [AllocSpec(freed, 4, receive=True)])
    d.acquire_lease(owner[freed], freed, LeaseKind.RECV)
    d.inbox.abort_local(freed, "again, test")
    ended.append((19, freed))
    for sid in sessions:
        mine = d.mine(sid)
        for c in range(20):
            got, cursor = d.inbox.wait_ended(c, 0, mine)
            want = [r for n, r in ended if n > c and owner[r] == sid]
            assert [r for r, _ in got] == want and cursor == 19, (sid, c)
            assert all(st.state is TransferState.FAILED and st.reason.endswith("test") for _, st in got)
    with pytest.raises(InvalidArgument, match="wait from cursor 0"):
        d.inbox.wait_ended(20, 0, d.mine(sessions[0]))
    d.check()
