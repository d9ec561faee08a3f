"""Issue 16: a Commit's wake of the decode engine's WaitReady, deferred until the sender's reply
is sent (:meth:`kvd.handoff.inbox.Inbox.commit` with ``defer_wake``; the peer socket calls the
wake once its reply left)."""

from __future__ import annotations

import threading
import time

from kvd.daemon.leases import LeaseTable
from kvd.handoff.inbox import Inbox
from kvd.records import LeaseKind, TransferRef, TransferState


def _receiving() -> tuple[Inbox, TransferRef]:
    leases = LeaseTable()
    inbox = Inbox(threading.RLock(), leases, boot_id="b1", clock=time.monotonic, on_stale=lambda: None)
    lease = leases.acquire("r", LeaseKind.RECV, session="s", boot_id="b1", epoch=1)
    inbox.expect("r", lease.lease_id)
    ref = TransferRef("b1", lease.lease_id, "r")
    inbox.begin(ref, "sender")
    return inbox, ref


def _wait_in_thread(inbox: Inbox) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append((inbox.wait("r", 5), time.monotonic())))
    t.start()
    time.sleep(0.02)  # the waiter is in its wait
    return t, got


def test_a_deferred_wake_wakes_the_waiter_when_called_and_the_state_is_ready_before():
    inbox, ref = _receiving()
    t, got = _wait_in_thread(inbox)
    wake = inbox.commit(ref, True, 10, "sender", defer_wake=True)
    assert inbox.status("r").state is TransferState.READY  # READY at once; only the wake waits
    called = time.monotonic()
    wake()
    t.join(2)
    st, at = got[0]
    assert st.state is TransferState.READY and st.nbytes == 10
    print(f"woken {1e3 * (at - called):.2f} ms after the wake")
    assert at - called < 0.05  # far under the waiter's 0.1 s poll: the wake woke it


def test_an_undeferred_commit_wakes_at_once_and_a_chunk_has_nothing_to_wake():
    inbox, ref = _receiving()
    assert inbox.commit(ref, False, 4, "sender")() is None  # not the last: a no-op wake
    t, got = _wait_in_thread(inbox)
    a = time.monotonic()
    inbox.commit(ref, True, 6, "sender")
    t.join(2)
    st, at = got[0]
    assert st.state is TransferState.READY and st.nbytes == 10 and at - a < 0.05


def test_a_wait_whose_caller_is_gone_ends_at_its_next_wake_up_with_the_state_then():
    """``active`` is asked at each wake-up, never before the first wait (a wait that need not
    block pays nothing); once False the wait returns the state then, long before its timeout."""
    inbox, _ = _receiving()
    asked: list[float] = []
    gone = threading.Event()

    def active() -> bool:
        asked.append(time.monotonic())
        return not gone.is_set()

    got: list = []
    t = threading.Thread(target=lambda: got.append(inbox.wait("r", 60, active)))
    t.start()
    time.sleep(0.35)
    assert asked, "asked at the wake-ups"
    gone.set()
    t.join(5)
    assert not t.is_alive() and got and got[0].state is TransferState.RECEIVING
