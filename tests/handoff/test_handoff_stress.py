"""Many engines handing requests over at once: every flow an engine may run, side by side on one
pair of daemons, and nothing lost, leaked or written where it does not belong.

Each of ``WORKERS`` threads is a prefill engine and a decode engine (a client of each daemon,
its own sessions; one pair in three over gRPC, the others over the engine socket) and runs
``ROUNDS`` handoffs, each of a random length and a random flow (seeded by ``STRESS_SEED``;
``STRESS_ROUNDS`` for a longer soak). The daemons run in this process (their nodes checked at the
end) and as processes of their own (truly in parallel with the engines):

* ``short``   -- ``allocate_recv``; ``allocate(ticket=)`` (the transfer begun there);
  ``send(free=True)``; the doorbell; ``free``;
* ``old``     -- ``allocate(receive)``, ``acquire_lease``; ``allocate``, ``begin_send``, ``send``;
  ``wait_ready``; both frees;
* ``chunked`` -- ``begin_send(chunk_tokens=)`` and one Send per chunk, the last one freeing;
* ``many``    -- three requests: ``allocate_recv_many``; ``allocate_many(tickets=)``; ``send_many``
  (each freed with its Send);
* ``abort``   -- the decode engine gives up before the Send (``abort``, then ``free``): the Send is
  refused, the prefill engine frees its request;
* ``race``    -- the decode engine aborts from another thread at a random moment while the Send
  runs: the Send returns and the request is READY (the abort too late), or the Send is refused
  and the request FAILED -- never one without the other; either way both free;
* ``gone``    -- the prefill engine frees its request before any Send: the decode side's transfer
  fails, and it frees its own;
* ``closed``  -- the prefill engine's session closes with the request in it (as an engine that
  exits does); a new session goes on.

The prefill engine writes random bytes into its request's pages before the Send; once READY the
decode engine's pages must hold exactly those bytes (what :func:`handoff_kit.moved` says the
Send moves). A refused flow must fail with the error its engine expects (never InternalError),
and leave its decode request FAILED or gone. At the end, with every session closed: no request,
lease, page or open transfer on either daemon, and ``Node.check()`` clean on both.
"""

from __future__ import annotations

import os
import random
import threading
import time

import daemon_kit as dk
import handoff_kit as hk
import pytest
import torch

from kvd.client import Client, TransferState
from kvd.errors import Aborted, CapacityError, FailedPrecondition, InternalError, KvdError, NotFound
from kvd.records import IndexVectors

SEED = int(os.environ.get("STRESS_SEED", "20261207"))
WORKERS = 6
ROUNDS = int(os.environ.get("STRESS_ROUNDS", "24"))
LENGTHS = (1, 4, 7, 16, 33, 64, 103)
FLOWS = ("short", "short", "old", "chunked", "many", "abort", "race", "gone", "closed")
READY, FAILED = TransferState.READY, TransferState.FAILED
#: what a refused Send may raise once its receiver gave up or its request is gone
REFUSED = (Aborted, FailedPrecondition, NotFound)


@pytest.fixture(params=["inproc", "subproc"])
def busy_pair(request, tmp_path):
    # 1 MiB: less than the workers may hold at once, so allocations meet a full pool now and then
    pair = hk.make_pair(tmp_path, "local", request.param, arena_bytes=1 << 20, session_ttl_s=30.0, lease_ttl_s=30.0)
    yield pair
    for s in pair.sides:
        s.stop()


class Worker:
    """One prefill engine and one decode engine, in one thread."""

    def __init__(self, pair: hk.Pair, k: int) -> None:
        self.pair, self.k = pair, k
        self.rnd = random.Random(SEED * 100 + k)
        self.seq = 0
        self.flows: dict[str, int] = {}
        self.errors: list[str] = []
        self.full = 0  # allocations that met a full pool (and were made again)
        self.races: dict[str, int] = {}  # how the race flow's transfers ended
        self.p = self._connect("prefill")
        self.d = self._connect("decode")
        self.pa = self.p.attach().tensor
        self.da = self.d.attach().tensor

    def _connect(self, role: str) -> Client:
        side = self.pair.prefill if role == "prefill" else self.pair.decode
        # Every third engine pair calls over gRPC, the others over the engine socket: both at once.
        return side.connect(f"{role}-engine-{self.k}", transport="grpc" if self.k % 3 == 2 else "fast")

    def _rid(self) -> str:
        self.seq += 1
        return f"w{self.k}-{self.seq}"

    # -- what an engine does around each call ---------------------------------------------------
    def _retry(self, fn):
        """A call that may meet a full pool while the others hold their requests: again, later."""
        deadline = time.monotonic() + 30  # the others finish and free theirs: on a loaded machine, slowly
        while True:
            try:
                return fn()
            except CapacityError:
                if time.monotonic() > deadline:
                    raise
                self.full += 1
                time.sleep(0.005)

    def _fill(self, src: IndexVectors, dst: IndexVectors, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Random bytes in every page of ``src`` the Send to ``dst`` moves; returns those pages'
        source ids and a copy of their bytes (the pages may be reused once the Send freed them)."""
        g = torch.Generator().manual_seed(self.rnd.randrange(1 << 62))
        out = {}
        for grp, (s, _) in hk.moved(src, dst, n, state=True).items():
            rows = hk.rows(self.pa, hk.PB[grp])
            ids = s.long()
            rows[ids] = torch.randint(0, 256, (ids.numel(), hk.PB[grp]), dtype=torch.uint8, generator=g)
            out[grp] = (s, rows[ids].clone())
        return out

    def _landed(self, rid: str, src: IndexVectors, dst: IndexVectors, n: int, sent: dict) -> None:
        for grp, (_, d) in hk.moved(src, dst, n, state=True).items():
            got = hk.rows(self.da, hk.PB[grp])[d.long()]
            if not torch.equal(got, sent[grp][1]):
                self.errors.append(f"{rid}: the decode pages of group {grp} do not hold what the prefill engine wrote")

    def _ready(self, rid: str) -> None:
        st = self.d.wait_ready(rid, 10)
        if st.state is not READY:
            raise AssertionError(f"{rid}: {st.state.name} ({st.reason}), not READY")

    def _ends_failed(self, rid: str) -> None:
        """The decode request of a transfer its sender gave up: FAILED (or freed already), then freed."""
        try:
            st = self.d.wait_ready(rid, 10)
        except NotFound:
            return
        if st.state is not FAILED:
            raise AssertionError(f"{rid}: {st.state.name} ({st.reason}) after its sender gave up, not FAILED")
        self.d.free(rid)

    def _begun(self, n: int):
        """A new request of ``n`` tokens on both sides, its transfer begun by the prefill
        Allocate: ``(rid, src, dst, lease)``."""
        rid = self._rid()
        dst, lease = self._retry(lambda: self.d.allocate_recv(rid, n))
        src = self._retry(lambda: self.p.allocate(rid, n, ticket=lease.ticket))
        return rid, src, dst, lease

    # -- the flows ------------------------------------------------------------------------------
    def short(self, n: int) -> None:
        rid, src, dst, lease = self._begun(n)
        sent = self._fill(src, dst, n)
        r = self.p.send(rid, lease.ticket, free=True)
        assert "free" in r.phases, r.phases
        self._ready(rid)
        self._landed(rid, src, dst, n, sent)
        self.d.free(rid)

    def old(self, n: int) -> None:
        rid = self._rid()
        dst = self._retry(lambda: self.d.allocate(rid, n, receive=True))
        lease = self.d.acquire_lease(rid, "recv")
        src = self._retry(lambda: self.p.allocate(rid, n))
        sent = self._fill(src, dst, n)
        self.p.begin_send(rid, lease.ticket)
        self.p.send(rid, lease.ticket)
        self._ready(rid)
        self._landed(rid, src, dst, n, sent)
        self.p.free(rid)
        self.d.free(rid)

    def chunked(self, n: int) -> None:
        rid = self._rid()
        chunk = max(1, n // 3)
        dst, lease = self._retry(lambda: self.d.allocate_recv(rid, n))
        src = self._retry(lambda: self.p.allocate(rid, n))
        sent = self._fill(src, dst, n)
        self.p.begin_send(rid, lease.ticket, chunk_tokens=chunk)
        for t0 in range(0, n, chunk):
            last = t0 + chunk >= n
            self.p.send(rid, lease.ticket, start=t0, end=None if last else t0 + chunk, last=last, free=last)
        self._ready(rid)
        self._landed(rid, src, dst, n, sent)
        self.d.free(rid)

    def many(self, n: int) -> None:
        items = [(self._rid(), self.rnd.choice(LENGTHS)) for _ in range(3)]
        recv = self._retry(lambda: self.d.allocate_recv_many(items))
        tickets = [lease.ticket for _, lease in recv]
        srcs = self._retry(lambda: self.p.allocate_many(items, tickets=tickets))
        sent = [self._fill(s, dst, m) for s, (dst, _), (_, m) in zip(srcs, recv, items)]
        out = self.p.send_many([(rid, t, 0, None, True, True) for (rid, _), t in zip(items, tickets)])
        for (rid, m), (dst, _), src, got, o in zip(items, recv, srcs, sent, out):
            if isinstance(o, BaseException):
                raise o
            self._ready(rid)
            self._landed(rid, src, dst, m, got)
            self.d.free(rid)

    def abort(self, n: int) -> None:
        rid, _, _, lease = self._begun(n)
        self.d.abort(rid, "the decode engine gave up")
        self.d.free(rid)
        try:
            self.p.send(rid, lease.ticket, free=True)
        except REFUSED:
            pass
        else:
            raise AssertionError(f"{rid}: a Send to a receiver that aborted succeeded")
        self.p.free(rid)

    def race(self, n: int) -> None:
        rid, src, dst, lease = self._begun(n)
        sent = self._fill(src, dst, n)
        late: list[BaseException] = []

        def give_up() -> None:
            time.sleep(self.rnd.random() * 0.002)
            try:
                self.d.abort(rid, "the decode engine gave up mid-Send")
            except BaseException as exc:  # noqa: BLE001 -- judged below
                late.append(exc)

        t = threading.Thread(target=give_up)
        t.start()
        try:
            self.p.send(rid, lease.ticket, free=True)
            sent_ok = True
        except REFUSED:
            sent_ok = False
            self.p.free(rid)
        t.join()
        if late and not isinstance(late[0], NotFound):
            raise late[0]
        st = self.d.wait_ready(rid, 10)
        # A Send that returned was committed: READY, whenever the abort came; a refused one never is.
        if st.state is not (READY if sent_ok else FAILED):
            raise AssertionError(f"{rid}: {st.state.name} ({st.reason}) after a Send that {'returned' if sent_ok else 'was refused'}")
        self.races[st.state.name] = self.races.get(st.state.name, 0) + 1
        if sent_ok:
            self._landed(rid, src, dst, n, sent)
        self.d.free(rid)

    def gone(self, n: int) -> None:
        rid, _, _, _ = self._begun(n)
        self.p.free(rid)
        self._ends_failed(rid)

    def closed(self, n: int) -> None:
        rid, _, _, _ = self._begun(n)
        self.p.close()  # the prefill engine exits: its session goes, and its request with it
        self.p = self._connect("prefill")
        self.pa = self.p.attach().tensor
        self._ends_failed(rid)

    def run(self) -> None:
        for _ in range(ROUNDS):
            flow, n = self.rnd.choice(FLOWS), self.rnd.choice(LENGTHS)
            self.flows[flow] = self.flows.get(flow, 0) + 1
            try:
                getattr(self, flow)(n)
            except InternalError as exc:
                self.errors.append(f"worker {self.k}, {flow} of {n}: a bug in kvd: {exc}")
            except (KvdError, AssertionError) as exc:
                self.errors.append(f"worker {self.k}, {flow} of {n}: {type(exc).__name__}: {exc}")
        self.p.close()
        self.d.close()


def test_many_engines_at_once_lose_nothing_and_leak_nothing(busy_pair):
    workers = [Worker(busy_pair, k) for k in range(WORKERS)]
    threads = [threading.Thread(target=w.run, name=f"stress-{w.k}") for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a worker is still running after 4 minutes: something wedged"
    errors = [e for w in workers for e in w.errors]
    flows: dict[str, int] = {}
    for w in workers:
        for f, c in w.flows.items():
            flows[f] = flows.get(f, 0) + c
    assert not errors, f"{len(errors)} flows went wrong (seed {SEED}, flows {flows}):\n  " + "\n  ".join(errors[:20])
    assert set(flows) == set(FLOWS), flows
    races = {k: sum(w.races.get(k, 0) for w in workers) for k in ("READY", "FAILED")}
    print(f"seed {SEED}: flows {flows}; races ended {races}; allocations that met a full pool and were made again: {sum(w.full for w in workers)}")

    probe = {s.role: s.connect("stress-probe") for s in busy_pair.sides}

    def settled() -> bool:
        for role, c in probe.items():
            st = c.stats()
            if st.pool.requests_live or st.leases_live or any(g.used_pages for g in st.pool.groups):
                return False
        return all(s.t.daemon is None or s.t.daemon.outbox is None or s.t.daemon.outbox.open_count() == 0 for s in busy_pair.sides)

    dk.wait_for(settled, 10, "both daemons back to nothing: no request, lease, page or open transfer")
    for s in busy_pair.sides:
        if s.node is not None:  # in-process: every invariant of the node too
            s.node.check()
    for c in probe.values():
        c.close()
