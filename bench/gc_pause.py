"""What a full garbage collection costs a started daemon, before and after ``kvd serve`` freezes its
heap (:func:`kvd.server.app.settle_heap`): the stall every call in flight waits out, since the
collector runs with the interpreter lock held.

    .venv/bin/python bench/gc_pause.py                        # tiny-hybrid, local backend
    .venv/bin/python bench/gc_pause.py --layout gemma-4-31b-it-tp2 --arena-gib 4

A daemon (``Daemon.start``, ``backend: local``) runs in this process, as ``kvd serve`` runs it, and
serves ``--requests`` allocate/free rounds from a client over its engine socket first (its caches
and plans warm). Then ``gc.collect()`` (a full collection) is timed ``--repeats`` times, the heap
frozen, and timed again: the same process, the same objects. Reported: objects the collector walks,
and the median full collection in ms, after against before.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchkit import cpu_model  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.config import load_settings  # noqa: E402
from kvd.server.app import Daemon, settle_heap  # noqa: E402


def full_collections(n: int) -> float:
    """Median wall of ``n`` full collections, in ms."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="tiny-hybrid", help="layout preset (default: %(default)s)")
    ap.add_argument("--arena-gib", type=float, default=0.25, help="arena in GiB (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=200, help="allocate/free rounds served first (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="full collections timed each way (default: %(default)s)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvd-gc-")
    d = Daemon.start(load_settings(listen_unix=f"{tmp}/kvd.sock", backend="local", layout=args.layout,
                                   arena_bytes=int(args.arena_gib * (1 << 30)), log_level="WARNING"))
    try:
        c = Client.connect(f"unix:{tmp}/kvd.sock", name="gc-bench")
        for i in range(args.requests):
            c.allocate(f"r{i}", 16)
            c.free(f"r{i}")
        c.close()
        walked = len(gc.get_objects())
        before = full_collections(args.repeats)
        frozen = settle_heap()
        left = len(gc.get_objects())
        after = full_collections(args.repeats)
    finally:
        gc.unfreeze()
        d.stop(0)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"kvd full garbage collection, in a started daemon -- {cpu_model()}; {args.layout}, {args.repeats} collections each way")
    print("| heap | objects walked | full collection, median ms | / unfrozen |")
    print("|---|---:|---:|---:|")
    print(f"| as started | {walked:,d} | {before:.2f} | 1.00x |")
    print(f"| frozen (kvd serve) | {left:,d} ({frozen:,d} frozen) | {after:.3f} | {after / before:.1e}x |")


if __name__ == "__main__":
    main()
