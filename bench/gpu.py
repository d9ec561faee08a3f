"""GPU data-plane benchmark (issue 6): page moves, id translation and post-capture finalize on a
CUDA virtual-memory arena, each against a baseline measured in the same run.

    python3 bench/gpu.py            # full run (about a minute on an H200, Triton compiles included)
    python3 bench/gpu.py --quick    # smaller sizes, the default designs only (~30 s)
    python3 bench/gpu.py --json out.json
    python3 bench/gpu.py --explore  # also: plain Triton / TMA copies of 512 MiB (where the time goes)
    python3 bench/gpu.py --sweep    # also: translate block x warps x hints grid

Self-checking: every timed variant (page-move design, translate tuning) is first run on its
inputs and compared with a reference; a variant that fails is reported as such and not timed,
and the exit status is 1 if anything failed.

1. Copy ceiling. ``dst.copy_(src)`` of 2 GiB inside one arena, GB/s counting bytes read and
   written (the device's practical bandwidth).
2. Page moves. A 4 GiB VMM arena viewed as ``[pages, page_bytes]`` for page sizes 4 KiB - 2 MiB.
   Runs of 1-8 pages are scattered: sources in random 8-page slots of the lower half,
   destinations in random slots of the upper half (no overlap), about 0.56 GiB moved per call.
   Each design of ``kernels.move_pages`` (``DESIGNS``: "flat" 8K/8w is the default) is timed
   with its table prepared on the device (kernel column) and with the run table on the CPU
   (e2e column: what compaction's ``copy_runs`` pays, table building included: for "flat", the
   pinned staging buffer, one asynchronous copy and one table-building launch), against torch
   ``index_select``/``index_copy_`` with device indices (the old path) and a contiguous
   ``copy_`` of the same byte count (the baseline). ratio = copy time / kernel time (target
   >= 0.8 for pages >= 16 KiB). For the default design, "e2e unstaged" times the previous CPU
   path (pageable copy, torch table build) in the same run. Both paths of every design are
   checked (every moved page against its source) before they are timed.
3. Translation. ``kernels.translate(v2p, vids)``: a 4M-entry int32 table, 1M and 16M int32 ids,
   random or request-ordered (runs of 64 consecutive ids). Bytes counted: 4 read per id, 4 read
   per table entry, 4 written = 12 B/id. 1M-id cases are replayed from a CUDA graph over 8
   rotating input sets (ids + outputs 64 MiB, more than the L2) so neither launch overhead nor
   cache hits on the ids flatter them; the same-traffic copy is timed the same way. ratio =
   translate GB/s / the 2 GiB copy's GB/s (target >= 0.7). The physically required traffic is
   printed too: ids and output (8 B/id) plus one 32-byte sector per distinct sector of the table
   the ids touch (a random gather reads a sector to use 4 bytes of it), counted on the inputs.
   Then every tuning in ``kernels.TRANSLATE_VARIANTS`` is timed the same way on 1M ids (each
   checked on all 8 sets and on ragged, out-of-range ids first) and the fastest is named.
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


#: Scales do_bench's warmup/rep windows (--quick lowers it).
_TIME_SCALE = 1.0


def _bench(fn, warmup: int = 25, rep: int = 200) -> float:
    import triton.testing

    warmup, rep = max(5, int(warmup * _TIME_SCALE)), max(20, int(rep * _TIME_SCALE))
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
    from kvd.copy.runs import Runs

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


DEFAULT_DESIGN = "flat 8K/8w"


def _move_checked(view, d_idx, s_idx, move) -> bool:
    """Zero the destinations, run ``move`` once, compare every moved page with its source."""
    view[d_idx] = 0
    move()
    return bool(torch.equal(view[d_idx], view[s_idx]))


def page_moves(arena, page_sizes: list[int], designs: list[tuple]) -> list[dict]:
    from kvd.copy import kernels
    from kvd.copy.runs import expand

    flat = arena.tensor()
    rows = []
    gen = torch.Generator().manual_seed(0)
    nan = float("nan")
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
        for label, strategy, tile, warps in designs:
            if strategy == "flat":
                prepared = kernels.prepare_tiles(view, view, runs, tile_bytes=tile)
            else:
                prepared = kernels.prepare_runs(runs, pb, view.device, tile_bytes=tile, strategy=strategy)
            kw = {"tile_bytes": tile, "strategy": strategy, "num_warps": warps}
            kernel_fn = lambda: kernels.move_pages(view, view, prepared, **kw)  # noqa: E731
            e2e_fn = lambda: kernels.move_pages(view, view, runs, **kw)  # noqa: E731 - runs on the CPU
            ok = _move_checked(view, d_idx, s_idx, kernel_fn) and _move_checked(view, d_idx, s_idx, e2e_fn)
            t_kernel = _bench(kernel_fn) if ok else nan
            t_e2e = _bench(e2e_fn, rep=100) if ok else nan
            t_old = nan
            if ok and label == DEFAULT_DESIGN:  # the previous CPU path, for comparison
                staged, kernels._STAGED_TABLE = kernels._STAGED_TABLE, False
                try:
                    ok = _move_checked(view, d_idx, s_idx, e2e_fn)
                    t_old = _bench(e2e_fn, rep=100) if ok else nan
                finally:
                    kernels._STAGED_TABLE = staged
            rows.append({
                "page_bytes": pb, "design": label, "runs": len(runs), "programs": len(prepared), "moved_bytes": moved,
                "kernel_ms": t_kernel, "e2e_ms": t_e2e, "e2e_unstaged_ms": t_old, "torch_index_ms": t_torch,
                "contig_copy_ms": t_copy, "kernel_GBps_rw": 2 * moved / t_kernel / 1e6, "ratio": t_copy / t_kernel,
                "ratio_e2e": t_copy / t_e2e, "ratio_e2e_unstaged": t_copy / t_old, "correct": ok,
            })
    return rows


_TABLE_N = 4 << 20  # entries of the translation table (16 MiB of int32)


def _id_sets(order: str, n: int, sets: int, g: torch.Generator, *, outside: bool = False) -> list[torch.Tensor]:
    """``sets`` int32 id tensors; ``outside``: a few ids (1 in ~3,000) outside the table, so the
    timed inputs also check the -1 path (torch's index_select would refuse them)."""
    dev = torch.device("cuda")
    out = []
    for _ in range(sets):
        if order == "random":
            v = torch.randint(0, _TABLE_N, (n,), dtype=torch.int32, device=dev, generator=g)
        else:
            starts = torch.randint(0, _TABLE_N - 64, (-(-n // 64),), device=dev, generator=g)
            v = (starts[:, None] + torch.arange(64, device=dev)[None, :]).flatten()[:n].to(torch.int32)
        if outside:
            v[::4099] = -1
            v[1::8191] = _TABLE_N
        out.append(v)
    return out


def _reference(v2p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v2p[v]`` with index_select semantics, -1 where ``v`` is outside the table."""
    v = v.to(torch.int64)
    inside = (v >= 0) & (v < v2p.numel())
    return torch.where(inside, v2p.index_select(0, v.clamp(0, v2p.numel() - 1)), torch.full_like(v2p[:1], -1))


def _physical_bytes(ids: list[torch.Tensor]) -> float:
    """Mean bytes one call must move at least: 4 B id read + 4 B written per id, plus one 32-byte
    sector per distinct sector of the table the ids touch (8 int32 entries per sector)."""
    return statistics.mean(8 * v.numel() + 32 * torch.unique(v.to(torch.int64) // 8).numel() for v in ids)


def _translate_ok(v2p: torch.Tensor, ids: list[torch.Tensor], refs: list[torch.Tensor], fn, *, ragged: bool = True) -> bool:
    """``fn(v2p, ids)`` equals the reference on every timed input set; ``ragged``: also on a
    ragged input (the masked path) with ids outside the table, as int64 and as int32 ids."""
    if not all(torch.equal(fn(v2p, v), r) for v, r in zip(ids, refs)):
        return False
    if not ragged:
        return True
    g = torch.Generator(device="cuda").manual_seed(3)
    odd = torch.randint(-8, _TABLE_N + 8, ((1 << 20) + 37,), dtype=torch.int64, device="cuda", generator=g)
    odd[::97], odd[1::89], odd[2::101] = -1, _TABLE_N, -(1 << 40)
    want = _reference(v2p, odd)
    small = odd.clamp(-(1 << 31), (1 << 31) - 1).to(torch.int32)
    return bool(torch.equal(fn(v2p, odd), want) and torch.equal(fn(v2p, small), want))


def translation(copy_gbps: float, sizes: list[int]) -> list[dict]:
    from kvd.copy import kernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    v2p = torch.randint(-1, 1 << 24, (_TABLE_N,), dtype=torch.int32, device=dev, generator=g)
    rows = []
    nan = float("nan")
    for n in sizes:
        for order in ("random", "request-ordered"):
            sets = 8 if n <= (1 << 22) else 1
            ids = _id_sets(order, n, sets, g)
            outs = [torch.empty(n, dtype=torch.int32, device=dev) for _ in range(sets)]
            refs = [v2p.index_select(0, v.long()) for v in ids]
            ok = _translate_ok(v2p, ids, refs, lambda t, v: kernels.translate(t, v))
            nbytes, phys = 12 * n, _physical_bytes(ids)
            cp_src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(sets)]
            cp_dst = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(sets)]

            def tr(i):
                return lambda: kernels.translate(v2p, ids[i])

            def torch_tr(i):
                return lambda: torch.index_select(v2p, 0, ids[i], out=outs[i])

            def cp(i):
                return lambda: cp_dst[i].copy_(cp_src[i])

            t_tr = _graph_time([tr(i) for i in range(sets)]) if ok else nan
            t_torch = _graph_time([torch_tr(i) for i in range(sets)])
            t_cp = _graph_time([cp(i) for i in range(sets)])
            t_plain = _bench(tr(0)) if ok else nan  # one eager launch, launch overhead included
            rows.append({
                "ids": n, "order": order, "translate_us": t_tr * 1e3, "eager_us": t_plain * 1e3,
                "index_select_us": t_torch * 1e3, "same_traffic_copy_us": t_cp * 1e3,
                "GBps": nbytes / t_tr / 1e6, "ratio_vs_copy_ceiling": nbytes / t_tr / 1e6 / copy_gbps,
                "ratio_vs_same_copy": t_cp / t_tr, "physical_B_per_id": phys / n,
                "physical_GBps": phys / t_tr / 1e6, "physical_ratio": phys / t_tr / 1e6 / copy_gbps, "correct": ok,
            })
    return rows


def translate_variants(copy_gbps: float, variants: dict, n: int = 1 << 20, *, ragged: bool = True) -> list[dict]:
    """Every tuning on ``n`` ids, random and request-ordered, graph replay over 8 rotating sets;
    each checked first (a failing or non-compiling tuning is reported, not timed). The timed sets
    hold a few ids outside the table, so the check covers the -1 path on the timed inputs."""
    from kvd.copy import kernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    v2p = torch.randint(-1, 1 << 24, (_TABLE_N,), dtype=torch.int32, device=dev, generator=g)
    rows = []
    for order in ("random", "request-ordered"):
        ids = _id_sets(order, n, 8, g, outside=True)
        refs = [_reference(v2p, v) for v in ids]
        phys = _physical_bytes(ids)
        for label, tu in variants.items():
            row = {"variant": label, "order": order, "tuning": tu._asdict(), "ids": n, "us": float("nan"),
                   "physical_B_per_id": phys / n, "correct": False, "error": ""}
            try:
                row["correct"] = _translate_ok(
                    v2p, ids, refs, lambda t, v, tu=tu: kernels.translate(t, v, tuning=tu), ragged=ragged
                )
                if row["correct"]:
                    t = _graph_time([(lambda i=i, tu=tu: kernels.translate(v2p, ids[i], tuning=tu)) for i in range(8)])
                    row["us"] = t * 1e3
            except Exception as e:  # noqa: BLE001 - a tuning that does not compile is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            row["GBps"] = 12 * n / row["us"] / 1e3
            row["ratio"] = row["GBps"] / copy_gbps
            row["physical_GBps"] = phys / row["us"] / 1e3
            row["physical_ratio"] = row["physical_GBps"] / copy_gbps
            rows.append(row)
    return rows


def sweep_variants() -> dict:
    """The --sweep grid: ids per program x warps x (no hints | stream + keep)."""
    from kvd.copy.kernels import TranslateTuning

    from kvd.copy.kernels import _TRANSLATE

    out = {"default 2048/4w": _TRANSLATE}
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 1 or block // (32 * warps) > 64:
                continue
            for hints in (False, True):
                out[f"{block}/{warps}w{' stream+keep' if hints else ''}"] = TranslateTuning(block, warps, True, hints, hints)
    return out


def _l2_mib() -> str:
    size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    return f"{size / MiB:.0f}" if size else "?"


def _print_variants(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}: 1M int32 ids, graph replay over 8 rotating sets, 12 B/id counted\n")
    print(_table(
        ["variant", "order", "us", "GB/s", "vs copy ceiling", "phys B/id", "phys GB/s", "phys vs ceiling", "ok"],
        [[r["variant"], r["order"], f"{r['us']:.2f}", f"{r['GBps']:,.0f}", f"{r['ratio']:.2f}",
          f"{r['physical_B_per_id']:.1f}", f"{r['physical_GBps']:,.0f}", f"{r['physical_ratio']:.2f}",
          "yes" if r["correct"] else ("NO " + r["error"]).strip()] for r in rows],
    ))
    for line in _winners(rows):
        print(line)
    print(flush=True)


def _winners(rows: list[dict]) -> list[str]:
    lines = []
    for order in dict.fromkeys(r["order"] for r in rows):
        good = [r for r in rows if r["order"] == order and r["correct"] and r["us"] == r["us"]]
        if good:
            best = min(good, key=lambda r: r["us"])
            base = next((r for r in good if r["variant"].startswith("default")), None)
            vs = f", {base['us'] / best['us']:.2f}x the default" if base else ""
            lines.append(f"fastest ({order}): {best['variant']} {best['us']:.2f} us, ratio {best['ratio']:.2f}{vs}")
    return lines


def explore(arena) -> list[dict]:
    """Where does the page-move kernel lose to memcpy? Same bytes (512 MiB) every row."""
    import triton
    import triton.language as tl

    from kvd.copy import kernels
    from kvd.copy.runs import Runs

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


def finalize(sizes_gib: list[int]) -> list[dict]:
    from kvd.memory.vmm import CudaVmmArena
    from kvd.pool.pool import Pool
    from kvd.pool.presets import preset

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
    ap.add_argument("--quick", action="store_true", help="smaller sizes, default designs only (~30 s)")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--sweep", action="store_true", help="also time a translate grid (block x warps x hints)")
    ap.add_argument("--explore", action="store_true", help="also time copy-kernel experiments (plain, TMA)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is false)")
        return 2
    import triton

    from kvd.memory.vmm import CudaVmmArena

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

    global _TIME_SCALE
    _TIME_SCALE = 0.25 if args.quick else 1.0
    arena_gib = 1 if args.quick else 4
    arena = CudaVmmArena(16 * GiB, arena_gib * GiB)
    arena.tensor().random_(0, 256)
    ceiling = copy_ceiling(arena, arena_gib * GiB // 2)
    result["copy_ceiling"] = ceiling
    print(f"\n## Copy ceiling: {_fmt_bytes(ceiling['bytes'])} dst.copy_(src): {ceiling['ms']:.3f} ms, "
          f"{ceiling['GBps_rw']:,.0f} GB/s (read + write)\n", flush=True)

    if args.quick:
        pages, designs = [16 * KiB, 256 * KiB, 2 * MiB], [d for d in DESIGNS if d[0] == DEFAULT_DESIGN]
    else:
        pages, designs = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB], DESIGNS
    moves = section("page_moves", lambda: page_moves(arena, pages, designs))
    print("## Page moves (scattered runs of 1-8 pages; ratio = contiguous copy time / kernel time; "
          "e2e = run table on the CPU, as compaction calls it: pinned staging + one copy + one table launch; "
          "e2e unstaged = the previous path, pageable copy + torch table build)\n")
    print(_table(
        ["page", "design", "runs", "moved", "kernel ms", "GB/s r+w", "copy ms", "ratio", "e2e ms", "ratio e2e",
         "e2e unstaged ms", "ratio unstaged", "torch idx ms", "vs torch", "ok"],
        [[_fmt_bytes(r["page_bytes"]), r["design"], r["runs"], f"{r['moved_bytes'] / MiB:.0f} MiB", f"{r['kernel_ms']:.3f}",
          f"{r['kernel_GBps_rw']:,.0f}", f"{r['contig_copy_ms']:.3f}", f"{r['ratio']:.2f}",
          f"{r['e2e_ms']:.3f}", f"{r['ratio_e2e']:.2f}",
          "-" if r["e2e_unstaged_ms"] != r["e2e_unstaged_ms"] else f"{r['e2e_unstaged_ms']:.3f}",
          "-" if r["e2e_unstaged_ms"] != r["e2e_unstaged_ms"] else f"{r['ratio_e2e_unstaged']:.2f}",
          f"{r['torch_index_ms']:.3f}", f"{r['torch_index_ms'] / r['kernel_ms']:.1f}x",
          "yes" if r["correct"] else "NO"] for r in moves],
    ), flush=True)
    if args.explore:
        exp = section("explore", lambda: explore(arena))
        print("\n## Copy experiments (512 MiB)\n")
        print(_table(["what", "ms", "GB/s r+w", "vs torch copy"],
                     [[r["what"], f"{r['ms']:.3f}", f"{r['GBps_rw']:,.0f}", f"{r['vs_copy']:.2f}"] for r in exp]), flush=True)
    arena.close()
    torch.cuda.empty_cache()

    trans = section("translation", lambda: translation(ceiling["GBps_rw"], [1 << 20] if args.quick else [1 << 20, 16 << 20]))
    print(f"\n## Translation ({_TABLE_N >> 20}M-entry int32 table = {_TABLE_N * 4 >> 20} MiB, L2 {_l2_mib()} MiB; "
          "int32 ids; 12 B/id counted; CUDA-graph replay, 8 rotating sets for 1M; default tuning)\n")
    print("physical = 8 B/id (ids + output) + 32 B per distinct table sector the ids touch: what DRAM must move "
          "when the table is not in L2; random ids touch about one sector per id, so 12 B/id understates their traffic.\n")
    print(_table(
        ["ids", "order", "translate us", "GB/s", "vs copy ceiling", "phys B/id", "phys GB/s", "phys vs ceiling",
         "same-traffic copy us", "vs same copy", "index_select us", "eager us", "ok"],
        [[f"{r['ids']:,}", r["order"], f"{r['translate_us']:.1f}", f"{r['GBps']:,.0f}",
          f"{r['ratio_vs_copy_ceiling']:.2f}", f"{r['physical_B_per_id']:.1f}", f"{r['physical_GBps']:,.0f}",
          f"{r['physical_ratio']:.2f}", f"{r['same_traffic_copy_us']:.1f}", f"{r['ratio_vs_same_copy']:.2f}",
          f"{r['index_select_us']:.1f}", f"{r['eager_us']:.1f}", "yes" if r["correct"] else "NO"] for r in trans],
    ), flush=True)

    from kvd.copy.kernels import TRANSLATE_VARIANTS

    named = TRANSLATE_VARIANTS
    if args.quick:
        named = {k: v for k, v in TRANSLATE_VARIANTS.items() if k in ("default 2048/4w", "plain 2048/4w", "stream+keep 4096/8w")}
    tvars = section("translate_variants", lambda: translate_variants(ceiling["GBps_rw"], named))
    _print_variants("Translate tunings (kernels.TRANSLATE_VARIANTS)", tvars)
    tsweep: list[dict] = []
    if args.sweep:
        tsweep = section("translate_sweep", lambda: translate_variants(ceiling["GBps_rw"], sweep_variants(), ragged=False))
        _print_variants("Translate sweep (ids per program / warps, with and without stream+keep hints)", tsweep)
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
    bad += [r for r in tvars + tsweep if not r["correct"]]
    bad += [r for r in fin if not r["base_unchanged"]]
    if failed:
        print("sections that failed:", ", ".join(failed))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
