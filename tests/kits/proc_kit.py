"""The processes on this machine, read from /proc, for tests that must leave none behind.

Not a test module (no ``test_`` prefix); test files and conftest import it as ``proc_kit``.
"""

from __future__ import annotations

import os
from typing import NamedTuple


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
