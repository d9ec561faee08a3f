"""Doorbells (issue 16): the decode daemon writes each inbound transfer's state on a shared
board, engines read it read-only; a slot names its lease, so a stale reader never mistakes
another transfer's state for its own."""

from __future__ import annotations

import mmap
import os
import threading

import pytest

from kvd.daemon.leases import LeaseTable
from kvd.handoff.inbox import Inbox
from kvd.memory.doorbells import SLOT_BYTES, Doorbells, DoorbellView
from kvd.records import LeaseKind, TransferRef, TransferState


@pytest.fixture
def board():
    b = Doorbells(slots=8)
    yield b
    b.close()


def view_of(b: Doorbells) -> DoorbellView:
    return DoorbellView(b.reader_fd(), b.slots, SLOT_BYTES)


def test_a_slot_reads_its_own_lease_only(board):
    v = view_of(board)
    slot = board.take(41)
    assert v.read(slot, 41) == (TransferState.WAITING, 0)
    board.ring(slot, 41, TransferState.READY, 12345)
    assert v.read(slot, 41) == (TransferState.READY, 12345)
    assert v.read(slot, 40) is None and v.read(slot, 42) is None  # another lease: ask the daemon
    board.give(slot)
    assert v.read(slot, 41) is None  # emptied
    again = board.take(43)
    assert again == slot and v.read(slot, 41) is None and v.read(slot, 43) == (TransferState.WAITING, 0)
    assert v.read(-1, 43) is None and v.read(board.slots, 43) is None
    v.close()
    assert v.read(slot, 43) is None  # closed: the daemon answers


def test_a_full_board_gives_no_slot_and_the_reader_cannot_write(board):
    slots = [board.take(100 + i) for i in range(board.slots)]
    assert sorted(slots) == list(range(board.slots)) and board.in_use == board.slots
    assert board.take(999) == -1
    fd = board.reader_fd()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, board.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    v = view_of(board)
    with pytest.raises(TypeError):
        v._map[0] = 1  # type: ignore[index]  # a read-only mapping
    v.close()


def test_a_closed_board_takes_and_writes_nothing():
    b = Doorbells(slots=2)
    s = b.take(7)
    b.close()
    b.ring(s, 7, TransferState.READY, 1)  # the daemon is stopping: a late writer is harmless
    b.give(s)
    assert b.take(8) == -1
    b.close()  # twice: nothing


def test_the_inbox_rings_every_state_change(board):
    lock = threading.RLock()
    leases = LeaseTable(default_ttl=30.0, clock=lambda: 0.0)
    inbox = Inbox(lock, leases, boot_id="b", clock=lambda: 0.0, on_stale=lambda: None, doorbells=board)
    v = view_of(board)
    lease = leases.acquire("r", LeaseKind.RECV, session="s", boot_id="b", epoch=1)
    inbox.expect("r", lease.lease_id)
    slot = inbox.bell("r")
    assert slot >= 0 and v.read(slot, lease.lease_id) == (TransferState.WAITING, 0)
    ref = TransferRef("b", lease.lease_id, "r")
    inbox.begin(ref, "sender")
    assert v.read(slot, lease.lease_id) == (TransferState.RECEIVING, 0)
    inbox.commit(ref, False, 100, "sender")
    assert v.read(slot, lease.lease_id) == (TransferState.RECEIVING, 100)
    inbox.commit(ref, True, 50, "sender")
    assert v.read(slot, lease.lease_id) == (TransferState.READY, 150)
    inbox.forget("r")
    assert v.read(slot, lease.lease_id) is None and inbox.bell("r") == -1 and board.in_use == 0

    other = leases.acquire("q", LeaseKind.RECV, session="s", boot_id="b", epoch=1)
    inbox.expect("q", other.lease_id)
    q = inbox.bell("q")
    inbox.abort_local("q", "the engine gave up")
    assert v.read(q, other.lease_id) == (TransferState.FAILED, 0)
    # A new RECV lease of the same request: the old transfer's slot goes back first.
    again = leases.acquire("q", LeaseKind.RECV, session="s", boot_id="b", epoch=1)
    inbox.expect("q", again.lease_id)
    assert board.in_use == 1 and v.read(inbox.bell("q"), again.lease_id) == (TransferState.WAITING, 0)
    v.close()



def test_a_closed_board_hands_out_no_descriptor_and_a_view_checks_the_size():
    from kvd.errors import FailedPrecondition, InvalidArgument

    b = Doorbells(slots=4)
    fd = b.reader_fd()
    with pytest.raises(InvalidArgument, match="not one this client reads"):
        DoorbellView(fd, 5)  # more slots than the file holds: refused (and the fd closed), not a SIGBUS later
    with pytest.raises(OSError):
        os.fstat(fd)
    b.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        b.reader_fd()


def test_many_doorbells_read_at_once(board):
    import numpy as np

    v = view_of(board)
    a, b = board.take(10), board.take(11)
    board.ring(b, 11, TransferState.READY, 5)
    got = v.states(np.array([a, b, b]), np.array([10, 11, 10]))
    assert got.tolist() == [1, 3, 0]  # WAITING, READY, another lease's slot
    v.close()
    assert v.states(np.array([a]), np.array([10])).tolist() == [0]


def test_a_board_refused_busy_is_asked_for_again_and_one_refused_otherwise_is_not(board):
    """A client maps its daemon's board at its first RECV lease with a slot. A daemon that was only
    busy (Unavailable with a retry hint: every engine-socket connection in a call, or the fetch's
    own connection evicted) is asked again at the next lease; one that refused for good (no board,
    a daemon that predates doorbells) is not asked again: its reads go to the daemon."""
    from kvd.client.bells import Bells
    from kvd.errors import FailedPrecondition, Unavailable

    answers = [Unavailable("busy", retry_after_s=0.0), (view_of(board), "boot-1")]
    asked = []

    def fetch():
        asked.append(1)
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    bells = Bells(fetch)
    slot = board.take(7)
    bells.note("a", slot + 1, 7, "boot-1")
    assert bells.state("a") is None and len(asked) == 1  # busy: no board yet
    bells.note("a", slot + 1, 7, "boot-1")
    assert bells.state("a") == (TransferState.WAITING, 0) and len(asked) == 2
    bells.close()

    refused = []

    def never():
        refused.append(1)
        raise FailedPrecondition("this daemon keeps no doorbell board")

    quiet = Bells(never)
    quiet.note("b", slot + 1, 7, "boot-1")
    quiet.note("b", slot + 1, 7, "boot-1")
    assert quiet.state("b") is None and len(refused) == 1
