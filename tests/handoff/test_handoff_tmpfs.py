"""A decode daemon's tmpfs without room for its arena must not kill the daemons that write into it.

A shm arena is a file on a tmpfs. Backed sparsely, its pages are taken as they are first written,
and a write past the tmpfs's room faults with SIGBUS -- in whichever process writes: with the
``local`` backend that is the *prefill* daemon, copying a request into the decode arena (seen:
a decode daemon with a 64 MiB arena in an 8 MiB tmpfs killed its sender at the 12th 1,000-token
handoff). So a daemon takes its arena's pages from the tmpfs when it backs them
(``arena_fallocate``, on by default):

* an arena the tmpfs cannot hold is refused at start, saying what to change;
* one that fits keeps its pages whatever else then fills the tmpfs: handoffs into every page of
  it (the arena filled with requests) go on, and the sender lives.

Needs a tmpfs of a known size: mounted here (root); skipped where mounting is not allowed.
"""

from __future__ import annotations

import os
import subprocess

import handoff_kit as hk
import pytest

from kvd.client import TransferState
from kvd.config import load_settings
from kvd.errors import CapacityError, FailedPrecondition
from kvd.server.app import Daemon

SMALL = 8 << 20


@pytest.fixture
def small_tmpfs(tmp_path):
    d = tmp_path / "small-shm"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_an_arena_the_tmpfs_cannot_hold_is_refused_at_start(small_tmpfs, tmp_path):
    settings = load_settings(listen_unix=str(tmp_path / "kvd.sock"), arena_dir=str(small_tmpfs), arena_bytes=64 << 20,
                             backend="local", log_level="WARNING")
    with pytest.raises(FailedPrecondition) as got:
        Daemon.start(settings)
    msg = str(got.value)
    assert f"arena_dir {str(small_tmpfs)!r} cannot hold the arena's 67,108,864 backed bytes" in msg, msg
    assert "shm-size" in msg and "arena_bytes" in msg, msg
    assert os.listdir(small_tmpfs) == [] and not (tmp_path / "kvd.sock").exists()


def test_a_full_tmpfs_cannot_take_back_an_arenas_pages(small_tmpfs, tmp_path):
    pair = hk.make_pair(tmp_path, "local", "subproc", arena_bytes=4 << 20, decode={"arena_dir": str(small_tmpfs)})
    try:
        # Something else on the node fills the rest of the tmpfs (the engine's own /dev/shm use).
        with open(small_tmpfs / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\xff" * (1 << 16))
                    f.flush()
            except OSError:
                pass  # full
        p, d = pair.prefill.connect("prefill-engine"), pair.decode.connect("decode-engine")
        # The decode arena filled with requests (every page of it bound), each then handed over:
        # every page of the arena written.
        tickets = {}
        while True:
            try:
                _, lease = d.allocate_recv(f"r{len(tickets)}", 400)
            except CapacityError:
                break
            tickets[lease.rid] = lease.ticket
        assert len(tickets) >= 4, tickets
        for rid, ticket in tickets.items():
            p.allocate(rid, 400, ticket=ticket)
            p.send(rid, ticket, free=True)
            assert d.wait_ready(rid, 10).state is TransferState.READY
        d.free(*tickets)
        assert pair.prefill.t.proc.poll() is None and pair.decode.t.proc.poll() is None, "a daemon died"
        p.close()
        d.close()
    finally:
        for s in pair.sides:
            s.stop()
