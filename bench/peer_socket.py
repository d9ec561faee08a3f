"""Peer-socket benchmark (issue 7): a Send's CheckTicket + Commit between two real daemons, over
gRPC and over the decode daemon's peer socket, in the same run.

    .venv/bin/python bench/peer_socket.py            # 1000 Sends per path (about a minute on a 2-core CPU)
    .venv/bin/python bench/peer_socket.py --quick    # 200 per path

Three daemons run as separate processes (``python -m kvd.cli serve --backend local``): P
(prefill) and two decode daemons, each on its own Unix listener: D serves its peer socket beside
it, G serves none (``--peer-socket ''``). This process plays the engines. Per iteration one small
request (``--tokens``, 16 by default: a few pages, so the write is a few KiB) is allocated on P
and, alternately, on D or on G, which issues a RECV lease, and P Sends it: D's ticket names its
peer socket (CheckTicket and Commit go there), G's names none (both calls over gRPC, to G's Unix
listener). Tickets are sealed, so one daemon's ticket cannot be rerouted; D and G are alike but
for the socket. Both requests are freed after each Send.

Timed: the Send's own phases (``SendResponse.phase_seconds``), measured by P's clock around its
PeerLink calls: ``check`` is the CheckTicket round trip, ``commit`` the Commit round trip -- from
P's Outbox to D's Inbox and back, what every Send pays. ``pair`` is their sum per Send; ``send``
the whole Send as P measured it. The path every call took is confirmed from P's
``kvd_peer_calls_total{method, path}`` after the run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchkit import BenchDaemon, cpu_model, cpu_snap, others_line, own_cpu, pct  # noqa: E402  (bench/ is sys.path[0])

PATHS = ("grpc", "socket")
ROWS = ("check", "commit", "pair", "send")


def peer_calls(port: int) -> dict[tuple[str, str], float]:
    """P's ``kvd_peer_calls_total`` by (method, path)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.labels["method"], s.labels["path"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvd_peer_calls_total"
    }


def run(p_addr: str, decode: dict[str, str], tokens: int, n: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """``decode``: the decode daemon's address per path (its ticket names a peer socket or none)."""
    from kvd.client import Client

    out: dict[str, dict[str, list[float]]] = {path: {row: [] for row in ROWS} for path in PATHS}
    with (
        Client.connect(p_addr, name="bench-prefill") as p,
        Client.connect(decode["grpc"], name="bench-decode-grpc") as g,
        Client.connect(decode["socket"], name="bench-decode-socket") as s,
    ):
        recv = {"grpc": g, "socket": s}
        for i in range(2 * (warmup + n)):
            path = PATHS[i % 2]
            rid = f"r{i}"
            d = recv[path]
            p.allocate(rid, tokens)
            d.allocate(rid, tokens, receive=True)
            ticket = d.acquire_lease(rid, "recv").ticket
            gc.disable()
            r = p.send(rid, ticket)
            gc.enable()
            p.free(rid)
            d.free(rid)
            if i >= 2 * warmup:
                ph = r.phases
                rows = out[path]
                rows["check"].append(ph["check"])
                rows["commit"].append(ph["commit"])
                rows["pair"].append(ph["check"] + ph["commit"])
                rows["send"].append(r.seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 Sends per path instead of 1000")
    ap.add_argument("--sends", type=int, default=None, help="timed Sends per path (default 1000; --quick 200)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (default: %(default)s)")
    ap.add_argument("--layout", default="tiny-hybrid", help="layout preset of both daemons (default: %(default)s)")
    args = ap.parse_args()
    n = args.sends or (200 if args.quick else 1000)
    warmup = 50

    cpu0, own0 = cpu_snap(), own_cpu()
    common = ("--backend", "local", "--layout", args.layout, "--arena-bytes", "64MiB")
    p_d = BenchDaemon.spawn(*common, "--metrics-port", "0")
    d_d = BenchDaemon.spawn(*common)
    g_d = BenchDaemon.spawn(*common, "--peer-socket", "")
    try:
        for daemon in (p_d, d_d, g_d):
            daemon.wait_ready()
        t0 = time.perf_counter()
        res = run(p_d.unix, {"grpc": g_d.unix, "socket": d_d.unix}, args.tokens, n, warmup)
        took = time.perf_counter() - t0
        assert p_d.metrics_port is not None
        calls = peer_calls(p_d.metrics_port)
    finally:
        for daemon in (p_d, d_d, g_d):
            daemon.stop()

    import google.protobuf
    import grpc

    print(f"kvd peer-socket benchmark -- {cpu_model()}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")
    print(f"a prefill and two decode daemons ({args.layout}, backend local), {args.tokens}-token requests, {n} timed Sends per path "
          f"(+{warmup} warm-up), paths alternating; {took:.0f} s")
    print()
    print(f"| {'step':<7} | {'gRPC p50 µs':>11} | {'gRPC p99 µs':>11} | {'socket p50 µs':>13} | {'socket p99 µs':>13} | {'gRPC / socket (p50)':>19} |")
    print("|---------|-------------|-------------|---------------|---------------|---------------------|")
    for row in ROWS:
        g, s = res["grpc"][row], res["socket"][row]
        print(f"| {row:<7} | {pct(g, 0.5) * 1e6:>11,.0f} | {pct(g, 0.99) * 1e6:>11,.0f} | {pct(s, 0.5) * 1e6:>13,.0f} | "
              f"{pct(s, 0.99) * 1e6:>13,.0f} | {pct(g, 0.5) / pct(s, 0.5):>18.1f}x |")
    saved = statistics.median(res["grpc"]["pair"]) - statistics.median(res["socket"]["pair"])
    print()
    print(f"a Send's CheckTicket + Commit: {statistics.median(res['socket']['pair']) * 1e6:,.0f} µs over the peer socket, "
          f"{statistics.median(res['grpc']['pair']) * 1e6:,.0f} µs over gRPC (median); {saved * 1e6:,.0f} µs saved per Send")
    made = ", ".join(f"{m} {path} {int(v)}" for (m, path), v in sorted(calls.items()))
    print(f"P's kvd_peer_calls_total: {made}")
    expect = {(m, path): n + warmup for m in ("CheckTicket", "Commit") for path in PATHS}
    if {k: v for k, v in calls.items() if k in expect} != expect:
        print("WARNING: the calls did not take the paths the tickets asked for; the rows above are mixed")
    print(others_line(cpu0, own0))


if __name__ == "__main__":
    main()
