"""Control-plane benchmark (issue 3): the engine's per-request gRPC calls against a bare echo.

    .venv/bin/python bench/control_plane.py            # full run (about 2 minutes on a 2-core CPU)
    .venv/bin/python bench/control_plane.py --quick    # smoke run (under 20 s)

A daemon is started in its own process (``python -m kvd.cli serve``, the ``gemma-4-31b-it-tp2``
layout by default) listening on a Unix socket (the engine's default path) and on TCP loopback.
Transports: ``fast`` (the engine socket beside the Unix listener, :mod:`kvd.client.fast`; with
``--no-spin`` also ``fast0``, the same with clients that sleep at once for each reply), ``unix``
(gRPC on the Unix socket), ``tcp`` (gRPC on loopback). Clients are separate processes, each with its own :class:`kvd.client.Client` (own session,
channel and GIL): 1 client, then 8 clients at once. Nothing is shared with the daemon's GIL.

Calls, each timed one by one on the client (wall time of the blocking call, parse included):

* ``echo``: ``Echo`` with an empty payload, the same server, transport and interceptor; the
  baseline every other row is compared against (same transport, same client count): over
  ``fast`` (the engine socket, issue 16) it is a bare framed round trip on the same socket.
* ``allocate``: ``Allocate`` of one request (``--tokens`` tokens, computed here -- the prefill
  side, so ``full`` and ``swa`` hold a page id per page: 256 + 256 ids at 4096 tokens).
* ``vectors`` (``GetVectors``), ``lease SEND`` (``AcquireLease``), ``release``
  (``ReleaseLease``), ``free`` (``Free`` of one request).
* ``round``: the five calls above in a row for one request (allocate, vectors, lease, release,
  free), timed as one.
* ``allocate x256``: ``allocate_many`` of ``--batch`` requests in one call; ``free x256`` frees
  them in one call.

Concurrency sweep (issue 16): ``--clients 1,2,4,8`` by default; after the table, per transport,
aggregate calls/s of all clients for ``echo`` and for the engine calls (allocate, vectors, lease,
release, free pooled: calls over their summed step windows), each against 1 client, and where it
saturates (the first client count past which doubling the clients adds under 10%).

Single calls run in cycles: every client does ``--cycle`` echos, then ``--cycle`` allocates,
then vectors, leases, releases and frees of the same requests, so echo is measured interleaved
with the rest. Before each step the clients meet at a barrier; ops/s is calls of all clients
divided by the summed step windows (first start to last finish), so it is aggregate throughput
with every client issuing the same call. p50/p99 pool the per-call times of all clients. Each
client warms up first (echo, rounds, one batch); the garbage collector is off in the clients'
timed loops (as in ``timeit``), the daemon runs as deployed.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchkit import BenchDaemon, cpu_model, cpu_snap, others_line, own_cpu  # noqa: E402  (bench/ is sys.path[0])

GIB = 1 << 30
SINGLE = ("echo", "allocate", "vectors", "lease SEND", "release", "free")


# =============================================================================================
# the daemon
# =============================================================================================
def request_bytes(layout_name: str, tokens: int, receive: bool) -> int:
    """Arena bytes one request takes (the pool's page rules: full ceil(t/ps) pages; swa pages
    for every page computed here, only the window tail when received; draft/state per layout)."""
    from kvd import preset

    layout = preset(layout_name)
    ps = layout.page_size
    n = -(-tokens // ps)
    total = 0
    for g in layout.groups:
        kind = g.kind.value
        if kind == "full":
            total += n * layout.page_bytes(g)
        elif kind == "swa":
            total += (n - (max(0, tokens - g.window) // ps if receive else 0)) * layout.page_bytes(g)
        elif kind == "draft":
            dps = g.page_size or ps
            total += -(-tokens // dps) * layout.page_bytes(g)
        else:  # state: one slot
            total += layout.page_bytes(g)
    return total


# =============================================================================================
# a client process
# =============================================================================================
@dataclass
class Plan:
    tokens: int
    receive: bool
    batch: int
    cycle: int  # single calls per step
    single_cycles: int  # cycles per client
    round_steps: int  # steps of `cycle` rounds per client
    batch_steps: int  # allocate_many + free per client
    warmup: int
    spin_us: float | None = None  # the fast clients' reply spin (None: the client's default)


def worker(wid: int, address: str, plan: Plan, barrier, out, transport: str = "unix") -> None:
    from kvd.client import Client
    from kvd.records import AllocSpec

    pc = time.perf_counter_ns
    lat: dict[str, list[int]] = {}
    win: dict[str, list[tuple[int, int]]] = {}
    seq = [0]

    def rids(n: int) -> list[str]:
        seq[0] += n
        return [f"w{wid}-{i}" for i in range(seq[0] - n, seq[0])]

    def step(name: str, fn, args) -> list:
        """One barrier-synchronised step: call fn(a) for each a, timing each call."""
        barrier.wait()
        ns = lat.setdefault(name, [])
        res = []
        gc.disable()
        t_start = pc()
        for a in args:
            t0 = pc()
            r = fn(a)
            ns.append(pc() - t0)
            res.append(r)
        t_end = pc()
        gc.enable()
        win.setdefault(name, []).append((t_start, t_end))
        return res

    spin = {"spin_us": 0.0} if transport == "fast0" else {} if plan.spin_us is None else {"spin_us": plan.spin_us}
    kv = Client.connect(address, name=f"bench-{wid}", transport="fast" if transport.startswith("fast") else "grpc", **spin)
    try:
        tok, recv = plan.tokens, plan.receive

        def round_(rid: str) -> None:
            kv.allocate(rid, tok, receive=recv)
            kv.vectors(rid)
            lease = kv.acquire_lease(rid, "send")
            kv.release_lease(lease.lease_id)
            kv.free(rid)

        # warm-up: channel, server threads, code paths, allocator state
        for _ in range(plan.warmup):
            kv.echo()
        for rid in rids(plan.warmup // 4):
            round_(rid)
        batch = rids(plan.batch)
        kv.allocate_many([AllocSpec(r, tok, recv) for r in batch])
        kv.free(*batch)

        for _ in range(plan.single_cycles):
            ids = rids(plan.cycle)
            step("echo", lambda _: kv.echo(), ids)
            step("allocate", lambda r: kv.allocate(r, tok, receive=recv), ids)
            step("vectors", kv.vectors, ids)
            leases = step("lease SEND", lambda r: kv.acquire_lease(r, "send"), ids)
            step("release", kv.release_lease, [lease.lease_id for lease in leases])
            step("free", kv.free, ids)
        for _ in range(plan.round_steps):
            step("round", round_, rids(plan.cycle))
        for _ in range(plan.batch_steps):
            ids = rids(plan.batch)
            specs = [AllocSpec(r, tok, recv) for r in ids]
            vecs = step(f"allocate x{plan.batch}", kv.allocate_many, [specs])[0]
            if len(vecs) != plan.batch:
                raise RuntimeError(f"allocate_many returned {len(vecs)} vectors for {plan.batch} requests")
            step(f"free x{plan.batch}", lambda x: kv.free(*x), [ids])
        out.put((wid, lat, win, None))
    except BaseException as exc:  # noqa: BLE001 -- reported by the parent
        barrier.abort()  # the other clients stop at their next step instead of waiting forever
        out.put((wid, {}, {}, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        kv.close()


@dataclass
class Result:
    name: str
    clients: int
    transport: str
    lat_ns: list[int] = field(default_factory=list)
    window_ns: int = 0

    def pct(self, q: float) -> float:
        s = sorted(self.lat_ns)
        return s[min(len(s) - 1, int(q * len(s)))] / 1e3

    @property
    def ops(self) -> float:
        return len(self.lat_ns) / (self.window_ns / 1e9)


def run_config(address: str, transport: str, clients: int, plan: Plan) -> dict[str, Result]:
    ctx = mp.get_context("fork")  # the parent never opens a gRPC channel, so forking is safe
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(w, address, plan, barrier, out, transport), daemon=True) for w in range(clients)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [e for *_, e in got if e]
    if errors:
        raise RuntimeError(f"{transport} x{clients}: client failed: {errors[0]}")
    results: dict[str, Result] = {}
    for _, lat, win, _ in got:
        for name, ns in lat.items():
            results.setdefault(name, Result(name, clients, transport)).lat_ns.extend(ns)
    for name, r in results.items():
        steps = list(zip(*(w[name] for _, _, w, _ in got)))  # step j of every client
        r.window_ns = sum(max(e for _, e in s) - min(b for b, _ in s) for s in steps)
    return results


# =============================================================================================
# report
# =============================================================================================
def machine() -> str:
    import google.protobuf
    import grpc
    from google.protobuf.internal import api_implementation

    return (f"{cpu_model()}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__} "
            f"({api_implementation.Type()})")


def proc_cpu(pid: int) -> float:
    """CPU seconds of a live process (its threads included); 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over ``seconds``; -1 where /proc/stat is unreadable."""
    try:
        t0, b0 = cpu_snap()
        time.sleep(seconds)
        t1, b1 = cpu_snap()
    except OSError:
        return -1.0
    return (b1 - b0) / max(1e-9, t1 - t0)


def table(all_results: list[dict[str, Result]], batch: int) -> str:
    order = [*SINGLE, "round", f"allocate x{batch}", f"free x{batch}"]
    hdr = f"| {'call':<15} | {'transport':<9} | {'clients':>7} | {'p50 µs':>8} | {'p99 µs':>8} | {'ops/s':>8} | {'p50 / echo p50':>14} |"
    lines = [hdr, "|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|"]
    for res in all_results:
        echo = res["echo"].pct(0.5)
        for name in order:
            r = res[name]
            p50 = r.pct(0.5)
            lines.append(
                f"| {name:<15} | {r.transport:<9} | {r.clients:>7} | {p50:>8,.0f} | {r.pct(0.99):>8,.0f} | "
                f"{r.ops:>8,.0f} | {p50 / echo:>13.2f}x |"
            )
    return "\n".join(lines)


ENGINE_CALLS = SINGLE[1:]


def aggregate(res: dict[str, Result], names: tuple[str, ...]) -> float:
    """Calls/s of all clients over the rows ``names`` (their calls over their summed windows)."""
    calls = sum(len(res[n].lat_ns) for n in names)
    return calls / (sum(res[n].window_ns for n in names) / 1e9)


def sweep(all_results: list[dict[str, Result]]) -> str:
    """Aggregate calls/s against client count, per transport, and where it saturates."""
    lines = [f"| {'transport':<9} | {'clients':>7} | {'echo calls/s':>12} | {'x 1 client':>10} | {'engine calls/s':>14} | {'x 1 client':>10} |",
             "|-----------|---------|--------------|------------|----------------|------------|"]
    notes = []
    for tr in dict.fromkeys(next(iter(r.values())).transport for r in all_results):
        rows = sorted(((next(iter(r.values())).clients, r) for r in all_results if next(iter(r.values())).transport == tr), key=lambda x: x[0])
        base_e, base_c = aggregate(rows[0][1], ("echo",)), aggregate(rows[0][1], ENGINE_CALLS)
        agg = []
        for n, r in rows:
            e, c = aggregate(r, ("echo",)), aggregate(r, ENGINE_CALLS)
            agg.append((n, c))
            lines.append(f"| {tr:<9} | {n:>7} | {e:>12,.0f} | {e / base_e:>9.2f}x | {c:>14,.0f} | {c / base_c:>9.2f}x |")
        sat = next((n for (n, c), (_, c2) in zip(agg, agg[1:]) if c2 < 1.10 * c), None)
        peak = max(agg, key=lambda x: x[1])
        notes.append(f"{tr}: engine calls peak at {peak[1]:,.0f}/s with {peak[0]} client(s) ({peak[1] / agg[0][1]:.2f}x 1 client); "
                     + (f"saturates at {sat} client(s) (more add under 10%)" if sat is not None else "still scaling at the largest count"))
    return "\n".join(lines + [""] + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer calls, Unix socket only (under 20 s)")
    ap.add_argument("--layout", default="gemma-4-31b-it-tp2", help="layout preset of the daemon (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per request (default: %(default)s)")
    ap.add_argument("--receive", action="store_true", help="allocate received requests (decode side) instead of computed ones")
    ap.add_argument("--batch", type=int, default=256, help="requests per allocate_many call (default: %(default)s)")
    ap.add_argument("--clients", default="1,2,4,8", help="client process counts, comma-separated (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=None, help="calls per single-call row over all clients (default 3072; --quick 512)")
    ap.add_argument("--no-tcp", action="store_true", help="Unix socket only")
    ap.add_argument("--spin-us", type=float, default=None, metavar="US",
                    help="how long the engine-socket clients look for a reply before they sleep (default: the client's, 200; 0: at once)")
    ap.add_argument("--no-spin", action="store_true",
                    help="also run the engine socket with clients that sleep at once for each reply (transport fast0), right after fast")
    ap.add_argument("--json", metavar="PATH", help="also write every row's p50/p99 (us) and ops/s, and the sweep's calls/s, here")
    args = ap.parse_args()

    client_counts = [int(c) for c in args.clients.split(",")]
    cycle = 64
    calls = args.calls or (512 if args.quick else 3072)
    rounds = 128 if args.quick else 768
    batches = 8 if args.quick else 48
    # fast: the engine socket (<unix>.fast, kvd.client.fast); unix: gRPC on the Unix socket; tcp: gRPC on loopback
    transports = ["fast", "unix"] if (args.quick or args.no_tcp) else ["fast", "unix", "tcp"]
    if args.no_spin:
        transports.insert(1, "fast0")

    per_req = request_bytes(args.layout, args.tokens, args.receive)
    live = max(client_counts) * (max(cycle, args.batch) + 2)
    arena = -(-int(per_req * live * 1.02 + 64 * 2**20) // GIB) * GIB  # sparse: only the tables use memory
    busy = busy_fraction()
    t_all = time.perf_counter()
    cpu0, own0 = cpu_snap(), own_cpu()
    extra = ["--listen-tcp", "127.0.0.1:0"] if "tcp" in transports else []
    # --no-arena-fallocate: the arena stays sparse (never touched; taking its pages would take the machine's memory)
    d = BenchDaemon.spawn("--arena-bytes", str(arena), "--no-arena-fallocate", "--layout", args.layout, *extra).wait_ready()
    print(f"kvd control-plane benchmark -- {machine()}")
    print(f"daemon: {args.layout}, {args.tokens}-token {'received' if args.receive else 'computed'} requests "
          f"({per_req / 2**20:,.0f} MiB each), sparse {arena / 2**40:.2f} TiB shm arena; "
          f"unix {d.unix}" + (f", tcp {d.tcp}" if d.tcp else ""), flush=True)
    if busy > 0.15:
        print(f"WARNING: {busy:.0%} of the CPUs were busy before the run (other processes); expect noisy numbers", flush=True)
    results = []
    other_share: dict[tuple[str, int], float] = {}
    try:
        for transport in transports:
            address = d.tcp if transport == "tcp" else d.unix
            for n in client_counts:
                plan = Plan(
                    tokens=args.tokens, receive=args.receive, batch=args.batch, cycle=cycle,
                    single_cycles=max(1, -(-calls // (cycle * n))), round_steps=max(1, -(-rounds // (cycle * n))),
                    batch_steps=max(1, -(-batches // n)), warmup=200 if args.quick else 400, spin_us=args.spin_us,
                )
                t0, c0, o0 = time.perf_counter(), cpu_snap(), own_cpu() + proc_cpu(d.proc.pid)
                results.append(run_config(address, transport, n, plan))  # type: ignore[arg-type]
                c1, o1 = cpu_snap(), own_cpu() + proc_cpu(d.proc.pid)
                other_share[(transport, n)] = max(0.0, (c1[1] - c0[1]) - (o1 - o0)) / max(1e-9, c1[0] - c0[0])
                print(f"  {transport} x{n}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    finally:
        d.stop()
    others = others_line(cpu0, own0)
    print()
    print(table(results, args.batch))
    print()
    for res in results:
        r, e = res["round"], res["echo"]
        b = res[f"allocate x{args.batch}"]
        print(f"{r.transport} x{r.clients}: round p50 = {r.pct(0.5) / e.pct(0.5) / 5:.2f}x five echos; "
              f"allocate x{args.batch}: {b.ops * args.batch:,.0f} requests/s, "
              f"{b.pct(0.5) / args.batch:,.1f} µs per request; other processes {other_share[(r.transport, r.clients)]:.0%} of the CPU")
    n_single = len(results[0]["echo"].lat_ns)
    if len(client_counts) > 1:
        print(f"\naggregate calls/s against client count ({os.cpu_count()} CPUs; daemon and clients share them):")
        print(sweep(results))
    print(f"\nsamples per row: single calls {n_single:,d}, rounds {len(results[0]['round'].lat_ns):,d}, "
          f"batches {len(results[0][f'allocate x{args.batch}'].lat_ns):,d} (pooled over clients); "
          f"total {time.perf_counter() - t_all:.0f} s")
    print(others)
    if args.json:
        rows = [{"call": name, "transport": r.transport, "clients": r.clients, "p50_us": r.pct(0.5), "p99_us": r.pct(0.99), "ops": r.ops}
                for res in results for name, r in res.items()]
        agg = [{"transport": next(iter(res.values())).transport, "clients": next(iter(res.values())).clients,
                "echo_calls_s": aggregate(res, ("echo",)), "engine_calls_s": aggregate(res, ENGINE_CALLS)} for res in results]
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "layout": args.layout, "tokens": args.tokens, "others": others, "rows": rows,
                       "aggregate": agg}, f, indent=1)


if __name__ == "__main__":
    main()
