"""A daemon that hangs (SIGSTOP: swapped out, paused by a debugger, a stuck host) is not dead: its
process lives and its sockets accept. The daemon beside it must not wait on it longer than its
peer timeout, nor stop serving its own engines meanwhile, and once the hung one runs again neither
keeps anything of the transfer caught in between.

* A hung receiver: the prefill engine's Send fails after the peer timeout (twice it where the
  socket's hello went unanswered first: then gRPC gets its own) with an error that names the
  call, the daemon and the setting; while it waits, another engine's calls on the prefill daemon
  are answered. ``warm``: the daemons talked before, over the peer socket; the receiver, resumed,
  reads the check it was sent, and fails that transfer for its sender's silence. ``cold``: the
  hung daemon never answered the socket's hello, and the call over gRPC never reached it: the
  transfer is still WAITING, its decode engine free to take another sender. A new handoff works
  in both, and after ``cold`` handoffs go over the peer socket again within seconds (a probe's
  hello is answered), not after the route's ``RETRY_S``.
* A hung sender: the decode engine's wait ends FAILED once the prefill daemon has been silent
  for the peer timeout; resumed, the prefill daemon's Send fails, and a new handoff works.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import daemon_kit as dk
import handoff_kit as hk
import proc_kit
import pytest

from kvd.client import TransferState
from kvd.errors import DeadlineExceeded, KvdError

READY, FAILED = TransferState.READY, TransferState.FAILED
TOKENS = 40


@pytest.fixture
def procs(tmp_path):
    pair = hk.make_pair(tmp_path, "local", "subproc")
    yield pair
    for s in pair.sides:
        if s.target is not None and s.target.proc is not None:
            os.kill(s.target.proc.pid, signal.SIGCONT)  # never leave a stopped daemon behind
        s.stop()


def _handoff_works(p, d, rid: str) -> None:
    _, lease = d.allocate_recv(rid, TOKENS)
    p.allocate(rid, TOKENS, ticket=lease.ticket)
    p.send(rid, lease.ticket, free=True)
    assert d.wait_ready(rid, 10).state is READY
    d.free(rid)


def _settled(pair: hk.Pair) -> None:
    probes = {s.role: s.connect("hung-probe") for s in pair.sides}

    def clean() -> bool:
        for c in probes.values():
            st = c.stats()
            if st.pool.requests_live or st.leases_live or any(g.used_pages for g in st.pool.groups):
                return False
        return True

    try:
        dk.wait_for(clean, hk.FENCE_S + hk.PEER_TIMEOUT_S + 5, "both daemons back to no request, lease or page")
    finally:
        for c in probes.values():
            c.close()


def _answered_meanwhile(other, busy: threading.Thread) -> int:
    """Calls of another engine on the same daemon, made while ``busy`` (the blocked call) still
    runs: every one must be answered. Returns how many were."""
    n = 0
    while busy.is_alive() and n < 200:
        rid = f"other-{n}"
        other.allocate(rid, 8)
        other.free(rid)
        other.echo()
        n += 1
    return n


@pytest.mark.parametrize("talked", ["warm", "cold"])
def test_a_hung_receiver_fails_the_send_in_time_and_wedges_nothing(procs, talked):
    p, d = procs.prefill.connect("prefill-engine"), procs.decode.connect("decode-engine")
    other = procs.prefill.connect("another-prefill-engine")
    if talked == "warm":
        _handoff_works(p, d, "before-the-hang")  # a peer socket connection is held since
    _, lease = d.allocate_recv("caught", TOKENS)
    p.allocate("caught", TOKENS)  # the check goes with the Send, to a daemon that no longer answers
    decode_pid = procs.decode.t.proc.pid
    proc_kit.stop(decode_pid)
    outcome: list[BaseException | None] = []
    t0 = time.monotonic()

    def send() -> None:
        try:
            p.send("caught", lease.ticket)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- judged below
            outcome.append(exc)

    try:
        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.1)
        served = _answered_meanwhile(other, t)
        t.join(timeout=hk.PEER_TIMEOUT_S + 10)
        took = time.monotonic() - t0
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert not t.is_alive(), "the Send to a hung receiver never returned"
    err = outcome[0] if outcome else None
    assert isinstance(err, DeadlineExceeded), f"a Send to a hung receiver ended after {took:.2f} s with {outcome}"
    assert served > 0, f"no call of another engine was answered while the Send waited ({took:.2f} s)"
    # What to look at: the call, the daemon, the setting (not gRPC's bare "Deadline Exceeded").
    assert "CheckTicket" in str(err) and f"within {hk.PEER_TIMEOUT_S:g} s (peer_timeout_s)" in str(err), str(err)
    print(f"\nhung receiver ({talked}): the Send failed after {took:.2f} s ({err}); {served} rounds of another "
          "engine's calls answered meanwhile")
    if talked == "warm":
        # Resumed, the decode daemon reads the check it was sent, and fails the transfer for its
        # sender's silence: its engine is not left waiting.
        st = d.wait_ready("caught", hk.PEER_TIMEOUT_S + 10)
        assert st.state is FAILED, st
    else:
        # Nothing reached it: the transfer waits for a sender as before, its lease intact.
        assert d.wait_ready("caught", 0.5).state is TransferState.WAITING
        d.abort("caught", "the prefill side gave up")
    d.free("caught")
    p.free("caught")
    _handoff_works(p, d, "after-the-hang")
    if talked == "cold":
        # Its hello went unanswered, so the route went to gRPC; a probe's hello is answered now,
        # and handoffs go over the peer socket again long before RETRY_S (10 s) has passed.
        def by_socket() -> float:
            return procs.prefill.counter("kvd_peer_calls_total", method="CheckTicket", path="socket")

        def over_the_socket_again(n=[0], base=by_socket()) -> bool:  # noqa: B006 -- a counter of tries
            n[0] += 1
            _handoff_works(p, d, f"after-the-hang-{n[0]}")
            return by_socket() > base

        dk.wait_for(over_the_socket_again, 6, "a handoff over the peer socket again", interval=0.2)
    for c in (p, d, other):
        c.close()
    _settled(procs)


def test_a_hung_sender_fails_the_wait_in_time_and_wedges_nothing(procs):
    p, d = procs.prefill.connect("prefill-engine"), procs.decode.connect("decode-engine")
    other = procs.decode.connect("another-decode-engine")
    _, lease = d.allocate_recv("caught", TOKENS)
    p.allocate("caught", TOKENS, ticket=lease.ticket)  # the transfer begun: the receiver expects its sender
    prefill_pid = procs.prefill.t.proc.pid
    # The receiver accepted the sender's check (sent past the Allocate's reply): RECEIVING.
    dk.wait_for(lambda: d.wait_ready("caught", 0).state is TransferState.RECEIVING, 5, "the receiver to accept the ticket")
    proc_kit.stop(prefill_pid)
    got = []
    t0 = time.monotonic()
    try:
        t = threading.Thread(target=lambda: got.append(d.wait_ready("caught", hk.PEER_TIMEOUT_S + 10)))
        t.start()
        served = _answered_meanwhile(other, t)
        t.join(timeout=hk.PEER_TIMEOUT_S + 12)
        took = time.monotonic() - t0
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    assert not t.is_alive() and got, "the decode engine's wait outlived its timeout"
    assert got[0].state is FAILED, f"a transfer whose sender hung ended {got[0]}"
    assert served > 0
    print(f"\nhung sender: the wait ended FAILED after {took:.2f} s ({got[0].reason}); {served} rounds of "
          "another engine's calls answered meanwhile")
    d.free("caught")
    with pytest.raises(KvdError):  # resumed, the sender's Send finds its transfer failed
        p.send("caught", lease.ticket)
    p.free("caught")
    _handoff_works(p, d, "after-the-hang")
    for c in (p, d, other):
        c.close()
    _settled(procs)


def test_a_receiver_that_hung_itself_does_not_blame_its_sender(procs):
    """The decode daemon itself stopped (SIGSTOP: CPU-throttled, paused, its VM descheduled) for
    longer than the peer timeout, while its sender kept beating: resumed, it must not fail the
    transfer for a silence it was not running to hear. The Send then lands."""
    p, d = procs.prefill.connect("prefill-engine"), procs.decode.connect("decode-engine")
    _, lease = d.allocate_recv("paused", TOKENS)
    p.allocate("paused", TOKENS, ticket=lease.ticket)
    dk.wait_for(lambda: d.wait_ready("paused", 0).state is TransferState.RECEIVING, 5, "the receiver to accept the ticket")
    decode_pid = procs.decode.t.proc.pid
    proc_kit.stop(decode_pid)
    try:
        time.sleep(2.5 * hk.PEER_TIMEOUT_S)
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    time.sleep(0.5)  # a few of its sweeps, and the sender's beats, since it resumed
    st = d.wait_ready("paused", 0)
    assert st.state is TransferState.RECEIVING, f"resumed, the receiver failed a live sender's transfer: {st}"
    p.send("paused", lease.ticket, free=True)
    assert d.wait_ready("paused", 10).state is READY
    d.free("paused")
    for c in (p, d):
        c.close()
    _settled(procs)
