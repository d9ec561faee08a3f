"""Issue 4, the failure paths: an abort from the decode engine mid-transfer, a prefill daemon
killed mid-transfer, a decode daemon killed mid-transfer. Each side learns within about a
second, no lease outlives the writes it fenced, and afterwards both pools hold exactly what the
live requests need (the conftest's teardown then proves both empty after the sessions close).

On the subprocess variants "killed" is SIGKILL; in-process it is ``Daemon.stop(0)`` (the test
process cannot kill itself), which stops the server, the heartbeats and the backend at once.
"""

from __future__ import annotations

import threading
import time

import daemon_kit as dk
import grpc
import handoff_kit as hk
import pytest
import torch

from kvd.client import TransferState
from kvd.errors import Aborted, KvdError, StaleEpoch, Unavailable

READY, WAITING, RECEIVING, FAILED = TransferState.READY, TransferState.WAITING, TransferState.RECEIVING, TransferState.FAILED
TOKENS = 103


def _failed_total(hp) -> int | None:
    """Inbound transfers the decode node counted as failed (in-process only)."""
    node = hp.pair.decode.node
    return None if node is None else node.inbox.failed_total


def _send_once_reachable(hp, rid: str, ticket: bytes):
    """Send, retrying while the receiver is still unreachable: right after a restart the
    sender's channel may be between reconnect attempts (they are at most a peer timeout apart)."""
    deadline = time.monotonic() + hk.PEER_TIMEOUT_S + 2.0
    while True:
        try:
            return hp.p.c.send(rid, ticket)
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_decode_abort_between_chunks_stops_the_sender_and_fences_the_pages(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    p_used = hp.p.used()
    failed0 = _failed_total(hp)
    hp.p.c.send(rid, lease.ticket, end=40, last=False)
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING

    t_abort = time.monotonic()
    assert hp.d.c.abort(rid, "engine preempted it") is True  # the sender was told
    st = hp.d.c.wait_ready(rid, 0)
    assert st.state is FAILED and st.reason == "aborted by the decode engine: engine preempted it", st
    with dk.expect(Aborted, grpc.StatusCode.ABORTED, "engine preempted it"):
        hp.p.c.send(rid, lease.ticket, start=40, last=True)
    # Nothing after the abort was written: the decode arena holds the first chunk only.
    pages = hk.moved(src, dst, 40, state=False)
    exp = hk.expected_arena(before_d, hp.p.arena, pages)
    assert torch.equal(hp.d.arena, exp), hk.diff_summary(hp.d.arena, exp)
    assert torch.equal(hp.p.arena, before_p)
    # The sender: no SEND lease left, its pool as it was.
    assert hp.p.c.stats().leases_live == 0 and hp.p.used() == p_used
    hp.p.assert_accounted()

    # The receiver keeps the pages fenced until no write of the sender can be in flight: here the
    # sender, idle, answered the abort with a drained AbortReceive, so the fence ended then (not
    # fence_s later; a sender that cannot answer keeps it fence_s: test_prefill_killed_mid_transfer).
    # The engine's free is accepted and takes effect when the fence ends.
    assert hp.d.free(rid) == 1
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    print(f"[{hp.pair.backend}/{hp.pair.mode}] pages back {time.monotonic() - t_abort:.3f} s after the abort")
    # The prefill engine trying again later still hears why, and still writes nothing.
    with dk.expect(Aborted, grpc.StatusCode.ABORTED, "receiver aborted: engine preempted it"):
        hp.p.c.send(rid, lease.ticket, start=40, last=True)
    assert torch.equal(hp.d.arena, exp)
    if failed0 is not None:
        assert _failed_total(hp) == failed0 + 1
    hp.check()


def test_decode_abort_while_the_sender_streams(hp):
    tokens = 400
    rid, src, dst, lease = hp.setup_request(tokens, scatter=False)
    failed0 = _failed_total(hp)
    out: dict = {"chunks": 0}
    go = threading.Event()

    def stream():
        # Chunks of 8 tokens, never the last one, over and over: only the abort ends this.
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                for t0 in range(0, tokens, 8):
                    hp.p.c.send(rid, lease.ticket, start=t0, end=t0 + 8, last=False)
                    out["chunks"] += 1
                    go.set()
        except KvdError as exc:
            out["exc"] = exc
        go.set()

    th = threading.Thread(target=stream)
    th.start()
    assert go.wait(10)
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING
    hp.d.c.abort(rid, "client went away")
    th.join(10)  # the stream would run on for its whole length had the abort not reached the sender
    assert not th.is_alive()
    assert isinstance(out.get("exc"), Aborted), out
    # The decode engine's own reason stands; what the sender says afterwards does not rewrite it.
    st = hp.d.c.wait_ready(rid, 0)
    assert st.state is FAILED and st.reason == "aborted by the decode engine: client went away", st
    if failed0 is not None:
        assert _failed_total(hp) == failed0 + 1, "one aborted transfer counted more than once"
    dk.wait_for(lambda: hp.p.c.stats().leases_live == 0, 3.0, "the SEND lease released")
    hp.p.assert_accounted()
    assert hp.d.free(rid) == 1
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    hp.check()


def test_decode_engine_leaving_without_free_keeps_the_fence(hp):
    rid, src, dst, lease = hp.setup_request(40, scatter=False)
    hp.p.c.send(rid, lease.ticket, end=20, last=False)
    t_abort = time.monotonic()
    hp.d.c.abort(rid, "engine exits")
    # The engine closes its session without freeing: the daemon frees its requests, the fenced
    # one only when the fence ends (a write of the sender may still land on those pages) -- at
    # once here, since the idle sender answered the abort drained.
    hp.d.reconnect()  # closes the old session
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    print(f"[{hp.pair.backend}/{hp.pair.mode}] pages back {time.monotonic() - t_abort:.3f} s after the abort")
    # The sender heard: its next Send is refused with the receiver's reason, writing nothing.
    with pytest.raises(Aborted, match="engine exits"):
        hp.p.c.send(rid, lease.ticket, start=20, last=True)
    hp.check()


def test_prefill_killed_mid_transfer(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    hp.p.c.send(rid, lease.ticket, end=40, last=False)
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING
    hp.d.assert_accounted()

    hp.pair.prefill.kill()
    # The decode side learns within a few peer timeouts (not after a long fixed timeout): the
    # wait is bounded by that, and the state says whether it learned.
    st = hp.d.c.wait_ready(rid, 3 * hk.PEER_TIMEOUT_S)
    assert st.state is FAILED and "stopped answering" in st.reason, st
    # The sender may have been partitioned rather than dead: the pages stay fenced, then return.
    assert hp.d.free(rid) == 1
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    assert hp.d.c.stats().leases_live == 0
    hp.d.assert_accounted()
    if hp.pair.decode.node is not None:
        hp.pair.decode.node.check()

    # A new prefill daemon on the same socket and port serves the next transfer.
    hp.pair.prefill.restart()
    hp.p.reconnect()
    rid2, src2, dst2, lease2 = hp.setup_request(TOKENS, scatter=False)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    hp.p.c.send(rid2, lease2.ticket)
    assert hp.d.c.wait_ready(rid2, 5).state is READY
    exp = hk.expected_arena(before_d, before_p, hk.moved(src2, dst2, TOKENS, state=True))
    assert torch.equal(hp.d.arena, exp), hk.diff_summary(hp.d.arena, exp)
    hp.check()


def test_decode_killed_mid_transfer(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    hp.p.c.send(rid, lease.ticket, end=40, last=False)
    p_stats = hp.p.c.stats()
    p_used = hp.p.used()

    hp.pair.decode.kill()
    with pytest.raises((Unavailable, Aborted)) as info:  # unreachable, or learned from the heartbeat
        hp.p.c.send(rid, lease.ticket, start=40, last=True)
    # The SEND lease is released; the prefill pool is otherwise as it was.
    dk.wait_for(lambda: hp.p.c.stats().leases_live == 0, 3.0, "the SEND lease released")
    s = hp.p.c.stats()
    assert hp.p.used() == p_used and s.pool.requests_live == p_stats.pool.requests_live
    hp.p.assert_accounted()
    if hp.pair.prefill.node is not None:
        hp.pair.prefill.node.check()
    # The peer link (connection refused), the heartbeat (unreachable) or the data plane (no live
    # owner of the peer arena / connection failure) notices first, depending on the backend.
    why = str(info.value)
    assert any(w in why for w in ("refused", "unreachable", "no live owner", "cannot be reached", "is gone", "failed", "Connection")), why

    # The decode daemon comes back on the same socket and port: a new boot.
    hp.pair.decode.restart()
    hp.d.reconnect()
    dst2 = hp.d.alloc(rid, TOKENS, receive=True)
    assert dst2.boot_id != dst.boot_id
    # Lease ids start again in a new boot: take the very id the old ticket names, so only the
    # boot id tells the old ticket from the new one.
    while True:
        lease2 = hp.d.c.acquire_lease(rid, "recv")
        assert lease2.lease_id <= lease.lease_id
        if lease2.lease_id == lease.lease_id:
            break
        hp.d.c.release_lease(lease2.lease_id)
    hk.randomize(hp.d.arena, hp.seed + 5)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    with dk.expect(StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION, "restarted"):
        _send_once_reachable(hp, rid, lease.ticket)
    assert torch.equal(hp.d.arena, before_d)
    # The stale sender's failure must not touch the new transfer of the same rid and lease id.
    st = hp.d.c.wait_ready(rid, 0.3)
    assert st.state is WAITING, st
    hp.p.c.send(rid, lease2.ticket)
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is READY, st
    exp = hk.expected_arena(before_d, before_p, hk.moved(src, dst2, TOKENS, state=True))
    assert torch.equal(hp.d.arena, exp), hk.diff_summary(hp.d.arena, exp)
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 0
    hp.check()
