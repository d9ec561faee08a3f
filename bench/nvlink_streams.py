"""Probe: does splitting one GPU A -> GPU B copy over several streams move bytes faster than
one ``copy_``? (The raw baseline of bench/gpu_transfer.py is one ``copy_``; kvd's local backend
issues one copy per block on one stream.)

For each stream count k, a buffer of ``--bytes`` is cut into k equal slices, each copied by
``dst_slice.copy_(src_slice)`` on its own stream; the time runs from an event every stream waits
for to the last stream's end (CUDA events, median of ``--reps``). Issued on A (push) and on B
(pull). Prints one table; needs two GPUs with peer access::

    python3 bench/nvlink_streams.py --bytes 1.76e9
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def timed(a: int, issue_on: int, src: torch.Tensor, dst: torch.Tensor, k: int, reps: int) -> float:
    n = src.numel()
    cuts = [n * i // k for i in range(k + 1)]
    with torch.cuda.device(issue_on):
        streams = [torch.cuda.Stream(issue_on) for _ in range(k)]
        main = torch.cuda.current_stream(issue_on)
        xs = []
        for r in range(reps + 2):
            go, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            go.record(main)
            ends = []
            for s, lo, hi in zip(streams, cuts, cuts[1:]):
                s.wait_event(go)
                with torch.cuda.stream(s):
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                e = torch.cuda.Event()
                e.record(s)
                ends.append(e)
            for e in ends:
                main.wait_event(e)
            stop.record(main)
            stop.synchronize()
            if r >= 2:
                xs.append(go.elapsed_time(stop) / 1e3)
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=float, default=1.76e9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--devices", default="0,1")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    a, b = (int(x) for x in args.devices.split(","))
    n = int(args.bytes)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{a}")
    dst = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{b}")
    print(f"| issued on | streams | ms | GB/s | vs one copy_ |\n|---|---:|---:|---:|---:|")
    for side, dev in (("A (push)", a), ("B (pull)", b)):
        base = None
        for k in (1, 2, 3, 4, 8):
            s = timed(a, dev, src, dst, k, args.reps)
            base = base or s
            print(f"| {side} | {k} | {s * 1e3:.3f} | {n / s / 1e9:,.0f} | {base / s:.3f} |", flush=True)
    ok = torch.equal(src.to(f"cuda:{b}"), dst)
    print(f"copy checked: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
