"""Probe: what waking up costs a daemon thread on this host, and whether spinning avoids it.

A Send's Python runs on a gRPC worker thread that was asleep, and its commit wakes the decode
daemon's peer-socket thread, asleep in ``recv`` while the copies ran (~5 ms for a 32k
request). This measures, between two processes over a Unix socket pair:

* ``rtt``: one-byte round trip (send, the peer's blocking ``recv`` wakes, it answers) right
  after the previous one (hot), after a 5 ms ``sleep`` on both sides (cold), after the caller
  spins 5 ms (its core stays busy, the peer sleeps), and with the peer told 5 ms ahead (a
  heads-up byte) so that it polls its socket without blocking until the next byte;
* ``work``: a fixed piece of Python + numpy (a gather of 2,048 ids and a 64-entry dict, about
  what a lease and plan do) run hot, after a 5 ms ``sleep``, and after a 5 ms spin.

Medians and p90 of ``--reps`` each, in microseconds, and each case's ratio to the hot one::

    python3 bench/wake_probe.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

GAP_S = 0.005
HEADS_UP, PING, QUIT = b"h", b"p", b"q"
SPIN_CAP_S = 0.05  # the peer polls at most this long after a heads-up


def _peer(sock: socket.socket) -> None:
    """Answer every PING; after a HEADS_UP, poll without blocking until the next byte."""
    while True:
        b = sock.recv(1)
        if b == HEADS_UP:
            end = time.perf_counter() + SPIN_CAP_S
            b = b""
            while not b and time.perf_counter() < end:
                try:
                    b = sock.recv(1, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
            if not b:
                b = sock.recv(1)
        if b in (QUIT, b""):
            return
        sock.send(b)


def _spin(s: float) -> None:
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass


def _rtt(sock: socket.socket, reps: int, how: str) -> list[float]:
    out = []
    for _ in range(reps):
        if how == "hot":
            pass
        elif how == "sleep":
            time.sleep(GAP_S)
        elif how == "spin":
            _spin(GAP_S)
        elif how == "heads-up":
            sock.send(HEADS_UP)
            _spin(GAP_S)
        elif how == "heads-up, caller sleeps":
            sock.send(HEADS_UP)
            time.sleep(GAP_S)
        a = time.perf_counter()
        sock.send(PING)
        sock.recv(1)
        out.append(time.perf_counter() - a)
    return out


def _work(reps: int, how: str) -> list[float]:
    table = np.random.default_rng(0).integers(0, 1 << 20, size=1 << 20, dtype=np.int32)
    ids = np.random.default_rng(1).integers(0, 1 << 20, size=2048)
    out = []
    for _ in range(reps):
        if how == "sleep":
            time.sleep(GAP_S)
        elif how == "spin":
            _spin(GAP_S)
        a = time.perf_counter()
        got = np.take(table, ids)
        d = {f"k{i}": int(got[i]) for i in range(64)}
        out.append(time.perf_counter() - a)
        assert len(d) == 64
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=400)
    args = ap.parse_args(argv)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        _peer(b)
        os._exit(0)
    b.close()
    rows = []
    _rtt(a, 50, "hot")  # warm up
    for how in ("hot", "sleep", "spin", "heads-up", "heads-up, caller sleeps"):
        xs = _rtt(a, args.reps, how)
        rows.append(("rtt", how, xs))
    a.send(QUIT)
    os.waitpid(pid, 0)
    _work(50, "hot")
    for how in ("hot", "sleep", "spin"):
        rows.append(("work", how, _work(args.reps, how)))
    base = {}
    print("| what | how | median us | p90 us | ratio to hot |\n|---|---|---:|---:|---:|")
    for what, how, xs in rows:
        xs = sorted(xs)
        m, p90 = statistics.median(xs) * 1e6, xs[int(len(xs) * 0.9)] * 1e6
        base.setdefault(what, m)
        print(f"| {what} | {how} | {m:.1f} | {p90:.1f} | {m / base[what]:.2f} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
