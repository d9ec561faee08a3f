"""Pool placement benchmark: how full the arena is when the pool first refuses a request.

For every preset (or ``--layouts``) and a few request lengths, an arena of ``--pages`` full-group
pages (backed, shm) is filled with requests of that length until ``can_allocate`` says no; the
table shows how many fit, the arena's free share at that refusal, and the share the refused
request needed (``Pool.floor_bytes`` of its length: what it takes alone in an empty pool, the
baseline). A refusal with more
free than needed (beyond a page of alignment per group) means the free bytes sit where no group
can grow -- a float boxed in -- until compaction: "boxed in".

    .venv/bin/python bench/pool_fill.py
    .venv/bin/python bench/pool_fill.py --layouts tiny-hybrid --pages 400
"""

from __future__ import annotations

import argparse
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvd.memory.arena import ShmArena
from kvd.records import AllocSpec
from kvd.pool.pool import Pool
from kvd.pool.presets import preset, preset_names


def fill(layout, pages: int, lengths) -> tuple[int, float, float]:
    """Requests placed before the first refusal, the arena's free share at that refusal, and
    the share the refused request needed."""
    pb = layout.page_bytes(layout.group("full"))
    arena = ShmArena(pages * pb, pages * pb)
    try:
        pool = Pool(layout, arena)
        n = 0
        while True:
            t = lengths(n)
            if not pool.can_allocate(AllocSpec(f"r{n}", t)):
                break
            pool.allocate(f"r{n}", t)
            n += 1
        pool.check()
        usable = arena.backed - pool.sink_bytes
        # The refused request alone, page alignment included: what an empty pool would need.
        return n, pool.stats().gap_bytes / usable, (pool.floor_bytes(t) - pool.sink_bytes) / usable
    finally:
        arena.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="*", default=None, help="presets (default: every preset)")
    ap.add_argument("--pages", type=int, default=4000, help="arena size in full-group pages (default 4000)")
    args = ap.parse_args(argv)
    print("| layout | requests | placed | arena free at the first refusal | the refused request needs | boxed in |")
    print("|---|---|---:|---:|---:|---|")
    for name in args.layouts or preset_names():
        layout = preset(name)
        ps = layout.page_size
        rnd = random.Random(1)
        for what, lengths in ((f"one page ({ps} tokens)", lambda n: ps), ("64 tokens", lambda n: 64),
                              ("512-8192 tokens", lambda n: rnd.randint(512, 8192)),
                              ("one of 2048 tokens, then one page each", lambda n: 2048 if n == 0 else ps)):
            placed, free, need = fill(layout, args.pages, lengths)
            # Page alignment at each group boundary may strand up to a page per group.
            slack = len(layout.groups) * layout.max_page_bytes / (args.pages * layout.page_bytes(layout.group("full")) - layout.max_page_bytes)
            boxed = "yes" if free > need + slack else "no"
            print(f"| {name} | {what} | {placed:,d} | {free:.1%} | {need:.1%} | {boxed} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
