"""The handoff's fixed cost (issue 16): one small request prefill -> decode, the whole control path.

    .venv/bin/python bench/handoff_calls.py            # 400 handoffs per flow (about a minute on 2 cores)
    .venv/bin/python bench/handoff_calls.py --quick    # 100 per flow

Two daemons (``python -m kvd.cli serve --backend local``, ``tiny-hybrid`` by default) run as
separate processes, and two more for the gRPC flows (so that what gRPC leaves in a daemon does not
cost the fast flows that follow it there: an A/A run with both pairs serving every flow read 4-9 %
against the main pair); this process is both engines (but for the ``decode apart`` flow), one client per daemon per flow. Per handoff of
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
* ``new fast, no spin`` and ``4 bare round trips, no spin``: the same on clients that sleep at once
  for each reply (``Client.connect(spin_us=0)``); the engine socket's clients look for a reply for
  200 us first (:data:`kvd.client.fast.SPIN_US`).
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

With ``--where`` (blocks of 25 unless ``--block`` says otherwise), the daemons run with their
metrics on and the bench reads their own clock of every engine call (``kvd_rpc_duration_seconds``,
frame read to reply sent) before and after each block of a flow: a second table splits each flow's
mean handoff into the time inside the daemons' calls -- the Send's Commit, a round trip to the
decode daemon, inside that -- and the rest (both directions on the wire, the wake-ups, this
process's client code); a third does so call by call for the two fast flows. A WaitReady is left
out of the daemons' share (its time is a wait), and so is work a daemon defers past a reply (the
check an Allocate with a ticket sends, its plan).

    .venv/bin/python bench/handoff_calls.py --where

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
import json
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
    ap.add_argument("--block", type=int, default=None, metavar="N",
                    help="flows take turns every N handoffs (default 1: handoff by handoff; 25 with --where); see the module docstring")
    ap.add_argument("--where", action="store_true",
                    help="also split each flow's time by the daemons' own clocks (implies --block 25 unless given)")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="another kvd checkout: its daemons run the old and new fast flows too, in the same run")
    ap.add_argument("--spin-us", type=float, default=None, metavar="US",
                    help="how long the engine-socket clients look for a reply before they sleep (default: the client's, 200)")
    ap.add_argument("--json", metavar="PATH", help="also write each flow's median and p99 (ms) here (bench/control_targets.py reads it)")
    args = ap.parse_args()
    n = args.repeats or (100 if args.quick else 400)
    block = max(1, args.block if args.block is not None else 25 if args.where else 1)

    import numpy as np

    from kvd.client import Client

    opts = ("--backend", "local", "--layout", args.layout, "--arena-bytes", str(256 << 20))
    cpu0, own0 = cpu_snap(), own_cpu()
    base_tree = os.path.abspath(args.baseline_tree) if args.baseline_tree else None
    clocked = ("--metrics-port", "0") if args.where else ()
    dp, dd = BenchDaemon.spawn(*opts, *clocked), BenchDaemon.spawn(*opts, *clocked)
    # The gRPC flows on a pair of their own: what gRPC's machinery leaves in a daemon (its threads,
    # its caches) would otherwise cost the fast flows that follow it there, and not @base's.
    gp, gd = BenchDaemon.spawn(*opts, *clocked), BenchDaemon.spawn(*opts, *clocked)
    bp, bd = (BenchDaemon.spawn(*opts, root=base_tree), BenchDaemon.spawn(*opts, root=base_tree)) if base_tree else (None, None)
    dp.wait_ready(), dd.wait_ready(), gp.wait_ready(), gd.wait_ready()
    if bp is not None and bd is not None:
        bp.wait_ready(), bd.wait_ready()
    apart = ApartWaiter.spawn(dd.unix, "decode-apart")
    try:
        apart.wait_started()
        cl = {}
        spin = {} if args.spin_us is None else {"spin_us": args.spin_us}
        for tr, (p_, d_) in (("grpc", (gp, gd)), ("fast", (dp, dd))):
            cl[tr] = (Client.connect(p_.unix, name=f"prefill-{tr}", transport=tr, **spin),
                      Client.connect(d_.unix, name=f"decode-{tr}", transport=tr, **spin))
        # the same daemons, clients that sleep at once for each reply (the engine socket's clients
        # look for it for SPIN_US first: kvd.ipc.frames.read_frame)
        cl["fast0"] = (Client.connect(dp.unix, name="prefill-fast0", transport="fast", spin_us=0),
                       Client.connect(dd.unix, name="decode-fast0", transport="fast", spin_us=0))
        if bp is not None and bd is not None:
            cl["base"] = (Client.connect(bp.unix, name="prefill-base", transport="fast"), Client.connect(bd.unix, name="decode-base", transport="fast"))
        tok = args.tokens
        seq = [0]
        nbytes = [0]
        laps: dict[str, dict[str, list[float]]] = {}  # flow -> call -> its time in each handoff
        commits: dict[str, list[float]] = {}  # flow -> the Send's Commit phase in each handoff

        def old(tr: str) -> None:
            p, d = cl[tr]
            seq[0] += 1
            rid = f"h{seq[0]}"
            lap = Laps(laps.setdefault(f"old {tr}", {}))
            d.allocate(rid, tok, receive=True)
            lap(OLD_CALLS[0])
            lease = d.acquire_lease(rid, "recv")
            lap(OLD_CALLS[1])
            p.allocate(rid, tok)
            lap(OLD_CALLS[2])
            p.begin_send(rid, lease.ticket)
            lap(OLD_CALLS[3])
            r = p.send(rid, lease.ticket)
            lap(OLD_CALLS[4])
            st = d.wait_ready(rid, 5)
            lap(OLD_CALLS[5])
            p.free(rid)
            lap(OLD_CALLS[6])
            d.free(rid)
            lap(OLD_CALLS[7])
            assert st.ready, st
            nbytes[0] = r.nbytes
            commits.setdefault(f"old {tr}", []).append(r.phases.get("commit", 0.0))

        def new(tr: str) -> None:
            p, d = cl[tr]
            seq[0] += 1
            rid = f"h{seq[0]}"
            lap = Laps(laps.setdefault(f"new {tr}", {}))
            _, lease = d.allocate_recv(rid, tok)
            lap(NEW_CALLS[0])
            p.allocate(rid, tok, ticket=lease.ticket)
            lap(NEW_CALLS[1])
            r = p.send(rid, lease.ticket, free=True)
            lap(NEW_CALLS[2])
            st = d.wait_ready(rid, 5)
            lap(NEW_CALLS[3])
            d.free(rid)
            lap(NEW_CALLS[4])
            assert st.ready and "free" in r.phases, (st, r.phases)
            commits.setdefault(f"new {tr}", []).append(r.phases.get("commit", 0.0))

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
            commits.setdefault("new fast, decode apart", []).append(r.phases.get("commit", 0.0))
            st, at = apart.collect()[rid]
            mid = max(replied, at) - a
            assert st.ready and "free" in r.phases, (st, r.phases)
            return recv_s + mid + apart.free([rid])

        fns = {"old grpc": lambda: old("grpc"), "old fast": lambda: old("fast"), "new fast": lambda: new("fast"), "new grpc": lambda: new("grpc"),
               "new fast, decode apart": new_apart, "new fast, no spin": lambda: new("fast0")}
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

        def bare(tr: str) -> None:
            p, d = cl[tr]
            d.echo()
            p.echo()
            p.echo()
            d.echo()

        fns["4 bare round trips"] = lambda: bare("fast")
        fns["4 bare round trips, no spin"] = lambda: bare("fast0")
        fns["memcpy"] = memcpy
        lat: dict[str, list[float]] = {k: [] for k in fns}
        laps.clear()
        commits.clear()
        # --where: the flows on this pair of daemons, and what their own clocks added per block
        clocks = {k for k in fns if k in CLOCKED} if args.where else set()
        inside: dict[str, dict[tuple[str, str], list[float]]] = {k: {} for k in clocks}
        gc.disable()
        for _ in range(-(-n // block)):
            for k, f in fns.items():
                kp, kd = (gp, gd) if "grpc" in k else (dp, dd)
                before = {"prefill": kp.rpc_clock(), "decode": kd.rpc_clock()} if k in clocks else None
                for _ in range(block):
                    t0 = pc()
                    own = f()  # a flow that times itself returns its wall
                    lat[k].append(pc() - t0 if own is None else own)
                if before is not None:
                    for side, now in (("prefill", kp.rpc_clock()), ("decode", kd.rpc_clock())):
                        for method, (sec, calls) in now.items():
                            was = before[side].get(method, (0.0, 0))
                            acc = inside[k].setdefault((side, method), [0.0, 0])
                            acc[0] += sec - was[0]
                            acc[1] += calls - was[1]
        gc.enable()
        for p, d in cl.values():
            p.close()
            d.close()
        pf.close()
    finally:
        apart.close()
        for d in (dp, dd, gp, gd, bp, bd):
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
    calls = {"old grpc": 8, "old fast": 8, "new fast": 5, "new grpc": 5, "new fast, decode apart": 5, "new fast, no spin": 5, "memcpy": 0,
             "4 bare round trips": 4, "4 bare round trips, no spin": 4,
             "old fast @base": 8, "new fast @base": 5, "prefill, check in Send": 2, "prefill, begin_send": 3, "prefill, allocate(ticket)": 2}
    for k, xs in lat.items():
        print(f"| {k:<{w}} | {calls[k]:>5} | {pct(xs, 0.5):>9.3f} | {pct(xs, 0.99):>7.3f} | {statistics.median(xs) / base:>16.2f}x |")
    if args.where:
        where(lat, inside, laps, commits)
    others = others_line(cpu0, own0)
    print(others)
    if args.json:
        flows = {k: {"calls": calls[k], "median_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "n": len(xs)} for k, xs in lat.items()}
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "layout": args.layout, "tokens": args.tokens, "bytes": nbytes[0], "block": block,
                       "others": others, "flows": flows}, f, indent=1)


#: The calls of each fast flow, in order, labelled "<daemon> <client method>": what ``--where`` splits.
OLD_CALLS = ("decode allocate(receive)", "decode acquire_lease", "prefill allocate", "prefill begin_send", "prefill send",
             "decode wait_ready", "prefill free", "decode free")
NEW_CALLS = ("decode allocate_recv", "prefill allocate(ticket)", "prefill send(free)", "decode wait_ready", "decode free")
_METHOD = {"allocate": "Allocate", "allocate_recv": "Allocate", "acquire_lease": "AcquireLease", "begin_send": "BeginSend",
           "send": "Send", "wait_ready": "WaitReady", "free": "Free"}
#: Flows whose daemons' clocks ``--where`` reads (the gRPC flows' pair or the fast flows').
CLOCKED = ("old grpc", "old fast", "new fast", "new grpc", "new fast, decode apart", "4 bare round trips")


class Laps:
    """Times the calls of one handoff one after another into ``into`` (call label -> seconds)."""

    def __init__(self, into: dict[str, list[float]]) -> None:
        self.into, self.t = into, time.perf_counter()

    def __call__(self, label: str) -> None:
        now = time.perf_counter()
        self.into.setdefault(label, []).append(now - self.t)
        self.t = now


def where(lat: dict[str, list[float]], inside: dict[str, dict[tuple[str, str], list[float]]],
          laps: dict[str, dict[str, list[float]]], commits: dict[str, list[float]]) -> None:
    """The ``--where`` tables: each clocked flow's mean handoff split by the daemons' clocks,
    then call by call for the fast flows."""
    print("\nWhere the time goes (means per handoff, ms): in the daemons = their own clocks of the engine calls "
          "(frame read to reply sent; WaitReady's wait left out), the Send's Commit round trip inside it; "
          "outside = the wire both ways, the wake-ups and this process's client code")
    print("| flow | handoff | in the daemons | of which the Send's Commit | outside the daemons | inside / handoff |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, acc in inside.items():
        n = len(lat[k])
        mean = statistics.fmean(lat[k]) * 1e3
        ins = sum(sec for (_, m), (sec, _) in acc.items() if m != "WaitReady") / n * 1e3
        com = statistics.fmean(commits[k]) * 1e3 if commits.get(k) else 0.0
        print(f"| {k} | {mean:.3f} | {ins:.3f} | {com:.3f} | {mean - ins:.3f} | {ins / mean:.2f} |")
    for flow, labels in (("old fast", OLD_CALLS), ("new fast", NEW_CALLS)):
        if flow not in inside or flow not in laps:
            continue
        print(f"\n| {flow}: call | client median ms | client mean ms | in the daemon, mean ms | calls made | outside, mean ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for label in labels:
            side, verb = label.split(" ", 1)
            key = (side, _METHOD[verb.split("(")[0]])
            xs = laps[flow][label]
            sec, calls = inside[flow].get(key, (0.0, 0))
            # Each (daemon, method) is called once per handoff in these flows: its mean is that call's.
            per = sec / calls * 1e3 if calls else 0.0
            share = per * calls / len(xs)  # a doorbell answers most waits: per handoff, not per call
            print(f"| {label} | {statistics.median(xs) * 1e3:.3f} | {statistics.fmean(xs) * 1e3:.3f} | "
                  f"{share:.3f} | {calls / len(xs):.2f} per handoff | {statistics.fmean(xs) * 1e3 - share:.3f} |")


if __name__ == "__main__":
    main()
