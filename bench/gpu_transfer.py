"""GPU transfer benchmark (issues 6 and 7): gemma-4-31b requests moved between two cuda daemons by
the ``local`` backend (or ``--backend mooncake``), on one GPU and from GPU 0 to GPU 1, against a
raw copy of the same bytes measured in the same run.

    python3 bench/gpu_transfer.py                      # devices 0,0 (same GPU)
    python3 bench/gpu_transfer.py --devices 0,1        # prefill on GPU 0, decode on GPU 1
    python3 bench/gpu_transfer.py --both --json out.json   # 0,0 then 0,1 (when two GPUs exist)
    python3 bench/gpu_transfer.py --backend mooncake --both   # the same over Mooncake's CUDA build

``--backend mooncake``: the daemons run ``--backend mooncake`` (Mooncake Transfer Engine, CUDA
build: RDMA where it finds HCAs, else TCP staged through host memory, ~1.6 GB/s on the H200
host, so the 32k request takes about a second per Send). Quick by default: 3 timed passes of the
32k request and no mixed workloads (``--mixed`` runs them: ~12 s per pass over TCP), no copy
breakdown (it times the local backend's copy). Rows name the backend; the raw baseline is the
same torch copy for both.

Per device pair ``A,B``: a prefill daemon (``kvd serve --arena cuda --cuda-device A --backend
local --layout gemma-4-31b-it-tp2``; ``--backend mooncake`` likewise) and a decode daemon (``--cuda-device B``) run as
subprocesses; this process is every prefill engine, through one Client per sender and daemon, and
the decode engines two ways (both measured, passes taking turns): in this process (threads, as
before) and apart (below). The
prefill daemon maps the decode arena's chunks for GPU A (peer access over NVLink for A != B) and
its Triton kernel writes the planned blocks through the mapping.

Workloads (prefill requests built by chunked prefill, ``--chunk`` tokens per step, so each keeps
its SWA pages near the window; decode requests allocated ``receive=True`` before each pass):

* ``32k``: one request of 32,768 tokens (full pages of every token + the SWA window tail:
  1.76 GB), sent ``--repeats`` times;
* ``32k, check in Send``: the same without BeginSend (every other workload's transfers are
  opened by BeginSend when their tickets are issued, as the prefill engine does: the Send then
  skips the CheckTicket round trip; here the Send runs it, overlapped with its lease and plan);
* ``32k in chunks of 8k``: the same request as a chunked prefill sends it, one Send per
  ``--chunk-send`` tokens one after another, opened by BeginSend with that chunk (so each
  chunk's plan is made ahead); server = the Sends' seconds summed, wall = first Send until the
  last reply and the WaitReady answer;
* ``mixed seq``: 32 requests, token counts log-uniform in [512, 32768] (seed ``--seed``), sent
  one after another;
* ``mixed x8``: the same 32 requests by 8 concurrent senders (threads, each with its own
  clients; request j belongs to sender j % 8);
* ``mixed batched``: the same 32 token counts as 4 SendMany calls of ``--batch`` (8) requests,
  in the workload's order, one after another (the daemon pipelines each call: one request's
  copies run while it commits the one before and prepares the one after). A call's requests
  must belong to its session, so these are 32 more prefill requests, all of sender 0, built
  with the others.

Measured: the Send replies' ``seconds`` (server side: ticket check, lease, plan, writes, commit)
and the client-observed wall time: the decode side is already waiting in WaitReady (as a decode
engine waits for its KV) when Send is issued, and wall runs until both the Send reply and the
WaitReady answer are back. Two walls: ``engines in one process`` -- the WaitReady is a thread of
this process, on the decode client of the checks (both replies arrive at about the same moment
and are decoded under this one interpreter's GIL, one after the other); ``decode engine apart``
-- as in a deployment, each sender's decode engine is a process of its own
(``benchkit.ApartWaiter``: its own session on the decode daemon, which allocates the decode
requests receive=True, waits and frees them), told over a pipe which requests to wait for (not
timed: it answers once its WaitReady threads are about to call, then gets the same head start),
and wall = from Send issued here until the Send reply here and the WaitReady answer there are
both in (its ``time.perf_counter()`` stamp: CLOCK_MONOTONIC, one clock for both processes); for ``mixed x8`` the wall time of the whole pass (which
also holds each Send's head start for its WaitReady: conservative). ``mixed
batched``: server = the SendMany replies' own ``seconds`` (the whole call in the daemon; its
items overlap in time, so their ``seconds`` do not add up), summed over the calls; wall = per
call, SendMany issued (the decode side already waiting in WaitReady for each of its requests)
until its reply and every WaitReady answer are back, summed over the calls. Baseline, in the same run: ``dst.copy_(src)`` of the same byte count -- inside GPU A for
A == B, ``dst_on_B.copy_(src_on_A)`` (torch's peer copy, copy engines) for A != B -- timed with
CUDA events, median of ``--raw-reps``; a workload's raw time is the sum over its requests.
Bytes are counted once (bytes moved, not read + written); ratio = kvd GB/s / raw GB/s.

Checked: the first pass of every workload (not timed) runs into a zeroed decode arena and every
planned block on the decode side must then equal the prefill side's random bytes; the byte and
block counts of every Send must match the plan this process computes (``plan_chunk``). Exit
status 1 when any check fails.

Where the time goes (per request, same blocks): the copy as the daemon does it (staged run
table + Triton launch + stream sync; this process maps the decode arena for GPU A the way the
daemon does and times the copy with the strategy the daemon picks, ``copy_strategy``: the Triton
kernel, or for few large blocks the copy engines, one cuMemcpyBatchAsync per write batch), its GPU time (CUDA
events), liveness (two zero-timeout polls of a watch of the decode handle socket per write batch;
a ping each where no watch opens), the two peer RPCs (CheckTicket and Commit, each about one Echo
round trip), and the rest (lease, plan, Python).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# NVLink multicast stays off (it can wedge a shared host's GPUs); nothing here uses it anyway.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from benchkit import ApartWaiter, BenchDaemon, cpu_set, log_uniform, med  # noqa: E402
from gpu import _table  # noqa: E402

from kvd.records import SEND_PHASES
from kvd.handoff.plan import plan_chunk
from kvd.handoff.ticket import read as read_ticket

GIB, MIB = 1 << 30, 1 << 20
LAYOUT = "gemma-4-31b-it-tp2"
BIG = 32768
MIXED_N, MIXED_LO, MIXED_HI = 32, 512, 32768
SENDERS = 8
#: How long the decode side's WaitReady is in flight before Send starts (not counted).
WAITER_HEAD_START_S = 0.003
#: Blocks per backend write, as the daemon's Outbox batches them (kvd.handoff.outbox.Outbox.batch_blocks).
BATCH = 256
#: Ways to send a workload's requests (Pair.send_pass).
SEQ, X8, BATCHED, CHUNKS = "seq", "x8", "batched", "chunks"


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- sizes --------------------------------------------------------------------------------------


def mixed_tokens(seed: int) -> list[int]:
    """32 token counts, log-uniform in [512, 32768], fixed by ``seed``."""
    return log_uniform(MIXED_N, MIXED_LO, MIXED_HI, seed)


def _geometry():
    from kvd.pool.layout import GroupKind
    from kvd.pool.presets import preset

    lay = preset(LAYOUT)
    swa = lay.group(GroupKind.SWA)
    return lay, lay.page_size, lay.page_bytes(lay.group(GroupKind.FULL)), lay.page_bytes(swa), swa.window


def held_bytes(tokens: int, *, chunk: int | None) -> int:
    """Arena bytes a request holds: every full page, SWA pages from the window of the length
    before its last step (prefill by chunks of ``chunk``) or of its whole length (received)."""
    _, ps, pbf, pbs, win = _geometry()
    n = -(-tokens // ps)
    base = tokens if chunk is None else tokens - (tokens - chunk * ((tokens - 1) // chunk))
    return n * pbf + (n - max(0, base - win) // ps) * pbs


def arena_bytes(need: int) -> int:
    """``need`` plus room for the sink and fragmentation between the groups, 2 MiB-aligned."""
    lay = _geometry()[0]
    n = int(need * 1.2) + lay.max_page_bytes + 2 * GIB
    return -(-n // (2 * MIB)) * (2 * MIB)


# ---- environment --------------------------------------------------------------------------------


def environment() -> dict:
    import triton

    n = torch.cuda.device_count()
    env: dict = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "gpus": [], "peer_access": {},
    }
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append({"index": i, "name": p.name, "sms": p.multi_processor_count, "GiB": round(p.total_memory / GIB, 1)})
    for a in range(n):
        for b in range(n):
            if a != b:
                env["peer_access"][f"{a}->{b}"] = bool(torch.cuda.can_device_access_peer(a, b))
    try:
        r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=15)
        env["topo"] = r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["topo"] = f"nvidia-smi topo -m failed: {exc}"
    try:
        import cuda.bindings

        env["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    return env


# ---- one device pair ----------------------------------------------------------------------------


@dataclass
class Req:
    rid: str
    tokens: int
    worker: int  # which sender's clients own it (on both daemons)
    nbytes: int = 0  # bytes the plan moves (set by the checked pass)
    blocks: int = 0
    plan_s: float = 0.0  # plan_chunk in the bench process (median), for comparison with the daemon's plan step


@dataclass
class Row:
    backend: str
    devices: str
    workload: str
    requests: int
    nbytes: int
    raw_s: float
    server_s: list[float] = field(default_factory=list)  # per pass: sum of Send.seconds
    wall_s: list[float] = field(default_factory=list)  # per pass: sum of Send-issued-to-ready times (x8: the pass)
    phases: list[dict[str, float]] = field(default_factory=list)  # per pass: the daemon's step times, summed
    # The same for the passes with the decode engines apart (ApartWaiter processes).
    server_apart_s: list[float] = field(default_factory=list)
    wall_apart_s: list[float] = field(default_factory=list)
    phases_apart: list[dict[str, float]] = field(default_factory=list)
    ok: bool = False
    why: str = ""
    first_pass_s: float = float("nan")
    concurrent: bool = False  # several senders at once: only the pass's wall time is a time
    batched: bool = False  # SendMany calls: server = the calls' seconds; per-item phases overlap in time
    plan_here_s: float = 0.0  # plan_chunk of the workload's requests in the bench process (sum of medians)

    def as_dict(self) -> dict:
        srv, wall, wall_apart = med(self.server_s), med(self.wall_s), med(self.wall_apart_s)
        return {
            "backend": self.backend, "devices": self.devices, "workload": self.workload, "requests": self.requests, "bytes": self.nbytes,
            "raw_ms": self.raw_s * 1e3, "raw_GBps": self.nbytes / self.raw_s / 1e9,
            "server_ms": srv * 1e3, "server_GBps": self.nbytes / srv / 1e9, "wall_ms": wall * 1e3,
            "wall_GBps": self.nbytes / wall / 1e9, "ratio_server": self.raw_s / srv, "ratio_wall": self.raw_s / wall,
            "server_ms_passes": [x * 1e3 for x in self.server_s], "wall_ms_passes": [x * 1e3 for x in self.wall_s],
            "first_pass_ms": self.first_pass_s * 1e3, "ok": self.ok, "why": self.why, "concurrent": self.concurrent,
            "batched": self.batched,
            # the daemon's own clock per step (SendResult.phases), median over the passes
            "plan_here_ms": self.plan_here_s * 1e3,
            "phases_ms": {k: med([p.get(k, 0.0) for p in self.phases]) * 1e3 for k in SEND_PHASES if any(k in p for p in self.phases)},
            # every other key the replies carried (the backend's parts of issue/write, the handler's share) and this
            # side's clock (client:reply, client:ready), summed per pass, median over the passes
            "detail_ms": _details(self.phases),
            # decode engines apart: wall and server of those passes, their steps and this side's / the waiter's clock
            "wall_apart_ms": wall_apart * 1e3, "wall_apart_GBps": self.nbytes / wall_apart / 1e9, "ratio_wall_apart": self.raw_s / wall_apart,
            "server_apart_ms": med(self.server_apart_s) * 1e3, "wall_apart_ms_passes": [x * 1e3 for x in self.wall_apart_s],
            "server_apart_ms_passes": [x * 1e3 for x in self.server_apart_s],
            "phases_apart_ms": {k: med([p.get(k, 0.0) for p in self.phases_apart]) * 1e3 for k in SEND_PHASES
                                if any(k in p for p in self.phases_apart)},
            "detail_apart_ms": _details(self.phases_apart),
        }


def _details(phases: list[dict[str, float]]) -> dict[str, float]:
    """Every key but the daemon's steps, median over the passes, ms."""
    return {k: med([p.get(k, 0.0) for p in phases]) * 1e3 for k in sorted({k for p in phases for k in p} - set(SEND_PHASES))}


class Pair:
    """Two daemons on GPUs ``a`` (prefill) and ``b`` (decode), the clients and the mappings."""

    def __init__(self, a: int, b: int, args: argparse.Namespace) -> None:
        self.a, self.b, self.args = a, b, args
        self.label = f"{a},{b}"
        self.backend = args.backend
        self.big = Req("big", BIG, 0)
        self.mixed = [Req(f"m{j}", t, j % SENDERS) for j, t in enumerate(mixed_tokens(args.seed))] if args.mixed else []
        # SendMany takes requests of the calling session only: the batched workload's own copies, all of sender 0.
        self.batched = [Req(f"b{j}", t, 0) for j, t in enumerate(mixed_tokens(args.seed))] if args.mixed and args.batched else []
        self.warm = [Req(f"warm{i}", t, 0) for i, t in enumerate((1000, 4096))]  # allocated whole (no chunks)
        p_need = sum(held_bytes(r.tokens, chunk=args.chunk) for r in [self.big, *self.mixed, *self.batched])
        p_need += sum(held_bytes(r.tokens, chunk=r.tokens) for r in self.warm)
        d_need = max(held_bytes(BIG, chunk=None), sum(held_bytes(r.tokens, chunk=None) for r in self.mixed))
        self.p_bytes, self.d_bytes = arena_bytes(p_need), arena_bytes(d_need)
        self.P = self.D = None
        self.pc: list = []
        self.dc: list = []
        self.waiters: list[ApartWaiter] = []  # decode engine w, apart: a process each
        self.p_att = self.d_att = None
        self.dmap_owner = self.dmap = None

    # -- life cycle ------------------------------------------------------------------------------

    def fits(self) -> None:
        """RuntimeError, saying what to pass, when the two arenas and the raw copy's buffers (the
        largest request's bytes, on each side) do not fit the GPUs' free memory: the arenas are
        sized for every workload at once (an H200's 139 GiB; an H100's 80 do not hold the mixed ones)."""
        top = max(held_bytes(r.tokens, chunk=None) for r in [self.big, *self.mixed])
        need = {self.a: self.p_bytes + top, self.b: 0}
        need[self.b] += self.d_bytes + top
        for dev, n in need.items():
            free, total = torch.cuda.mem_get_info(dev)
            if n > free:
                raise RuntimeError(
                    f"GPU {dev}: this run needs {n / GIB:.1f} GiB (arenas {self.p_bytes / GIB:.1f} + {self.d_bytes / GIB:.1f} GiB "
                    f"and the raw copy's buffers), {free / GIB:.1f} of its {total / GIB:.1f} GiB are free; pass --no-batched or --no-mixed "
                    "(the lone 32k request only), or run on a larger GPU")

    def start(self) -> None:
        self.fits()
        t0 = time.perf_counter()
        common = ["--arena", "cuda", "--backend", self.backend, "--layout", LAYOUT, "--peer-timeout-s", "30",
                  "--lease-ttl-s", "120", "--session-ttl-s", "60", "--grace-s", "1"]
        p_cpus, d_cpus = (cpu_set(x) for x in self.args.daemon_cpus.split(":")) if self.args.daemon_cpus else (None, None)
        self.P = BenchDaemon.spawn(*common, "--cuda-device", str(self.a), "--arena-bytes", str(self.p_bytes), cpus=p_cpus)
        self.D = BenchDaemon.spawn(*common, "--cuda-device", str(self.b), "--arena-bytes", str(self.d_bytes), cpus=d_cpus)
        self.P.wait_ready()
        self.D.wait_ready()
        from kvd.client import Client

        for i in range(SENDERS):
            self.pc.append(Client.connect(self.P.unix, name=f"prefill-{i}", timeout=300))
            self.dc.append(Client.connect(self.D.unix, name=f"decode-{i}", timeout=300))
        self.waiters = [ApartWaiter.spawn(self.D.unix, f"decode-apart-{i}") for i in range(SENDERS)]
        for w in self.waiters:
            w.wait_started()
        self.p_att, self.d_att = self.pc[0].attach(), self.dc[0].attach()
        if self.p_att.tensor.device != torch.device("cuda", self.a) or self.d_att.tensor.device != torch.device("cuda", self.b):
            raise RuntimeError(f"arenas attached on {self.p_att.tensor.device} / {self.d_att.tensor.device}, not cuda:{self.a} / cuda:{self.b}")
        self.p_env = self.pc[0].info().envelopes
        self.p_base = self.p_env[0].base
        self.d_base = self.dc[0].info().envelopes[0].base
        self.layout = self.pc[0].info().layout
        log(f"[{self.label}] {self.backend} daemons up in {time.perf_counter() - t0:.1f} s; arenas: prefill {self.p_bytes / GIB:.1f} GiB on "
            f"cuda:{self.a}, decode {self.d_bytes / GIB:.1f} GiB on cuda:{self.b}")

    def map_decode_for_a(self) -> None:
        """Map the decode arena for GPU A, as the prefill daemon's local backend does (for kernel
        timing; nothing to time for Mooncake, whose copy this process cannot replay)."""
        from kvd.ipc import fdpass
        from kvd.memory.cuda import can_access_peer
        from kvd.memory.vmm import import_arena

        if self.backend != "local" or (self.a != self.b and not can_access_peer(self.a, self.b)):
            return
        h = fdpass.fetch(self.D.unix.removeprefix("unix:") + ".handles", session=self.dc[0].session_id)
        try:
            self.dmap_owner, self.dmap = import_arena(h.header, h.fds, self.a)
        finally:
            for fd in h.fds:
                os.close(fd)

    def stop(self) -> None:
        self.dmap = None
        for what in (self.dmap_owner, self.p_att, self.d_att):
            if what is not None:
                try:
                    what.close()
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
        self.p_att = self.d_att = self.dmap_owner = None
        for w in self.waiters:
            w.close()
        for c in self.pc + self.dc:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        for d in (self.P, self.D):
            if d is not None:
                d.stop()
        gc.collect()
        torch.cuda.empty_cache()

    # -- requests ----------------------------------------------------------------------------------

    def build_prefill(self) -> None:
        """Chunked prefill of every request on the prefill daemon, then random bytes in the whole arena."""
        from kvd.errors import CapacityError

        t0 = time.perf_counter()
        chunk = self.args.chunk
        for r in [self.big, *self.mixed, *self.batched]:
            kv = self.pc[r.worker]
            done = min(chunk, r.tokens)
            try:
                kv.allocate(r.rid, done)
            except CapacityError:
                kv.compact()
                kv.allocate(r.rid, done)
            while done < r.tokens:
                add = min(chunk, r.tokens - done)
                try:
                    kv.extend(r.rid, add)
                except CapacityError:
                    kv.compact()
                    kv.extend(r.rid, add)
                done += add
        self.p_att.tensor.random_(0, 256)
        torch.cuda.synchronize(self.a)
        log(f"[{self.label}] prefill requests built ({1 + len(self.mixed) + len(self.batched)}, chunks of {chunk} tokens) and filled "
            f"in {time.perf_counter() - t0:.1f} s")

    def receive(self, reqs: list[Req], begin: bool = True, chunk: int = 0, apart: bool = False) -> dict[str, bytes]:
        """Allocate every request on the decode daemon (receive=True) and take its RECV lease
        (``apart``: by its sender's decode engine process); ``begin``: then the prefill side
        opens each transfer (BeginSend, with ``chunk`` as its chunk_tokens), as a prefill engine
        does when the ticket arrives, before the prompt is computed (not timed)."""
        from kvd.errors import CapacityError

        tickets = {}
        if apart:
            by: dict[int, list[tuple[str, int]]] = defaultdict(list)
            for r in reqs:
                by[r.worker].append((r.rid, r.tokens))
            for w, items in by.items():
                tickets.update(self.waiters[w].receive(items)[0])
        for r in [] if apart else reqs:
            kv = self.dc[r.worker]
            try:
                kv.allocate(r.rid, r.tokens, receive=True)
            except CapacityError:
                kv.compact()
                kv.allocate(r.rid, r.tokens, receive=True)
            tickets[r.rid] = kv.acquire_lease(r.rid, "recv").ticket
        if begin:
            for r in reqs:
                self.pc[r.worker].begin_send(r.rid, tickets[r.rid], chunk_tokens=chunk)
        return tickets

    def release(self, reqs: list[Req], apart: bool = False) -> None:
        by: dict[int, list[str]] = defaultdict(list)
        for r in reqs:
            by[r.worker].append(r.rid)
        for w, rids in by.items():
            if apart:
                self.waiters[w].free(rids)
            else:
                self.dc[w].free(*rids)

    def arm(self, w: int, rids: list[str], apart: bool) -> Callable[[], dict[str, tuple[object, float]]]:
        """Start sender ``w``'s decode side waiting in WaitReady for ``rids`` and give the calls
        WAITER_HEAD_START_S to reach the decode daemon (not timed); returns what collects the
        answers: per rid, its TransferStatus and the perf_counter() when it arrived. ``apart``:
        in that decode engine's own process (its stamps); else threads of this process on
        ``self.dc[w]``."""
        if apart:
            self.waiters[w].arm(rids)
            time.sleep(WAITER_HEAD_START_S)
            return self.waiters[w].collect
        got: dict[str, tuple[object, float]] = {}
        pc = time.perf_counter

        def wait(rid: str) -> None:
            st = self.dc[w].wait_ready(rid, 120)
            got[rid] = (st, pc())

        threads = [threading.Thread(target=wait, args=(rid,), name=f"wait-{rid}") for rid in rids]
        for t in threads:
            t.start()
        time.sleep(WAITER_HEAD_START_S)  # the WaitReady calls reach the decode daemon before Send starts

        def collect() -> dict[str, tuple[object, float]]:
            for t in threads:
                t.join()
            missing = [rid for rid in rids if rid not in got]
            if missing:
                raise RuntimeError(f"{missing}: WaitReady raised (see the thread's traceback)")
            return got

        return collect

    def send_one(self, r: Req, ticket: bytes, apart: bool = False) -> tuple[object, float]:
        """Send ``r`` while the decode side already waits in WaitReady (how a decode engine waits
        for its KV; ``apart``: in its own process); returns the Send reply and the wall time from
        issuing Send until both the Send reply and the decode's WaitReady answer arrived."""
        from kvd.client import TransferState

        pc = time.perf_counter
        collect = self.arm(r.worker, [r.rid], apart)
        a = pc()
        res = self.pc[r.worker].send(r.rid, ticket)
        replied = pc()
        st, ready = collect()[r.rid]
        # In one process: until this thread has both (as before); apart: the later of the two stamps.
        wall = (max(replied, ready) if apart else pc()) - a
        # This side's clock: the Send's reply and the WaitReady answer, from the Send issued.
        res.phases["client:reply"], res.phases["client:ready"] = replied - a, ready - a
        if st.state is not TransferState.READY:
            raise RuntimeError(f"{r.rid}: transfer ended {st.state.value}: {st.reason}")
        if r.nbytes and (res.nbytes != r.nbytes or st.nbytes != r.nbytes):
            raise RuntimeError(f"{r.rid}: Send moved {res.nbytes:,d} bytes, WaitReady saw {st.nbytes:,d}, the plan has {r.nbytes:,d}")
        return res, wall

    def send_chunks(self, r: Req, ticket: bytes, apart: bool = False) -> tuple[object, float]:
        """:meth:`send_one` as a chunked prefill sends: one Send per ``--chunk-send`` tokens, one
        after another (the last with ``last``); returns the Sends summed as one result (bytes,
        blocks, seconds, phases) and the wall time from the first Send until the last reply and
        the decode's WaitReady answer arrived."""
        from kvd.client import SendResult, TransferState

        step = self.args.chunk_send
        pc = time.perf_counter
        collect = self.arm(r.worker, [r.rid], apart)
        a = pc()
        parts = [self.pc[r.worker].send(r.rid, ticket, start=t0, end=min(r.tokens, t0 + step), last=t0 + step >= r.tokens)
                 for t0 in range(0, r.tokens, step)]
        replied = pc()
        st, ready = collect()[r.rid]
        wall = (max(replied, ready) if apart else pc()) - a
        if st.state is not TransferState.READY:
            raise RuntimeError(f"{r.rid}: chunked transfer did not end READY: {st}")
        phases: dict[str, float] = {"client:reply": replied - a, "client:ready": ready - a}
        for x in parts:
            for k, v in x.phases.items():
                phases[k] = phases.get(k, 0.0) + v
        res = SendResult(sum(x.nbytes for x in parts), sum(x.blocks for x in parts), sum(x.seconds for x in parts), {}, phases)
        if r.nbytes and (res.nbytes != r.nbytes or st.nbytes != r.nbytes):
            raise RuntimeError(f"{r.rid}: chunked Sends moved {res.nbytes:,d} bytes, WaitReady saw {st.nbytes:,d}, the plan has {r.nbytes:,d}")
        return res, wall

    def send_batch(self, reqs: list[Req], tickets: dict[str, bytes], apart: bool = False) -> tuple[dict[str, tuple[object, float]], float, float]:
        """One SendMany of ``reqs`` (all of one sender) while the decode side already waits in
        WaitReady for each; returns per request (its result, the call's wall), the call's own
        seconds in the daemon, and the wall from issuing SendMany until its reply and every
        WaitReady answer arrived."""
        from kvd.client import SendResult, TransferState

        w = reqs[0].worker
        if any(r.worker != w for r in reqs):
            raise RuntimeError("a SendMany call takes requests of its own session only")
        pc = time.perf_counter
        collect = self.arm(w, [r.rid for r in reqs], apart)
        a = pc()
        out = self.pc[w].send_many([(r.rid, tickets[r.rid]) for r in reqs])
        replied = pc()
        answers = collect()
        wall = (max(replied, *(at for _, at in answers.values())) if apart else pc()) - a
        for r, res in zip(reqs, out):
            if not isinstance(res, SendResult):
                raise RuntimeError(f"{r.rid}: SendMany item failed: {type(res).__name__}: {res}")
            st = answers[r.rid][0]
            if st.state is not TransferState.READY:
                raise RuntimeError(f"{r.rid}: transfer ended {st.state.value}: {st.reason}")
            if r.nbytes and (res.nbytes != r.nbytes or st.nbytes != r.nbytes):
                raise RuntimeError(f"{r.rid}: Send moved {res.nbytes:,d} bytes, WaitReady saw {st.nbytes:,d}, the plan has {r.nbytes:,d}")
        return {r.rid: (res, wall) for r, res in zip(reqs, out)}, out.seconds, wall

    def send_pass(self, reqs: list[Req], tickets: dict[str, bytes], how: str,
                  apart: bool = False) -> tuple[dict[str, tuple[object, float]], float, float]:
        """Send every request once, ``how``: SEQ (one Send after another), X8 (the senders at
        once), BATCHED (SendMany calls of ``--batch`` requests, one after another); ``apart``:
        the decode side waits in the decode engines' own processes (``tickets`` from theirs).
        Returns per request (Send result, wall), the pass's wall (SEQ, BATCHED: the sum of the
        calls' walls; X8: its span) and server seconds (the sum of Send.seconds; BATCHED: of the
        calls' seconds)."""
        if how == X8:
            res = self.concurrent(reqs, tickets, apart)
            return res, self.span, sum(x.seconds for x, _ in res.values())
        if how == CHUNKS:
            res = {r.rid: self.send_chunks(r, tickets[r.rid], apart) for r in reqs}
            return res, sum(w for _, w in res.values()), sum(x.seconds for x, _ in res.values())
        if how == BATCHED:
            res, wall, server = {}, 0.0, 0.0
            k = self.args.batch
            for i in range(0, len(reqs), k):
                part, s, w = self.send_batch(reqs[i : i + k], tickets, apart)
                res.update(part)
                server += s
                wall += w
            return res, wall, server
        res = {r.rid: self.send_one(r, tickets[r.rid], apart) for r in reqs}
        return res, sum(w for _, w in res.values()), sum(x.seconds for x, _ in res.values())

    # -- the checked pass --------------------------------------------------------------------------

    def plan(self, r: Req, ticket: bytes):
        t = read_ticket(ticket)
        src = self.pc[r.worker].vectors(r.rid)
        return plan_chunk(self.layout, src, t.vectors, self.p_env, t.envelopes, 0, r.tokens, True)

    def verify(self, plan) -> str:
        """"" when every planned block landed; else what differs."""
        p, d = self.p_att.tensor, self.d_att.tensor
        for k, blk in enumerate(plan.blocks):
            s = p[blk.src - self.p_base : blk.src - self.p_base + blk.length]
            t = d[blk.dst - self.d_base : blk.dst - self.d_base + blk.length]
            if not torch.equal(s.to(t.device), t):
                return f"block {k} ({blk.length:,d} bytes at decode offset {blk.dst - self.d_base:,d}) differs"
        return ""

    def checked_pass(self, reqs: list[Req], breakdown: list[dict] | None, how: str, begin: bool = True) -> tuple[str, float]:
        """The first pass of a workload: decode arena zeroed, sent (opened by BeginSend unless
        ``begin`` is False), every block compared. Also times the copy of each request's blocks
        in this process (for ``breakdown``)."""
        self.d_att.tensor.zero_()
        torch.cuda.synchronize(self.b)
        tickets = self.receive(reqs, begin, chunk=self.args.chunk_send if how == CHUNKS else 0)
        plans = {r.rid: self.plan(r, tickets[r.rid]) for r in reqs}
        # The planner in this process, no daemon around it: how fast this host runs it.
        for r in reqs:
            t = read_ticket(tickets[r.rid])
            src = self.pc[r.worker].vectors(r.rid)
            xs = []
            for _ in range(7):
                a = time.perf_counter()
                plan_chunk(self.layout, src, t.vectors, self.p_env, t.envelopes, 0, r.tokens, True)
                xs.append(time.perf_counter() - a)
            r.plan_s = med(xs[2:])
        t0 = time.perf_counter()
        results, _, _ = self.send_pass(reqs, tickets, how)
        first = time.perf_counter() - t0
        why = ""
        for r in reqs:
            res, _ = results[r.rid]
            pl = plans[r.rid]
            # Chunks cut runs at their edges: the same bytes, in as many blocks or more.
            if res.nbytes != pl.nbytes or (res.blocks < len(pl.blocks) if how == CHUNKS else res.blocks != len(pl.blocks)):
                why = why or f"{r.rid}: Send moved {res.nbytes:,d} bytes in {res.blocks} blocks, the plan {pl.nbytes:,d} in {len(pl.blocks)}"
            r.nbytes, r.blocks = pl.nbytes, len(pl.blocks)
        torch.cuda.synchronize(self.b)
        for r in reqs:
            why = why or self.verify(plans[r.rid])
        if breakdown is not None and self.dmap is not None:
            for r in reqs:
                breakdown.append({"rid": r.rid, "tokens": r.tokens, "bytes": r.nbytes, "blocks": r.blocks,
                                  "send_ms_checked": results[r.rid][0].seconds * 1e3, **self.time_copy(plans[r.rid])})
        self.release(reqs)
        return why, first

    def time_copy(self, plan, reps: int = 5) -> dict:
        """The daemon's copy of ``plan``'s blocks in its batches (the strategy it picks per batch),
        GPU A -> the decode arena mapped for GPU A: wall time with the stream sync (what the
        daemon's write pays) and GPU time."""
        from kvd.copy.blocks import COPY_ENGINE, batch_usable, copy_blocks, copy_engine_blocks, copy_strategy

        s = [b.src - self.p_base for b in plan.blocks]
        d = [b.dst - self.d_base for b in plan.blocks]
        n = [b.length for b in plan.blocks]
        stream = torch.cuda.Stream(self.a)  # as the daemon's backend: its own stream (batched memcpys refuse the default)
        home = None if self.a == self.b else self.b
        strategies = [copy_strategy(home, n[i : i + BATCH], batch=batch_usable()) for i in range(0, len(n), BATCH)]

        def once() -> None:
            with torch.cuda.stream(stream):
                for k, i in enumerate(range(0, len(n), BATCH)):
                    j = i + BATCH
                    if strategies[k] == COPY_ENGINE:
                        copy_engine_blocks(self.p_att.tensor, self.dmap, s[i:j], d[i:j], n[i:j], home)
                    else:
                        copy_blocks(self.p_att.tensor, self.dmap, s[i:j], d[i:j], n[i:j])

        once()
        stream.synchronize()
        walls, gpu = [], []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record(stream)
            once()
            e1.record(stream)
            stream.synchronize()
            walls.append(time.perf_counter() - t0)
            gpu.append(e0.elapsed_time(e1) / 1e3)
        # The same byte count as ONE copy between the same two arenas (the prefill arena and the
        # decode arena as the daemon maps it): what the arenas' memory allows, blocks aside.
        total = sum(n)
        one = []
        if total <= min(self.p_att.tensor.numel(), self.dmap.numel()):
            for _ in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                with torch.cuda.stream(stream):
                    self.dmap[:total].copy_(self.p_att.tensor[:total], non_blocking=True)
                e1.record(stream)
                e1.synchronize()
                one.append(e0.elapsed_time(e1) / 1e3)
        return {"copy_ms": med(walls) * 1e3, "kernel_ms": med(gpu) * 1e3, "one_copy_arenas_ms": med(one) * 1e3,
                "batches": -(-len(n) // BATCH), "strategies": sorted(set(strategies))}

    # -- timed passes ------------------------------------------------------------------------------

    def concurrent(self, reqs: list[Req], tickets: dict[str, bytes], apart: bool = False) -> dict[str, tuple[object, float]]:
        """Every sender sends its requests in order, all senders at once; returns per-request
        (Send reply, Send issued until ready seconds) and stores the pass's span in ``self.span``."""
        mine: dict[int, list[Req]] = defaultdict(list)
        for r in reqs:
            mine[r.worker].append(r)
        out: dict[str, tuple[object, float]] = {}
        spans: list[tuple[float, float]] = []
        errors: list[BaseException] = []
        go = threading.Barrier(len(mine))
        lock = threading.Lock()

        def run(w: int) -> None:
            try:
                go.wait()
                a = time.perf_counter()
                for r in mine[w]:
                    res = self.send_one(r, tickets[r.rid], apart)
                    with lock:
                        out[r.rid] = res
                with lock:
                    spans.append((a, time.perf_counter()))
            except BaseException as exc:  # noqa: BLE001 -- re-raised below
                errors.append(exc)
                go.abort()

        threads = [threading.Thread(target=run, args=(w,), name=f"sender-{w}") for w in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.span = max(b for _, b in spans) - min(a for a, _ in spans)
        return out

    def timed_passes(self, row: Row, reqs: list[Req], passes: int, how: str, begin: bool = True) -> None:
        """``passes`` passes with the decode engines in this process and as many with them apart,
        taking turns (drift on the host hits both alike)."""
        for _ in range(passes):
            for apart in (False, True):
                tickets = self.receive(reqs, begin, chunk=self.args.chunk_send if how == CHUNKS else 0, apart=apart)
                gc.disable()
                try:
                    res, wall, server = self.send_pass(reqs, tickets, how, apart)
                finally:
                    gc.enable()
                (row.wall_apart_s if apart else row.wall_s).append(wall)
                (row.server_apart_s if apart else row.server_s).append(server)
                steps: dict[str, float] = {}
                for x, _ in res.values():
                    for k, v in x.phases.items():
                        steps[k] = steps.get(k, 0.0) + v
                (row.phases_apart if apart else row.phases).append(steps)
                self.release(reqs, apart)

    # -- baselines ---------------------------------------------------------------------------------

    def raw_copy_s(self, sizes: list[int], reps: int) -> dict[int, float]:
        """Median seconds of ``dst[:n].copy_(src[:n])`` per distinct ``n``: inside GPU A, or
        GPU A -> GPU B (torch issues a peer copy on A's current stream)."""
        top = max(sizes)
        src = torch.empty(top, dtype=torch.uint8, device=f"cuda:{self.a}")
        dst = torch.empty(top, dtype=torch.uint8, device=f"cuda:{self.b}")
        stream = torch.cuda.current_stream(self.a)
        out = {}
        try:
            for n in sorted(set(sizes)):
                xs = []
                for k in range(reps + 2):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.device(self.a):
                        e0.record(stream)
                        dst[:n].copy_(src[:n])
                        e1.record(stream)
                    e1.synchronize()
                    if k >= 2:
                        xs.append(e0.elapsed_time(e1) / 1e3)
                out[n] = med(xs)
        finally:
            del src, dst
            torch.cuda.synchronize(self.a)
            torch.cuda.synchronize(self.b)
            torch.cuda.empty_cache()
        return out

    def control_floor(self, n: int = 40) -> dict:
        """One liveness ping of the decode handle socket, one liveness poll of a watch of it (what
        the daemon's write checks when the watch opens), one Echo RPC to the decode daemon (the
        floor of CheckTicket and Commit), medians."""
        from kvd.ipc.fdpass import ping, watch

        path = self.D.unix.removeprefix("unix:") + ".handles"
        pings, echoes, polls = [], [], []
        try:
            w = watch(path, timeout=5)
        except Exception as exc:  # noqa: BLE001 -- the daemon falls back to pings too
            log(f"[{self.label}] no watch of {path}: {exc}; liveness = pings")
            w = None
        for k in range(n + 5):
            a = time.perf_counter()
            ping(path, timeout=5)
            b = time.perf_counter()
            self.dc[0].echo()
            c = time.perf_counter()
            quiet = w.quiet() if w is not None else False
            e = time.perf_counter()
            if k >= 5:
                pings.append(b - a)
                echoes.append(c - b)
                polls.append(e - c)
        watched = w is not None and w.quiet()
        if w is not None:
            w.close()
        return {"ping_ms": med(pings) * 1e3, "echo_ms": med(echoes) * 1e3, "poll_ms": med(polls) * 1e3,
                "watched": bool(watched and quiet)}


def run_pair(a: int, b: int, args: argparse.Namespace) -> dict:
    pair = Pair(a, b, args)
    out: dict = {"devices": [a, b], "rows": [], "breakdown": {}, "error": ""}
    t0 = time.perf_counter()
    try:
        pair.start()
        pair.build_prefill()
        pair.map_decode_for_a()
        floor = pair.control_floor()
        out["control"] = floor
        log(f"[{pair.label}] liveness ping {floor['ping_ms']:.3f} ms, watch poll {floor['poll_ms']:.4f} ms "
            f"({'watched' if floor['watched'] else 'no watch: pings'}), Echo RPC {floor['echo_ms']:.3f} ms")

        # Warm-up (Triton JIT in the prefill daemon, first mapping of the decode arena): two small requests.
        warm = pair.warm
        for r in warm:
            pair.pc[0].allocate(r.rid, r.tokens)
        t1 = time.perf_counter()
        for apart in (False, True, False, True):
            tickets = pair.receive(warm, apart=apart)
            for r in warm:
                pair.send_one(r, tickets[r.rid], apart)
            pair.release(warm, apart)
        pair.pc[0].free(*(r.rid for r in warm))
        log(f"[{pair.label}] warm-up sends took {time.perf_counter() - t1:.1f} s (first use: Triton JIT or Mooncake's handshake)")

        # The baseline needs the byte counts: a checked pass of each workload first.
        bd_big: list[dict] = []
        bd_mixed: list[dict] = []
        why_big, first_big = pair.checked_pass([pair.big], bd_big, SEQ)
        if pair.mixed:
            why_seq, first_seq = pair.checked_pass(pair.mixed, bd_mixed, SEQ)
            why_conc, first_conc = pair.checked_pass(pair.mixed, None, X8)
            why_bat, first_bat = pair.checked_pass(pair.batched, None, BATCHED) if pair.batched else ("", 0.0)
            log(f"[{pair.label}] checked passes: 32k {'ok' if not why_big else why_big}; mixed seq "
                f"{'ok' if not why_seq else why_seq}; mixed x8 {'ok' if not why_conc else why_conc}; mixed batched "
                f"{'skipped (--no-batched)' if not pair.batched else 'ok' if not why_bat else why_bat}")
        else:
            log(f"[{pair.label}] checked pass: 32k {'ok' if not why_big else why_big}; mixed workloads skipped")

        sizes = [pair.big.nbytes] + [r.nbytes for r in pair.mixed + pair.batched]
        raw = pair.raw_copy_s(sizes, args.raw_reps)
        raw_mixed = sum(raw[r.nbytes] for r in pair.mixed)
        mixed_bytes = sum(r.nbytes for r in pair.mixed)

        rows = [Row(pair.backend, pair.label, "32k", 1, pair.big.nbytes, raw[pair.big.nbytes], ok=not why_big, why=why_big,
                    first_pass_s=first_big, plan_here_s=pair.big.plan_s)]
        pair.timed_passes(rows[0], [pair.big], args.repeats, SEQ)
        # The same request with the ticket checked inside the Send (no BeginSend first).
        why_check, first_check = pair.checked_pass([pair.big], None, SEQ, begin=False)
        rows.append(Row(pair.backend, pair.label, "32k, check in Send", 1, pair.big.nbytes, raw[pair.big.nbytes], ok=not why_check,
                        why=why_check, first_pass_s=first_check, plan_here_s=pair.big.plan_s))
        pair.timed_passes(rows[1], [pair.big], args.repeats, SEQ, begin=False)
        if args.chunk_send:
            # As a chunked prefill sends it: a Send per chunk, each planned by BeginSend.
            why_chunks, first_chunks = pair.checked_pass([pair.big], None, CHUNKS)
            log(f"[{pair.label}] checked pass: 32k in chunks of {args.chunk_send:,d} {'ok' if not why_chunks else why_chunks}")
            rows.append(Row(pair.backend, pair.label, f"32k in chunks of {args.chunk_send // 1024}k", 1, pair.big.nbytes,
                            raw[pair.big.nbytes], ok=not why_chunks, why=why_chunks, first_pass_s=first_chunks,
                            plan_here_s=pair.big.plan_s))
            pair.timed_passes(rows[-1], [pair.big], args.repeats, CHUNKS)
        if pair.mixed:
            plan_mixed = sum(r.plan_s for r in pair.mixed)
            rows += [
                Row(pair.backend, pair.label, "mixed seq", len(pair.mixed), mixed_bytes, raw_mixed, ok=not why_seq, why=why_seq,
                    first_pass_s=first_seq, plan_here_s=plan_mixed),
                Row(pair.backend, pair.label, f"mixed x{SENDERS}", len(pair.mixed), mixed_bytes, raw_mixed, ok=not why_conc,
                    why=why_conc, first_pass_s=first_conc, concurrent=True, plan_here_s=plan_mixed),
            ]
            pair.timed_passes(rows[-2], pair.mixed, args.mixed_passes, SEQ)
            pair.timed_passes(rows[-1], pair.mixed, args.mixed_passes, X8)
            if pair.batched:
                rows.append(Row(pair.backend, pair.label, "mixed batched", len(pair.batched), sum(r.nbytes for r in pair.batched),
                                sum(raw[r.nbytes] for r in pair.batched), ok=not why_bat, why=why_bat, first_pass_s=first_bat,
                                batched=True, plan_here_s=sum(r.plan_s for r in pair.batched)))
                pair.timed_passes(rows[-1], pair.batched, args.mixed_passes, BATCHED)
        out["rows"] = [r.as_dict() for r in rows]

        # Where the time goes, per request: medians of the timed 32k passes; mixed: per-request
        # sums over the 32 requests (Send.seconds from the median sequential pass).
        def breakdown(bd: list[dict], row: Row) -> dict:
            if not bd:
                return {}
            batches = sum(x["batches"] for x in bd)
            copy = sum(x["copy_ms"] for x in bd)
            kern = sum(x["kernel_ms"] for x in bd)
            one = sum(x["one_copy_arenas_ms"] for x in bd)
            # Liveness: two checks per write batch, polls of the watch (pings where none opened).
            liveness = 2 * batches * (floor["poll_ms"] if floor["watched"] else floor["ping_ms"])
            rpcs = 2 * len(bd) * floor["echo_ms"]
            send = med(row.server_s) * 1e3
            strategy = "+".join(sorted({st for x in bd for st in x["strategies"]}))
            return {"requests": len(bd), "send_ms": send, "copy_ms": copy, "kernel_ms": kern, "one_copy_arenas_ms": one,
                    "liveness_ms": liveness,
                    "strategy": strategy,
                    "peer_rpcs_ms": rpcs, "rest_ms": send - copy - liveness - rpcs, "client_extra_ms": med(row.wall_s) * 1e3 - send,
                    "client_extra_apart_ms": (med(row.wall_apart_s) - med(row.server_apart_s)) * 1e3,
                    "kernel_GBps": sum(x["bytes"] for x in bd) / kern / 1e6, "per_request": bd}

        out["breakdown"] = {"32k": breakdown(bd_big, rows[0])}
        if pair.mixed:
            seq_row = next(r for r in rows if r.workload == "mixed seq")
            out["breakdown"]["mixed seq"] = breakdown(bd_mixed, seq_row)
        if pair.backend != "local":
            out["breakdown_note"] = f"{pair.backend} backend: no copy breakdown (it times the local backend's copy)"
        elif pair.dmap is None:
            out["breakdown_note"] = f"cuda:{a} has no peer access to cuda:{b}: no kernel timing"
    except Exception as exc:  # noqa: BLE001 -- report, stop the daemons, go on
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"
        for d, name in ((pair.P, "prefill"), (pair.D, "decode")):
            if d is not None and d.proc.poll() is not None:
                out["error"] += f"; {name} daemon exited with {d.proc.returncode}"
    finally:
        pair.stop()
    out["seconds"] = time.perf_counter() - t0
    log(f"[{pair.label}] done in {out['seconds']:.1f} s")
    return out


# ---- report -------------------------------------------------------------------------------------


def _num(x: float) -> str:
    """GB/s and ratios: whole numbers from 100 up, else three significant digits (Mooncake over
    TCP moves ~1.6 GB/s, a ratio of ~0.004 against NVLink)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def report(env: dict, pairs: list[dict]) -> None:
    backends = ", ".join(sorted({r["backend"] for p in pairs for r in p["rows"]})) or "-"
    log(f"\n## GPU transfer: kvd ({backends} backend) vs a raw copy of the same bytes (bytes counted once: moved, not "
        "read + written; ratio = kvd GB/s / raw GB/s; raw = dst.copy_(src) inside one GPU, or dst_on_B.copy_(src_on_A) "
        "across GPUs; server = Send.seconds, wall = client: Send issued until its reply and the decode side's already waiting WaitReady both returned "
        "(engines in one process: the WaitReady a thread of the sender's process, both replies decoded under its GIL; decode engine apart: "
        "the WaitReady in a process of its own, its answer's arrival stamped there), x8 = the pass's span; "
        "batched = SendMany calls of --batch requests: server = the calls' own seconds, wall = per call until its reply and all its "
        "WaitReady answers returned, summed)\n")
    rows = [r for p in pairs for r in p["rows"]]
    log(_table(
        ["backend", "GPUs P,D", "workload", "reqs", "GB", "raw ms", "raw GB/s", "kvd server ms", "GB/s", "ratio",
         "wall (engines in one process) ms", "GB/s", "ratio", "wall (decode engine apart) ms", "GB/s", "ratio", "ok"],
        [[r["backend"], r["devices"], r["workload"], r["requests"], f"{r['bytes'] / 1e9:.2f}", f"{r['raw_ms']:.2f}", f"{r['raw_GBps']:,.0f}",
          "-" if r["concurrent"] else f"{r['server_ms']:.2f}",
          "-" if r["concurrent"] else _num(r["server_GBps"]),
          "-" if r["concurrent"] else _num(r["ratio_server"]),
          f"{r['wall_ms']:.2f}", _num(r["wall_GBps"]), _num(r["ratio_wall"]),
          f"{r['wall_apart_ms']:.2f}", _num(r["wall_apart_GBps"]), _num(r["ratio_wall_apart"]), "ok" if r["ok"] else "NO"] for r in rows],
    ))
    bd_rows = []
    for p in pairs:
        for name, b in p.get("breakdown", {}).items():
            if b:
                bd_rows.append([f"{p['devices'][0]},{p['devices'][1]}", name, b["requests"], b["strategy"], f"{b['send_ms']:.2f}", f"{b['copy_ms']:.2f}",
                                f"{b['kernel_ms']:.2f}", f"{b['one_copy_arenas_ms']:.2f}", f"{b['kernel_GBps']:,.0f}", f"{b['liveness_ms']:.2f}",
                                f"{b['peer_rpcs_ms']:.2f}", f"{b['rest_ms']:.2f}", f"{b['client_extra_ms']:.2f}", f"{b['client_extra_apart_ms']:.2f}"])
    if bd_rows:  # the local backend's copy only (Mooncake's cannot be replayed here)
        log("\n## Where the kvd time goes (server side, per workload pass; copy = copy_blocks of the same blocks timed in "
            "this process on the decode arena mapped for the prefill GPU, with the stream sync, as the daemon's write; "
            "liveness = 2 checks per write batch (watch polls, or pings where no watch opened); strategy = the daemon's copy "
            "(kernel: Triton move_pages; copy-engine: the blocks as one cuMemcpyBatchAsync per write batch); one copy = the same byte "
            "count as one copy between the same two arenas, GPU time; peer RPCs = CheckTicket + Commit ~ 2 Echo RPCs; "
            "rest = Send.seconds minus those: lease, plan, Python; client extra = wall - Send.seconds: the Send and WaitReady RPCs, "
            "engines in one process; apart = the same of the passes with the decode engine apart)\n")
        log(_table(["GPUs P,D", "workload", "reqs", "copy strategy", "Send.seconds ms", "copy ms", "copy GPU ms", "one copy GPU ms", "copy GB/s", "liveness ms",
                    "peer RPCs ms", "rest ms", "client extra ms", "client extra apart ms"], bd_rows))
    log("\n## The daemon's own clock: each Send's steps (SendResult.phases), summed per pass, median over passes, ms "
        "(lease = SEND lease; plan = blocks planned; check = CheckTicket round trip; write = copies + liveness; "
        "commit = Commit round trip; x8 rows overlap in time; batched rows too: a request's write runs from its copies issued "
        "until they landed, while the daemon commits the request before and prepares the one after)\n")
    ph_rows = [[r["backend"], r["devices"], r["workload"], r["requests"], *(f"{r['phases_ms'].get(k, 0.0):.2f}" for k in SEND_PHASES),
                "-" if r["concurrent"] else f"{r['server_ms']:.2f}", f"{r['plan_here_ms']:.2f}"] for r in rows if r.get("phases_ms")]
    log(_table(["backend", "GPUs P,D", "workload", "reqs", *SEND_PHASES, "Send.seconds ms", "plan in this process ms"], ph_rows))
    wall_rows = [_wall_row(r, apart) for r in rows for apart in (False, True)
                 if r.get("detail_apart_ms" if apart else "detail_ms", {}).get("client:reply") and not r["concurrent"]]
    if wall_rows:
        log("\n## Where the wall goes, per request (ms; Sends one after another; each pass summed, median over passes, / requests): "
            "fixed = Send.seconds - write (everything but the wait for the copies); issue:* / write:* = the backend's parts of "
            "those steps (peer = mapping + liveness, prep = strategy + offsets, copy = the copy call, event = the CUDA event; "
            "wait = the event's wait, after = the liveness check after); handler = the Send handler outside Send.seconds "
            "(ticket = the ticket read); wire = Send reply on this side - handler (the engine socket both ways); ready lag = the "
            "WaitReady answer - the Send reply (negative: it came first); decode = where the decode engine waited: one process "
            "(a thread of the sender's) or apart (its own process, its stamp of the answer)\n")
        log(_table(["GPUs P,D", "workload", "decode", "reqs", "wall", "Send.seconds", "write", "fixed", "prep", "lease", "plan", "issue",
                    "issue:peer", "issue:prep", "issue:copy", "issue:event", "write:wait", "write:after", "commit", "release",
                    "handler", "ticket", "wire", "ready lag"], wall_rows))
    for p in pairs:
        if p.get("control"):
            c = p["control"]
            log(f"\n[{p['devices'][0]},{p['devices'][1]}] one liveness ping {c['ping_ms']:.3f} ms, one watch poll "
                f"{c.get('poll_ms', 0.0):.4f} ms ({'watched' if c.get('watched') else 'no watch'}), one Echo RPC {c['echo_ms']:.3f} ms; "
                f"pair took {p['seconds']:.1f} s" + (f"; {p['breakdown_note']}" if p.get("breakdown_note") else ""))
        if p.get("error"):
            log(f"[{p['devices'][0]},{p['devices'][1]}] FAILED: {p['error']}")
        for r in p["rows"]:
            if not r["ok"]:
                log(f"[{r['devices']}] {r['workload']}: check failed: {r['why']}")


def _wall_row(r: dict, apart: bool) -> list[str]:
    """A row of the per-request wall table: ``r``'s steps and details over its requests, of the
    passes with the decode engine apart or in one process."""
    sfx = "_apart" if apart else ""
    n, ph, dt = r["requests"], r[f"phases{sfx}_ms"], r[f"detail{sfx}_ms"]
    srv = sum(ph.values())
    call = dt.get("call", 0.0)

    def f(x: float) -> str:
        return f"{x / n:.3f}"

    return [r["devices"], r["workload"], "apart" if apart else "one process", str(n), f(r[f"wall{sfx}_ms"]), f(srv), f(ph.get("write", 0.0)), f(srv - ph.get("write", 0.0)),
            *(f(ph.get(k, 0.0)) for k in ("prep", "lease", "plan", "issue")),
            *(f(dt.get(k, 0.0)) for k in ("issue:peer", "issue:prep", "issue:copy", "issue:event", "write:wait", "write:after")),
            f(ph.get("commit", 0.0)), f(ph.get("release", 0.0)), f(call - srv), f(dt.get("ticket", 0.0)),
            f(dt["client:reply"] - call), f(dt.get("client:ready", 0.0) - dt["client:reply"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="0,0", help="prefill GPU,decode GPU (default 0,0)")
    ap.add_argument("--both", action="store_true", help="run 0,0 and then 0,1 (0,1 only when two GPUs exist)")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--backend", choices=("local", "mooncake"), default="local",
                    help="the daemons' data plane (default local; mooncake needs Mooncake's CUDA build)")
    ap.add_argument("--repeats", type=int, help="timed passes of the 32k request (default 8; 3 with --backend mooncake)")
    ap.add_argument("--mixed", action=argparse.BooleanOptionalAction,
                    help="run the mixed workloads too (default: yes for local, no for mooncake)")
    ap.add_argument("--batched", action=argparse.BooleanOptionalAction, default=True,
                    help="with the mixed workloads, the SendMany one too (its own copy of the 32 requests in the prefill "
                    "arena: --no-batched fits the mixed ones on an H100)")
    ap.add_argument("--mixed-passes", type=int, default=5, help="timed passes of each mixed workload (default 5; 1 with --backend mooncake)")
    ap.add_argument("--raw-reps", type=int, default=10, help="timed raw copies per byte count (default 10)")
    ap.add_argument("--batch", type=int, default=8, help="requests per SendMany call in the mixed batched workload (default 8)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens when building the requests (default 2048)")
    ap.add_argument("--chunk-send", type=int, default=8192,
                    help="row '32k in chunks': the 32k request as Sends of this many tokens, each planned by BeginSend (0: no such row)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the mixed workload's token counts")
    ap.add_argument("--daemon-cpus", metavar="P:D",
                    help="pin the prefill daemon to cores P and the decode daemon to cores D (taskset lists, e.g. 2-3:4-5; "
                         "what exclusive cores, e.g. Kubernetes' static CPU manager, give a sidecar)")
    args = ap.parse_args()
    quick = args.backend == "mooncake"  # over TCP: ~1.6 GB/s, about a second per 32k Send
    if args.repeats is None:
        args.repeats = 3 if quick else 8
    if args.mixed is None:
        args.mixed = not quick
    if quick and "--mixed-passes" not in sys.argv:
        args.mixed_passes = 1
    if not torch.cuda.is_available():
        print("bench/gpu_transfer.py needs a CUDA device (torch.cuda.is_available() is false)")
        return 2
    n = torch.cuda.device_count()
    if args.both:
        pairs = [(0, 0)] + ([(0, 1)] if n >= 2 else [])
    else:
        try:
            a, b = (int(x) for x in args.devices.split(","))
        except ValueError:
            print(f"--devices {args.devices!r}: give two GPU indices, e.g. 0,1")
            return 2
        if not (0 <= a < n and 0 <= b < n):
            print(f"--devices {args.devices}: this host has {n} CUDA device(s)")
            return 2
        pairs = [(a, b)]
    env = environment()
    log("env: " + json.dumps({k: v for k, v in env.items() if k != "topo"}))
    log(f"daemon cores: {args.daemon_cpus or 'not pinned'} (prefill:decode)")
    log("nvidia-smi topo -m:\n" + env.get("topo", ""))
    if args.both and n < 2:
        log("only one GPU: --both runs 0,0 alone")
    if args.mixed:
        log(f"mixed workload tokens (seed {args.seed}): {sorted(mixed_tokens(args.seed))}")
    if quick:
        log(f"--backend mooncake: quick run: {args.repeats} timed passes of the 32k request"
            + (f", {args.mixed_passes} of each mixed workload" if args.mixed else
               ", mixed workloads skipped (over TCP ~1.6 GB/s: ~12 s per pass; --mixed runs them)")
            + "; no copy breakdown (it replays the local backend's copy)")
    t0 = time.perf_counter()
    results = [run_pair(a, b, args) for a, b in pairs]
    report(env, results)
    log(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "pairs": results}, f, indent=1)
    bad = [p for p in results if p["error"] or not p["rows"] or not all(r["ok"] for r in p["rows"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
