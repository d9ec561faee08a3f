"""GPU data-plane benchmark (issue 6): page moves, id translation and post-capture finalize on a
CUDA virtual-memory arena, each against a baseline measured in the same run.

    python3 bench/gpu.py            # full run (well under a minute on an H200)
    python3 bench/gpu.py --quick    # smaller sizes
    python3 bench/gpu.py --json out.json
    python3 bench/gpu.py --explore  # also: plain Triton / TMA copies of 512 MiB (where the time goes)
    python3 bench/gpu.py --sweep    # also: translate block/warps variants

1. Copy ceiling. ``dst.copy_(src)`` of 2 GiB inside one arena, GB/s counting bytes read and
   written (the device's practical bandwidth).
2. Page moves. A 4 GiB VMM arena viewed as ``[pages, page_bytes]`` for page sizes 4 KiB - 2 MiB.
   Runs of 1-8 pages are scattered: sources in random 8-page slots of the lower half,
   destinations in random slots of the upper half (no overlap), about 0.56 GiB moved per call.
   Each design of ``kernels.move_pages`` (``DESIGNS``: "flat" 8K/8w is the default) is timed
   with its table prepared on the device (kernel column) and with the run table on the CPU
   (e2e column: what compaction's ``copy_runs`` pays, table building included), against torch
   ``index_select``/``index_copy_`` with device indices (the old path) and a contiguous
   ``copy_`` of the same byte count (the baseline). ratio = copy time / kernel time (target
   >= 0.8 for pages >= 16 KiB). Every design's moved pages are checked against their sources.
3. Translation. ``kernels.translate(v2p, vids)``: a 4M-entry int32 table, 1M and 16M int32 ids,
   random or request-ordered (runs of 64 consecutive ids). Bytes counted: 4 read per id, 4 read
   per table entry, 4 written = 12 B/id. 1M-id cases are replayed from a CUDA graph over 8
   rotating input sets (96 MiB, more than the 60 MB L2) so neither launch overhead nor cache
   hits flatter them; the same-traffic copy is timed the same way. ratio = translate GB/s /
   the 2 GiB copy's GB/s (target >= 0.7).
4. Finalize. ``Pool(gpt-oss-20b, CudaVmmArena(256 GiB), post_capture=True).finalize(N GiB)``:
   wall time to back N GiB in place (cuMemCreate + cuMemMap + cuMemSetAccess + capacities),
   the base address before and after, and the time to give it back (close).

Times are medians of ``triton.testing.do_bench`` (events) or of graph replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def _bench(fn, warmup: int = 25, rep: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _graph_time(fns: list, replays: int = 50) -> float:
    """Median ms per call of ``fns`` (one round = every fn once), replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm up (compiles) outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(fns))
    return statistics.median(times)


def copy_ceiling(arena, nbytes: int) -> dict:
    t = arena.tensor()
    src, dst = t[:nbytes], t[nbytes : 2 * nbytes]
    ms = _bench(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "GBps_rw": 2 * nbytes / ms / 1e6}


def _scattered_runs(pages: int, slot: int, gen: torch.Generator):
    from kvd.runs import Runs

    half = pages // 2
    slots = half // slot
    n = max(1, slots // 2)
    src = torch.randperm(slots, generator=gen)[:n] * slot
    dst = half + torch.randperm(slots, generator=gen)[:n] * slot
    length = torch.randint(1, slot + 1, (n,), generator=gen)
    return Runs(src.to(torch.int64), dst.to(torch.int64), length.to(torch.int64))


#: (label, strategy, tile bytes, num_warps) of the page-move designs timed side by side.
DESIGNS = [
    ("tile 32K", "tile", None, None),
    ("balanced 32K", "balanced", None, None),
    ("flat 2K/4w", "flat", 2 * KiB, 4),
    ("flat 8K/8w", "flat", 8 * KiB, 8),
    ("flat 32K/8w", "flat", 32 * KiB, 8),
]


def page_moves(arena, page_sizes: list[int]) -> list[dict]:
    from kvd import kernels
    from kvd.runs import expand

    flat = arena.tensor()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for pb in page_sizes:
        pages = flat.numel() // pb
        view = flat[: pages * pb].view(pages, pb)
        runs = _scattered_runs(pages, 8, gen)
        moved = int(runs.length.sum()) * pb
        s_idx, d_idx = (t.to(view.device) for t in expand(runs))
        half = (pages // 2) * pb
        c_src, c_dst = flat[:moved], flat[half : half + moved]
        t_copy = _bench(lambda: c_dst.copy_(c_src))
        t_torch = _bench(lambda: view.index_copy_(0, d_idx, view.index_select(0, s_idx)), rep=100)
        for label, strategy, tile, warps in DESIGNS:
            if strategy == "flat":
                prepared = kernels.prepare_tiles(view, view, runs, tile_bytes=tile)
            else:
                prepared = kernels.prepare_runs(runs, pb, view.device, tile_bytes=tile, strategy=strategy)
            kw = {"tile_bytes": tile, "strategy": strategy, "num_warps": warps}
            t_kernel = _bench(lambda: kernels.move_pages(view, view, prepared, **kw))
            t_e2e = _bench(lambda: kernels.move_pages(view, view, runs, **kw), rep=100)  # runs on the CPU
            view[d_idx] = 0  # correctness: fresh destinations, one move, compare every moved page
            kernels.move_pages(view, view, runs, **kw)
            ok = bool(torch.equal(view[d_idx], view[s_idx]))
            rows.append({
                "page_bytes": pb, "design": label, "runs": len(runs), "programs": len(prepared), "moved_bytes": moved,
                "kernel_ms": t_kernel, "e2e_ms": t_e2e, "torch_index_ms": t_torch, "contig_copy_ms": t_copy,
                "kernel_GBps_rw": 2 * moved / t_kernel / 1e6, "ratio": t_copy / t_kernel, "ratio_e2e": t_copy / t_e2e,
                "correct": ok,
            })
    return rows


def translation(copy_gbps: float, sizes: list[int]) -> list[dict]:
    from kvd import kernels

    dev = torch.device("cuda")
    table_n = 4 << 20
    g = torch.Generator(device=dev).manual_seed(1)
    v2p = torch.randint(-1, 1 << 24, (table_n,), dtype=torch.int32, device=dev, generator=g)
    rows = []
    for n in sizes:
        for order in ("random", "request-ordered"):
            sets = 8 if n <= (1 << 22) else 1
            ids, outs = [], []
            for _ in range(sets):
                if order == "random":
                    v = torch.randint(0, table_n, (n,), dtype=torch.int32, device=dev, generator=g)
                else:
                    starts = torch.randint(0, table_n - 64, (-(-n // 64),), device=dev, generator=g)
                    v = (starts[:, None] + torch.arange(64, device=dev)[None, :]).flatten()[:n].to(torch.int32)
                ids.append(v)
                outs.append(torch.empty(n, dtype=torch.int32, device=dev))
            ref = v2p.index_select(0, ids[0].long())
            ok = bool(torch.equal(kernels.translate(v2p, ids[0]), ref))
            nbytes = 12 * n
            cp_src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(sets)]
            cp_dst = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(sets)]

            def tr(i):
                return lambda: kernels.translate(v2p, ids[i])

            def torch_tr(i):
                return lambda: torch.index_select(v2p, 0, ids[i], out=outs[i])

            def cp(i):
                return lambda: cp_dst[i].copy_(cp_src[i])

            t_tr = _graph_time([tr(i) for i in range(sets)])
            t_torch = _graph_time([torch_tr(i) for i in range(sets)])
            t_cp = _graph_time([cp(i) for i in range(sets)])
            t_plain = _bench(tr(0))  # one eager launch, launch overhead included
            rows.append({
                "ids": n, "order": order, "translate_us": t_tr * 1e3, "eager_us": t_plain * 1e3,
                "index_select_us": t_torch * 1e3, "same_traffic_copy_us": t_cp * 1e3,
                "GBps": nbytes / t_tr / 1e6, "ratio_vs_copy_ceiling": nbytes / t_tr / 1e6 / copy_gbps,
                "ratio_vs_same_copy": t_cp / t_tr, "correct": ok,
            })
    return rows


def explore(arena) -> list[dict]:
    """Where does the page-move kernel lose to memcpy? Same bytes (512 MiB) every row."""
    import triton
    import triton.language as tl

    from kvd import kernels
    from kvd.runs import Runs

    @triton.jit
    def plain_copy(src, dst, n, BLOCK: tl.constexpr, POLICY: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if POLICY == 1:
            x = tl.load(src + off, eviction_policy="evict_first")
            tl.store(dst + off, x, eviction_policy="evict_first")
        else:
            x = tl.load(src + off)
            tl.store(dst + off, x)

    @triton.jit
    def tma_copy(src, dst, n_rows, ROWS: tl.constexpr, COLS: tl.constexpr):
        ds = tl.make_tensor_descriptor(src, shape=[n_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
        dd = tl.make_tensor_descriptor(dst, shape=[n_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
        row = tl.program_id(0) * ROWS
        dd.store([row, 0], ds.load([row, 0]))

    nbytes = 512 * MiB
    flat = arena.tensor()
    a, b = flat[:nbytes], flat[2 * GiB : 2 * GiB + nbytes]
    a64, b64 = a.view(torch.int64), b.view(torch.int64)
    rows = []
    t_copy = _bench(lambda: b.copy_(a))
    rows.append({"what": "torch copy_ (VMM arena)", "ms": t_copy})
    m1, m2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows.append({"what": "torch copy_ (cudaMalloc)", "ms": _bench(lambda: m2.copy_(m1))})
    view = flat[: 4 * GiB].view(-1, 64 * KiB)
    one = Runs(torch.tensor([0]), torch.tensor([2 * GiB // (64 * KiB)]), torch.tensor([nbytes // (64 * KiB)]))
    for strat in ("tile", "balanced"):
        prep = kernels.prepare_runs(one, 64 * KiB, view.device, strategy=strat)
        rows.append({"what": f"move_pages one contiguous run ({strat})",
                     "ms": _bench(lambda: kernels.move_pages(view, view, prep, strategy=strat))})
    for warps in (2, 4, 16):
        prep = kernels.prepare_runs(one, 64 * KiB, view.device)
        rows.append({"what": f"move_pages one run, num_warps={warps}",
                     "ms": _bench(lambda: kernels.move_pages(view, view, prep, num_warps=warps))})
    n = a64.numel()
    for block in (256, 1024, 4096):
        for warps in (4, 8):
            for pol in (0, 1):
                fn = lambda: plain_copy[(n // block,)](a64, b64, n, BLOCK=block, POLICY=pol, num_warps=warps)  # noqa: E731
                rows.append({"what": f"plain triton copy BLOCK={block} warps={warps} evict_first={pol}", "ms": _bench(fn)})
    try:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        for rows_, cols in ((256, 16), (128, 32), (64, 64)):
            nr = n // cols
            fn = lambda: tma_copy[(nr // rows_,)](a64, b64, nr, ROWS=rows_, COLS=cols)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(a, b))
            rows.append({"what": f"TMA copy box [{rows_}, {cols}] int64 (ok={ok})", "ms": _bench(fn)})
    except Exception as e:  # noqa: BLE001
        rows.append({"what": f"TMA copy failed: {type(e).__name__}: {str(e)[:160]}", "ms": float("nan")})
    for r in rows:
        r["GBps_rw"] = 2 * nbytes / r["ms"] / 1e6
        r["vs_copy"] = t_copy / r["ms"]
    return rows


def translate_sweep(copy_gbps: float) -> list[dict]:
    from kvd import kernels

    dev = torch.device("cuda")
    table_n, n, sets = 4 << 20, 1 << 20, 8
    g = torch.Generator(device=dev).manual_seed(2)
    v2p = torch.randint(-1, 1 << 24, (table_n,), dtype=torch.int32, device=dev, generator=g)
    ids = []
    for _ in range(sets):
        starts = torch.randint(0, table_n - 64, (n // 64,), device=dev, generator=g)
        ids.append((starts[:, None] + torch.arange(64, device=dev)[None, :]).flatten().to(torch.int32))
    rows = []
    for block in (512, 1024, 2048, 4096, 8192):
        for warps in (4, 8):
            fns = [(lambda i=i: kernels.translate(v2p, ids[i], block=block, num_warps=warps)) for i in range(sets)]
            t = _graph_time(fns)
            rows.append({"block": block, "warps": warps, "us": t * 1e3, "GBps": 12 * n / t / 1e6,
                         "ratio": 12 * n / t / 1e6 / copy_gbps})
    return rows


def finalize(sizes_gib: list[int]) -> list[dict]:
    from kvd.arena_cuda import CudaVmmArena
    from kvd.pool import Pool
    from kvd.presets import preset

    layout = preset("gpt-oss-20b")
    rows = []
    for n in sizes_gib:
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        arena = CudaVmmArena(256 * GiB)
        pool = Pool(layout, arena, post_capture=True)
        t_init = time.perf_counter() - t0
        base = arena.base
        t0 = time.perf_counter()
        pool.finalize(n * GiB)
        torch.cuda.synchronize()
        t_fin = time.perf_counter() - t0
        t = arena.tensor()
        t[-1] = 1  # the last backed byte is usable
        t[: 1 << 20].fill_(2)
        torch.cuda.synchronize()
        same = arena.base == base and pool.page_view("full").data_ptr() == base
        del t
        pool = None
        t0 = time.perf_counter()
        arena.close()
        t_close = time.perf_counter() - t0
        rows.append({"GiB": n, "reserve_and_pool_ms": t_init * 1e3, "finalize_ms": t_fin * 1e3,
                     "GiB_per_s": n / t_fin, "base_unchanged": same, "close_ms": t_close * 1e3})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--sweep", action="store_true", help="also time translate variants (block, warps)")
    ap.add_argument("--explore", action="store_true", help="also time copy-kernel experiments (plain, TMA)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is false)")
        return 2
    import triton

    from kvd.arena_cuda import CudaVmmArena

    props = torch.cuda.get_device_properties(0)
    env = {
        "date": datetime.date.today().isoformat(), "card": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
    }
    try:
        import cuda.bindings

        env["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
    except Exception:
        pass
    print("env:", json.dumps(env))
    result: dict = {"env": env}
    failed: list[str] = []

    def section(name: str, fn):
        """Run one section; print its table at once (a later failure keeps it), never stop the run."""
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - report and go on with the next section
            import traceback

            traceback.print_exc()
            failed.append(name)
            result[name] = []
        return result[name]

    arena_gib = 1 if args.quick else 4
    arena = CudaVmmArena(16 * GiB, arena_gib * GiB)
    arena.tensor().random_(0, 256)
    ceiling = copy_ceiling(arena, arena_gib * GiB // 2)
    result["copy_ceiling"] = ceiling
    print(f"\n## Copy ceiling: {_fmt_bytes(ceiling['bytes'])} dst.copy_(src): {ceiling['ms']:.3f} ms, "
          f"{ceiling['GBps_rw']:,.0f} GB/s (read + write)\n", flush=True)

    pages = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB]
    moves = section("page_moves", lambda: page_moves(arena, pages))
    print("## Page moves (scattered runs of 1-8 pages; ratio = contiguous copy time / kernel time; "
          "e2e = run table on the CPU, as compaction calls it)\n")
    print(_table(
        ["page", "design", "runs", "moved", "kernel ms", "GB/s r+w", "copy ms", "ratio", "e2e ms", "ratio e2e",
         "torch idx ms", "vs torch", "ok"],
        [[_fmt_bytes(r["page_bytes"]), r["design"], r["runs"], f"{r['moved_bytes'] / MiB:.0f} MiB", f"{r['kernel_ms']:.3f}",
          f"{r['kernel_GBps_rw']:,.0f}", f"{r['contig_copy_ms']:.3f}", f"{r['ratio']:.2f}",
          f"{r['e2e_ms']:.3f}", f"{r['ratio_e2e']:.2f}", f"{r['torch_index_ms']:.3f}",
          f"{r['torch_index_ms'] / r['kernel_ms']:.1f}x", "yes" if r["correct"] else "NO"] for r in moves],
    ), flush=True)
    if args.explore:
        exp = section("explore", lambda: explore(arena))
        print("\n## Copy experiments (512 MiB)\n")
        print(_table(["what", "ms", "GB/s r+w", "vs torch copy"],
                     [[r["what"], f"{r['ms']:.3f}", f"{r['GBps_rw']:,.0f}", f"{r['vs_copy']:.2f}"] for r in exp]), flush=True)
    arena.close()
    torch.cuda.empty_cache()

    trans = section("translation", lambda: translation(ceiling["GBps_rw"], [1 << 20] if args.quick else [1 << 20, 16 << 20]))
    print("\n## Translation (4M-entry table, int32 ids; 12 B/id; CUDA-graph replay, 8 rotating sets for 1M)\n")
    print(_table(
        ["ids", "order", "translate us", "GB/s", "vs copy ceiling", "same-traffic copy us", "vs same copy",
         "index_select us", "eager us", "ok"],
        [[f"{r['ids']:,}", r["order"], f"{r['translate_us']:.1f}", f"{r['GBps']:,.0f}",
          f"{r['ratio_vs_copy_ceiling']:.2f}", f"{r['same_traffic_copy_us']:.1f}", f"{r['ratio_vs_same_copy']:.2f}",
          f"{r['index_select_us']:.1f}", f"{r['eager_us']:.1f}", "yes" if r["correct"] else "NO"] for r in trans],
    ), flush=True)
    if args.sweep:
        tsweep = section("translate_sweep", lambda: translate_sweep(ceiling["GBps_rw"]))
        print("\n## Translate sweep (1M request-ordered ids, graph replay)\n")
        print(_table(["block", "warps", "us", "GB/s", "vs copy ceiling"],
                     [[r["block"], r["warps"], f"{r['us']:.2f}", f"{r['GBps']:,.0f}", f"{r['ratio']:.2f}"] for r in tsweep]))
    torch.cuda.empty_cache()

    fin = section("finalize", lambda: finalize([1, 4] if args.quick else [1, 8, 32, 64]))
    print("\n## Finalize (Pool(gpt-oss-20b, CudaVmmArena(256 GiB), post_capture=True).finalize(N))\n")
    print(_table(
        ["backed", "reserve+pool ms", "finalize ms", "GiB/s", "base unchanged", "close ms"],
        [[f"{r['GiB']} GiB", f"{r['reserve_and_pool_ms']:.1f}", f"{r['finalize_ms']:.2f}", f"{r['GiB_per_s']:,.0f}",
          "yes" if r["base_unchanged"] else "NO", f"{r['close_ms']:.2f}"] for r in fin],
    ), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = [r for r in moves if not r["correct"]] + [r for r in trans if not r["correct"]]
    bad += [r for r in fin if not r["base_unchanged"]]
    if failed:
        print("sections that failed:", ", ".join(failed))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
