"""Issue 16's targets in one run: each figure against its baseline from the same run, met or not.

    .venv/bin/python bench/control_targets.py           # CPU: the short handoff, single calls, 1-8 clients (~4 min, 2 cores)
    .venv/bin/python bench/control_targets.py --quick   # fewer samples, 1 and 8 clients (~2 min)
    python3 bench/control_targets.py --gpu               # and the same-GPU transfer (bash bench/gpu_check.sh targets)

The benches that measure each target run one after another, each in its own process, and write
their numbers as JSON (kept with ``--keep DIR``):

1. ``bench/handoff_calls.py --block 25``: one 16-token ``tiny-hybrid`` request, backend ``local``,
   two daemons; the short flow over the engine socket (``new fast``, 5 calls) and today's 8-call
   flow over gRPC (``old grpc``, the baseline) and over the engine socket (``old fast``), with
   four bare engine-socket round trips;
2. ``bench/control_plane.py --no-tcp --no-spin``: single engine calls over the engine socket, one
   client, against a bare ``Echo`` on the same socket (``gemma-4-31b-it-tp2``, a 4,096-token
   computed request), from clients as they come (a reply looked for 200 us before the thread
   sleeps) and from clients that sleep at once (``no spin``); then 1, 2, 4 and 8 client processes'
   aggregate engine calls/s (``--quick``: 1 and 8);
3. with ``--gpu`` (a CUDA host): ``bench/gpu_transfer.py --devices 0,0 --no-batched``: a lone
   32k-token gemma request and ``mixed seq`` (32 requests one at a time), wall time with the
   decode engine in its own process, against ``dst.copy_(src)`` of the same bytes.

It prints one table: the target, the goal the issue sets, the figure, its baseline and their
ratio. A benchmark, not a test: the exit code is 0 whatever is met, 1 if a bench failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Target:
    """One row: ``value`` against ``goal`` (``<=`` or ``>=``); ``base`` is the same run's baseline."""

    name: str
    op: str  # "<=", ">=" or "" (reported, no goal)
    goal: float
    value: float | None
    unit: str
    base_name: str = ""
    base: float | None = None

    def met(self) -> str:
        if self.value is None:
            return "not run"
        if not self.op:
            return "-"
        ok = self.value <= self.goal if self.op == "<=" else self.value >= self.goal
        return "yes" if ok else "no"

    def cells(self) -> list[str]:
        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:,.3f}" if x < 10 else f"{x:,.0f}" if x >= 1000 else f"{x:,.1f}"

        ratio = f"{self.value / self.base:.2f}x" if self.value is not None and self.base else "-"
        goal = f"{self.op} {self.goal:g} {self.unit}".strip() if self.op else "report"
        base = f"{self.base_name} {num(self.base)}" if self.base_name else "-"
        measured = f"{num(self.value)} {self.unit}".strip() if self.value is not None else "-"
        return [self.name, goal, measured, base, ratio, self.met()]


def run(cmd: list[str], log: str, limit: float) -> bool:
    """Run one bench (its output to ``log`` and to stderr as it goes); False if it failed."""
    print(f"== {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"== exit {rc} after {time.monotonic() - t0:.0f} s ({log})", file=sys.stderr, flush=True)
    return rc == 0


def load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def handoff_targets(h: dict | None) -> list[Target]:
    f = (h or {}).get("flows", {})

    def v(flow: str, key: str) -> float | None:
        return f[flow][key] if flow in f else None

    old = v("old grpc", "median_ms")
    return [
        Target("short handoff, 16 tokens, median", "<=", 1.0, v("new fast", "median_ms"), "ms", "old flow over gRPC", old),
        Target("short handoff, 16 tokens, p99", "<=", 3.0, v("new fast", "p99_ms"), "ms", "old flow over gRPC, p99", v("old grpc", "p99_ms")),
        Target("old flow over the engine socket, median", "<=", 2.0, v("old fast", "median_ms"), "ms", "old flow over gRPC", old),
        Target("four bare round trips (the short flow's floor)", "", 0.0, v("4 bare round trips", "median_ms"), "ms",
               "short handoff", v("new fast", "median_ms")),
    ]


def call_targets(c: dict | None) -> list[Target]:
    rows = {(r["call"], r["transport"], r["clients"]): r for r in (c or {}).get("rows", [])}

    def p50(call: str, transport: str = "fast") -> float | None:
        r = rows.get((call, transport, 1))
        return r["p50_us"] if r else None

    out = []
    # fast0: the same calls from clients that sleep at once for each reply (what the spin is worth)
    for transport, how in (("fast", ""), ("fast0", ", no spin")):
        if transport == "fast0" and p50("echo", transport) is None:
            continue
        echo = p50("echo", transport)
        out += [Target(f"engine socket{how}, 1 client: {label} p50", "<=", goal, p50(call, transport), "us", "bare Echo", echo)
                for label, call, goal in (("lease", "lease SEND", 100.0), ("release", "release", 100.0),
                                          ("vectors", "vectors", 100.0), ("allocate 4,096 tokens", "allocate", 200.0))]
    agg = sorted((a["clients"], a["engine_calls_s"]) for a in (c or {}).get("aggregate", []) if a["transport"] == "fast")
    if agg:
        one = agg[0][1]
        for n, calls in agg[1:]:
            out.append(Target(f"engine calls/s, {n} clients", "", 0.0, calls, "/s", f"{agg[0][0]} client", one))
    else:
        out.append(Target("engine calls/s, 8 clients", "", 0.0, None, "/s"))
    return out


def gpu_targets(g: dict | None) -> list[Target]:
    rows = {r["workload"]: r for p in (g or {}).get("pairs", []) for r in p.get("rows", [])}

    def ratio(w: str) -> float | None:
        return rows[w]["ratio_wall_apart"] if w in rows else None

    return [Target(f"GPU, same-GPU pair: {w} wall / raw copy", ">=", goal, ratio(w), "", "server / raw copy",
                   rows[w]["ratio_server"] if w in rows else None) for w, goal in (("32k", 0.6), ("mixed seq", 0.5))]


def table(rows: list[Target]) -> str:
    hdr = ["target", "goal", "measured", "baseline (same run)", "measured / baseline", "met"]
    cells = [r.cells() for r in rows]
    w = [max(len(x) for x in col) for col in zip(hdr, *cells)]
    line = lambda xs: "| " + " | ".join(x.ljust(n) for x, n in zip(xs, w)) + " |"  # noqa: E731
    return "\n".join([line(hdr), "|" + "|".join("-" * (n + 2) for n in w) + "|", *map(line, cells)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples; 1 and 8 clients")
    ap.add_argument("--gpu", action="store_true", help="also the same-GPU transfer (needs CUDA)")
    ap.add_argument("--keep", metavar="DIR", help="keep each bench's log and JSON here")
    args = ap.parse_args()
    out = args.keep or tempfile.mkdtemp(prefix="kvd-targets-")
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    ok = run([py, "bench/handoff_calls.py", "--block", "25", *quick, "--json", f"{out}/handoff.json"], f"{out}/handoff.log", 900)
    ok &= run([py, "bench/control_plane.py", "--no-tcp", "--no-spin", *quick, "--clients", "1,8" if args.quick else "1,2,4,8",
               "--json", f"{out}/calls.json"], f"{out}/calls.log", 900)
    if args.gpu:
        ok &= run([py, "bench/gpu_transfer.py", "--devices", "0,0", "--no-batched", "--json", f"{out}/gpu.json"], f"{out}/gpu.log", 900)
    h, c = load(f"{out}/handoff.json"), load(f"{out}/calls.json")
    rows = handoff_targets(h) + call_targets(c) + gpu_targets(load(f"{out}/gpu.json") if args.gpu else None)
    print(f"issue 16's targets, {time.strftime('%Y-%m-%d %H:%MZ', time.gmtime())} -- {(h or c or {}).get('machine', '?')}")
    print(table(rows))
    for name, d in (("handoff_calls", h), ("control_plane", c)):
        if d:
            print(f"{name}: {d['others']}")
    if not args.gpu:
        print("GPU rows not run: python3 bench/control_targets.py --gpu on a CUDA host (bash bench/gpu_check.sh targets)")
    if not args.keep:
        print(f"logs and JSON: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
