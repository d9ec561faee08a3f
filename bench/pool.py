"""Pool core benchmark (issue 2): request ops, bulk translation and compaction, each against a
baseline measured in the same run.

    .venv/bin/python bench/pool.py            # full run (about a minute on a 2-core CPU)
    .venv/bin/python bench/pool.py --quick    # smoke run (a few seconds)

Layout: the ``gemma-4-31b-it-tp2`` preset (full page 655,360 B, swa page 6,553,600 B).

1. Requests. ``--requests`` requests (10,000) of 512-8192 tokens, uniform; 3 in 4 are received
   (``receive=True``: only the SWA window tail is bound, the decode side) and 1 in 4 computed here
   (SWA pages for every token, the prefill side). Each request is allocated, extended once by a
   decode-like step (1, 2, 4, 8, 16 or 32 tokens), translated (its full ids), asked for its
   vectors and freed; single calls first, then ``allocate_many`` / ``extend_many`` /
   ``free_many`` in batches. All requests are live at once: the arena is a *sparse* shm file
   sized so they all fit (several TiB of address space). Allocation, extension, translation and
   free never touch page bytes, so only the pool's tables use memory.
2. Translation. ``pool.translate("full", vids)`` on 1M virtual ids of live requests (the int32
   ids the pool hands out), against ``index_select`` of the same ids on an int32 tensor as long
   as the pool's v2p table.
3. Compaction. A real (touched) arena of ``--compact-gib`` GiB is filled with short requests
   (16-64 tokens: 1-4 pages), every other request is freed, and ``pool.compact()`` moves the live pages;
   bytes moved / seconds against ``dst.copy_(src)`` of a contiguous uint8 tensor of the same
   byte count. The moved bytes are checked afterwards (markers at both ends of every page).

Each timed thing runs ``--repeats`` times (translation and the copy baseline more, they are
short); the table shows the median. The garbage collector is off inside timed loops (as in
``timeit``).
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

import kvd.pool as kvd_pool
from kvd import AllocSpec, GroupKind, Pool, ShmArena, preset

LAYOUT = "gemma-4-31b-it-tp2"
EXTEND_SIZES = (1, 2, 4, 8, 16, 32)  # tokens per decode-like step (1 token, speculative k, chunks)
BATCH_SIZES = (16, 256)
TRANSLATE_IDS = 1_000_000
GIB = 1 << 30


# =============================================================================================
# timing helpers
# =============================================================================================
@dataclass(slots=True)
class Sample:
    """One repeat of one timed thing: per-call times and how many items (requests) it covered."""

    call_ns: list[int]
    items: int

    @property
    def total_s(self) -> float:
        return sum(self.call_ns) / 1e9


@dataclass(slots=True)
class Row:
    name: str
    batch: int = 1  # requests per call (the last batch may be shorter)
    samples: list[Sample] = field(default_factory=list)

    def median(self, f: Callable[[Sample], float]) -> float:
        return statistics.median(f(s) for s in self.samples)


def timed_calls(fn: Callable, args: Iterable[tuple]) -> list[int]:
    """Call ``fn(*a)`` for each ``a``; return each call's wall time in ns (gc off)."""
    pc = time.perf_counter_ns
    out = []
    gc.collect()
    gc.disable()
    try:
        for a in args:
            t0 = pc()
            fn(*a)
            out.append(pc() - t0)
    finally:
        gc.enable()
    return out


def time_repeated(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn()``, ``repeats`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    gc.collect()
    gc.disable()
    try:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return out


def pct(values: Sequence[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def batches(seq: Sequence, n: int) -> list[Sequence]:
    return [seq[i : i + n] for i in range(0, len(seq), n)]


# =============================================================================================
# 1. request ops
# =============================================================================================
@dataclass(slots=True)
class Workload:
    tokens: list[int]
    receive: list[bool]
    extend: list[int]
    order: list[int]  # the order requests are extended, translated and freed in (shuffled)


def make_workload(n: int, seed: int) -> Workload:
    rng = random.Random(seed)
    tokens = [rng.randint(512, 8192) for _ in range(n)]
    receive = [i % 4 != 0 for i in range(n)]
    extend = [rng.choice(EXTEND_SIZES) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    return Workload(tokens, receive, extend, order)


def sparse_arena_bytes(pool_layout, w: Workload) -> int:
    """Bytes that hold every request of ``w`` at its peak (before or after its extend), plus slack.

    Mirrors the pool's page rules: full ``ceil(t / ps)`` pages; swa pages from
    ``max(0, base - window) // ps`` (base 0 for a computed request, its length when received)."""
    full_g, swa_g = pool_layout.group("full"), pool_layout.group("swa")
    ps, win = pool_layout.page_size, swa_g.window
    full_pages = swa_pages = 0
    for t, recv, e in zip(w.tokens, w.receive, w.extend):
        n0, n1 = -(-t // ps), -(-(t + e) // ps)
        swa0 = n0 - max(0, (t if recv else 0) - win) // ps
        swa1 = n1 - max(0, t - win) // ps
        full_pages += n1
        swa_pages += max(swa0, swa1)
    need = full_pages * pool_layout.page_bytes(full_g) + swa_pages * pool_layout.page_bytes(swa_g)
    need += pool_layout.max_page_bytes * 8  # sink + page alignment of the two regions
    return -(-int(need * 1.01) // GIB) * GIB


def bench_requests(n: int, repeats: int, seed: int, n_translate: int) -> tuple[dict[str, Row], dict]:
    layout = preset(LAYOUT)
    w = make_workload(n, seed)
    arena_bytes = sparse_arena_bytes(layout, w)
    arena = ShmArena(arena_bytes, arena_bytes)
    pool = Pool(layout, arena)
    rows: dict[str, Row] = {}

    def row(name: str, batch: int = 1) -> Row:
        return rows.setdefault(name, Row(name, batch))

    ext_new_page = sum(-(-(t + e) // layout.page_size) > -(-t // layout.page_size) for t, e in zip(w.tokens, w.extend))

    # ---- single calls -----------------------------------------------------------------------
    for r in range(repeats):
        rids = [f"s{r}-{i}" for i in range(n)]
        ordered = [rids[i] for i in w.order]
        ns = timed_calls(lambda rid, t, recv: pool.allocate(rid, t, receive=recv), ((rids[i], w.tokens[i], w.receive[i]) for i in range(n)))
        row("allocate").samples.append(Sample(ns, n))
        ns = timed_calls(pool.extend, ((rids[i], w.extend[i]) for i in w.order))
        row("extend").samples.append(Sample(ns, n))
        vids = [pool.virtual_ids(rid)["full"] for rid in ordered]
        ns = timed_calls(pool.translate, (("full", v) for v in vids))
        row("translate (1 request)").samples.append(Sample(ns, n))
        ns = timed_calls(pool.vectors, ((rid,) for rid in ordered))
        row("vectors (1 request)").samples.append(Sample(ns, n))
        if r == 0:
            pool.check()
            live_full = pool.groups[GroupKind.FULL].used
            live_swa = pool.groups[GroupKind.SWA].used
        ns = timed_calls(pool.free, ((rid,) for rid in ordered))
        row("free").samples.append(Sample(ns, n))
    pool.check()

    # ---- batched calls ----------------------------------------------------------------------
    for b in BATCH_SIZES:
        for r in range(repeats):
            rids = [f"b{b}-{r}-{i}" for i in range(n)]
            specs = [AllocSpec(rids[i], w.tokens[i], w.receive[i]) for i in range(n)]
            ns = timed_calls(pool.allocate_many, ((chunk,) for chunk in batches(specs, b)))
            row(f"allocate_many x{b}", b).samples.append(Sample(ns, n))
            items = [(rids[i], w.extend[i]) for i in w.order]
            ns = timed_calls(pool.extend_many, ((chunk,) for chunk in batches(items, b)))
            row(f"extend_many x{b}", b).samples.append(Sample(ns, n))
            ordered = [rids[i] for i in w.order]
            ns = timed_calls(pool.free_many, ((chunk,) for chunk in batches(ordered, b)))
            row(f"free_many x{b}", b).samples.append(Sample(ns, n))
    pool.check()

    # ---- 2. translation of 1M ids -----------------------------------------------------------
    rids = [f"t-{i}" for i in range(n)]
    for chunk in batches([AllocSpec(rids[i], w.tokens[i], w.receive[i]) for i in range(n)], 256):
        pool.allocate_many(chunk)
    live = torch.cat([pool.virtual_ids(rids[i])["full"] for i in w.order])  # request order, int32
    reps = -(-n_translate // live.numel())
    vids32 = live.repeat(reps)[:n_translate].contiguous()
    gen = torch.Generator().manual_seed(seed)
    vids32_rand = vids32[torch.randperm(vids32.numel(), generator=gen)].contiguous()
    v2p = pool.groups[GroupKind.FULL].v2p
    table = torch.randint(0, 1 << 30, (v2p.numel(),), dtype=torch.int32, generator=gen)  # same size as v2p
    t_reps = max(repeats, 11)
    translate = {}
    for label, ids in (("request order", vids32), ("random order", vids32_rand)):
        ids64 = ids.to(torch.int64)
        if not torch.equal(pool.translate("full", ids), v2p[ids64]):
            raise RuntimeError("translate returned the wrong pages")
        translate[label] = {
            "pool_int32": time_repeated(lambda: pool.translate("full", ids), t_reps),
            "pool_int64": time_repeated(lambda: pool.translate("full", ids64), t_reps),
            "baseline": time_repeated(lambda: table.index_select(0, ids64), t_reps),
        }
    info = {
        "n": n,
        "arena_bytes": arena_bytes,
        "full_v2p": v2p.numel(),
        "live_full_pages": live_full,
        "live_swa_pages": live_swa,
        "ext_new_page": ext_new_page,
        "translate_live_ids": live.numel(),
        "translate": translate,
        "t_reps": t_reps,
        "tables_mib": sum(t.numel() * t.element_size() for a in pool.groups.values() for t in (a.v2p, a.p2v, a._holes)) / 2**20,
    }
    pool.free_many(rids)
    del pool, v2p
    arena.close()
    return rows, info


# =============================================================================================
# 3. compaction
# =============================================================================================
def fragment(pool: Pool, seed: int, tag: str) -> list[str]:
    """Fill the pool with short requests, free every other one; return the live ones."""
    rng = random.Random(seed)
    rids: list[str] = []
    while True:
        spec = AllocSpec(f"{tag}-{len(rids)}", rng.randint(16, 64))
        if not pool.can_allocate(spec):
            break
        pool.allocate_many([spec])
        rids.append(spec.rid)
    pool.free_many(rids[::2])
    return rids[1::2]


def write_markers(pool: Pool, rids: list[str]) -> dict[str, dict[GroupKind, torch.Tensor]]:
    """Stamp the first and last 8 bytes of every live page with a value unique to (rid, group, page)."""
    marks = {}
    for n, rid in enumerate(rids):
        v = pool.vectors(rid)
        marks[rid] = {}
        for kind, pages in ((GroupKind.FULL, v.full), (GroupKind.SWA, v.swa)):
            words = pool.page_view(kind).view(torch.int64)
            val = torch.arange(pages.numel(), dtype=torch.int64) + (n << 32) + (kind is GroupKind.SWA) * (1 << 56)
            words[pages.long(), 0] = val
            words[pages.long(), -1] = ~val
            marks[rid][kind] = val
    return marks


def check_markers(pool: Pool, marks: dict[str, dict[GroupKind, torch.Tensor]]) -> None:
    for rid, by_kind in marks.items():
        v = pool.vectors(rid)
        for kind, pages in ((GroupKind.FULL, v.full), (GroupKind.SWA, v.swa)):
            words = pool.page_view(kind).view(torch.int64)
            if not (torch.equal(words[pages.long(), 0], by_kind[kind]) and torch.equal(words[pages.long(), -1], ~by_kind[kind])):
                raise RuntimeError(f"compaction corrupted the pages of {rid} ({kind.value})")


def bench_compaction(arena_gib: float, repeats: int, seed: int) -> dict:
    layout = preset(LAYOUT)
    nbytes = int(arena_gib * GIB)
    arena = ShmArena(nbytes, nbytes)
    arena.tensor().fill_(0x5A)  # back every page with memory first: KV that was written
    pool = Pool(layout, arena)

    copy_s: list[float] = []
    real_copy_runs = kvd_pool.copy_runs

    def timed_copy_runs(*a, **k):  # attribute the time spent copying bytes (one call per group)
        t0 = time.perf_counter()
        real_copy_runs(*a, **k)
        copy_s[-1] += time.perf_counter() - t0

    results = []
    kvd_pool.copy_runs = timed_copy_runs
    try:
        for r in range(repeats):
            live = fragment(pool, seed, f"c{r}")  # same seed: every repeat moves the same pages
            marks = write_markers(pool, live) if r == 0 else None
            st = pool.stats()
            holes = {g.name: g.hole_pages for g in st.groups}
            copy_s.append(0.0)
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            res = pool.compact()
            dt = time.perf_counter() - t0
            gc.enable()
            pool.check()
            if marks is not None:
                check_markers(pool, marks)
            results.append((res, dt, len(live), holes))
            pool.free_many(live)
    finally:
        kvd_pool.copy_runs = real_copy_runs
    moved = results[0][0].bytes_moved
    if any(res.bytes_moved != moved for res, *_ in results):
        raise RuntimeError("repeats moved different byte counts; the fragmentation is not deterministic")
    del pool
    arena.close()

    src = torch.empty(moved, dtype=torch.uint8).fill_(1)
    dst = torch.empty(moved, dtype=torch.uint8).fill_(2)
    base = time_repeated(lambda: dst.copy_(src), max(repeats, 5))
    del src, dst
    return {
        "arena_bytes": nbytes,
        "live_requests": results[0][2],
        "holes": results[0][3],
        "pages_moved": results[0][0].pages_moved,
        "bytes_moved": moved,
        "compact_s": [dt for _, dt, *_ in results],
        "copy_s": copy_s,
        "baseline_s": base,
    }


# =============================================================================================
# report
# =============================================================================================
def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def report(rows: dict[str, Row], info: dict, comp: dict, args: argparse.Namespace) -> None:
    layout = preset(LAYOUT)
    print(f"kvd bench/pool.py -- {LAYOUT}: full page {layout.page_bytes(layout.group('full')):,d} B, "
          f"swa page {layout.page_bytes(layout.group('swa')):,d} B (window {layout.group('swa').window})")
    print(f"host: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, python {platform.python_version()}; "
          f"median of {args.repeats} repeats{' (--quick)' if args.quick else ''}")
    print()
    n = info["n"]
    print(f"1. Request ops: {n:,d} requests, 512-8192 tokens (uniform), 3 in 4 received / 1 in 4 computed; "
          f"each extended once by {'/'.join(map(str, EXTEND_SIZES))} tokens "
          f"({info['ext_new_page']:,d} of {n:,d} extends cross a page)")
    print(f"   all {n:,d} live at once: {info['live_full_pages']:,d} full + {info['live_swa_pages']:,d} swa pages in a "
          f"sparse {info['arena_bytes'] / 2**40:.2f} TiB shm arena (never touched; tables {info['tables_mib']:.0f} MiB, "
          f"full v2p {info['full_v2p']:,d} ids)")
    print()
    print("| op | calls | batch | µs/call | µs/request | requests/s | p50 µs/call | p99 µs/call |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows.values():
        calls = len(r.samples[0].call_ns)
        per_call = r.median(lambda s: s.total_s / len(s.call_ns) * 1e6)
        per_req = r.median(lambda s: s.total_s / s.items * 1e6)
        rate = r.median(lambda s: s.items / s.total_s)
        p50 = r.median(lambda s: pct(s.call_ns, 0.5) / 1e3)
        p99 = r.median(lambda s: pct(s.call_ns, 0.99) / 1e3)
        print(f"| {r.name} | {calls:,d} | {r.batch:,d} | {per_call:,.1f} | {per_req:,.1f} | "
              f"{fmt_rate(rate)} | {p50:,.1f} | {p99:,.1f} |")
    print()
    print(f"2. Translation: pool.translate(\"full\", vids) of {TRANSLATE_IDS:,d} ids of live requests "
          f"({info['translate_live_ids']:,d} live ids{', tiled' if info['translate_live_ids'] < TRANSLATE_IDS else ''}); "
          f"baseline: int32_table.index_select(0, ids_int64), table as long as the v2p; median of {info['t_reps']}")
    print()
    print("| ids | pool, int32 vids (ms) | pool, int64 vids (ms) | baseline index_select (ms) | pool int32 / baseline | target |")
    print("|---|---:|---:|---:|---:|---|")
    worst_ms = 0.0
    for label, t in info["translate"].items():
        p32, p64, b = (statistics.median(t[k]) * 1e3 for k in ("pool_int32", "pool_int64", "baseline"))
        worst_ms = max(worst_ms, p32, p64)
        print(f"| {label} | {p32:.2f} | {p64:.2f} | {b:.2f} | {p32 / b:.2f}x | {'< 10 ms: ok' if p32 < 10 else '< 10 ms: MISSED'} |")
    print()
    c = comp
    cs, cp, bs = (statistics.median(c[k]) for k in ("compact_s", "copy_s", "baseline_s"))
    moved = c["bytes_moved"]
    ratio = (moved / cs) / (moved / bs)
    print(f"3. Compaction: {c['arena_bytes'] / GIB:.1f} GiB touched shm arena filled with 16-64-token requests, every other "
          f"one freed ({c['live_requests']} live; holes {c['holes']['swa']} swa + {c['holes']['full']} full pages), then "
          f"pool.compact(); baseline: dst.copy_(src), {moved:,d} B contiguous uint8")
    print()
    print("| what | pages | bytes | ms | GB/s | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| pool.compact() | {c['pages_moved']:,d} | {moved:,d} | {cs * 1e3:.1f} | {moved / cs / 1e9:.2f} | "
          f"{ratio:.2f} ({'>= 0.8: ok' if ratio >= 0.8 else '>= 0.8: MISSED'}) |")
    print(f"| of which copy_runs | {c['pages_moved']:,d} | {moved:,d} | {cp * 1e3:.1f} | {moved / cp / 1e9:.2f} | {bs / cp:.2f} |")
    print(f"| baseline dst.copy_(src) | - | {moved:,d} | {bs * 1e3:.1f} | {moved / bs / 1e9:.2f} | 1.00 |")
    print()
    print(f"summary: translate 1M ids {worst_ms:.2f} ms (target < 10 ms); compaction {ratio:.2f}x of a plain copy (target >= 0.8)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1,000 requests, 2 repeats, 1 GiB compaction arena")
    ap.add_argument("--requests", type=int, default=None, help="requests in part 1 (default 10,000; --quick 1,000)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of each timed thing (default 3; --quick 2)")
    ap.add_argument("--compact-gib", type=float, default=None, help="compaction arena in GiB (default 3; --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.requests = args.requests or (1_000 if args.quick else 10_000)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.compact_gib = args.compact_gib or (1.0 if args.quick else 3.0)
    t0 = time.perf_counter()
    rows, info = bench_requests(args.requests, args.repeats, args.seed, TRANSLATE_IDS)
    gc.collect()
    comp = bench_compaction(args.compact_gib, args.repeats, args.seed)
    report(rows, info, comp, args)
    print(f"(ran {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
