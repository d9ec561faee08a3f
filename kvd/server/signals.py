"""The signals that stop ``kvd serve``: :class:`StopSignals`, installed first thing.

Standard library only: ``kvd serve`` installs it before it imports torch, gRPC and the daemon,
which take seconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable

__all__ = ["StopSignals"]


class StopSignals:
    """Handlers that note a stop signal, and :meth:`wait`, which blocks the main thread until
    one came. Create it, and call every method, in the main thread.

    Why first thing: in a container kvd is PID 1, and the kernel drops a signal sent to a
    namespace's init process unless it has a handler for it. A SIGTERM while the daemon still
    started (torch imported, the arena mapped, a backend brought up: seconds) was lost, and the
    pod waited out its whole grace period to be killed. Noted here, it stops the daemon as soon
    as it has started, before it announces itself.

    Why a wakeup fd and ``select``, not ``Event.wait()``: the kernel hands a signal sent to the
    process to any thread that does not block it (grpc's, kvd's), and CPython runs the handler in
    the main thread only once that thread runs Python again. A main thread asleep in a lock never
    would: the daemon ignored a SIGTERM delivered to another thread and was killed undrained at
    the end of Kubernetes' grace period. The wakeup fd is written by whichever thread takes the
    signal, and ``select`` on it wakes the main thread."""

    def __init__(self, signums: tuple[int, ...]) -> None:
        self.got: list[int] = []  # the signals noted so far, first first
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self.listen(*signums)

    def listen(self, *signums: int) -> None:
        """Note these signals too from now on (``serve`` adds SIGINT once started: before, Ctrl-C
        stops the start-up at once, as KeyboardInterrupt)."""
        for num in signums:
            signal.signal(num, self._note)

    def _note(self, num: int, frame: object) -> None:  # noqa: ARG002  # runs in the main thread
        self.got.append(num)

    def wait(self, ready: Callable[[], None]) -> int:
        """Call ``ready`` and block until a signal came; returns the first one's number. A signal
        noted before (during start-up) returns it at once, ``ready`` not called. The handlers
        stay: a second signal while the caller drains changes nothing."""
        if self.got:
            return self.got[0]
        ready()
        poll = select.poll()
        poll.register(self._r, select.POLLIN)
        while not self.got:
            poll.poll()  # returns once a signal wrote the fd; the handler has run by then
            with contextlib.suppress(BlockingIOError):
                os.read(self._r, 512)
        return self.got[0]

    def close(self) -> None:
        """Give the wakeup fd back (the handlers stay); again, nothing."""
        if self._r < 0:
            return
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = -1
