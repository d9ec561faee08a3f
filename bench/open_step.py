"""A prefill step's new requests opened on the engine's forward thread (issue 16): one
``allocate(rid, tokens, ticket=)`` each, against one ``allocate_many(specs, tickets=)`` for the
step -- what the vLLM connector's worker pays before the step's first layer is saved.

    .venv/bin/python bench/open_step.py            # steps of 1, 2, 4, 8 and 16 new requests; ~30 s
    .venv/bin/python bench/open_step.py --quick

Two daemons (``kvd serve --backend local``, ``tiny-hybrid`` by default) run as separate
processes; this process is both engines, over the engine socket. Per step, untimed: the decode
side's ``allocate_recv`` of each request (its ticket). Timed: the prefill side opening the step's
requests (each allocated, its transfer begun: the receiver's check deferred past the reply), the
two ways taking turns step by step. Untimed again: each request's ``send(free=True)`` and the
decode side's ``free`` (every transfer checked READY), so each step starts from an empty pool.
Reported: median per step and per request, and the ratio of the two ways.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchkit import BenchDaemon, cpu_model, cpu_snap, med, others_line, own_cpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 steps per way and size instead of 100")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="new requests per step (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    ap.add_argument("--layout", default="tiny-hybrid", help="layout preset (default %(default)s)")
    args = ap.parse_args()
    steps = 20 if args.quick else 100
    sizes = [int(x) for x in args.sizes.split(",")]

    from kvd.client import Client

    opts = ("--backend", "local", "--layout", args.layout, "--arena-bytes", str(256 << 20))
    cpu0, own0 = cpu_snap(), own_cpu()
    dp, dd = BenchDaemon.spawn(*opts), BenchDaemon.spawn(*opts)
    dp.wait_ready(), dd.wait_ready()
    seq = [0]
    took: dict[tuple[int, str], list[float]] = {}
    try:
        with Client.connect(dp.unix, name="prefill", transport="fast") as p, Client.connect(dd.unix, name="decode", transport="fast") as d:

            def step(k: int, way: str, timed: bool) -> None:
                rids = [f"s{seq[0] + i}" for i in range(k)]
                seq[0] += k
                tickets = [d.allocate_recv(rid, args.tokens)[1].ticket for rid in rids]
                t0 = time.perf_counter()
                if way == "one call each":
                    for rid, t in zip(rids, tickets):
                        p.allocate(rid, args.tokens, ticket=t)
                else:
                    p.allocate_many([(rid, args.tokens) for rid in rids], tickets=tickets)
                dt = time.perf_counter() - t0
                for rid, t in zip(rids, tickets):
                    p.send(rid, t, free=True)
                    assert d.wait_ready(rid, 5).ready, rid
                d.free(*rids)
                if timed:
                    took.setdefault((k, way), []).append(dt)

            ways = ("one call each", "one call per step")
            for k in sizes:
                for w in ways:
                    step(k, w, False)  # warm
            gc.disable()
            for _ in range(steps):
                for k in sizes:
                    for w in ways:
                        step(k, w, True)
            gc.enable()
    finally:
        dp.stop(), dd.stop()

    print(f"kvd: a prefill step's new requests opened -- {cpu_model()}; {args.layout}, "
          f"{args.tokens} tokens each, backend local, engine socket, {steps} steps per way and size")
    print("| new requests per step | one call each: ms per step | one call per step: ms per step | per request (each / per step) | per step / each |")
    print("|---:|---:|---:|---:|---:|")
    for k in sizes:
        a, b = med(took[(k, ways[0])]) * 1e3, med(took[(k, ways[1])]) * 1e3
        print(f"| {k} | {a:.3f} | {b:.3f} | {a / k:.3f} / {b / k:.3f} | {b / a:.2f}x |")
    print(others_line(cpu0, own0))


if __name__ == "__main__":
    main()
