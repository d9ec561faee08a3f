"""Issue 16: one WaitEnded call watches every inbound transfer of a decode engine's session -- those
whose RECV lease comes after the call too -- and answers each that ended (READY or FAILED) once,
in the order they ended, over the engine socket and over gRPC alike; over gRPC it shares
WaitReady's bounded waits and is never refused what it can answer at once."""

from __future__ import annotations

import asyncio
import threading
import time

import daemon_kit as dk
import grpc
import pytest

from kvd import errors as E
from kvd.client import AsyncClient, TransferState
from kvd.server.service import GRPC_WAIT_SLOTS


@pytest.fixture(params=["fast", "grpc"])
def watcher(request, hp):
    """A second session on the decode daemon, over the engine socket or gRPC: the watcher."""
    c = hp.pair.decode.connect(f"watcher-{request.param}", transport=request.param)
    assert c.transport == request.param
    yield c
    c.close()


def _recv(hp, c, tokens: int, prefix: str) -> tuple[str, bytes]:
    """A request on both daemons, its RECV lease taken by session ``c``: (rid, ticket)."""
    rid = dk.rid(prefix)
    hp.p.alloc(rid, tokens)
    _, lease = c.allocate_recv(rid, tokens)
    return rid, lease.ticket


def _send(hp, rid: str, ticket: bytes) -> int:
    r = hp.p.c.send(rid, ticket, free=True)
    hp.p.live.discard(rid)
    return r.nbytes


def test_one_call_answers_each_transfer_of_the_session_once_as_it_ends(hp, watcher):
    a, ta = _recv(hp, watcher, 40, "we-a")
    b, _ = _recv(hp, watcher, 24, "we-b")
    first = watcher.wait_ended(0, 0)
    assert first.transfers == [] and first.cursor >= 0, first  # nothing over yet: at once, none

    got: list = []
    t = threading.Thread(target=lambda: got.append(watcher.wait_ended(first.cursor, 10)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the call answered before any transfer ended"
    late, tl = _recv(hp, watcher, 16, "we-late")  # a RECV lease taken while the call waits
    nbytes = _send(hp, late, tl)
    t.join(5)
    assert not t.is_alive() and len(got) == 1, "the waiting call missed a transfer whose lease came after it"
    ended = got[0]
    assert [(s.rid, s.state, s.nbytes) for s in ended.transfers] == [(late, TransferState.READY, nbytes)], ended
    assert ended.cursor > first.cursor

    assert watcher.wait_ended(ended.cursor, 0).transfers == []  # answered once
    nbytes_a = _send(hp, a, ta)
    assert watcher.abort(b, "the decode engine gave up") is False  # no sender began
    again = watcher.wait_ended(ended.cursor, 5)
    assert [(s.rid, s.state) for s in again.transfers] == [(a, TransferState.READY), (b, TransferState.FAILED)], again
    assert again.transfers[0].nbytes == nbytes_a and "gave up" in again.transfers[1].reason

    # From 0: every one the daemon holds that is over, in the order they ended.
    assert [s.rid for s in watcher.wait_ended(0, 0).transfers] == [late, a, b]
    assert watcher.free(late, a, b) == 3
    assert watcher.wait_ended(0, 0).transfers == []  # freed: forgotten
    hp.check()


def test_another_sessions_transfers_are_not_answered(hp, watcher):
    mine, _ = _recv(hp, watcher, 24, "we-mine")
    theirs, t_theirs = _recv(hp, hp.d.c, 24, "we-theirs")
    hp.d.live.add(theirs)
    c0 = watcher.wait_ended(0, 0).cursor
    _send(hp, theirs, t_theirs)
    assert hp.d.c.wait_ready(theirs, 5).state is TransferState.READY
    t0 = time.monotonic()
    assert watcher.wait_ended(c0, 0.4).transfers == []  # the other session's READY does not end the wait
    assert time.monotonic() - t0 >= 0.35
    assert [s.rid for s in hp.d.c.wait_ended(c0, 0).transfers] == [theirs]
    watcher.abort(mine, "test over")
    assert watcher.free(mine) == 1 and hp.d.free(theirs) == 1
    hp.check()


@pytest.mark.parametrize("transport", ["fast", "grpc"])
def test_the_asyncio_client_waits_for_ends_the_same_way(hp, transport):
    rid = dk.rid("we-async")
    hp.p.alloc(rid, 24)

    async def go() -> None:
        async with await AsyncClient.connect(hp.pair.decode.t.unix, name="async-watcher", transport=transport) as kv:
            _, lease = await kv.allocate_recv(rid, 24)
            c0 = (await kv.wait_ended(0, 0)).cursor
            waiting = asyncio.ensure_future(kv.wait_ended(c0, 10))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "answered before the transfer ended"
            nbytes = await asyncio.to_thread(_send, hp, rid, lease.ticket)
            got = await asyncio.wait_for(waiting, 5)
            assert [(t.rid, t.state, t.nbytes) for t in got.transfers] == [(rid, TransferState.READY, nbytes)], got
            assert got.cursor > c0 and (await kv.wait_ended(got.cursor, 0)).transfers == []
            assert await kv.free(rid) == 1

    asyncio.run(go())
    hp.check()


def test_bad_cursors_and_timeouts_are_refused_and_change_nothing(hp, watcher):
    rid, _ = _recv(hp, watcher, 24, "we-bad")
    cursor = watcher.wait_ended(0, 0).cursor
    with dk.expect(E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "wait from cursor 0"):
        watcher.wait_ended(cursor + 1_000_000, 0)
    with dk.expect(E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "wait timeout must be in [0, 3600]"):
        watcher.wait_ended(cursor, -1)
    assert watcher.wait_ready(rid, 0).state is TransferState.WAITING
    watcher.abort(rid, "test over")
    assert watcher.free(rid) == 1
    hp.check()


def test_over_grpc_with_every_wait_taken_it_retries_and_is_answered_at_once_when_it_can(hp):
    """Every gRPC wait slot held by WaitReady calls on transfers that never come: a WaitEnded over
    gRPC with nothing to answer is refused for now and sent again by the client within its
    timeout; one with a transfer over to answer is answered without a slot (the waits that hold the
    slots are still blocked when it is). Waits, not timings: a slow machine only waits longer."""
    g = hp.pair.decode.connect("watcher-slots", transport="grpc")
    held = [_recv(hp, g, 16, f"we-held{i}")[0] for i in range(GRPC_WAIT_SLOTS)]
    waits = [threading.Thread(target=g.wait_ready, args=(r, 30.0)) for r in held]
    for w in waits:
        w.start()
    try:
        time.sleep(0.3)  # the held waits reach the daemon
        refused = lambda: hp.pair.decode.counter("kvd_rpc_duration_seconds_count", method="WaitEnded", code="UNAVAILABLE")  # noqa: E731
        c0 = g.wait_ended(0, 0).cursor
        t0, before = time.monotonic(), refused()
        assert g.wait_ended(c0, 0.8).transfers == []  # refused (Unavailable) and sent again until its end
        assert time.monotonic() - t0 >= 0.6 and all(w.is_alive() for w in waits)
        assert refused() > before
        rid, ticket = _recv(hp, g, 24, "we-over")
        _send(hp, rid, ticket)
        before = refused()
        got = g.wait_ended(c0, 20)
        assert [(s.rid, s.state) for s in got.transfers] == [(rid, TransferState.READY)]
        assert all(w.is_alive() for w in waits) and refused() == before, "the answer was refused for want of a slot"
    finally:
        for r in held:
            g.abort(r, "test over")
        for w in waits:
            w.join(5)
    assert g.free(*held, rid) == GRPC_WAIT_SLOTS + 1
    g.close()
    hp.check()
