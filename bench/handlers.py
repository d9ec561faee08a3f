"""What the daemons' handlers cost per call, without the wire (issue 16): the CPU a handoff spends
in Python, against a bare Echo through the same path.

    .venv/bin/python bench/handlers.py                 # 2,000 handoffs, tiny-hybrid, 16 tokens
    .venv/bin/python bench/handlers.py --quick         # 300
    .venv/bin/python bench/handlers.py --quick --count # and what each call runs: Python, C, numpy/torch calls
    .venv/bin/python bench/handlers.py --layout gemma-4-31b-it-tp2 --tokens 4096 --arena-gib 64

Two daemons (``Daemon.start``, ``backend: local``) in this process. Every engine call goes through
the engine socket's own ``_answer`` (parse, the servicer's handler, the reply frame) with its
request bytes already on a socketpair, so what is timed is what a daemon does per call, hot, with
no wake-up and no other process in the way. The prefill daemon's peer calls (CheckTicket, Commit)
reach the decode daemon's :class:`~kvd.server.peer_calls.PeerCalls` directly, as serialised
messages (each side parses what it gets), in the calling thread: their cost is inside the
Send's and is also shown on its own.

``--count`` also counts, per call, what the calling thread runs (``sys.setprofile`` over 100 more
handoffs): Python function calls, calls into C, and of those the numpy and torch ones. Counts do
not drift with the machine's noise or speed, so they compare rounds and machines where timings
cannot: a hot path made lighter shows as fewer calls.

Per handoff, the short flow: decode ``Allocate`` (receive, lease: the ticket), prefill
``Allocate`` with the ticket (the receiver's check and the Send's plan, deferred past its reply,
counted in it), prefill ``Send`` (last, free), decode ``WaitReady``, decode ``Free``. Baseline:
``Echo`` through the same ``_answer`` path. The garbage collector is off while timing. Reported:
median per call in microseconds, and the median ratio to Echo; then the Send's own phases.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvd.config import load_settings  # noqa: E402
from kvd.ipc.frames import HEAD  # noqa: E402
from kvd.rpc.engine_wire import METHOD_IDS  # noqa: E402
from kvd.server.app import Daemon  # noqa: E402
from kvd.server.engine_socket import session_md  # noqa: E402
from kvd.server.peer_calls import PeerCalls  # noqa: E402
from kvd.v1 import kvd_pb2 as pb  # noqa: E402

COUNTED = 100  # handoffs counted by --count
CALLS = ("decode Allocate+lease", "prefill Allocate(ticket)", "prefill Send(free)", "decode WaitReady", "decode Free")


class DirectLink:
    """The prefill daemon's peer link, replaced: CheckTicket and Commit go to the decode daemon's
    PeerCalls in this thread, as serialised messages (timed apart in ``peer``)."""

    def __init__(self, calls: PeerCalls, peer: dict[str, list[float]]) -> None:
        self.calls, self.peer = calls, peer

    def _call(self, name: str, fn: Callable, request) -> object:
        t0 = time.perf_counter()
        data = request.SerializeToString()
        reply = fn(type(request).FromString(data))
        if isinstance(reply, tuple):  # commit_then: the reply and the wake
            reply, wake = reply
            wake()
        type(reply).FromString(reply.SerializeToString())
        self.peer[name].append(time.perf_counter() - t0)
        return reply

    def start_check(self, address, ticket, sender, via=None):
        reply = self._call("CheckTicket", self.calls.check_ticket, pb.CheckTicketRequest(ticket=ticket, sender=sender))
        return lambda: reply

    def commit(self, address, ref, last, nbytes, sender, via=None):
        from kvd.rpc.convert import ref_to_pb

        self._call("Commit", self.calls.commit_then, pb.CommitRequest(ref=ref_to_pb(ref), last=last, bytes=nbytes, sender=sender))

    def abort_receive(self, *a, **k):
        raise RuntimeError("abort_receive in the handler bench: a handoff failed")

    def abort_send(self, *a, **k):
        raise RuntimeError("abort_send in the handler bench: a handoff failed")

    def heartbeat(self, address, sender, refs, via=None):
        # Forwarded (not timed): a first Send of a long request (its pages touched for the first
        # time) can outlast the receiver's peer timeout, which only heartbeats keep at bay.
        from kvd.rpc.convert import ref_to_pb

        data = pb.HeartbeatRequest(sender=sender, refs=[ref_to_pb(r) for r in refs]).SerializeToString()
        return list(self.calls.heartbeat(pb.HeartbeatRequest.FromString(data)).dead_lease_ids)


class Counter:
    """Python calls, C calls, and numpy / torch C calls per engine call (``--count``), in the
    calling thread: the profile hook files each event under the call in progress."""

    current = "-"

    def __init__(self) -> None:
        self.py: dict[str, int] = {}
        self.c: dict[str, int] = {}
        self.arrays: dict[str, int] = {}

    def hook(self, frame, event: str, arg) -> None:
        k = Counter.current
        if event == "call":
            self.py[k] = self.py.get(k, 0) + 1
        elif event == "c_call":
            self.c[k] = self.c.get(k, 0) + 1
            owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
            if owner and owner.split(".")[0] in ("torch", "numpy"):
                self.arrays[k] = self.arrays.get(k, 0) + 1


class Engine:
    """One engine's calls into one daemon's engine socket handlers, over a socketpair that holds
    each request's bytes (read by ``_answer`` as from a connection)."""

    def __init__(self, d: Daemon, name: str) -> None:
        self.srv = d.engine_socket
        assert self.srv is not None
        self.a, self.b = socket.socketpair()
        self.md: tuple[tuple[str, str], ...] = ()
        reply = self.call("OpenSession", pb.OpenSessionRequest(name=name, ttl_seconds=3600))
        self.md = session_md(reply.session_id)  # as the engine socket keeps it: the session, packed ids

    def call(self, method: str, request, label: str = ""):
        from kvd.rpc.engine_wire import METHODS

        Counter.current = label or method
        body = request.SerializeToString()
        self.a.sendall(body)
        kind = METHOD_IDS[method]
        reply, sid, _, code, after = self.srv._answer(self.b, len(body), kind, self.md)
        for fn in after:  # the work the handler left for after its reply: part of its cost here
            fn()
        n, ok = HEAD.unpack_from(reply)
        if ok != 0:
            raise RuntimeError(f"{method} refused: {pb.PeerStatus.FromString(reply[HEAD.size:])}")
        return METHODS[kind].response.FromString(reply[HEAD.size:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 handoffs")
    ap.add_argument("--layout", default="tiny-hybrid", help="layout preset (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (default: %(default)s)")
    ap.add_argument("--arena-gib", type=float, default=0.25, help="arena of each daemon in GiB (default: %(default)s)")
    ap.add_argument("--count", action="store_true", help="also count Python, C and numpy/torch calls per call (100 more handoffs)")
    ap.add_argument("--repeats", type=int, default=None, help="handoffs (default 2000; --quick 300)")
    args = ap.parse_args()
    n = args.repeats or (300 if args.quick else 2000)

    tmp = tempfile.mkdtemp(prefix="kvd-handlers-")
    arena = int(args.arena_gib * (1 << 30))

    def start(name: str) -> Daemon:
        return Daemon.start(load_settings(listen_unix=f"{tmp}/{name}.sock", backend="local", layout=args.layout,
                                          arena_bytes=arena, log_level="WARNING"))

    dp, dd = start("p"), start("d")
    peer: dict[str, list[float]] = {"CheckTicket": [], "Commit": []}
    assert dp.outbox is not None and dd.tickets is not None
    dp.outbox.link = DirectLink(PeerCalls(dd.node, None, dd.outbox, dd.tickets), peer)
    pe, de = Engine(dp, "prefill"), Engine(dd, "decode")
    lat: dict[str, list[float]] = {k: [] for k in ("Echo", *CALLS)}
    phases: dict[str, list[float]] = {}
    pc = time.perf_counter
    tok = args.tokens

    def handoff(i: int, keep: bool) -> None:
        rid = f"h{i}"
        t = [pc()]
        de.call("Echo", pb.EchoRequest(), "Echo")
        t.append(pc())
        r = de.call("Allocate", pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid, tokens=tok, receive=True, lease=True)]), CALLS[0])
        t.append(pc())
        pe.call("Allocate", pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid, tokens=tok, ticket=r.leases[0].ticket)]), CALLS[1])
        t.append(pc())
        s = pe.call("Send", pb.SendRequest(rid=rid, ticket=r.leases[0].ticket, last=True, free=True), CALLS[2])
        t.append(pc())
        w = de.call("WaitReady", pb.WaitRequest(rid=rid, timeout_seconds=5), CALLS[3])
        t.append(pc())
        de.call("Free", pb.FreeRequest(rids=[rid]), CALLS[4])
        t.append(pc())
        if w.state != pb.READY or "free" not in s.phase_seconds:
            raise RuntimeError(f"handoff {rid} did not complete: {w}, {dict(s.phase_seconds)}")
        if keep:
            for k, a, b in zip(lat, t, t[1:]):
                lat[k].append(b - a)
            for k, v in s.phase_seconds.items():
                phases.setdefault(k, []).append(v)

    try:
        for i in range(min(200, n)):  # warm-up: plans, caches, the allocators' first growth
            handoff(i, False)
        for v in peer.values():
            v.clear()
        gc.collect()
        gc.disable()
        for i in range(n):
            handoff(1000 + i, True)
        gc.enable()
        counter = Counter()
        if args.count:
            sys.setprofile(counter.hook)
            try:
                for i in range(COUNTED):
                    handoff(100_000 + i, False)
            finally:
                sys.setprofile(None)
        dp.node.pool.check()
        dd.node.pool.check()
    finally:
        dp.stop(0)
        dd.stop(0)
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) * 1e6 for k, v in lat.items()}
    print(f"kvd handlers, in process, hot -- {args.layout}, {tok} tokens, {n} handoffs; median per call")
    print("| call | median us | / Echo |")
    print("|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:,.1f} | {v / med['Echo']:.1f}x |")
    total = sum(med[k] for k in CALLS)
    print(f"| the five calls of a handoff | {total:,.1f} | {total / med['Echo']:.1f}x |")
    for k, v in peer.items():
        print(f"| of the Send: decode {k} (parse, handler, reply) | {statistics.median(v) * 1e6:,.1f} | "
              f"{statistics.median(v) * 1e6 / med['Echo']:.1f}x |")
    print("\nSend phases, median us: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f}" for k, v in phases.items()))
    if args.count:
        print(f"\nWhat each call runs in the calling thread, per call ({COUNTED} handoffs under sys.setprofile)")
        print("| call | Python calls | C calls | of which numpy / torch |")
        print("|---|---:|---:|---:|")
        for k in ("Echo", *CALLS):
            print(f"| {k} | {counter.py.get(k, 0) / COUNTED:,.0f} | {counter.c.get(k, 0) / COUNTED:,.0f} | {counter.arrays.get(k, 0) / COUNTED:,.0f} |")
        one = [sum(d.get(k, 0) for k in CALLS) / COUNTED for d in (counter.py, counter.c, counter.arrays)]
        print(f"| the five calls of a handoff | {one[0]:,.0f} | {one[1]:,.0f} | {one[2]:,.0f} |")


if __name__ == "__main__":
    main()
