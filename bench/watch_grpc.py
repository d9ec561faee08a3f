"""A decode engine watching many pending transfers over gRPC (issue 16): a WaitReady per transfer,
each on a thread of its own (the vLLM connector's ticket book before), against one thread's
WaitEnded calls (now), on the same daemon in the same run.

    .venv/bin/python bench/watch_grpc.py              # 64 transfers, 3 s idle, 3 rounds
    .venv/bin/python bench/watch_grpc.py --quick      # 1 round

One daemon (``python -m kvd.cli serve --backend local``, its own process) and one gRPC client here.
Per round and watcher: ``--transfers`` requests allocated with a RECV lease (WAITING: no sender),
watched for ``--idle`` seconds with nothing ending -- the daemon's CPU over that time (from
/proc/<pid>/stat) and the calls the watcher made -- then every transfer aborted at once by the test
and the time until the watcher has seen each end (median and last). The daemon's gRPC server lets 8
WaitReady calls wait at once; the rest are refused with a 0.2 s retry hint, which kvd's client
follows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchkit import BenchDaemon, cpu_model, cpu_snap, others_line, own_cpu  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.errors import KvdError  # noqa: E402


def daemon_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


class Counting:
    """The client's gRPC calls by method, as sent (a wait refused for now and sent again counts
    each time)."""

    def __init__(self, c: Client) -> None:
        self.n: dict[str, int] = {}
        stub, lock, n = c._stub, threading.Lock(), self.n

        class Stub:
            def __getattr__(self, method: str):
                fn = getattr(stub, method)

                def call(*a, **k):
                    with lock:
                        n[method] = n.get(method, 0) + 1
                    return fn(*a, **k)

                return call

        c._stub = Stub()


def per_transfer(c: Client, rids: list[str], seen: dict[str, float], stop: threading.Event) -> list[threading.Thread]:
    def watch(rid: str) -> None:
        while not stop.is_set():
            try:
                st = c.wait_ready(rid, 5.0)
            except KvdError:
                break
            if st.state.name in ("READY", "FAILED"):
                seen[rid] = time.monotonic()
                return

    return [threading.Thread(target=watch, args=(r,), daemon=True) for r in rids]


def one_watcher(c: Client, rids: list[str], seen: dict[str, float], stop: threading.Event) -> list[threading.Thread]:
    want = set(rids)

    def watch() -> None:
        cursor = c.wait_ended(0, 0).cursor
        while want - seen.keys() and not stop.is_set():
            got = c.wait_ended(cursor, 1.0)
            cursor = got.cursor
            now = time.monotonic()
            for t in got.transfers:
                if t.rid in want:
                    seen[t.rid] = now

    return [threading.Thread(target=watch, daemon=True)]


WATCHERS = {"WaitReady per transfer": per_transfer, "one WaitEnded watcher": one_watcher}


def round_(c: Client, counts: Counting, pid: int, name: str, n: int, idle: float, tag: str) -> dict[str, float]:
    rids = [f"w-{tag}-{i}" for i in range(n)]
    for r in rids:
        c.allocate_recv(r, 16)
    seen: dict[str, float] = {}
    stop = threading.Event()
    threads = WATCHERS[name](c, rids, seen, stop)
    for t in threads:
        t.start()
    time.sleep(0.3)  # the watchers settle
    before = dict(counts.n)
    cpu0, t0 = daemon_cpu(pid), time.monotonic()
    time.sleep(idle)
    cpu_idle = (daemon_cpu(pid) - cpu0) / (time.monotonic() - t0)
    calls = sum(counts.n.values()) - sum(before.values())
    t_end = time.monotonic()
    for r in rids:
        c.abort(r, "bench")
    deadline = time.monotonic() + 10
    while len(seen) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    stop.set()
    lat = sorted(seen[r] - t_end for r in rids if r in seen)
    for t in threads:
        t.join(6)
    c.free(*rids)
    return {"cpu": cpu_idle, "calls": calls / idle, "med": statistics.median(lat) * 1e3 if lat else float("nan"),
            "last": lat[-1] * 1e3 if lat else float("nan"), "missed": n - len(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--transfers", type=int, default=64)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    cpu0, own0 = cpu_snap(), own_cpu()
    d = BenchDaemon.spawn("--backend", "local").wait_ready()
    try:
        c = Client.connect(d.unix, name="watcher", transport="grpc", ttl=60)
        counts = Counting(c)
        out: dict[str, list[dict[str, float]]] = {k: [] for k in WATCHERS}
        for i in range(rounds):
            for name in WATCHERS:
                out[name].append(round_(c, counts, d.proc.pid, name, args.transfers, args.idle, f"{i}-{len(out[name])}-{name[:3]}"))
        c.close()
    finally:
        d.stop()
    print(f"kvd: a decode engine watching {args.transfers} pending transfers over gRPC -- {cpu_model()}, "
          f"{rounds} round(s), {args.idle:.0f} s idle each; medians over rounds")
    print("| watcher | daemon CPU while idle | calls/s while idle | all aborted: seen, median ms | last ms | missed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rs in out.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {name} | {m['cpu']:.1%} of a core | {m['calls']:,.0f} | {m['med']:,.1f} | {m['last']:,.1f} | {m['missed']:.0f} |")
    print(others_line(cpu0, own0))


if __name__ == "__main__":
    main()
