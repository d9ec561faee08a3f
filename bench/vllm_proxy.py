"""``kvd proxy`` in front of two vLLM OpenAI servers against the decode server alone (CPU, tiny Llama).

    .venv-vllm/bin/python bench/vllm_proxy.py [--lengths 128,1024,3072] [--repeats 8] [--tokens 16] [--out FILE.json]

Two daemons, a prefill and a decode ``vllm.entrypoints.openai.api_server`` with kvd's connector
(tests/vllm/pd_kit.py: the tier's own recipe), and ``kvd proxy`` over them. Per prompt length,
streamed completions of ``--tokens`` greedy tokens, the ways taking turns request by request (new
prompts each time: no cache helps either way):

* ``decode alone``: the decode server computes the prompt itself (what a colocated server does);
* ``through kvd proxy``: tokens given, ticket, prefill on the other server, KV handed off through
  the daemons, decode -- time to the first streamed token and to the last, and the proxy's own
  stages from its headers (``x-kvd-ticket-ms``, ``x-kvd-prefill-ms``).

Baseline for the proxy's own cost: ``GET /v1/models`` through the proxy against the same call to the
decode server (one HTTP hop more, nothing else). Medians; ratios against ``decode alone`` in the
same run. On this CPU box with a 2-layer random model a prompt costs next to nothing to compute, so
the PD way pays its extra hops and a second server's step without the prefill compute it saves on a
real model: read what the proxy and the handoff add, in milliseconds, not the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
import pd_kit as pk  # noqa: E402
from tiny_models import build  # noqa: E402


def stream(url: str, body: dict) -> tuple[float, float, dict[str, str]]:
    """Seconds to the first streamed token and to the end, and the answer's headers."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        for raw in r:
            if first is None and raw.startswith(b"data: {"):
                first = time.perf_counter() - t0
    assert first is not None, "no token streamed"
    return first, time.perf_counter() - t0, headers


def get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,1024,3072", help="prompt lengths in tokens (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvd-proxy-bench-"))
    model = build("llama", str(tmp / "models"))
    procs = []
    daemons = []
    try:
        pd_, dd = pk.Daemon.start(tmp, "p"), pk.Daemon.start(tmp, "d")
        daemons += [pd_, dd]
        pport, dport, tport = pk.free_port(), pk.free_port(), pk.free_port()
        pre, dec, tickets = (f"http://127.0.0.1:{p}" for p in (pport, dport, tport))
        max_len = max(lengths) + args.tokens + 64
        procs.append(pk.start_server(tmp, "decode", model, dport, pk.kv_config("kv_consumer", dd.address, kvd_ticket_listen=f"127.0.0.1:{tport}"),
                                     max_len=max_len))
        pk.wait_up(dec, procs[-1], tmp / "decode.server.log")
        procs.append(pk.start_server(tmp, "prefill", model, pport, pk.kv_config("kv_producer", pd_.address), max_len=max_len))
        pk.wait_up(pre, procs[-1], tmp / "prefill.server.log")
        proxy, proc = pk.start_proxy(tmp, "proxy", [pre], [(dec, tickets)])
        procs.append(proc)

        rows = []
        salt = 0
        for n in lengths:
            alone: list[tuple[float, float]] = []
            pd: list[tuple[float, float]] = []
            stages: list[tuple[float, float]] = []
            for i in range(args.repeats + 1):  # the first of each: warm-up, not counted
                for way in ("alone", "pd"):
                    salt += 1
                    body = {"model": model, "prompt": pk.prompts([n], salt=salt)[0], "max_tokens": args.tokens,
                            "temperature": 0, "ignore_eos": True}
                    first, total, h = stream(dec if way == "alone" else proxy, body)
                    if way == "pd":
                        assert h.get("x-kvd-path") == "pd", h
                    if i == 0:
                        continue
                    if way == "alone":
                        alone.append((first, total))
                    else:
                        pd.append((first, total))
                        stages.append((float(h["x-kvd-ticket-ms"]), float(h["x-kvd-prefill-ms"])))
            med = lambda xs, k: statistics.median(x[k] for x in xs) * 1e3  # noqa: E731
            rows.append({"tokens": n, "alone_first_ms": med(alone, 0), "alone_total_ms": med(alone, 1), "pd_first_ms": med(pd, 0),
                         "pd_total_ms": med(pd, 1), "ticket_ms": statistics.median(s[0] for s in stages),
                         "prefill_ms": statistics.median(s[1] for s in stages)})
        hops = {"direct": [], "proxy": []}
        for _ in range(50):
            hops["direct"].append(get(dec))
            hops["proxy"].append(get(proxy))
        hop = {k: statistics.median(v) * 1e3 for k, v in hops.items()}
    finally:
        pk.stop_all(procs)
        for d in daemons:
            d.stop()

    print(f"kvd proxy vs the decode server alone -- vLLM OpenAI servers (CPU), tiny Llama, {args.tokens} tokens streamed, "
          f"median of {args.repeats}")
    print("| prompt tokens | alone: first token ms | through kvd proxy: first token ms | ratio | ticket ms | prefill ms "
          "| alone: last token ms | proxy: last token ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']:,d} | {r['alone_first_ms']:.1f} | {r['pd_first_ms']:.1f} | {r['pd_first_ms'] / r['alone_first_ms']:.2f}x "
              f"| {r['ticket_ms']:.2f} | {r['prefill_ms']:.1f} | {r['alone_total_ms']:.1f} | {r['pd_total_ms']:.1f} |")
    print(f"GET /v1/models: direct {hop['direct']:.2f} ms, through the proxy {hop['proxy']:.2f} ms "
          f"(one hop more: {hop['proxy'] - hop['direct']:+.2f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "hop_ms": hop}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
