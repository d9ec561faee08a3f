"""Engine processes and the router between them.

Each engine is its own process and talks only to its own daemon (``kvd.client`` over the
daemon's Unix socket); the router -- the demo's main process -- passes requests, tickets and
first tokens between them over pipes::

    router ── Admit(req) ────────▶ decode engine ── allocate + RECV lease (daemon B)
    router ◀─ Ticket(rid, bytes) ─┘
    router ── Prefill(req, ticket) ▶ prefill engine ── compute + Send per chunk (daemon A ─▶ B)
    router ◀─ FirstToken ─────────┘
    router ── Start(first) ──────▶ decode engine ── wait_ready, decode rounds
    router ◀─ Done(completion) ───┘

Messages are the frozen dataclasses below, pickled by ``multiprocessing``; an engine that fails
sends :class:`Crashed` with its traceback before exiting. No tensor crosses a pipe: tokens and
traces are Python ints and floats, so an engine on a GPU sends the same messages as one on the CPU.

An engine computes on ``EngineSpec.device``: it prepares the process for deterministic CUDA
(:func:`kvd.engine.device.prepare`) before anything touches CUDA, builds its models there, and
refuses a daemon whose arena (``attach()``) lives on another device. Its client is
:class:`~kvd.engine.device.Fenced`: every daemon call waits for the engine's queued GPU work.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast
from multiprocessing.connection import Connection, wait

import torch

from kvd.engine.decode import DecodeEngine
from kvd.engine.device import Fenced, prepare
from kvd.engine.prefill import PrefillEngine
from kvd.engine.records import Completion, EngineConfig, FirstToken, Request
from kvd.engine.model import build_models
from kvd.engine.paged import PagedKV

__all__ = [
    "EngineSpec", "Admit", "Ticket", "Prefill", "Start", "Cancel", "Done", "Shutdown", "Ready", "Report", "Crashed",
    "engine_main", "recv_or_raise", "Router", "RouterResult",
]


@dataclass(frozen=True)
class EngineSpec:
    role: str  # "prefill" | "decode"
    address: str  # the engine's own daemon
    cfg: EngineConfig
    finalize_bytes: int | None = None  # post-capture: the KV budget to back before serving
    device: str = "cpu"  # where the engine computes; its daemon's arena must be there too ("cuda:0": arena=cuda)
    warm_moves: tuple[int, ...] = ()  # decode: DecodeEngine.warm_up's scratch lengths before Ready (none: no warm-up)


# ---- messages ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Admit:
    req: Request


@dataclass(frozen=True)
class Ticket:
    rid: str
    ticket: bytes


@dataclass(frozen=True)
class Prefill:
    req: Request
    ticket: bytes


@dataclass(frozen=True)
class Start:
    first: FirstToken


@dataclass(frozen=True)
class Cancel:
    rid: str
    reason: str


@dataclass(frozen=True)
class Done:
    completion: Completion


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    role: str
    finalized_bytes: int
    device: str = "cpu"  # where the engine's models and its daemon's arena views live
    device_name: str = ""  # the GPU's name (torch.cuda.get_device_name), "" on the CPU


@dataclass(frozen=True)
class Report:
    role: str
    stats: dict


@dataclass(frozen=True)
class Crashed:
    role: str
    error: str


# ---- engine processes --------------------------------------------------------------------
def engine_main(spec: EngineSpec, conn: Connection) -> None:
    """Process entry point: connect to the own daemon, finalize (post-capture), attach, serve."""
    from kvd.client import Client

    torch.set_num_threads(1)  # two engines, two daemons and a reference share the cores
    kv = att = None
    try:
        dev = prepare(spec.device)  # before anything touches CUDA
        models = build_models(device=dev)
        # On a GPU the daemon's first compaction or Send JIT-compiles its Triton page-move kernels
        # (seconds on a cold cache): allow calls that long instead of failing a healthy run.
        call_timeout = 5.0 if dev.type == "cpu" else 60.0
        kv = Fenced.wrap(_connect(Client, spec.address, f"{spec.role}-engine", call_timeout=call_timeout), dev)
        info = kv.info()
        if info.layout.fingerprint != models.layout.fingerprint:
            raise RuntimeError(
                f"daemon at {spec.address} runs layout {info.layout.name!r} ({info.layout.fingerprint}), but the "
                f"engine's models need {models.layout.fingerprint}; start it with the engine's layout"
            )
        if not info.finalized:
            info = kv.finalize(spec.finalize_bytes)  # graphs are "captured": back the final KV budget
        att = kv.attach()
        paged = PagedKV(models.layout, att.views)
        if paged.device != dev:
            raise RuntimeError(
                f"the daemon at {spec.address} keeps its arena on {paged.device}, but this engine computes on {dev}; "
                "start the daemon with the matching arena (--arena cuda --cuda-device N for a GPU engine)"
            )
        dec = DecodeEngine(kv, paged, models, spec.cfg) if spec.role == "decode" else None
        if dec is not None and spec.warm_moves:
            dec.warm_up(spec.warm_moves)  # the handoff's shapes warm up through the router (kvd.engine.warmup)
        conn.send(Ready(spec.role, att.tensor.numel(), str(dev), torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""))
        if dec is None:
            _prefill_loop(PrefillEngine(kv, paged, models, spec.cfg), conn)
        else:
            _decode_loop(dec, conn)
    except BaseException:  # noqa: BLE001 - report anything, then exit
        try:
            conn.send(Crashed(spec.role, traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        if att is not None:
            try:
                if att.tensor.is_cuda:
                    torch.cuda.synchronize(att.tensor.device)  # no kernel of ours may touch the mapping once it is gone
            finally:
                att.close()
        if kv is not None:
            kv.close()


def _connect(client_cls, address: str, name: str, timeout_s: float = 60.0, call_timeout: float = 5.0):
    """Connect once the daemon serves (the demo starts engines and daemons together); every
    later call of the client has ``call_timeout`` seconds."""
    from kvd.errors import KvdError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client_cls.connect(address, name=name, timeout=call_timeout)
        except KvdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _prefill_loop(pre: PrefillEngine, conn: Connection) -> None:
    while True:
        msg = conn.recv()
        if isinstance(msg, Shutdown):
            conn.send(Report("prefill", {"send_leases": pre.send_leases}))
            return
        assert isinstance(msg, Prefill), msg
        conn.send(pre.prefill(msg.req, msg.ticket))


def _decode_loop(dec: DecodeEngine, conn: Connection) -> None:
    admits: deque[Request] = deque()
    stopping = False
    while True:
        if dec.running or dec.retracted:
            timeout: float | None = 0.0
        elif any(s.started for s in dec.awaiting.values()) or admits:
            timeout = 0.002
        else:
            timeout = None if not stopping else 0.0
        if conn.poll(timeout):
            while True:
                msg = conn.recv()
                if isinstance(msg, Admit):
                    admits.append(msg.req)
                elif isinstance(msg, Start):
                    dec.start(msg.first)
                elif isinstance(msg, Cancel):
                    conn.send(Done(dec.cancel(msg.rid, msg.reason)))
                elif isinstance(msg, Shutdown):
                    stopping = True
                if not conn.poll(0):
                    break
        dec.maintain()  # restores first: retracted requests go before new admissions
        while admits:
            ticket = dec.admit(admits[0])
            if ticket is None:
                break
            conn.send(Ticket(admits.popleft().rid, ticket))
        for c in dec.poll_ready():
            conn.send(Done(c))
        for c in dec.step():
            conn.send(Done(c))
        if stopping and not dec.busy and not admits:
            conn.send(Report("decode", asdict(dec.stats)))
            return


# ---- router ------------------------------------------------------------------------------
def recv_or_raise(conn: Connection):
    """``conn.recv()``, with a dead engine process turned into a RuntimeError that says so."""
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError("an engine process exited without a word (killed, or crashed in native code)") from None


@dataclass
class RouterResult:
    completions: dict[str, Completion] = field(default_factory=dict)
    firsts: dict[str, FirstToken] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    decode_window_s: float = 0.0  # first Start .. last Done
    wall_s: float = 0.0


class Router:
    """Feeds ``requests`` through the two engine processes, at most ``max_inflight`` at a time."""

    def __init__(self, prefill: Connection, decode: Connection, *, max_inflight: int = 16) -> None:
        self.prefill = prefill
        self.decode = decode
        self.max_inflight = max_inflight

    def run(self, requests: list[Request], progress: Callable[[int, int], None] | None = None,
            timeout_s: float = 600.0) -> RouterResult:
        out = RouterResult()
        queue = deque(requests)
        by_rid = {r.rid: r for r in requests}
        submitted: dict[str, float] = {}
        inflight = 0
        t_begin = time.perf_counter()
        t_first_start = t_last_done = None
        deadline = time.monotonic() + timeout_s
        while len(out.completions) < len(requests):
            while queue and inflight < self.max_inflight:
                req = queue.popleft()
                submitted[req.rid] = time.perf_counter()
                self.decode.send(Admit(req))
                inflight += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"router: {len(requests) - len(out.completions)} requests still unfinished after {timeout_s:.0f} s")
            for conn in cast("list[Connection]", wait([self.prefill, self.decode], timeout=1.0)):  # the objects given
                msg = recv_or_raise(conn)
                now = time.perf_counter()
                if isinstance(msg, Crashed):
                    raise RuntimeError(f"{msg.role} engine crashed:\n{msg.error}")
                if isinstance(msg, Ticket):
                    self.prefill.send(Prefill(by_rid[msg.rid], msg.ticket))
                elif isinstance(msg, FirstToken):
                    out.firsts[msg.rid] = msg
                    out.ttft_s[msg.rid] = now - submitted[msg.rid]
                    if msg.error:
                        self.decode.send(Cancel(msg.rid, f"prefill failed: {msg.error}"))
                    else:
                        t_first_start = t_first_start or now
                        self.decode.send(Start(msg))
                elif isinstance(msg, Done):
                    out.completions[msg.completion.rid] = msg.completion
                    inflight -= 1
                    t_last_done = now
                    if progress:
                        progress(len(out.completions), len(requests))
        out.wall_s = time.perf_counter() - t_begin
        if t_first_start and t_last_done:
            out.decode_window_s = t_last_done - t_first_start
        return out

    def shutdown(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Ask both engines to finish and return their reports."""
        reports: dict[str, dict] = {}
        for conn in (self.prefill, self.decode):
            conn.send(Shutdown())
        deadline = time.monotonic() + timeout_s
        pending = [self.prefill, self.decode]
        while pending and time.monotonic() < deadline:
            for conn in cast("list[Connection]", wait(pending, timeout=max(0.0, deadline - time.monotonic()))):
                try:
                    msg = conn.recv()
                except EOFError:
                    pending.remove(conn)
                    continue
                if isinstance(msg, Report):
                    reports[msg.role] = msg.stats
                    pending.remove(conn)
                elif isinstance(msg, Crashed):
                    raise RuntimeError(f"{msg.role} engine crashed:\n{msg.error}")
        return reports
