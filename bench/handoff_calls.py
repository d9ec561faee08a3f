"""The handoff's fixed cost (issue 16): one small request prefill -> decode, the whole control path.

    .venv/bin/python bench/handoff_calls.py            # 400 handoffs per flow (about a minute on 2 cores)
    .venv/bin/python bench/handoff_calls.py --quick    # 100 per flow

Two daemons (``python -m kvd.cli serve --backend local``, ``tiny-hybrid`` by default) run as
separate processes; this process is both engines (but for the ``decode apart`` flow), one client per daemon per flow. Per handoff of
``--tokens`` tokens (16 by default), wall time on this side, from the decode side's first call to
the last free:

* ``old grpc``: today's flow over gRPC, 8 calls -- decode ``allocate(receive)``, ``acquire_lease
  (recv)``; prefill ``allocate``, ``begin_send``, ``send``; decode ``wait_ready``; both ``free``.
* ``old fast``: the same 8 calls over the engine socket (``transport="fast"``).
* ``new fast``: 5 calls over the engine socket -- decode ``allocate_recv`` (allocate + RECV lease +
  ticket); prefill ``allocate(ticket=)`` (allocate, and begin the transfer: the receiver's check
  runs while the reply goes back, and the Send collects its answer), ``send(free=True)`` (the
  request is freed there); decode ``wait_ready`` (a READY doorbell: no call), ``free``. A daemon
  that predates ``allocate(ticket=)`` (``@base``) ignores the ticket there and checks it in the
  Send.
* ``new grpc``: the 5 calls over gRPC.
* ``new fast, decode apart``: the 5 calls over the engine socket with the decode engine in
  another process (:class:`benchkit.ApartWaiter`, its own session), as in a deployment; its
  WaitReady is already waiting (issued ~3 ms before, not timed) when the prefill side starts.
  Wall = the child's ``allocate_recv`` (timed there) + from the prefill ``allocate`` issued here
  until both the Send reply (here) and the WaitReady answer (the child's stamp, same clock) are
  in + the child's ``free`` (timed there); the pipe between the two processes is not timed.
* ``4 bare round trips``: the short flow's four engine-socket calls as ``Echo`` calls, to the same
  daemons in the same order (decode, prefill, prefill, decode): the floor of the short flow when
  the daemons' handlers cost nothing (the peer calls between the daemons not counted).
* ``memcpy``: the same bytes (every page the Send moves) copied between two buffers here.
* with ``--prompt-ms T`` (a prompt computing T ms between the prefill engine's Allocate and its
  Send, as in a real engine; the decode side's calls come before, untimed), three more rows time
  only the prefill engine's calls (Allocate, BeginSend where used, Send(free)), the prompt left
  out: ``prefill, check in Send`` (``allocate``; the Send runs the check), ``prefill, begin_send``
  (``allocate`` + ``begin_send``: the check waited for before the prompt), ``prefill, allocate
  (ticket)`` (the check runs during the prompt, the Send finds it answered).
* with ``--baseline-tree DIR`` (another checkout of kvd, e.g. ``git worktree add /tmp/base
  <commit>``): ``old fast @base`` and ``new fast @base``, the same two flows against a second
  pair of daemons running DIR's kvd, taking turns with the others: a before/after in one run.
  The clients are this checkout's (the wire is the same; a daemon that predates doorbells
  refuses the board, and its ``wait_ready`` is a call, as it was then).

    .venv/bin/python bench/handoff_calls.py --quick --baseline-tree /tmp/base
    .venv/bin/python bench/handoff_calls.py --quick --prompt-ms 2

Flows take turns handoff by handoff (so drift on a shared host hits them alike); the garbage
collector is off while timing. ``--block N``: they take turns every N handoffs instead. Turn by
turn, every handoff follows the other flows' calls through the same daemons -- gRPC's machinery
among them -- so each starts with the processors' caches full of someone else's work, which an
engine that uses one transport never sees; in blocks (``--block 25``), a flow runs as such an
engine does, warm after its first handoff, and drift still hits every flow alike, block by block. Reported: median and p99 per flow, and ratios to ``old grpc``.
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

from benchkit import ApartWaiter, BenchDaemon, cpu_model, cpu_snap, others_line, own_cpu  # noqa: E402

FLOWS = ("old grpc", "old fast", "new fast", "new grpc", "new fast, decode apart")
#: How long the apart decode engine's WaitReady is in flight before the prefill side starts (not timed).
HEAD_START_S = 0.003


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 handoffs per flow")
    ap.add_argument("--layout", default="tiny-hybrid", help="layout preset (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=None, help="handoffs per flow (default 400; --quick 100)")
    ap.add_argument("--prompt-ms", type=float, default=0.0, metavar="T",
                    help="also time the prefill engine's calls around a prompt computing T ms (three ways)")
    ap.add_argument("--block", type=int, default=1, metavar="N",
                    help="flows take turns every N handoffs (default 1: handoff by handoff); see the module docstring")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="another kvd checkout: its daemons run the old and new fast flows too, in the same run")
    args = ap.parse_args()
    n = args.repeats or (100 if args.quick else 400)

    import numpy as np

    from kvd.client import Client

    opts = ("--backend", "local", "--layout", args.layout, "--arena-bytes", str(256 << 20))
    cpu0, own0 = cpu_snap(), own_cpu()
    base_tree = os.path.abspath(args.baseline_tree) if args.baseline_tree else None
    dp, dd = BenchDaemon.spawn(*opts), BenchDaemon.spawn(*opts)
    bp, bd = (BenchDaemon.spawn(*opts, root=base_tree), BenchDaemon.spawn(*opts, root=base_tree)) if base_tree else (None, None)
    dp.wait_ready(), dd.wait_ready()
    if bp is not None and bd is not None:
        bp.wait_ready(), bd.wait_ready()
    apart = ApartWaiter.spawn(dd.unix, "decode-apart")
    try:
        apart.wait_started()
        cl = {}
        for tr in ("grpc", "fast"):
            cl[tr] = (Client.connect(dp.unix, name=f"prefill-{tr}", transport=tr), Client.connect(dd.unix, name=f"decode-{tr}", transport=tr))
        if bp is not None and bd is not None:
            cl["base"] = (Client.connect(bp.unix, name="prefill-base", transport="fast"), Client.connect(bd.unix, name="decode-base", transport="fast"))
        tok = args.tokens
        seq = [0]
        nbytes = [0]

        def old(tr: str) -> None:
            p, d = cl[tr]
            seq[0] += 1
            rid = f"h{seq[0]}"
            d.allocate(rid, tok, receive=True)
            lease = d.acquire_lease(rid, "recv")
            p.allocate(rid, tok)
            p.begin_send(rid, lease.ticket)
            r = p.send(rid, lease.ticket)
            st = d.wait_ready(rid, 5)
            p.free(rid)
            d.free(rid)
            assert st.ready, st
            nbytes[0] = r.nbytes

        def new(tr: str) -> None:
            p, d = cl[tr]
            seq[0] += 1
            rid = f"h{seq[0]}"
            _, lease = d.allocate_recv(rid, tok)
            p.allocate(rid, tok, ticket=lease.ticket)
            r = p.send(rid, lease.ticket, free=True)
            st = d.wait_ready(rid, 5)
            d.free(rid)
            assert st.ready and "free" in r.phases, (st, r.phases)

        pf = Client.connect(dp.unix, name="prefill-apart", transport="fast")
        pc = time.perf_counter

        def new_apart() -> float:
            """The wall time of one handoff with the decode engine in the waiter process."""
            seq[0] += 1
            rid = f"h{seq[0]}"
            tickets, recv_s = apart.receive([(rid, tok)], one_call=True)
            apart.arm([rid], 5)
            time.sleep(HEAD_START_S)
            a = pc()
            pf.allocate(rid, tok, ticket=tickets[rid])
            r = pf.send(rid, tickets[rid], free=True)
            replied = pc()
            st, at = apart.collect()[rid]
            mid = max(replied, at) - a
            assert st.ready and "free" in r.phases, (st, r.phases)
            return recv_s + mid + apart.free([rid])

        fns = {"old grpc": lambda: old("grpc"), "old fast": lambda: old("fast"), "new fast": lambda: new("fast"), "new grpc": lambda: new("grpc"),
               "new fast, decode apart": new_apart}
        def prefill(way: str) -> float:
            """The prefill engine's calls around a prompt of ``--prompt-ms`` (not counted)."""
            p, d = cl["fast"]
            seq[0] += 1
            rid = f"h{seq[0]}"
            _, lease = d.allocate_recv(rid, tok)
            a = pc()
            if way == "ticket":
                p.allocate(rid, tok, ticket=lease.ticket)
            else:
                p.allocate(rid, tok)
                if way == "begin":
                    p.begin_send(rid, lease.ticket)
            b = pc()
            time.sleep(args.prompt_ms / 1e3)
            c = pc()
            r = p.send(rid, lease.ticket, free=True)
            e = pc()
            assert d.wait_ready(rid, 5).ready and "free" in r.phases
            d.free(rid)
            return (b - a) + (e - c)

        if args.prompt_ms > 0:
            fns["prefill, check in Send"] = lambda: prefill("send")
            fns["prefill, begin_send"] = lambda: prefill("begin")
            fns["prefill, allocate(ticket)"] = lambda: prefill("ticket")
        if "base" in cl:
            fns["old fast @base"] = lambda: old("base")
            fns["new fast @base"] = lambda: new("base")
        for _ in range(30):  # warm-up: connections, server threads, plans, peer sockets
            for f in fns.values():
                f()
        src = np.random.default_rng(0).integers(0, 255, max(1, nbytes[0]), dtype=np.uint8)
        dst = np.empty_like(src)

        def memcpy() -> None:
            dst[:] = src

        def bare() -> None:
            p, d = cl["fast"]
            d.echo()
            p.echo()
            p.echo()
            d.echo()

        fns["4 bare round trips"] = bare
        fns["memcpy"] = memcpy
        lat: dict[str, list[float]] = {k: [] for k in fns}
        gc.disable()
        block = max(1, args.block)
        for _ in range(-(-n // block)):
            for k, f in fns.items():
                for _ in range(block):
                    t0 = pc()
                    own = f()  # a flow that times itself returns its wall
                    lat[k].append(pc() - t0 if own is None else own)
        gc.enable()
        for p, d in cl.values():
            p.close()
            d.close()
        pf.close()
    finally:
        apart.close()
        for d in (dp, dd, bp, bd):
            if d is not None:
                d.stop()

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3

    print(f"kvd handoff control path -- {cpu_model()}; {args.layout}, {args.tokens} tokens ({nbytes[0]:,d} B moved), "
          f"backend local, {n} handoffs per flow, taking turns every {block}" + (f"; @base: daemons of {base_tree}" if base_tree else ""))
    w = max(map(len, lat))
    print(f"| {'flow':<{w}} | calls | {'median ms':>9} | {'p99 ms':>7} | median / old grpc |")
    print(f"|{'-' * (w + 2)}|-------|-----------|---------|-------------------|")
    base = statistics.median(lat["old grpc"])
    calls = {"old grpc": 8, "old fast": 8, "new fast": 5, "new grpc": 5, "new fast, decode apart": 5, "memcpy": 0, "4 bare round trips": 4,
             "old fast @base": 8, "new fast @base": 5, "prefill, check in Send": 2, "prefill, begin_send": 3, "prefill, allocate(ticket)": 2}
    for k, xs in lat.items():
        print(f"| {k:<{w}} | {calls[k]:>5} | {pct(xs, 0.5):>9.3f} | {pct(xs, 0.99):>7.3f} | {statistics.median(xs) / base:>16.2f}x |")
    print(others_line(cpu0, own0))


if __name__ == "__main__":
    main()
