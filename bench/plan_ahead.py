"""What BeginSend takes off a request's Sends (CPU daemons, loopback): their own ``lease``,
``plan`` and ``check`` steps (``SendResult.phases``, summed over the request's chunk Sends, median
over requests) for a gemma-4-31b request sent in chunks, opened three ways in the same run,
interleaved: no BeginSend (the first Send checks the ticket while it gathers the vectors and
plans; every chunk gathers and plans), BeginSend without the chunk (the ticket checked ahead;
the lease reuses the vectors BeginSend gathered; each chunk still plans), BeginSend with
``chunk_tokens`` (each chunk's plan is ready). Each Send follows a 5 ms pause, as Sends arrive
between forward passes.

    .venv/bin/python bench/plan_ahead.py                 # 4,096 tokens in chunks of 2,048, 40 requests per way
    .venv/bin/python bench/plan_ahead.py --tokens 8192 --chunk 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchkit import BenchDaemon, med  # noqa: E402

from kvd.client import Client

WAYS = ("no BeginSend", "BeginSend", "BeginSend with the chunk")
STEPS = ("lease", "plan", "check")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=40, help="requests per way (the first 3 of each are warm-up)")
    args = ap.parse_args(argv)
    # sparse, as before: 3 GiB per daemon taken up front would cost 3 s of start-up each, and this times calls
    daemon_args = ["--backend", "local", "--layout", "gemma-4-31b-it-tp2", "--arena-bytes", str(3 << 30), "--no-arena-fallocate"]
    p, d = BenchDaemon.spawn(*daemon_args), BenchDaemon.spawn(*daemon_args)
    try:
        p.wait_ready()
        d.wait_ready()
        with Client.connect(p.unix, name="prefill") as pc, Client.connect(d.unix, name="decode") as dc:
            per: dict[str, dict[str, list[float]]] = {w: {k: [] for k in STEPS} for w in WAYS}
            for i in range(args.requests * len(WAYS)):
                way, rid = WAYS[i % len(WAYS)], f"r{i}"
                pc.allocate(rid, args.tokens)
                dc.allocate(rid, args.tokens, receive=True)
                ticket = dc.acquire_lease(rid, "recv").ticket
                if way != WAYS[0]:
                    pc.begin_send(rid, ticket, chunk_tokens=args.chunk if way == WAYS[2] else 0)
                steps = dict.fromkeys(STEPS, 0.0)
                for t0 in range(0, args.tokens, args.chunk):
                    time.sleep(0.005)
                    t1 = min(args.tokens, t0 + args.chunk)
                    r = pc.send(rid, ticket, start=t0, end=t1, last=t1 == args.tokens)
                    for k in STEPS:
                        steps[k] += r.phases.get(k, 0.0)
                if not dc.wait_ready(rid, 10).ready:
                    raise RuntimeError(f"{rid}: the transfer did not complete")
                if i >= 3 * len(WAYS):  # the first 3 requests of each way warm up
                    for k in STEPS:
                        per[way][k].append(steps[k])
                pc.free(rid)
                dc.free(rid)
        chunks = -(-args.tokens // args.chunk)
        print(f"| {args.tokens:,d}-token requests, {chunks} Sends of {args.chunk:,d} tokens | lease ms | plan ms | check ms | the three ms |")
        print("|---|---:|---:|---:|---:|")
        for way in WAYS:
            m = {k: med(v) * 1e3 for k, v in per[way].items()}
            total = med([sum(x) for x in zip(*per[way].values())]) * 1e3
            print(f"| {way} | {m['lease']:.3f} | {m['plan']:.3f} | {m['check']:.3f} | {total:.3f} |")
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
