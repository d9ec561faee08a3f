"""CPU stand-ins for the CUDA pieces of handle passing (not a test module).

* :class:`MemfdArena` -- an :class:`~kvd.memory.arena.Arena` whose ``handle().kind`` is ``"cuda-vmm"``,
  backed by one memfd in granules of ``GRAN`` bytes: ``chunks`` and ``export_fds`` look like
  :class:`~kvd.memory.vmm.CudaVmmArena`'s (one chunk covering the mapped bytes), and the fds it
  exports map the same memory, so bytes written through an import are visible here.
* :func:`memfd_import` -- what :func:`kvd.memory.vmm.import_arena` does, for memfds: maps the
  (single) received fd and returns ``(owner, uint8 tensor over header.backed)``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import uuid

import torch

from kvd.memory.arena import Arena, ArenaHandle
from kvd.ipc.fdpass import HandleHeader

GRAN = 64 << 10


def open_fds() -> int:
    """Fds open in this process now (for leak checks)."""
    return len(os.listdir("/proc/self/fd"))


def fds_settle_at(expected: int, timeout: float = 5.0) -> int:
    """Fds open in this process once the count reaches ``expected`` (or ``timeout`` passes).

    The handle server runs in a thread of the test process and closes its end of an exchange
    just after the reply went out, so the count is checked once it had the chance to settle;
    a real leak never settles and the caller's assertion fails with the count."""
    deadline = time.monotonic() + timeout
    n = open_fds()
    while n != expected and time.monotonic() < deadline:
        time.sleep(0.005)
        n = open_fds()
    return n


class MemfdArena(Arena):
    def __init__(self, reserved: int, backed: int = 0, *, name: str | None = None) -> None:
        self._reserved = reserved
        self.region_id = name or f"kvd-memfd-{uuid.uuid4().hex[:8]}"
        self._fd = os.memfd_create(self.region_id)
        os.ftruncate(self._fd, reserved)
        self._mm = mmap.mmap(self._fd, reserved)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._full = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._mapped = 0
        self._backed = 0
        self.exports = 0  # export_fds calls
        self.set_backed(backed)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return [(0, self._mapped)] if self._mapped else []

    def set_backed(self, nbytes: int) -> None:
        self._check_size(nbytes)
        self._backed = nbytes
        self._mapped = -(-nbytes // GRAN) * GRAN

    def tensor(self) -> torch.Tensor:
        return self._full[: self._backed]

    def handle(self) -> ArenaHandle:
        return ArenaHandle(kind="cuda-vmm", path="", backed=self._backed, region_id=self.region_id)

    def export_fds(self) -> list[tuple[int, int]]:
        self.exports += 1
        return [(os.dup(self._fd), size) for _, size in self.chunks]

    def close(self) -> None:
        if self._fd < 0:
            return
        self._full = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
        os.close(self._fd)
        self._fd = -1


class _MmapOwner:
    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.closed = False

    def close(self) -> None:
        self.closed = True
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive; the GC unmaps


def memfd_import(header: HandleHeader, fds: list[int], device: object = None) -> tuple[_MmapOwner, torch.Tensor]:
    assert len(fds) == 1, "MemfdArena exports one chunk"
    mm = mmap.mmap(fds[0], sum(header.sizes))
    return _MmapOwner(mm), torch.frombuffer(mm, dtype=torch.uint8)[: header.backed]
