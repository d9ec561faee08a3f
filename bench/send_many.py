"""SendMany against Send on the CPU (issue 7): the same requests handed off between two shm daemons
(``local`` backend) as one Send each, and as SendMany calls of ``--batch`` requests.

    .venv/bin/python bench/send_many.py            # ~1 min on a 2-core VM
    .venv/bin/python bench/send_many.py --quick    # a few seconds

Two daemons (``kvd serve --backend local --layout gpt-oss-20b``, shm arenas; ``--layout`` for
another: gemma-4-31b-it-tp2's 6.5 MB SWA pages do not fit a small VM's memory) run as
subprocesses; this process is both engines (one Client each). Workloads: ``small``, ``--n``
requests of ``--small`` tokens each (the per-request control plane dominates), and ``mixed``,
``--n`` requests log-uniform in [``--lo``, ``--hi``] tokens (seed ``--seed``). Per pass the
decode side allocates every request (``receive=True``) and takes its RECV lease (not timed);
timed: the client's wall from the first call to the last reply (Commit made each request READY
before its reply), one Send per request or ``n / batch`` SendMany calls in the workload's order.
Every pass then checks each request is READY on the decode side, the first pass of each way also
every planned block's bytes. Passes alternate the two ways; medians.

What this measures on the CPU: the shm backend copies inside ``write_async`` (memcpy in the
daemon's thread), so nothing overlaps the copies here; what SendMany saves is one gRPC round
trip from the engine per request (``n`` Sends become ``n / batch`` calls). On a GPU the copies
run on their own while the daemon prepares and commits the neighbours (bench/gpu_transfer.py,
row ``mixed batched``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchkit import BenchDaemon, cpu_model, cpu_snap, log_uniform, med, others_line, own_cpu  # noqa: E402

MIB = 1 << 20


def token_counts(kind: str, args: argparse.Namespace) -> list[int]:
    if kind == "small":
        return [args.small] * args.n
    return log_uniform(args.n, args.lo, args.hi, args.seed)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from kvd.pool.presets import load_layout

        self.args = args
        self.layout = load_layout(args.layout)
        # One workload at a time lives on the prefill daemon (every page of every request).
        need = max(sum(self.held(t) for t in token_counts(kind, args)) for kind in ("small", "mixed"))
        self.arena = -(-int(need * 1.25 + self.layout.max_page_bytes + 64 * MIB) // (64 * MIB)) * (64 * MIB)
        opts = ("--backend", args.backend, "--layout", args.layout, "--arena-bytes", str(self.arena), "--lease-ttl-s", "120",
                "--session-ttl-s", "60", "--peer-timeout-s", "30")
        self.P, self.D = BenchDaemon.spawn(*opts), BenchDaemon.spawn(*opts)
        self.P.wait_ready()
        self.D.wait_ready()
        from kvd.client import Client

        self.pc = Client.connect(self.P.unix, name="bench-prefill", timeout=120)
        self.dc = Client.connect(self.D.unix, name="bench-decode", timeout=120)
        self.p_att, self.d_att = self.pc.attach(), self.dc.attach()
        self.p_env, self.d_env = self.pc.info().envelopes, self.dc.info().envelopes

    def held(self, tokens: int) -> int:
        """Bytes a prefill request of ``tokens`` holds, allocated at once: a page of every group
        (but state) per page of tokens, one state slot."""
        from kvd.pool.layout import GroupKind

        n = -(-tokens // self.layout.page_size)
        return sum(self.layout.page_bytes(g) * (1 if g.kind is GroupKind.STATE else n) for g in self.layout.groups)

    def close(self) -> None:
        for a in (self.p_att, self.d_att):
            a.close()
        for c in (self.pc, self.dc):
            c.close()
        for d in (self.P, self.D):
            d.stop()

    def build(self, kind: str) -> list[tuple[str, int]]:
        """The workload's requests on the prefill daemon, random bytes in its arena."""
        import torch

        reqs = [(f"{kind}-{j}", t) for j, t in enumerate(token_counts(kind, self.args))]
        for rid, t in reqs:
            self.pc.allocate(rid, t)
        g = torch.Generator().manual_seed(len(reqs))
        t = self.p_att.tensor
        for i in range(0, t.numel(), 64 * MIB):  # by slices: no arena-sized temporary
            part = t[i : i + 64 * MIB]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=g))
        return reqs

    def receive(self, reqs: list[tuple[str, int]]) -> dict[str, bytes]:
        tickets = {}
        for rid, t in reqs:
            self.dc.allocate(rid, t, receive=True)
            tickets[rid] = self.dc.acquire_lease(rid, "recv").ticket
        return tickets

    def verify(self, reqs: list[tuple[str, int]], tickets: dict[str, bytes]) -> str:
        import torch

        from kvd.handoff.plan import plan_chunk
        from kvd.handoff.ticket import read as read_ticket

        p, d = self.p_att.tensor, self.d_att.tensor
        pb, db = self.p_env[0].base, self.d_env[0].base
        for rid, t in reqs:
            info = read_ticket(tickets[rid])
            plan = plan_chunk(self.layout, self.pc.vectors(rid), info.vectors, self.p_env, info.envelopes, 0, t, True)
            for s, dd, n in zip(*plan.as_lists()):
                if not torch.equal(p[s - pb : s - pb + n], d[dd - db : dd - db + n]):
                    return f"{rid}: a block of {n:,d} bytes at decode offset {dd - db:,d} differs"
        return ""

    def one_pass(self, reqs: list[tuple[str, int]], way: str, check: bool) -> tuple[float, float, int, str]:
        """(client wall, sum of the daemon's seconds, bytes moved, what failed or "")."""
        from kvd.client import SendResult, TransferState

        if check:
            self.d_att.tensor.zero_()
        tickets = self.receive(reqs)
        gc.disable()
        try:
            a = time.perf_counter()
            if way == "send":
                results = [self.pc.send(rid, tickets[rid]) for rid, _ in reqs]
                server = sum(r.seconds for r in results)
            else:
                k = self.args.batch
                calls = [self.pc.send_many([(rid, tickets[rid]) for rid, _ in reqs[i : i + k]]) for i in range(0, len(reqs), k)]
                results = [r for c in calls for r in c]
                server = sum(c.seconds for c in calls)
            wall = time.perf_counter() - a
        finally:
            gc.enable()
        why = next((f"{rid}: {r}" for (rid, _), r in zip(reqs, results) if not isinstance(r, SendResult)), "")
        why = why or next((f"{rid} not READY" for rid, _ in reqs if self.dc.wait_ready(rid, 0).state is not TransferState.READY), "")
        if check and not why:
            why = self.verify(reqs, tickets)
        self.dc.free(*(rid for rid, _ in reqs))
        return wall, server, sum(r.nbytes for r in results if isinstance(r, SendResult)), why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 passes per way instead of 11")
    ap.add_argument("--n", type=int, default=32, help="requests per workload (default 32)")
    ap.add_argument("--batch", type=int, default=8, help="requests per SendMany (default 8)")
    ap.add_argument("--small", type=int, default=16, help="tokens per request of the small workload (default 16: one page)")
    ap.add_argument("--lo", type=int, default=128, help="mixed workload: fewest tokens (default 128)")
    ap.add_argument("--hi", type=int, default=4096, help="mixed workload: most tokens (default 4096)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--layout", default="gpt-oss-20b", help="the daemons' layout preset (default gpt-oss-20b)")
    ap.add_argument("--backend", default="local", choices=("local", "mooncake"),
                    help="the daemons' backend (default local: shm copies; mooncake: Transfer Engine over TCP on loopback)")
    ap.add_argument("--passes", type=int, help="timed passes per way and workload (default 11; --quick 3)")
    args = ap.parse_args()
    args.passes = args.passes or (3 if args.quick else 11)
    import torch

    torch.set_num_threads(1)
    cpu0, own0 = cpu_snap(), own_cpu()
    print(f"SendMany vs Send, CPU, two shm daemons ({args.backend} backend, {args.layout}) -- {cpu_model()}")
    b = Bench(args)
    bad = False
    try:
        print("| workload | reqs | MB | way | wall ms | daemon ms | per request ms (wall) | Send / SendMany wall |")
        print("|---|---|---|---|---|---|---|---|")
        for kind in ("small", "mixed"):
            reqs = b.build(kind)
            ways = {"send": ([], []), "send_many": ([], [])}
            for way in ways:  # the first pass of each way: checked byte for byte, not timed
                _, _, nbytes, why = b.one_pass(reqs, way, check=True)
                if why:
                    print(f"{kind} {way}: check failed: {why}")
                    bad = True
            for k in range(args.passes):
                for way in (("send", "send_many") if k % 2 else ("send_many", "send")):
                    wall, server, _, why = b.one_pass(reqs, way, check=False)
                    if why:
                        print(f"{kind} {way}: {why}")
                        bad = True
                    ways[way][0].append(wall)
                    ways[way][1].append(server)
            mb = nbytes / 1e6
            ratio = med(ways["send"][0]) / med(ways["send_many"][0])
            for way, (walls, servers) in ways.items():
                label = "Send each" if way == "send" else f"SendMany({args.batch}) x {-(-len(reqs) // args.batch)}"
                print(f"| {kind} | {len(reqs)} | {mb:,.0f} | {label} | {med(walls) * 1e3:.2f} | {med(servers) * 1e3:.2f} | "
                      f"{med(walls) * 1e3 / len(reqs):.3f} | {ratio:.2f} |")
            b.pc.free(*(rid for rid, _ in reqs))
    finally:
        b.close()
    print(f"\n{args.passes} timed passes per way (alternating), medians; {others_line(cpu0, own0)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
