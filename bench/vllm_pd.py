"""vLLM prefill -> kvd -> kvd -> vLLM decode against one colocated vLLM (``make demo-vllm``).

    .venv-vllm/bin/python bench/vllm_pd.py [--model llama] [--requests 8] [--ttft-lengths 512,4096]
                                           [--repeats 5] [--out FILE.json] [--nixl]

Each engine (vLLM 0.32 CPU, offline API, in-process engine core: tests/vllm/engine_proc.py) and
each kvd daemon is its own process; the daemons take their layout from their engine
(layout_from_engine). On a tiny random-weight float32 model (tests/vllm/tiny_models.py):

1. N requests (prompt lengths spread over 70..--max-len) through PD, 32 greedy tokens each:
   identical to the colocated vLLM's, or exit 1;
2. TTFT, one request at a time, per prompt length: colocated = one completion with max_tokens=1;
   PD = ticket + prefill (max_tokens=1: the KV written to kvd, sent) + decode's first token (the
   KV loaded, the tail computed). The median of --repeats, and what PD adds. Twice: the decode
   connector as configured by default (a load whose KV landed before admission copied in the step
   that computes the tail: "sync loads"), then a decode engine with ``kvd_sync_load_tokens=0``
   (every load a step of its own first, as before), in the same run (--no-async-baseline: once);
3. the connectors' copies (vLLM blocks <-> kvd pages) and kvd's Send (daemon to daemon, local
   backend), in bytes and seconds, against a plain ``torch`` copy of the same bytes here;
4. --nixl: the same requests through vLLM's own NixlConnector (CPU, UCX), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from pd_kit import Daemon, Engine, free_port, kv_config, prompts, ticket  # noqa: E402
from tiny_models import build  # noqa: E402


def ttft_colocated(e: Engine, p: list[int], repeats: int) -> float:
    e.run([p], max_tokens=1)  # warm-up
    return statistics.median(timed(lambda: e.run([p], max_tokens=1)) for _ in range(repeats))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


PARTS: dict[int, list[tuple[float, float, float]]] = {}  # prompt length -> (ticket, prefill, decode) seconds


def pd_once(prefill: Engine, decode: Engine, port: int, ps: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    tks = [ticket(port, p) for p in ps]
    t1 = time.perf_counter()
    pre = prefill.run([p[: t["kvd_tokens"]] for p, t in zip(ps, tks)], tks, max_tokens=1)
    t2 = time.perf_counter()
    out = decode.run(ps, [{"kvd_rid": t["kvd_rid"]} for t in tks], max_tokens=max_tokens)
    PARTS.setdefault(len(ps[0]), []).append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return pre, out


def ttft_pd(pre: Engine, dec: Engine, port: int, lengths: list[int], repeats: int) -> tuple[dict, dict, dict, dict]:
    """Per prompt length: the median PD TTFT of ``repeats``, its parts' medians (ticket, prefill,
    decode's first token), the copies per request, and how many decode loads were sync loads."""
    ttft, parts, copies, sync = {}, {}, {}, {}
    for n_ in lengths:
        p = prompts([n_])
        pd_once(pre, dec, port, p, 1)  # warm-up: the first request of a length is slower
        before = pre.copy_stats(), dec.copy_stats()
        PARTS[n_] = []
        ttft[n_] = statistics.median(timed(lambda: pd_once(pre, dec, port, p, 1)) for _ in range(repeats))
        after = pre.copy_stats(), dec.copy_stats()
        parts[n_] = dict(zip(("ticket", "prefill", "decode"), (statistics.median(x[i] for x in PARTS[n_]) for i in range(3))))
        copies[n_] = {
            k: (after[0 if k.startswith(("save", "send")) else 1][k] - before[0 if k.startswith(("save", "send")) else 1][k]) / repeats
            for k in ("save_bytes", "save_s", "send_bytes", "send_s", "load_bytes", "load_s")}
        sync[n_] = after[1]["sync_loads"] - before[1]["sync_loads"]
    return ttft, parts, copies, sync


def busy_first_token(pre: Engine, dec: Engine, port: int, lengths: list[int], repeats: int, background: int) -> dict:
    """Per prompt length: a PD request (ticket, prefill) arriving at the decode engine while
    ``background`` others decode there; the medians of its steps and ms from arrival to its first
    token, over ``repeats``."""
    out = {}
    for n_ in lengths:
        steps, secs = [], []
        for i in range(repeats + 1):  # the first: a warm-up
            p = prompts([n_], salt=100 + i)
            t = ticket(port, p[0])
            pre.run([p[0][: t["kvd_tokens"]]], [t], max_tokens=1)
            r = dec.busy(p, [{"kvd_rid": t["kvd_rid"]}], background)
            if i:
                steps.append(r["steps"][0])
                secs.append(r["seconds"][0])
        out[n_] = {"steps": statistics.median(steps), "ms": statistics.median(secs) * 1e3}
    return out


def plain_copy_s(nbytes: int, repeats: int = 16) -> float:
    """A contiguous torch copy of ``nbytes`` in this process, from and to memory out of the caches
    (each repeat another slice of 64+ MiB buffers, touched first): the median of ``repeats``, the
    floor for a KV copy of those bytes."""
    import torch

    torch.set_num_threads(1)  # two OMP threads on a shared 2-core box wait for each other's time slice (~8 ms)
    n = max(1, nbytes // 4)
    src, dst = torch.randn(max(n * repeats, 16 << 20)), torch.empty(max(n * repeats, 16 << 20)).fill_(1.0)
    slots = [(i * n) % (src.numel() - n + 1) for i in range(repeats)]
    return statistics.median(timed(lambda: dst[o:o + n].copy_(src[o:o + n])) for o in slots)


def nixl_run(tmp: Path, model: str, ps: list[list[int]], lengths: list[int], repeats: int, extra: list[str]) -> dict:
    """vLLM's NixlConnector on the same pair (CPU, host buffer, UCX): outputs and TTFT."""
    def cfg(role: str) -> str:
        return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"backends": ["UCX"]}})

    dec = Engine(tmp, "nixl-decode", model, cfg("kv_both"), env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                                                  "UCX_MODULES": "^ib"}, extra=extra).ready()
    pre = Engine(tmp, "nixl-prefill", model, cfg("kv_both"), env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                                                   "UCX_MODULES": "^ib"}, extra=extra).ready()
    try:
        def once(batch: list[list[int]], max_tokens: int) -> dict:
            r = pre.run(batch, [{"do_remote_decode": True}] * len(batch), max_tokens=1)
            return dec.run(batch, [dict(kp, do_remote_prefill=True, do_remote_decode=False) for kp in r["kv_params"]],
                           max_tokens=max_tokens)

        out = once(ps, 32)
        ttft = {}
        for n in lengths:
            once(prompts([n]), 1)  # warm-up, as for kvd
            ttft[n] = statistics.median(timed(lambda: once(prompts([n]), 1)) for _ in range(repeats))
        return {"tokens": out["tokens"], "ttft": ttft}
    finally:
        pre.stop()
        dec.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", help="tiny model family (tests/vllm/tiny_models.py)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--ttft-lengths", default="512,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=600, help="longest prompt of the N requests")
    ap.add_argument("--workdir", default="/tmp/kvd-demo-vllm")
    ap.add_argument("--out", default=None, help="write the figures here (JSON)")
    ap.add_argument("--nixl", action="store_true", help="also run vLLM's NixlConnector on the same pair")
    ap.add_argument("--busy", type=int, default=7,
                    help="requests the decode engine decodes while a PD request arrives (0: skip; its engines take 8 at once)")
    ap.add_argument("--no-async-baseline", action="store_true",
                    help="skip the second decode engine (kvd_sync_load_tokens=0: every load a step of its own)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.ttft_lengths.split(",") if x]
    tmp = Path(a.workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    model = build(a.model, str(tmp / "models"))
    mml = max(lengths + [a.max_len]) + 64
    extra = ["--max-model-len", str(mml)]
    n = a.requests
    ps = prompts([70 + (i * 997) % max(1, a.max_len - 70) for i in range(n)])
    fig: dict = {"model": a.model, "requests": n, "prompt_tokens": [len(p) for p in ps], "repeats": a.repeats}

    print(f"colocated vLLM ({a.model}, max_model_len {mml}) ...", flush=True)
    co = Engine(tmp, "colocated", model, extra=extra).ready()
    try:
        base = co.run(ps)
        fig["ttft_colocated_s"] = {n_: ttft_colocated(co, prompts([n_])[0], a.repeats) for n_ in lengths}
    finally:
        co.stop()

    started: list = []
    try:
        pdd, ddd = Daemon.start(tmp, "demo-prefill"), Daemon.start(tmp, "demo-decode")
        started += [pdd, ddd]
        port = free_port()
        print("decode vLLM + kvd, prefill vLLM + kvd ...", flush=True)
        dec = Engine(tmp, "demo-decode", model, kv_config("kv_consumer", ddd.address, kvd_ticket_listen=f"127.0.0.1:{port}"),
                     extra=extra)
        started.append(dec)
        dec.ready()
        pre = Engine(tmp, "demo-prefill", model, kv_config("kv_producer", pdd.address), extra=extra)
        started.append(pre)
        pre.ready()
        r_pre, r_dec = pd_once(pre, dec, port, ps, 32)
        same = [x == y for x, y in zip(r_dec["tokens"], base["tokens"])]
        fig["identical"] = sum(same)
        fig["copy"] = {"prefill": pre.copy_stats(), "decode": dec.copy_stats()}
        fig["ttft_pd_s"], fig["ttft_pd_parts_s"], fig["copy_per_request"], fig["sync_loads"] = ttft_pd(pre, dec, port, lengths, a.repeats)
        if a.busy:
            fig["busy"] = busy_first_token(pre, dec, port, lengths, a.repeats, a.busy)
        if not a.no_async_baseline:
            dec.stop()
            started.remove(dec)
            port2 = free_port()
            print("decode vLLM + kvd, every load a step of its own (kvd_sync_load_tokens=0) ...", flush=True)
            dec2 = Engine(tmp, "demo-decode-async", model, kv_config("kv_consumer", ddd.address, kvd_ticket_listen=f"127.0.0.1:{port2}",
                                                                    kvd_sync_load_tokens=0), extra=extra)
            started.append(dec2)
            dec2.ready()
            fig["ttft_pd_async_s"], fig["ttft_pd_async_parts_s"], _, _ = ttft_pd(pre, dec2, port2, lengths, a.repeats)
            if a.busy:
                fig["busy_async"] = busy_first_token(pre, dec2, port2, lengths, a.repeats, a.busy)
    finally:
        for p in reversed(started):
            p.stop()
    cs = fig["copy"]
    fig["plain_copy_s"] = {"save": plain_copy_s(cs["prefill"]["save_bytes"]), "load": plain_copy_s(cs["decode"]["load_bytes"]),
                           "send": plain_copy_s(cs["prefill"]["send_bytes"])}
    if a.nixl:
        try:
            nx = nixl_run(tmp, model, ps, lengths, a.repeats, extra)
            fig["nixl"] = {"identical": sum(x == y for x, y in zip(nx["tokens"], base["tokens"])), "ttft_s": nx["ttft"]}
        except Exception as exc:  # report why, keep kvd's figures
            fig["nixl"] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}

    print(f"\noutputs identical to the colocated vLLM: {fig['identical']}/{n} requests (32 greedy tokens, prompts "
          f"{min(fig['prompt_tokens'])}-{max(fig['prompt_tokens'])} tokens)")
    print("TTFT (median of %d)  colocated   PD (kvd)   PD adds" % a.repeats)
    for n_ in lengths:
        c = fig["ttft_colocated_s"][n_]
        for way, key in (("", "ttft_pd"), (" (async loads)", "ttft_pd_async")):
            if f"{key}_s" not in fig:
                continue
            p, parts = fig[f"{key}_s"][n_], fig[f"{key}_parts_s"][n_]
            sync = f", {fig['sync_loads'][n_]}/{a.repeats} sync loads" if not way else ""
            print(f"  {n_:5d} tokens{way:15s} {c * 1e3:8.1f} ms {p * 1e3:8.1f} ms {(p - c) * 1e3:+8.1f} ms   (ticket "
                  f"{parts['ticket'] * 1e3:.1f} ms, prefill {parts['prefill'] * 1e3:.1f} ms, decode's first token "
                  f"{parts['decode'] * 1e3:.1f} ms{sync})")
    if "busy" in fig:
        print(f"A PD request arriving while the decode engine decodes {a.busy} others: steps and ms to its first token "
              f"(median of {a.repeats})")
        for n_ in lengths:
            b, ba = fig["busy"][n_], fig.get("busy_async", {}).get(n_)
            vs = f"   async loads: {ba['steps']:.0f} steps, {ba['ms']:.1f} ms   ratio {b['ms'] / ba['ms']:.2f}" if ba else ""
            print(f"  {n_:5d} tokens   sync loads: {b['steps']:.0f} steps, {b['ms']:.1f} ms{vs}")
    pre_s, dec_s = cs["prefill"], cs["decode"]
    print(f"KV moved by kvd: {pre_s['send_bytes']:,d} B in {pre_s['sends']} Sends, {pre_s['send_s'] * 1e3:.1f} ms in kvd "
          f"(a plain copy of those bytes: {fig['plain_copy_s']['send'] * 1e3:.2f} ms)")
    print(f"connector copies: save (vLLM -> kvd) {pre_s['save_bytes']:,d} B in {pre_s['save_s'] * 1e3:.1f} ms "
          f"(plain copy {fig['plain_copy_s']['save'] * 1e3:.2f} ms); load (kvd -> vLLM) {dec_s['load_bytes']:,d} B in "
          f"{dec_s['load_s'] * 1e3:.1f} ms (plain copy {fig['plain_copy_s']['load'] * 1e3:.2f} ms), for the N requests")
    for n_, c in fig.get("copy_per_request", {}).items():
        print(f"  per {n_}-token request: save {c['save_bytes']:,.0f} B {c['save_s'] * 1e3:.1f} ms (plain "
              f"{plain_copy_s(int(c['save_bytes'])) * 1e3:.2f} ms), Send {c['send_s'] * 1e3:.1f} ms, load {c['load_s'] * 1e3:.1f} ms "
              f"(plain {plain_copy_s(int(c['load_bytes'])) * 1e3:.2f} ms)")
    if "nixl" in fig:
        print(f"vLLM NixlConnector: {fig['nixl']}")
    if a.out:
        Path(a.out).write_text(json.dumps(fig, indent=1))
    return 0 if fig["identical"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
