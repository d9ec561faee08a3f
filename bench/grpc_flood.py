"""What a flood of gRPC calls with large requests makes the daemon hold (kvd.server.lanes, kvd.ipc.frames).

    .venv/bin/python bench/grpc_flood.py                               # this checkout, ~1 min
    .venv/bin/python bench/grpc_flood.py --baseline-tree /tmp/base     # and another checkout's kvd, same run
                                                                       #   (git worktree add /tmp/base <commit>)

A daemon (``kvd serve``, default settings, TCP loopback) per tree and scenario; the daemon's
resident memory (VmRSS) before, and its peak (VmHWM) over the scenario:

* ``queued``: a client holds 20 calls without a request (the daemon's 16 gRPC threads busy), then
  ``--calls`` Echo calls of ``--mib`` MiB each are started behind them: what the queued calls
  make the daemon hold 3 s later, before any is served;
* ``refused``: ``--calls`` Free calls naming one rid of ``--mib`` MiB, from 8 connections at
  once: each is read and refused (a rid is at most 256 bytes) -- what reading them costs;
* ``oversized``: the same with rids of 16 MiB: over this tree's request limit (4 MiB), read by a
  daemon that took 64 MiB.

And the cost to every call: a 1-byte Echo's round trip over gRPC, median of 1,000 (after 100
unmeasured), on a daemon of each tree in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
from benchkit import BenchDaemon, add_baseline_tree, trees  # noqa: E402
from grpc_held import HOLDER  # noqa: E402

from kvd.v1 import kvd_pb2 as pb  # noqa: E402
from kvd.v1 import kvd_pb2_grpc as pb_grpc  # noqa: E402

SCENARIOS = ("queued", "refused", "oversized")
_BIG = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20),
        ("grpc.use_local_subchannel_pool", 1)]


def _mem(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        d = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    return d["VmRSS"], d["VmHWM"]


def _settle(futures: Sequence[Any]) -> dict[str, int]:
    """How the calls ended: status code name -> count."""
    out: dict[str, int] = {}
    for f in futures:
        try:
            f.result(timeout=300)
            name = "OK"
        except grpc.RpcError as exc:
            name = exc.code().name
        out[name] = out.get(name, 0) + 1
    return out


def flood(root: str, kind: str, calls: int, mib: float) -> tuple[float, float, float, dict[str, int]]:
    """(RSS before, RSS when measured, peak, outcomes) of one scenario, MiB."""
    d = BenchDaemon.spawn("--listen-tcp", "127.0.0.1:0", root=root).wait_ready()
    holder = None
    futures: list[Any]
    channels = [grpc.insecure_channel(d.tcp or "", options=_BIG) for _ in range(8)]
    try:
        time.sleep(0.5)
        before, _ = _mem(d.proc.pid)
        if kind == "queued":
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.tcp or "", "echo", "20"], stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # its calls took the daemon's threads
            payload = b"x" * int(mib * 2**20)
            futures = [pb_grpc.KvdStub(channels[i % 8]).Echo.future(pb.EchoRequest(payload=payload), timeout=300) for i in range(calls)]
            time.sleep(3.0)
            now, peak = _mem(d.proc.pid)
            holder.kill()
            holder.wait()
            holder = None
        else:
            rid = "x" * int((16 if kind == "oversized" else mib) * 2**20)
            futures = [pb_grpc.KvdStub(channels[i % 8]).Free.future(pb.FreeRequest(rids=[rid]), timeout=300) for i in range(calls)]
        outcomes = _settle(futures)
        after, peak = _mem(d.proc.pid)
        return before, (now if kind == "queued" else after), peak, outcomes
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for ch in channels:
            ch.close()
        d.stop()


def echo_p50(root: str, n: int = 1000) -> float:
    """Median round trip of a 1-byte gRPC Echo, microseconds."""
    d = BenchDaemon.spawn("--listen-tcp", "127.0.0.1:0", root=root).wait_ready()
    try:
        with grpc.insecure_channel(d.tcp or "") as ch:
            echo = pb_grpc.KvdStub(ch).Echo
            req = pb.EchoRequest(payload=b"x")
            for _ in range(100):
                echo(req, timeout=5)
            xs = []
            for _ in range(n):
                t = time.perf_counter()
                echo(req, timeout=5)
                xs.append(time.perf_counter() - t)
        return statistics.median(xs) * 1e6
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=64, help="calls per scenario (default: %(default)s)")
    ap.add_argument("--mib", type=float, default=3.9, help="MiB per request in queued and refused (default: %(default)s: under the 4 MiB limit)")
    add_baseline_tree(ap)
    ap.add_argument("--only", choices=SCENARIOS, action="append", help="run only these scenarios")
    args = ap.parse_args()
    runs = trees(args)
    print(f"kvd gRPC under {args.calls} calls of large requests ({args.mib:g} MiB; oversized: 16 MiB); daemon memory in MiB")
    print("| tree | scenario | RSS before | grown when measured | peak over before | calls ended |")
    print("|---|---|---:|---:|---:|---|")
    for kind in args.only or SCENARIOS:
        for name, root in runs:
            before, now, peak, outcomes = flood(root, kind, args.calls, args.mib)
            ends = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            print(f"| {name} | {kind} | {before:.0f} | {now - before:+.0f} | {peak - before:+.0f} | {ends} |", flush=True)
    print("\n| tree | 1-byte Echo over gRPC, p50 us |\n|---|---:|")
    for _ in range(2):  # in turn, twice: the VM's noise shows
        for name, root in runs:
            print(f"| {name} | {echo_p50(root):.0f} |", flush=True)


if __name__ == "__main__":
    main()
