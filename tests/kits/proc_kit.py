"""The processes on this machine, read from /proc: for tests that must leave none behind, and
for tests that stop one (SIGSTOP) and must know it stopped; and a process at its thread limit.

Not a test module (no ``test_`` prefix); test files and conftest import it as ``proc_kit``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from typing import Any, NamedTuple


class Proc(NamedTuple):
    pid: int
    ppid: int
    sid: int  # session id
    cmd: str  # command line, arguments joined by spaces


def live_processes() -> list[Proc]:
    """Every live process (zombies left out: exited, not yet reaped)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            # After "pid (comm)" -- comm may hold spaces and parentheses: state, ppid, pgrp, session, ...
            state, ppid, _pgrp, sid = stat.rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state != "Z":
            out.append(Proc(int(pid), int(ppid), int(sid), cmd))
    return out


def open_files(pid: int) -> int:
    """Files ``pid`` holds open now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def resident_bytes(pid: int) -> int:
    """Resident memory of ``pid`` now (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    kill() only marks the stop pending: one thread of the process must run to begin the group
    stop, and the others stop as they next leave the kernel. On a loaded host that takes
    milliseconds, during which the "hung" process still answers calls (a whole Send to it
    succeeded so in CI). A test of a hung process must wait for this."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid}: not every thread stopped {timeout:g} s after SIGSTOP")
        time.sleep(0.001)


def _all_stopped(pid: int) -> bool:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


def failing_thread_starts(monkeypatch: Any, module: Any, times: int = 1, spare: str = "") -> list[RuntimeError]:
    """Make ``module``'s next ``times`` ``threading.Thread(...).start()`` calls fail as at the
    process's thread limit (a container's pids limit, memory for a stack): RuntimeError "can't
    start new thread". A thread named ``spare`` starts anyway. Returns the failures not raised yet."""
    failures = [RuntimeError("can't start new thread") for _ in range(times)]

    class Thread(threading.Thread):
        def start(self) -> None:
            if failures and self.name != spare:
                raise failures.pop()
            super().start()

    monkeypatch.setattr(module, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": Thread}))
    return failures
