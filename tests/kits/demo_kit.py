"""Running ``kvd demo`` as a user does, for the tests that check it on the CPU and on GPUs: a
subprocess in its own session, bounded in time, that must leave no process of that session and
no arena file behind.

Not a test module (no ``test_`` prefix); test files import it as ``demo_kit``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from proc_kit import live_processes


def session_members(sid: int) -> list[str]:
    """Command lines of live (not zombie) processes whose session id is ``sid``."""
    return [p.cmd for p in live_processes() if p.sid == sid]


def run_demo(args: list[str], limit_s: float) -> subprocess.CompletedProcess:
    """``python -m kvd.cli demo *args`` in a new session. Past ``limit_s`` the whole session (its
    daemons and engines) is killed and the test fails with the output so far; otherwise the run's
    status and output come back once its session is empty and no arena file is reported left."""
    cmd = [sys.executable, "-m", "kvd.cli", "demo", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = p.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{' '.join(cmd[1:])} ran past {limit_s} s\n{out}\n{err}") from None
    time.sleep(0.5)  # the demo's children exit as it returns; give the kernel a moment to reap them
    assert session_members(p.pid) == [], "the demo left processes behind"
    assert "left arena files behind" not in err, err
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
