"""Pure-core tests of :meth:`kvd.handoff.outbox.Outbox.send_many`: two in-process nodes whose shm arenas
the ``local`` backend really copies between, and a peer link that runs the receiver's own ticket
check (``Node.check_ticket`` + ``Inbox.begin``, what ``PeerCalls.check_ticket`` does) in-process
(``link_kit.CheckingLink``).

What is pinned down here: a batch lands exactly the bytes the same Sends one by one land; the
pipeline order (item i's copies issued before item i-1 is waited for and committed); each item's
failure is its own (refused before its receiver hears, or its receiver told at once, drained);
duplicates are refused before anything happens; a receiver's abort in the middle of a batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pool_testkit as pk
from link_kit import CheckingLink
from kvd.backends.local import LocalBackend
from kvd.errors import Aborted, InvalidArgument, KvdError, NotFound, StaleEpoch
from kvd.records import SEND_PHASES, AllocSpec, LeaseKind, SendResult, TicketInfo, TransferState
from kvd.handoff.flight import MAX_SEND_ITEMS, SendItem
from kvd.handoff.outbox import Outbox
from kvd.daemon.node import Node
from kvd.handoff.inbox import Inbox
from kvd.pool.pool import Pool
from kvd.handoff.plan import plan_chunk

READY, WAITING, FAILED = TransferState.READY, TransferState.WAITING, TransferState.FAILED
#: Token counts of the batch's requests (two-group layout: 4 tokens a page, an 8-token window).
LENGTHS = (20, 37, 9, 28)


class RecordingBackend(LocalBackend):
    """The shm local backend, recording when each write is issued and when its waiter returned;
    ``fail_landing[rid]``: the waiter of that request's write raises it (after the copy, as a
    peer that died during the write does)."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.events = events
        self.current = ""  # the rid whose writes are being issued (set by the test's Outbox hook)
        self.fail_landing: dict[str, KvdError] = {}

    def write_async(self, peer, srcs, dsts, lens):
        rid = self.current
        self.events.append(("issue", rid))
        wait = super().write_async(peer, srcs, dsts, lens)

        def landed():
            wait()
            self.events.append(("landed", rid))
            if rid in self.fail_landing:
                raise self.fail_landing.pop(rid)

        return landed


class Batch:
    """A prefill node and a decode node with requests of ``LENGTHS`` on both, random bytes in the
    prefill arena, a RECV lease (ticket) per request, and an Outbox whose backend records."""

    def __init__(self) -> None:
        s = pk.sizings()["two-group"]
        self.p, self.d = Node(Pool(s.layout, pk.arena_for(s))), Node(Pool(s.layout, pk.arena_for(s)))
        for n in (self.p, self.d):
            Inbox.attach(n)
        self.ps, self.ds = (n.open_session("engine").session_id for n in (self.p, self.d))
        self.events: list[tuple[str, str]] = []
        self.backend = RecordingBackend(self.events)
        self.backend.register(self.p.pool.arena)
        self.link = CheckingLink(self.d, self.events)
        self.outbox = Outbox(self.p, self.backend, self.link, address="prefill")
        prepare = self.outbox._prepare

        def prepare_and_name(session, f):  # tells the recording backend whose writes come next
            self.backend.current = f.item.rid
            prepare(session, f)

        self.outbox._prepare = prepare_and_name  # type: ignore[method-assign]
        self.rids = [f"req-{i}" for i in range(len(LENGTHS))]
        for rid, n in zip(self.rids, LENGTHS):
            self.p.allocate(self.ps, [AllocSpec(rid, n)])
            self.d.allocate(self.ds, [AllocSpec(rid, n, receive=True)])
        g = torch.Generator().manual_seed(5)
        src = self.p.pool.arena.tensor()
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, generator=g))
        self.tickets = {rid: self.ticket(rid) for rid in self.rids}

    def ticket(self, rid: str) -> TicketInfo:
        """A new RECV lease on ``rid`` and its ticket (what ``KvdService._lease_pb`` carries)."""
        lease, vec = self.d.acquire_lease(self.ds, rid, LeaseKind.RECV)
        return self.register(TicketInfo(
            peer_address="decode", boot_id=self.d.pool.boot_id, epoch=vec.epoch, lease_id=lease.lease_id, rid=rid,
            layout_fingerprint=self.d.layout.fingerprint, envelopes=self.d.pool.envelopes(), vectors=vec,
            transfer_endpoint=self.d.pool.arena.handle().path, backend="local",
        ))

    def register(self, t: TicketInfo) -> TicketInfo:
        self.link.register(t)
        return t

    def item(self, rid: str, t: TicketInfo | None = None, start: int = 0, end: int | None = None) -> SendItem:
        t = t or self.tickets[rid]
        raw = next(k for k, v in self.link.tickets.items() if v is t)
        return SendItem(rid, t, raw, start, end, True)

    @property
    def dst(self) -> torch.Tensor:
        return self.d.pool.arena.tensor()

    def expected(self, rids: list[str]) -> torch.Tensor:
        """The decode arena as it is now with every block of ``rids``' plans (whole requests)
        copied from the prefill arena."""
        exp = self.dst.clone()
        src = self.p.pool.arena.tensor()
        sb, db = self.p.pool.envelopes()[0].base, self.d.pool.envelopes()[0].base
        for rid in rids:
            t = self.tickets[rid]
            plan = plan_chunk(self.p.layout, self.p.pool.vectors(rid), t.vectors, self.p.pool.envelopes(), t.envelopes, 0, t.vectors.tokens, True)
            for s, d, n in zip(*plan.as_lists()):
                exp[d - db : d - db + n] = src[s - sb : s - sb + n]
        return exp

    def state(self, rid: str) -> TransferState:
        return self.d.inbox.status(rid).state

    def close(self) -> None:
        assert self.outbox.open_count() == 0, "outbound transfers left open"
        assert len(self.p.leases) == 0, "a SEND lease outlived its item"
        assert self.backend._in_flight == 0, "a write still counts as in flight"
        self.p.check()
        self.d.check()
        self.backend.close()
        for n in (self.p, self.d):
            n.pool.arena.close()


@pytest.fixture
def b():
    batch = Batch()
    yield batch
    batch.close()


def _results(out: list) -> list[SendResult]:
    assert all(isinstance(r, SendResult) for r in out), out
    return out


def test_a_batch_lands_the_bytes_the_same_sends_land_one_by_one(b):
    exp = b.expected(b.rids)
    assert not torch.equal(exp, b.dst)  # the requests' blocks are not zero on the sender
    out = _results(b.outbox.send_many(b.ps, [b.item(r) for r in b.rids]))
    batched = b.dst.clone()
    assert torch.equal(batched, exp)
    for r, n in zip(out, LENGTHS):
        steps = {k: v for k, v in r.phases.items() if k in SEND_PHASES}
        assert r.nbytes > 0 and list(steps) == list(SEND_PHASES)
        assert sum(steps.values()) == pytest.approx(r.seconds, rel=1e-6, abs=1e-9)
    assert all(b.state(rid) is READY for rid in b.rids)
    assert len(b.d.leases) == 0  # READY dropped every RECV lease
    assert b.outbox.sent_total == len(b.rids) and b.outbox.items_total == len(b.rids) and b.outbox.calls_total == 1

    # Again, one Send per request into a zeroed arena: the same bytes, the same counts.
    b.dst.zero_()
    b.tickets = {rid: b.ticket(rid) for rid in b.rids}
    single = [b.outbox.send(b.ps, rid, b.tickets[rid], b.item(rid).raw, 0, None, True) for rid in b.rids]
    assert torch.equal(b.dst, batched)
    assert [(r.nbytes, r.blocks, r.pages) for r in single] == [(r.nbytes, r.blocks, r.pages) for r in out]


def test_each_items_copies_are_issued_before_the_previous_item_is_waited_for_and_committed(b):
    _results(b.outbox.send_many(b.ps, [b.item(r) for r in b.rids]))
    r0, r1, r2, r3 = b.rids
    assert b.events == [
        ("check", r0), ("issue", r0),
        ("check", r1), ("issue", r1), ("landed", r0), ("commit", r0),
        ("check", r2), ("issue", r2), ("landed", r1), ("commit", r1),
        ("check", r3), ("issue", r3), ("landed", r2), ("commit", r2),
        ("landed", r3), ("commit", r3),
    ]


@pytest.mark.parametrize("bad", ["range", "other-rid", "forged-lease", "old-boot", "freed"])
def test_one_bad_item_in_the_middle_fails_alone(b, bad):
    """A bad item between good ones: the others land; a refusal the ticket, the sender's own
    request (freed: not this session's any more, checked before the receiver hears of it) or the
    receiver's check shows leaves the bad item's receiver WAITING and untouched."""
    r0, r1, r2, r3 = b.rids
    item = b.item(r1)
    want: tuple[type[KvdError], str]
    if bad == "range":
        item, want = b.item(r1, end=LENGTHS[1] + 1), (InvalidArgument, "not inside the request")
    elif bad == "other-rid":
        item, want = item._replace(rid=r3), (InvalidArgument, f"ticket is for request {r1!r}")
    elif bad == "forged-lease":
        item, want = b.item(r1, b.register(dataclasses.replace(item.ticket, lease_id=999))), (NotFound, "lease 999")
    elif bad == "old-boot":
        item, want = b.item(r1, b.register(dataclasses.replace(item.ticket, boot_id="boot-before"))), (StaleEpoch, "restarted")
    else:
        b.p.free(b.ps, [r1])
        want = (NotFound, "not allocated")
    before = b.dst.clone()
    out = b.outbox.send_many(b.ps, [b.item(r0), item, b.item(r2)])
    assert isinstance(out[1], want[0]) and want[1] in str(out[1]), out[1]
    _results([out[0], out[2]])
    assert b.state(r0) is READY and b.state(r2) is READY
    assert b.state(r1) is WAITING and b.link.aborts == []
    assert (("check", r1) in b.events) is (bad in ("forged-lease", "old-boot"))  # the receiver's own refusals
    b.d.release_lease(b.ds, b.tickets[r1].lease_id)
    assert torch.equal(b.dst, b.expected([r0, r2])) and not torch.equal(before, b.dst)
    assert b.outbox.failed_total == 1 and b.outbox.sent_total == 2
    assert [e for e in b.events if e[0] == "issue"] == [("issue", r0), ("issue", r2)]
    b.d.release_lease(b.ds, b.tickets[r3].lease_id)  # not in this batch
    assert len(b.d.leases) == 0


def test_a_write_that_fails_landing_fails_its_item_alone_and_its_receiver_learns_drained(b):
    r0, r1, r2, r3 = b.rids
    b.backend.fail_landing[r1] = Aborted("peer arena lost its owner during the write")
    out = b.outbox.send_many(b.ps, [b.item(r) for r in (r0, r1, r2)])
    assert isinstance(out[1], Aborted) and "lost its owner" in str(out[1])
    _results([out[0], out[2]])
    st = b.d.inbox.status(r1)
    assert st.state is FAILED and "lost its owner" in st.reason
    assert b.link.aborts == [(r1, f"Aborted: {out[1]}", True)]
    assert ("commit", r1) not in b.events  # never committed
    b.d.release_lease(b.ds, b.tickets[r3].lease_id)  # not in this batch
    assert len(b.d.leases) == 0  # drained: the receiver's fence is not kept


def test_duplicates_and_sizes_are_refused_before_anything_happens(b):
    r0, r1, r2, _ = b.rids
    before = b.dst.clone()
    with pytest.raises(InvalidArgument, match=r"items 0 and 2 both send request 'req-0'.*nothing was sent"):
        b.outbox.send_many(b.ps, [b.item(r0), b.item(r1), b.item(r0, start=8)])
    with pytest.raises(InvalidArgument, match=r"items 1 and 2 carry the same ticket \(lease \d+ of receiver boot"):
        b.outbox.send_many(b.ps, [b.item(r0), b.item(r1), b.item(r1)._replace(rid=r2)])
    with pytest.raises(InvalidArgument, match="at least one item"):
        b.outbox.send_many(b.ps, [])
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SEND_ITEMS} items, got 1,025; split them"):
        b.outbox.send_many(b.ps, [b.item(r0)] * (MAX_SEND_ITEMS + 1))
    assert b.events == [] and torch.equal(b.dst, before)
    assert all(b.state(rid) is WAITING for rid in b.rids)
    assert b.outbox.calls_total == 0 and b.outbox.failed_total == 0
    for rid in b.rids:
        b.d.release_lease(b.ds, b.tickets[rid].lease_id)


def test_an_item_given_as_an_error_comes_back_in_its_place(b):
    r0, r1 = b.rids[:2]
    unreadable = InvalidArgument("ticket bytes do not parse as a kvd ticket")
    out = b.outbox.send_many(b.ps, [b.item(r0), unreadable, b.item(r1)])
    assert out[1] is unreadable and isinstance(out[0], SendResult) and isinstance(out[2], SendResult)
    assert b.outbox.failed_total == 0  # not an item this daemon tried
    for rid in b.rids[2:]:
        b.d.release_lease(b.ds, b.tickets[rid].lease_id)


def test_receiver_aborts_in_the_middle_of_a_batch(b):
    """While item 2's ticket is checked, the decode engine aborts item 1, whose copies are issued
    but not yet committed; once item 3's ticket is accepted, it aborts item 3, before its copies
    are issued. Items 1 and 3 fail Aborted (3 with nothing written), 0 and 2 land."""
    r0, r1, r2, r3 = b.rids

    def abort(rid: str):
        def go():
            target = b.d.inbox.abort_local(rid, "the engine preempted it")
            assert target is not None  # the sender began: it is told (AbortSend)
            b.outbox.abort_remote(target[1], "the engine preempted it")

        return go

    b.link.after_check[r2] = abort(r1)
    b.link.after_check[r3] = abort(r3)
    out = b.outbox.send_many(b.ps, [b.item(r) for r in b.rids])
    _results([out[0], out[2]])
    assert isinstance(out[1], Aborted) and isinstance(out[3], Aborted)
    assert f"transfer of {r3!r} aborted after 0 bytes: receiver aborted" in str(out[3])
    for rid in (r1, r3):
        st = b.d.inbox.status(rid)
        assert st.state is FAILED and st.reason == "aborted by the decode engine: the engine preempted it"
    # 1 is not committed: the sender learned of the abort before its commit (it checks then too)
    assert ("issue", r3) not in b.events and ("commit", r1) not in b.events
    # Item 1's bytes landed before the abort was noticed; item 3's pages were never written.
    assert torch.equal(b.dst, b.expected([r0, r1, r2]))
    # Each told its receiver that nothing of it can still land: the fences end now.
    assert [(rid, drained) for rid, _, drained in b.link.aborts] == [(r1, True), (r3, True)]
    assert len(b.d.leases) == 0
