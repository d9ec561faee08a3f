"""Doorbells: where a decode engine reads that its KV arrived, without a call to its daemon.

A decode daemon keeps one small shared table, a slot per inbound transfer (RECV lease). The
daemon writes a slot at every state change of its transfer; engines map the table read-only
(the file descriptor travels over the engine socket: :mod:`kvd.server.engine_socket`) and read
the slot their lease named (``Lease.bell``). A ``wait_ready`` that finds its transfer READY there
returns at once, no round trip (:mod:`kvd.client.bells`); anything else asks the daemon, which
answers the moment the state changes (pushed, as before). A memfd, not a file: nothing to name,
share or clean up, and it is freed with its last mapping::

    slot i, 16 bytes:  [ u64 word: lease_id << 3 | state ][ u64 bytes committed ]
    state:  0 empty  1 WAITING  2 RECEIVING  3 READY  4 FAILED

The lease id in the word makes a slot unambiguous: lease ids never repeat within a boot, so a
reader holding an old slot number (its request freed, the slot given to another lease) sees
another lease id and asks the daemon instead. The daemon writes the byte count before the word;
the state is what an engine acts on, the count is informative (a reader sees the final count with
READY on x86-64, which keeps stores in order; on a weaker memory model it may see an earlier one).

Only the daemon writes (:class:`Doorbells`, under its node's lock). Engines get a read-only
descriptor (:meth:`Doorbells.reader_fd`), and the board is sealed once the daemon mapped it: no
new writable mapping, no ``write``, no resize -- also for an engine that reopens its descriptor
read-write through ``/proc`` (a memfd's own permissions let anyone do that), so no engine can
change another's state or shrink the board under the daemon.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from kvd.errors import FailedPrecondition, InternalError, InvalidArgument
from kvd.records import TransferState

__all__ = ["SLOT_BYTES", "SLOTS", "Doorbells", "DoorbellView", "STATE_CODES"]

#: Bytes per slot: the word and the byte count.
SLOT_BYTES = 16
#: Slots of a daemon's board: inbound transfers at once that get a doorbell (more get none, and
#: their engines ask the daemon, as without doorbells). 1 MiB.
SLOTS = 65536
#: A slot's state code per transfer state (0: the slot is empty).
STATE_CODES: dict[TransferState, int] = {
    TransferState.WAITING: 1, TransferState.RECEIVING: 2, TransferState.READY: 3, TransferState.FAILED: 4,
}
_STATES = {code: s for s, code in STATE_CODES.items()}
_MAX_LEASE = (1 << 60) - 1  # the word (lease id << 3 | state) stays a positive int64
# Linux 5.1's F_SEAL_FUTURE_WRITE (not in Python's fcntl before 3.12): mappings made before stay
# writable (the daemon's), new ones and write() are refused.
_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


class Doorbells:
    """The daemon's board: ``slots`` slots in a sealed memfd, written under the owner's lock (not
    thread-safe on its own). A slot is taken for a transfer (:meth:`take`), rung at each state
    change (:meth:`ring`) and given back when the transfer is forgotten (:meth:`give`)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.nbytes = slots * SLOT_BYTES
        self._fd = os.memfd_create("kvd-doorbells", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, self.nbytes)
            self._map = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(self._fd)
            raise
        self._words: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint64)  # 2 per slot: word, bytes
        # Free slots, the lowest taken first (a small board stays in few pages).
        self._free = list(range(slots - 1, -1, -1))

    def take(self, lease_id: int) -> int:
        """A slot for the transfer under ``lease_id``, written WAITING; -1 when none is free (or
        the board is closed)."""
        if not self._free or self._words is None:
            return -1
        slot = self._free.pop()
        self.ring(slot, lease_id, TransferState.WAITING, 0)
        return slot

    def ring(self, slot: int, lease_id: int, state: TransferState, nbytes: int) -> None:
        """Write ``slot``: its transfer (``lease_id``) is in ``state`` with ``nbytes`` committed."""
        if not 0 < lease_id <= _MAX_LEASE:
            raise InternalError(f"doorbell: lease id {lease_id} out of range (a bug in kvd)")
        w = self._words
        if w is None:
            return  # closed: the daemon is stopping, nobody reads it any more
        w[2 * slot + 1] = nbytes  # the count first: whoever sees the state sees its count (x86-64)
        w[2 * slot] = (lease_id << 3) | STATE_CODES[state]

    def give(self, slot: int) -> None:
        """Empty ``slot`` and make it free again."""
        w = self._words
        if w is not None:
            w[2 * slot] = w[2 * slot + 1] = 0
        self._free.append(slot)

    @property
    def in_use(self) -> int:
        """Slots held by transfers now."""
        return self.slots - len(self._free)

    def reader_fd(self) -> int:
        """A new read-only descriptor of the board, for one engine (the caller closes it once
        sent). FailedPrecondition once the board is closed (the daemon is stopping)."""
        if self._words is None:
            raise FailedPrecondition("the doorbell board is closed: this daemon is stopping")
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmap and close the board (idempotent); engines' mappings stay valid until theirs go.
        Writes after this do nothing."""
        if self._words is None:
            return
        self._words = None
        try:
            self._map.close()
        except BufferError:
            pass  # a ring in another thread still holds the view: unmapped when it lets go
        os.close(self._fd)


class DoorbellView:
    """An engine's read-only mapping of a daemon's board, from the descriptor
    :meth:`Doorbells.reader_fd` gave (this takes it over and closes it)."""

    def __init__(self, fd: int, slots: int, slot_bytes: int = SLOT_BYTES) -> None:
        try:
            size = os.fstat(fd).st_size
            if slot_bytes != SLOT_BYTES or not 0 < slots <= 1 << 24 or size < slots * SLOT_BYTES:
                raise InvalidArgument(
                    f"doorbells: a board of {slots} slots of {slot_bytes} bytes in {size:,d} bytes is not one this client reads"
                )
            self.slots = slots
            self._map = mmap.mmap(fd, slots * SLOT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint64)

    def read(self, slot: int, lease_id: int) -> tuple[TransferState, int] | None:
        """``(state, bytes committed)`` of the transfer under ``lease_id`` in ``slot``, or None
        when the slot holds another transfer (or none), or the view is closed: then only the
        daemon can say."""
        w = self._words
        if w is None or not 0 <= slot < self.slots:
            return None
        word = int(w[2 * slot])
        if word >> 3 != lease_id:
            return None
        state = _STATES.get(word & 7)
        return None if state is None else (state, int(w[2 * slot + 1]))

    def states(self, slots: np.ndarray, lease_ids: np.ndarray) -> np.ndarray:
        """The state codes (:data:`STATE_CODES`; 0: another transfer or none, ask the daemon) of
        many transfers at once, one gather: ``slots`` and ``lease_ids`` are parallel int64 arrays
        of slots inside the board."""
        w = self._words
        if w is None:
            return np.zeros(len(slots), dtype=np.int64)
        words = w[2 * slots].astype(np.int64)
        return np.where((words >> 3) == lease_ids, words & 7, 0)

    def close(self) -> None:
        """Stop reading (:meth:`read` answers None after); the mapping goes with its last reader."""
        self._words = None
        try:
            self._map.close()
        except BufferError:
            pass  # a read in another thread still holds the view: unmapped when it lets go
