"""What calls that hold the daemon's gRPC threads cost its other callers (kvd.server.lanes).

    .venv/bin/python bench/grpc_held.py                                # this checkout, ~1 min
    .venv/bin/python bench/grpc_held.py --baseline-tree /tmp/base      # and another checkout's kvd, same run
                                                                       #   (git worktree add /tmp/base <commit>)

A daemon (``kvd serve``, default settings, TCP loopback) and, in a process of its own, a client
that holds ``--held`` gRPC calls open (more than the daemon's 16 gRPC threads):

* ``none``: nothing held (the baseline);
* ``reflection``: reflection streams left open after one answer (grpcui, a stuck grpcurl);
* ``no request``: unary kvd calls whose request never comes, from a live client;
* ``stopped``: the same, then the client SIGSTOPped (paused, frozen, its host gone quiet).

Meanwhile this process probes every 0.1 s for ``--window`` seconds, on a connection of its own:
a health check (what the kubelet's gRPC probe sends), a kvd ``Echo`` (standing for an engine's
call over gRPC: an Allocate, a Free) and a Peer ``Heartbeat`` (standing for another daemon's
calls: its Commits, CheckTickets and heartbeats), each with a 1 s deadline. Reported per probe:
the share answered within the deadline, the median of those answered, and how long after the
hold began the first one was answered.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
from benchkit import BenchDaemon, add_baseline_tree, trees  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvd.v1 import kvd_pb2 as pb  # noqa: E402
from kvd.v1 import kvd_pb2_grpc as pb_grpc  # noqa: E402

SCENARIOS = ("none", "reflection", "no request", "stopped")

# The holding client: opens the calls, says "ready", then waits to be killed (grpc_flood.py takes it too).
HOLDER = r"""
import sys, threading, grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
address, kind, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
never = threading.Event()
def ask_then_wait(first):
    if first is not None:
        yield first
    never.wait()
channels, calls = [], []
for _ in range(n):
    ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    channels.append(ch)
    if kind == "reflection":
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        calls.append(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(ask_then_wait(ask)))
    else:
        echo = ch.stream_unary("/kvd.v1.Kvd/Echo", request_serializer=bytes, response_deserializer=bytes)
        calls.append(echo.future(ask_then_wait(None)))
print("ready", flush=True)
never.wait()
"""


def probe(address: str, window: float) -> dict[str, list[tuple[float, float | None]]]:
    """(time since start, latency or None) per probe kind, every 0.1 s for ``window`` s."""
    out: dict[str, list[tuple[float, float | None]]] = {"health": [], "kvd": [], "peer": []}
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        echo = pb_grpc.KvdStub(ch).Echo
        beat = pb_grpc.PeerStub(ch).Heartbeat
        t0 = time.monotonic()
        while time.monotonic() - t0 < window:
            for name, call in (("health", lambda: check(health_pb2.HealthCheckRequest(), timeout=1)),
                               ("kvd", lambda: echo(pb.EchoRequest(payload=b"x"), timeout=1)),
                               ("peer", lambda: beat(pb.HeartbeatRequest(sender="probe"), timeout=1))):
                s = time.monotonic()
                try:
                    call()
                    out[name].append((s - t0, time.monotonic() - s))
                except grpc.RpcError:
                    out[name].append((s - t0, None))
            time.sleep(0.1)
    return out


def run(root: str, kind: str, held: int, window: float) -> dict[str, list[tuple[float, float | None]]]:
    d = BenchDaemon.spawn("--listen-tcp", "127.0.0.1:0", root=root).wait_ready()
    holder = None
    try:
        assert d.tcp
        if kind != "none":
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.tcp, "reflection" if kind == "reflection" else "echo", str(held)],
                                      stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # its calls reached the daemon's threads
            if kind == "stopped":
                os.kill(holder.pid, signal.SIGSTOP)
        return probe(d.tcp, window)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        d.stop()


def row(tree: str, kind: str, got: dict[str, list[tuple[float, float | None]]]) -> str:
    cells = []
    for name in ("health", "kvd", "peer"):
        xs = got[name]
        ok = [lat for _, lat in xs if lat is not None]
        first = next((t for t, lat in xs if lat is not None), None)
        cells += [f"{len(ok)}/{len(xs)}", f"{statistics.median(ok) * 1e3:.1f}" if ok else "-", f"{first:.1f}" if first is not None else "never"]
    return f"| {tree} | {kind} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held", type=int, default=20, help="calls the client holds (default: %(default)s; the daemon has 16 gRPC threads)")
    ap.add_argument("--window", type=float, default=25.0, help="seconds of probing per scenario (default: %(default)s: past the 10 s keepalive and its 10 s timeout)")
    add_baseline_tree(ap)
    ap.add_argument("--only", choices=SCENARIOS, action="append", help="run only these scenarios")
    args = ap.parse_args()
    runs = trees(args)
    print(f"kvd gRPC under {args.held} held calls; probes every 0.1 s for {args.window:g} s, 1 s deadline")
    print("| tree | held | health: answered | health: median ms | health: first after s | kvd Echo: answered | kvd Echo: median ms "
          "| kvd Echo: first after s | Peer Heartbeat: answered | Peer Heartbeat: median ms | Peer Heartbeat: first after s |")
    print("|---|---|" + "---:|" * 9)
    for kind in args.only or SCENARIOS:
        for name, root in runs:
            window = args.window if kind == "stopped" else min(args.window, 3.0)
            print(row(name, kind, run(root, kind, args.held, window)), flush=True)


if __name__ == "__main__":
    main()
