"""BeginSend between two real daemons (every variant of ``pair``): the prefill engine opens a
transfer when the ticket arrives, the decode daemon checks the ticket then, and the Sends that
follow start writing at once (no CheckTicket round trip in them). A ticket the receiver refuses
is refused by BeginSend with the status the first Send would have raised, nothing changed."""

from __future__ import annotations


import daemon_kit as dk
import grpc
import pytest

from kvd.client import TransferState
from kvd.errors import InvalidArgument, NotFound, PermissionDenied
from kvd.records import SEND_PHASES

READY, WAITING, RECEIVING = TransferState.READY, TransferState.WAITING, TransferState.RECEIVING


def _checks(hp) -> float:
    """CheckTicket calls the prefill daemon made, over either path."""
    return sum(hp.pair.prefill.counter("kvd_peer_calls_total", method="CheckTicket", path=p) for p in ("socket", "grpc"))


def test_begin_send_then_every_send_skips_the_check(hp):
    rid, src, dst, lease = hp.setup_request(70, prefix="begin")
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    checks0 = _checks(hp)

    assert hp.p.c.begin_send(rid, lease.ticket) is True
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING  # the decode daemon accepted it now
    assert hp.p.c.begin_send(rid, lease.ticket) is False  # open already: nothing asked
    first = hp.p.c.send(rid, lease.ticket, start=0, end=40, last=False)
    last = hp.p.c.send(rid, lease.ticket, start=40, last=True)

    assert "check" not in first.phases and "check" not in last.phases, (first.phases, last.phases)
    assert _checks(hp) == checks0 + 1  # begin's, and only begin's
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is READY and st.nbytes == first.nbytes + last.nbytes, st
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    assert hp.p.c.stats().leases_live == 0
    hp.check()


def _planned_ahead(hp) -> float:
    return hp.pair.prefill.counter("kvd_send_planned_ahead_total")


def test_a_whole_request_send_after_begin_uses_the_plan_begin_made(hp):
    rid, src, dst, lease = hp.setup_request(70, prefix="ahead")
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    ahead0 = _planned_ahead(hp)
    assert hp.p.c.begin_send(rid, lease.ticket) is True
    res = hp.p.c.send(rid, lease.ticket)
    assert _planned_ahead(hp) == ahead0 + 1
    assert [k for k in res.phases if k in SEND_PHASES] == ["prep", "lease", "plan", "issue", "write", "commit", "release"], res.phases
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    hp.check()


def test_chunk_sends_after_begin_with_the_chunk_use_the_plans_begin_made(hp):
    rid, src, dst, lease = hp.setup_request(70, prefix="ahead-chunks")
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    ahead0 = _planned_ahead(hp)
    with pytest.raises(InvalidArgument, match="chunk_tokens -1 must be 0"):
        hp.p.c.begin_send(rid, lease.ticket, chunk_tokens=-1)  # refused by the client, before the wire
    assert hp.p.c.begin_send(rid, lease.ticket, chunk_tokens=40) is True
    first = hp.p.c.send(rid, lease.ticket, start=0, end=40, last=False)
    last = hp.p.c.send(rid, lease.ticket, start=40, last=True)
    assert _planned_ahead(hp) == ahead0 + 2
    assert hp.d.c.wait_ready(rid, 5).state is READY
    assert first.nbytes + last.nbytes == hp.d.c.wait_ready(rid, 0).nbytes
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    hp.check()


def test_begin_send_with_a_dead_lease_is_refused_and_changes_nothing(hp):
    rid, _, _, lease = hp.setup_request(20, scatter=False, prefix="begin-gone")
    hp.d.c.release_lease(lease.lease_id)
    before_p, before_d = hp.p.c.stats(), hp.d.c.stats()
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "is not live"):
        hp.p.c.begin_send(rid, lease.ticket)
    after_p, after_d = hp.p.c.stats(), hp.d.c.stats()
    assert (after_p.pool, after_p.leases_live) == (before_p.pool, before_p.leases_live)
    assert (after_d.pool, after_d.leases_live) == (before_d.pool, before_d.leases_live)
    hp.check()


def test_begin_send_for_another_sessions_request_is_refused_before_the_receiver_hears(hp):
    rid, _, _, lease = hp.setup_request(20, scatter=False, prefix="begin-other")
    other = hp.pair.prefill.connect("another-engine")
    with dk.expect(PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, "another client session"):
        other.begin_send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 0).state is WAITING  # the decode daemon never heard of it
    hp.p.c.send(rid, lease.ticket)  # the owner's Send still goes through
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.check()


def test_the_asyncio_client_begins_a_send_too(hp):
    async def send(kv, rid, ticket):
        return await kv.begin_send(rid, ticket), await kv.send(rid, ticket)

    opened, res = hp.async_handoff("async-begin", send)
    assert opened is True and "check" not in res.phases, res
    hp.check()


def test_a_send_of_a_begun_transfer_reuses_its_ticket_parse(hp, monkeypatch):
    """Issue 16: the ticket's bytes parse alike, so a Send of an open transfer reads them once (at
    BeginSend); bytes of no open transfer are parsed (and refused) as before."""
    if hp.p.side.node is None:
        pytest.skip("patches the daemon's ticket reader: in-process pair only")
    import kvd.handoff.outbox as ob

    rid, src, dst, lease = hp.setup_request(40, prefix="begin-parse")
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    assert hp.p.c.begin_send(rid, lease.ticket) is True
    calls = []
    real = ob.read_ticket
    monkeypatch.setattr(ob, "read_ticket", lambda raw: calls.append(raw) or real(raw))
    res = hp.p.c.send(rid, lease.ticket)
    assert calls == [] and res.phases["ticket"] >= 0, calls  # no parse: the transfer's own
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "ticket"):
        hp.p.c.send(rid, b"not a ticket")
    assert calls == [b"not a ticket"]
    hp.p.free(rid)
    hp.d.free(rid)
    hp.check()
