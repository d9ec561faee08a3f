"""The vLLM connector's copies (kvd.connectors.vllm_blocks) against a plain copy of the same bytes,
for each KV layout vLLM 0.32 allocates (tensors made as its model runner makes them:
tests/kits/vllm_alloc_kit.py), in one run, timed with CUDA events (wall clock on the CPU).

    python bench/vllm_gpu_copy.py                      # cuda if present: 32 layers, 8 kv heads x 128, bf16
    python bench/vllm_gpu_copy.py --device cpu --layers 2 --tokens 512   # a quick check without a GPU

save = vLLM blocks -> kvd pages of every layer, layer by layer as save_kv_layer does (one request,
tokens [0, T)); load = kvd pages -> vLLM blocks of every layer in one call, as start_load_kv does.
The request's vLLM blocks and kvd pages are shuffled (what a busy engine holds; ``--consecutive``:
each in order, a fresh engine's). On the CPU the torch path copies runs that fill a block and a page
block for page (slices of consecutive ones, else a gather and a scatter); ``--per-token`` turns that
off (every token indexed, as before it), the baseline to run beside it. plain =
``dst.copy_(src)`` of the same byte count, contiguous, same device. save/load ms: the copies' time
on the device (CUDA events, the host's issue hidden behind a queued sleep); ratio = plain / that;
issue = the host's time to queue one request's copies (slot tables and launches: in vLLM this runs
beside the forward, which hides it as long as the host stays ahead). path: the copy that ran (``triton``: kvd.connectors.vllm_kernels; ``torch``: index ops, with the
reason the kernel did not apply); launches: what one request's save and load issued (kernel
launches, or torch index ops). Each copy is checked (the loaded blocks equal the source) before
it is timed. ``--path torch`` times the torch path on a GPU too. The second table splits the
issue time into its pieces (kvd.connectors.vllm_blocks.HOST_S, median of the reps): slots
(token_slots), rows (kernel blocks and rows), staging (the pinned buffer and the copy to the
device), launch (the copy calls: plan look-up and kernel launches, summed over a save's layers).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests", "kits")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import vllm_alloc_kit as va  # noqa: E402

from kvd.client.views import all_views  # noqa: E402
from kvd.connectors import vllm_blocks as vb  # noqa: E402
from kvd.pool.layout import GroupKind, GroupSpec, Layout  # noqa: E402


def timed(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """(median device seconds of ``fn``, median host seconds to issue it). On a GPU the device
    time is taken between CUDA events behind a ``torch.cuda._sleep`` longer than the issue, so
    the host's Python (slot tables, launches) is hidden and only the queued work is timed; on
    the CPU both are the wall clock."""
    fn()
    dev, issue = [], []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            # ~2 GHz clock: cover twice the last issue time and 1 ms
            torch.cuda._sleep(int(2e9 * (2 * (issue[-1] if issue else 0.01) + 1e-3)))
            a.record()
            t0 = time.perf_counter()
            fn()
            issue.append(time.perf_counter() - t0)
            b.record()
            b.synchronize()
            dev.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            issue.append(time.perf_counter() - t0)
            dev.append(issue[-1])
    return sorted(dev)[len(dev) // 2], sorted(issue)[len(issue) // 2]


def run(device: torch.device, layers: int, heads: int, dim: int, bs: int, tokens: int, layout: str, reps: int,
        path: str | None = None, consecutive: bool = False, per_token: bool = False) -> dict:
    rnd = random.Random(tokens)
    nblocks = tokens // bs + 1
    pool = 2 * nblocks + 8
    grp = va.Group(tuple(f"l{i}" for i in range(layers)), heads, dim)
    make = va.allocate_legacy if layout.endswith("_LEGACY") else va.allocate
    _, src = make([grp], pool, bs, layout, device=str(device), fill=1)
    _, dst = make([grp], pool, bs, layout, device=str(device))
    kl = Layout(name="bench", page_size=bs, dtype="bfloat16",
                groups=(GroupSpec(kind=GroupKind.FULL, num_layers=layers, num_kv_heads=heads, head_dim=dim),))
    arena = torch.zeros(kl.page_bytes(kl.group("full")) * pool, dtype=torch.uint8, device=device)
    views = all_views(kl, arena)["full"]
    ids = list(range(1, nblocks + 1)) if consecutive else rnd.sample(range(1, pool), nblocks)
    pages = list(range(3, nblocks + 3)) if consecutive else rnd.sample(range(pool), nblocks)
    cs = vb.CopyStream(device)

    def slots(lb: vb.LayerBlocks) -> vb.DeviceSlots:
        at = cs.slots(vb.token_slots(ids, 0, tokens, bs, pages), lb)
        # --per-token: the CPU torch path's block-for-page runs off (every token indexed), as before them
        return at._replace(whole=None) if per_token else at
    srcb = [vb.detect_layout(src[n], num_kv_heads=heads, block_size=bs, head_size=dim) for n in grp.layers]
    dstb = [vb.detect_layout(dst[n], num_kv_heads=heads, block_size=bs, head_size=dim) for n in grp.layers]

    def save() -> None:  # what save_kv_layer does for every layer of one request
        with cs.after_current():
            at = slots(srcb[0])
            for lb, v in zip(srcb, views):
                vb.save_layer(lb, at, v, path=path)
        ev = cs.record()
        if ev is not None:
            torch.cuda.current_stream(device).wait_event(ev)

    def load() -> None:  # start_load_kv for one request
        with cs.after_current():
            at = slots(dstb[0])
            vb.load_layers(dstb, at, views, path=path)
        ev = cs.record()
        if ev is not None:
            torch.cuda.current_stream(device).wait_event(ev)

    counts = []
    for fn in (save, load):
        before = vb.LAUNCHES.copy()
        fn()
        ran = vb.LAUNCHES - before
        counts.append(ran["triton"] or ran["torch"])
    why = vb.kernel_refusal(srcb[0], views[0]) if path != "torch" else "asked for"
    ran_path = "triton" if why is None else f"torch ({why})"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for a, b in zip(srcb, dstb):  # checked before timing
        for blk_i, blk in enumerate(ids):
            n = min(bs, tokens - blk_i * bs)
            assert torch.equal(a.k[blk, :n].view(torch.int16), b.k[blk, :n].view(torch.int16)), layout
            assert torch.equal(a.v[blk, :n].view(torch.int16), b.v[blk, :n].view(torch.int16)), layout
    nbytes = layers * tokens * heads * 2 * dim * 2
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_b = torch.empty_like(flat_a)
    plain, _ = timed(lambda: flat_b.copy_(flat_a), device, reps)
    (ts, issue_s), (tl, issue_l) = timed(save, device, reps), timed(load, device, reps)
    host = {}
    for what, fn in (("save", save), ("load", load)):  # where one request's issue time goes: median per piece
        seen: dict[str, list[float]] = {}
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            vb.HOST_S.clear()
            fn()
            for k in ("slots", "rows", "staging", "launch"):
                seen.setdefault(k, []).append(vb.HOST_S.get(k, 0.0))
        host[what] = {k: sorted(v)[len(v) // 2] for k, v in seen.items()}
        host[what]["issue"] = issue_s if what == "save" else issue_l
    return {"host": host, "layout": layout, "tokens": tokens, "bytes": nbytes, "save_s": ts, "load_s": tl, "plain_s": plain,
            "issue_save_s": issue_s, "issue_load_s": issue_l,
            "path": ran_path, "launches": tuple(counts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--layouts", nargs="+", default=["LBNHC", "LBHNC", "BLNHC", "LHBNC",
                                                       "FLASH_ATTN_LEGACY", "FLASHINFER_NHD_LEGACY", "FLASHINFER_HND_LEGACY"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--path", choices=["auto", "triton", "torch"], default="auto",
                    help="the copy path (auto: the Triton kernel where it applies)")
    ap.add_argument("--consecutive", action="store_true",
                    help="the request's vLLM blocks and kvd pages each consecutive (a fresh engine's), not shuffled")
    ap.add_argument("--per-token", action="store_true",
                    help="the CPU torch path token by token (its block-for-page runs off): the baseline of the shortcut")
    a = ap.parse_args()
    dev = torch.device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"vLLM connector copies on {name}: {a.layers} layers x {a.heads} kv heads x {a.dim}, bf16, "
          f"{a.block_size}-token blocks; median of {a.reps}")
    print(f"{'layout':<22} {'tokens':>6} {'MiB':>7} {'save ms':>8} {'load ms':>8} {'plain ms':>8} "
          f"{'save GB/s':>9} {'load GB/s':>9} {'ratio s/l':>10} {'issue ms s/l':>13} {'launches s/l':>12}  path")
    paths = set()
    pieces = []
    for lay in a.layouts:
        for t in a.tokens:
            r = run(dev, a.layers, a.heads, a.dim, a.block_size, t, lay, a.reps, None if a.path == "auto" else a.path,
                    a.consecutive, a.per_token)
            gb = r["bytes"] / 1e9
            print(f"{lay:<22} {t:>6} {r['bytes'] / 2**20:>7.1f} {r['save_s'] * 1e3:>8.3f} {r['load_s'] * 1e3:>8.3f} "
                  f"{r['plain_s'] * 1e3:>8.3f} {gb / r['save_s']:>9.1f} {gb / r['load_s']:>9.1f} "
                  f"{r['plain_s'] / r['save_s']:>5.2f}/{r['plain_s'] / r['load_s']:.2f} "
                  f"{'%.3f/%.3f' % (r['issue_save_s'] * 1e3, r['issue_load_s'] * 1e3):>13} "
                  f"{'%d/%d' % r['launches']:>12}  {r['path'].split(' ')[0]}")
            paths.add(r["path"])
            pieces.append((lay, t, r["host"]))
    print("host time per request, median us: slots = token_slots, rows = kernel blocks and rows, staging = pinned "
          "buffer + the copy to the device, launch = the copy calls (plan look-up, launches); issue = median total")
    print(f"{'layout':<22} {'tokens':>6}  {'save: slots rows staging launch issue':>40}  {'load: slots rows staging launch issue':>40}")
    for lay, t, h in pieces:
        cols = ["".join(f"{h[w].get(k, 0.0) * 1e6:>8.0f}" for k in ("slots", "rows", "staging", "launch", "issue")) for w in ("save", "load")]
        print(f"{lay:<22} {t:>6}  {cols[0]:>40}  {cols[1]:>40}")
    for p in sorted(paths):
        print(f"path: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
