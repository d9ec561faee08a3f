"""Pinned host buffers that carry small tables (run tables of page moves) to one CUDA device.

A host-to-device copy from ordinary (pageable) memory waits for the device to drain its stream
before it starts, so every call that ships a table that way stalls the GPU behind the host. A
copy from pinned memory is a plain asynchronous DMA on the current stream instead, but then the
host must not write the buffer again until the copy has read it. :class:`Staging` keeps two
pinned buffers per device and alternates between them; each remembers an event recorded after
the copy that last read it, and a writer waits on that event before reusing the buffer::

    call n:    wait(event[n % 2]) -> write buffer n % 2 -> copy to the device -> record event[n % 2]
    call n+1:  the other buffer, so it never waits on the copy just issued by call n

So the host can run at most two calls ahead of the copies, and a call only blocks when the
device is two whole calls behind (its stream still has the previous call's work queued then).
Buffers grow geometrically and are never shrunk.
"""

from __future__ import annotations

import threading

import torch

from kvd.errors import InternalError

__all__ = ["Staging", "staging_for"]

#: int64 elements a staging buffer holds at first (128 KiB: a 4,096-run table).
_MIN_ELEMS = 1 << 14


class Staging:
    """Two pinned int64 buffers for one device, used in turn (see the module docstring).

    Use :meth:`to_device` only while holding :attr:`lock`, from :meth:`acquire` on: the buffer it
    returns is the caller's until :meth:`to_device` has issued the copy."""

    __slots__ = ("_bufs", "_events", "_turn", "device", "lock")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]  # recorded after the last copy from the buffer
        self._turn = 0

    def acquire(self, n: int) -> tuple[int, torch.Tensor]:
        """A pinned int64 buffer of at least ``n`` elements that no pending copy still reads, and
        its slot number for :meth:`to_device`. Blocks while the copy that last read it is pending."""
        slot = self._turn
        self._turn ^= 1
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has finished (at once if it has)
        buf = self._bufs[slot]
        if buf is None or buf.numel() < n:
            cap = max(n, _MIN_ELEMS, 2 * (buf.numel() if buf is not None else 0))
            buf = self._bufs[slot] = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        return slot, buf

    def to_device(self, slot: int, n: int) -> torch.Tensor:
        """Copy the first ``n`` elements of buffer ``slot`` into a new device tensor, asynchronously
        on the device's current stream, and record the event that guards the buffer's reuse."""
        buf = self._bufs[slot]
        if buf is None or buf.numel() < n:
            raise InternalError(f"Staging.to_device: slot {slot} holds fewer than {n} elements; this is a bug in kvd")
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        out.copy_(buf[:n], non_blocking=True)  # on the current stream of out's device
        ev = self._events[slot]
        if ev is None:
            ev = self._events[slot] = torch.cuda.Event()
        ev.record(stream)
        return out

    def capacity(self) -> list[int]:
        """Elements each buffer holds now (0: not allocated yet); for tests and stats."""
        return [0 if b is None else b.numel() for b in self._bufs]


_STAGING: dict[int, Staging] = {}
_STAGING_LOCK = threading.Lock()


def staging_for(device: torch.device) -> Staging:
    """The process-wide :class:`Staging` of ``device`` (a CUDA device), made on first use."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _STAGING.get(idx)
    if s is None:
        with _STAGING_LOCK:
            s = _STAGING.setdefault(idx, Staging(torch.device("cuda", idx)))
    return s
