"""What BeginSend's planning ahead takes off a Send (CPU daemons, loopback): the Send's own
``lease`` and ``plan`` steps (``SendResult.phases``) for chunked Sends of a gemma-4-31b request,
opened three ways in the same run, interleaved: no BeginSend (the Send checks the ticket,
gathers the vectors and plans), BeginSend without the chunk (the lease reuses the vectors it
gathered; each chunk still plans), BeginSend with ``chunk_tokens`` (each chunk's plan is ready).
Each Send follows a 5 ms pause, as Sends arrive between forward passes.

    .venv/bin/python bench/plan_ahead.py                 # 4,096 tokens in chunks of 2,048, 40 requests per way
    .venv/bin/python bench/plan_ahead.py --tokens 8192 --chunk 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchkit import BenchDaemon  # noqa: E402

from kvd.client import Client  # noqa: E402

WAYS = ("no BeginSend", "BeginSend", "BeginSend with the chunk")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=40, help="requests per way (the first 3 of each are warm-up)")
    args = ap.parse_args(argv)
    daemon_args = ["--backend", "local", "--layout", "gemma-4-31b-it-tp2", "--arena-bytes", str(3 << 30)]
    p, d = BenchDaemon.spawn(*daemon_args), BenchDaemon.spawn(*daemon_args)
    try:
        p.wait_ready()
        d.wait_ready()
        pc, dc = Client.connect(p.unix, name="prefill"), Client.connect(d.unix, name="decode")
        steps: dict[str, dict[str, list[float]]] = {w: {"lease": [], "plan": [], "seconds": []} for w in WAYS}
        for i in range(args.requests * len(WAYS)):
            way, rid = WAYS[i % len(WAYS)], f"r{i}"
            pc.allocate(rid, args.tokens)
            dc.allocate(rid, args.tokens, receive=True)
            ticket = dc.acquire_lease(rid, "recv").ticket
            if way != WAYS[0]:
                pc.begin_send(rid, ticket, chunk_tokens=args.chunk if way == WAYS[2] else 0)
            for t0 in range(0, args.tokens, args.chunk):
                time.sleep(0.005)
                t1 = min(args.tokens, t0 + args.chunk)
                r = pc.send(rid, ticket, start=t0, end=t1, last=t1 == args.tokens)
                if i >= 3 * len(WAYS):
                    for k in ("lease", "plan"):
                        steps[way][k].append(r.phases.get(k, 0.0))
                    steps[way]["seconds"].append(r.seconds)
            if not dc.wait_ready(rid, 10).ready:
                raise RuntimeError(f"{rid}: the transfer did not complete")
            pc.free(rid)
            dc.free(rid)
        print(f"| Sends of {args.chunk:,d}-token chunks ({args.tokens:,d}-token requests) | lease ms | plan ms | Send.seconds ms |")
        print("|---|---:|---:|---:|")
        for way in WAYS:
            med = {k: statistics.median(v) * 1e3 for k, v in steps[way].items()}
            print(f"| {way} | {med['lease']:.3f} | {med['plan']:.3f} | {med['seconds']:.2f} |")
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
