"""Probe: does splitting one GPU A -> GPU B copy over several streams, or issuing its blocks as
one ``cuMemcpyBatchAsync``, move bytes faster than one ``copy_``? (The raw baseline of
bench/gpu_transfer.py is one ``copy_``; kvd's local backend issues a write's blocks as one batch.)
``--devices 0,0``: the same on one GPU.

For each stream count k, a buffer of ``--bytes`` is cut into k equal slices (or into
``--blocks`` blocks, round-robin over the k streams), each copied by
``dst_slice.copy_(src_slice)`` on its stream; the time runs from an event every stream waits
for to the last stream's end (CUDA events, median of ``--reps``). Issued on A (push) and on B
(pull). Prints one table; needs two GPUs with peer access::

    python3 bench/nvlink_streams.py --bytes 1.76e9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # kvd's own batch call (timed_batch)


def timed(issue_on: int, src: torch.Tensor, dst: torch.Tensor, k: int, reps: int, blocks: int = 0) -> float:
    """``blocks`` > 0: the buffer is cut into that many blocks instead, copied one ``copy_``
    each, round-robin over the k streams (as a request's page runs would be)."""
    n = src.numel()
    parts = blocks or k
    cuts = [n * i // parts for i in range(parts + 1)]
    with torch.cuda.device(issue_on):
        streams = [torch.cuda.Stream(issue_on) for _ in range(k)]
        main = torch.cuda.current_stream(issue_on)
        xs = []
        for r in range(reps + 2):
            go, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            go.record(main)
            ends = []
            for s in streams:
                s.wait_event(go)
            for j, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                with torch.cuda.stream(streams[j % k]):
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            for s in streams:
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


def timed_batch(a: int, b: int, src: torch.Tensor, dst: torch.Tensor, blocks: int, reps: int) -> float | None:
    """``blocks`` blocks as the daemon's local backend issues them: one ``cuMemcpyBatchAsync``
    (:func:`kvd.copy.blocks._copy_batch`) on a stream of A (not the legacy default
    stream: the driver refuses it for batches). None when this driver or these bindings lack it."""
    from kvd.copy.blocks import _copy_batch

    n = src.numel()
    cuts = [n * i // blocks for i in range(blocks + 1)]
    offs, sizes = cuts[:-1], [hi - lo for lo, hi in zip(cuts, cuts[1:])]
    stream = torch.cuda.Stream(a)
    xs = []
    for r in range(reps + 2):
        go, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        go.record(stream)
        if not _copy_batch(src, dst, offs, offs, sizes, b, stream):
            return None
        stop.record(stream)
        stop.synchronize()
        if r >= 2:
            xs.append(go.elapsed_time(stop) / 1e3)
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=float, default=1.76e9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--blocks", type=int, nargs="*", default=[17, 64], help="also cut into this many blocks (round-robin over the streams)")
    args = ap.parse_args()
    a, b = (int(x) for x in args.devices.split(","))
    if torch.cuda.device_count() <= max(a, b):
        print(f"needs GPUs {a} and {b}", file=sys.stderr)
        return 2
    n = int(args.bytes)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{a}")
    dst = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{b}")
    print("| issued on | blocks | streams | ms | GB/s | vs one copy_ |\n|---|---:|---:|---:|---:|---:|")
    one = timed(a, src, dst, 1, args.reps)
    for side, dev in (("A (push)", a), ("B (pull)", b)):
        for blocks in (0, *args.blocks):
            for k in (1, 2, 3, 4, 8):
                s = timed(dev, src, dst, k, args.reps, blocks)
                print(f"| {side} | {blocks or k} | {k} | {s * 1e3:.3f} | {n / s / 1e9:,.0f} | {one / s:.3f} |", flush=True)
    ok = torch.equal(src.to(f"cuda:{b}"), dst)  # what the copy_ loops left
    for blocks in args.blocks:
        dst.zero_()
        try:
            s = timed_batch(a, b, src, dst, blocks, args.reps)
        except Exception as exc:  # noqa: BLE001 -- a probe: say why and go on
            print(f"| cuMemcpyBatchAsync | {blocks} | - | failed: {type(exc).__name__}: {exc} | | |", flush=True)
            continue
        if s is None:
            print(f"| cuMemcpyBatchAsync | {blocks} | - | not available with this driver or these bindings | | |", flush=True)
            continue
        good = torch.equal(src.to(f"cuda:{b}"), dst)
        ok = ok and good
        print(f"| cuMemcpyBatchAsync{'' if good else ' (MISMATCH)'} | {blocks} | 1 | {s * 1e3:.3f} | {n / s / 1e9:,.0f} | {one / s:.3f} |", flush=True)
    print(f"copies checked: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
