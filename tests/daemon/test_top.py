"""kvd top and kvd status --json against a running daemon, read off their screens."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time

from daemon_kit import REPO, rid

from kvd.records import LeaseKind


def _top(address: str, *extra: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "top", "--address", address, *extra],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_top_once_draws_group_bars_requests_and_leases(subproc):
    c = subproc.connect(name="engine-top")
    a, b = rid("top-a"), rid("top-b")
    c.allocate(a, 40)
    c.allocate(b, 8)
    lease = c.acquire_lease(a, LeaseKind.SEND, ttl=120)
    out = _top(subproc.tcp, "--once", "--interval", "0.2")
    print(out)
    for group in ("full", "swa", "state", "draft"):  # one bar per group, with its counts
        assert re.search(rf"^{group}\s+[▓█▒░·]+\s+\d", out, re.M), out
    # 40 tokens / 4 per page = 10 full pages pinned by the lease, drawn as pinned cells.
    assert re.search(r"^full\s+▓+█*[▒░·]+\s+12\s+10\s", out, re.M), out
    assert re.search(rf"{a}\s+engine-top\s+40\s+10\s+10\s+[\d.]+s\s+yes", out), out
    assert re.search(rf"{lease.lease_id}\s+{a}\s+send\s+[\d.]+s", out), out
    assert "requests: 2 live" in out and "leases: 1 live" in out and "rates  allocations" in out
    c.release_lease(lease.lease_id)
    c.free(a, b)


def test_top_refreshes_in_place_under_a_pty(subproc):
    """The live screen: started on a terminal, it redraws; a request allocated meanwhile appears."""
    c = subproc.connect(name="engine-live")
    first = rid("live-1")
    c.allocate(first, 16)
    pid, fd = pty.fork()
    if pid == 0:  # the child: kvd top on the pty
        os.chdir(REPO)
        os.environ.update(COLUMNS="140", LINES="60", TERM="xterm")
        os.execv(sys.executable, [sys.executable, "-m", "kvd.cli", "top", "--address", subproc.tcp, "--interval", "0.2"])
    screen = b""
    second = rid("live-2")
    added = False

    def read(until: bytes, timeout: float) -> bool:
        nonlocal screen
        deadline = time.monotonic() + timeout
        while until not in screen and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    screen += os.read(fd, 65536)
                except OSError:
                    return False
        return until in screen

    try:
        assert read(first.encode(), 30), screen.decode(errors="replace")[-2000:]
        before = len(screen)
        c.allocate(second, 24)
        added = True
        assert read(second.encode(), 30), screen.decode(errors="replace")[-2000:]
        assert second.encode() not in screen[:before]
    finally:
        os.kill(pid, 2)  # Ctrl-C: kvd top exits 0
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    text = screen.decode(errors="replace")
    assert second in text, text[-3000:]
    assert "requests: 2 live" in text
    assert "\x1b[" in text  # rich moved the cursor to redraw in place
    assert os.waitstatus_to_exitcode(status) == 0
    c.free(first, *([second] if added else []))


def test_status_json(subproc):
    c = subproc.connect()
    r0 = rid("json")
    c.allocate(r0, 40)
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--json", "--address", subproc.tcp],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["layout_name"] == "tiny-hybrid" and st["pool"]["requests_live"] >= 1
    full = next(g for g in st["pool"]["groups"] if g["name"] == "full")
    assert full["used_pages"] >= 10 and full["page_bytes"] == 2048
    c.free(r0)


def test_activity_rpc_ages_and_bounds(inproc):
    c = inproc.connect(name="eng")
    names = [rid("act") for _ in range(5)]
    for n in names:
        c.allocate(n, 4)
    time.sleep(0.05)
    act = c.activity(limit=3)
    assert act.requests_total == 5 and len(act.requests) == 3
    assert [r.rid for r in act.requests] == names[:3]  # the oldest first
    assert all(r.age_s > 0.04 and r.session == "eng" for r in act.requests)
    assert act.allocations_total >= 5
    c.free(*names)
    assert c.activity().requests_total == 0
