"""``kvd demo``: a prefill node and a decode node on loopback, proven against the colocated run.

What runs (every box its own process; engines talk only to their own daemon)::

    kvd serve (prefill node) ◀── prefill engine ─┐                      ┌─ reference process
             ║ Mooncake TCP (or local)             router (this process)   run_colocated()
    kvd serve (decode node)  ◀── decode engine  ─┘                      └─ (same engine code, one pool)

Both daemons start post-capture (only the sink backed); each engine calls ``finalize(bytes)``
before serving. The decode node's budget is small on purpose: at peak a new request does not
fit, so the decode engine retracts (offloads) a running one, restores it later, and compacts at
step boundaries. The run passes only if every request's output equals the colocated reference
token for token, with bit-identical logit traces (exit status 1 otherwise).

Warm-up and time to first token. Before anything is timed the router runs
:func:`kvd.engine.warmup.warmup_requests` through both engines and both daemons (every shape
bucket of the workload: see that module), as a real engine warms up at start-up, and the
reference runs the same set first; so compiles and first-use costs (Triton, cuBLAS, the caching
allocator, the first Send's connections) stay out of the timed requests. The reference runs
*after* the PD run, alone on the machine, one request at a time; the summary (and ``--json``)
reports TTFT of the PD run (at the router: admission, the wait behind earlier prompts, prefill
and its Sends), the PD prefill alone (the prefill engine's allocate to its last Send, no queue)
and the colocated prefill, each p50 / p95, and their ratios.

``--device cuda`` (:attr:`DemoOptions.device`) runs the same thing on GPU 0: both daemons own a
CUDA virtual-memory arena there (``kvd serve --arena cuda --cuda-device 0``), the ``local``
backend copies KV GPU to GPU (``auto`` picks ``local``; an explicit ``mooncake`` needs Mooncake's
CUDA build, refused otherwise, and moves the KV over TCP or RDMA through the Transfer Engine),
both engines and the colocated reference compute on that GPU
with the same weights. Identity still holds because every forward pass is one request's, with
shapes that depend only on that request (so engine and reference run the very same kernels on
the very same shapes), under deterministic CUDA settings applied in each process before CUDA
starts; :mod:`kvd.engine.device` spells the guarantee out.

``--decode-device cuda:1`` (:attr:`DemoOptions.decode_device`) splits the roles over two GPUs of
the host: the prefill daemon's arena, the prefill engine and the colocated reference on GPU 0,
the decode daemon's arena and the decode engine on GPU 1; the ``local`` backend then writes KV
from GPU 0 into the decode arena on GPU 1 through peer access. :func:`kvd.engine.device.place`
refuses (exit 2) a GPU the host does not have and a pair without peer access, before anything
starts; the summary names both devices and warns when they are not the same model.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TextIO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from kvd.engine.device import CUBLAS_WORKSPACE, Placement, place, prepare, resolve
from kvd.engine.records import Completion, EngineConfig, Request
from kvd.errors import Unavailable
from kvd.engine.model import TargetConfig, build_models
from kvd.engine.reference import compare, run_colocated
from kvd.engine.router import EngineSpec, Ready, Router, RouterResult, engine_main, recv_or_raise
from kvd.engine.warmup import MOVE_LENGTHS, warmup_requests

__all__ = ["DemoOptions", "run_demo", "workload", "choose_backend", "ttft_figures"]

PREFILL_BYTES = 4 << 20  # one prompt at a time, every SWA page of it
DECODE_BYTES = 2 << 20  # ~10 of the workload's requests at once, 16 in flight: pressure is part of the demo
RESERVE_BYTES = 64 << 20  # the post-capture reservation (address space only)
#: the RECV lease of an admitted request (its ticket): it may wait behind up to max_inflight prompts
TICKET_TTL_S = 60.0


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 64
    backend: str = "auto"  # auto | mooncake | nixl | local
    quick: bool = False
    seed: int = 0
    spec_k: int = 3
    chunk: int = 64
    max_inflight: int = 16
    device: str = "cpu"  # cpu | cuda (GPU 0: daemons' arenas, engines and the reference)
    decode_device: str | None = None  # cuda:N: the decode daemon's arena and engine there; None: on `device`
    fault: str | None = None  # test only: the prefill daemon misplaces KV with a named fault (kvd.demo.faults.FAULTS)
    json_path: str | None = None  # also write the summary's figures as JSON there


def choose_backend(asked: str, err: TextIO, device: str = "cpu") -> str:
    """``auto``: Mooncake when importable, else ``local`` with a notice saying what is missing. An
    explicit ``mooncake`` or ``nixl`` that is not importable is refused (Unavailable, saying what
    is missing: the Python package or a system library) before anything starts.
    With ``device="cuda"``: ``auto`` is ``local`` (GPU to GPU over the host's own links; Mooncake
    stages GPU memory through TCP where there is no RDMA); an explicit ``mooncake`` needs the
    CUDA build and is refused (Unavailable, or InvalidArgument for its environment) without it."""
    if asked == "local":
        return asked
    if device == "cuda":
        if asked == "mooncake":
            from kvd.backends.mooncake import check_installed
            from kvd.errors import KvdError

            try:
                check_installed(cuda_arena=True)
            except KvdError as exc:
                raise type(exc)(f"--backend mooncake with --device cuda: {exc}; or use --backend local") from exc
            return "mooncake"
        if asked != "nixl":
            return "local"
    if asked == "nixl":  # a CUDA arena needs NIXL's VRAM support: the daemon refuses at start-up without it
        from kvd.backends.nixl import NixlBackend

        why = NixlBackend.missing()
        if why is not None:
            raise Unavailable(f"--backend nixl: {why}; or use --backend local")
        return "nixl"
    from kvd.backends.mooncake import MooncakeBackend

    why = MooncakeBackend.missing()
    if why is not None:
        if asked == "mooncake":
            raise Unavailable(f"--backend mooncake: {why}; or use --backend local")
        print(f"kvd demo: NOTICE: {why}; falling back to the `local` backend (same-host shared-memory copy).", file=err)
        return "local"
    return "mooncake"


def workload(n: int, seed: int, *, quick: bool = False) -> list[Request]:
    """``n`` requests with mixed prompt lengths: a quarter shorter than the SWA window, a quarter
    one to three windows, half four to ten windows; 32..48 new tokens each (32 with ``quick``)."""
    w = TargetConfig().window
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kind = i % 4
        lo, hi = [(4, w - 1), (w + 1, 3 * w), (4 * w, 10 * w), (4 * w, 10 * w)][kind]
        plen = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = tuple(torch.randint(0, TargetConfig().vocab, (plen,), generator=g).tolist())
        max_new = 32 if quick else int(torch.randint(32, 49, (1,), generator=g))
        out.append(Request(f"req-{i:03d}", prompt, max_new))
    return out


def _reference_main(requests: list[Request], warm: list[Request], cfg: EngineConfig, conn, device: str = "cpu") -> None:
    """Build the models at once, then wait for the word (the PD run is over: nothing else runs)
    and send back ``(completions, ttft seconds by rid)``, the warm-up run first."""
    torch.set_num_threads(1)
    try:
        dev = prepare(device)  # before anything touches CUDA, exactly as in the engine processes
        models = build_models(device=dev)
        conn.recv()
        ttft: dict[str, float] = {}
        conn.send((run_colocated(requests, models, cfg, warmup=warm, ttft=ttft), ttft))
    except BaseException as exc:  # noqa: BLE001
        conn.send(RuntimeError(f"colocated reference failed: {type(exc).__name__}: {exc}"))


class _Daemon:
    """A ``kvd serve`` subprocess; its log goes to a file, its first stdout line says it serves.
    ``fault`` (test only): it sends with that fault of :mod:`kvd.demo.faults` installed."""

    def __init__(self, name: str, workdir: str, arena_dir: str, layout_path: str, backend: str, speculative: bool,
                 device: torch.device = torch.device("cpu"), fault: str | None = None) -> None:
        self.name = name
        self.sock = os.path.join(workdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"{name}.log")
        launcher = ["kvd.demo.faults", fault] if fault else ["kvd.cli"]
        cmd = [
            sys.executable, "-m", *launcher, "serve", "--layout", layout_path, "--listen-unix", self.sock,
            "--listen-tcp", "127.0.0.1:0", "--backend", backend, "--post-capture",
            "--arena-bytes", str(PREFILL_BYTES if name == "prefill" else DECODE_BYTES),
            "--reserve-bytes", str(RESERVE_BYTES), "--arena-dir", arena_dir, "--grace-s", "1", "--log-level", "WARNING",
        ]
        if speculative:
            cmd.append("--speculative")
        # A heartbeat starved for a second must not fail a healthy transfer: on a GPU the first
        # compaction or Send JIT-compiles Triton kernels in the daemon (seconds, GIL held), and on a
        # 2-core machine also running tests the warm-up's first-use costs starved one past the 1 s
        # default. Only failure detection gets slower, and no demo fault is a peer failure.
        cmd += ["--peer-timeout-s", "30"]
        env = None
        if device.type == "cuda":  # the daemon owns a CUDA virtual-memory arena on that GPU
            cmd += ["--arena", "cuda", "--cuda-device", str(device.index or 0)]
            env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, env=env)

    @property
    def address(self) -> str:
        return f"unix:{self.sock}"

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode(errors="replace")
            if "serving on" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"{self.name} daemon did not start (exit {self.proc.poll()}); its log:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


class _Progress:
    """The requests done so far, a progress bar drawn by rich on ``err``: redrawn in place on a
    terminal; elsewhere (a pipe, a log file) rich draws it once, when it stops."""

    def __init__(self, err: TextIO) -> None:
        self.bar = Progress(
            TextColumn("kvd demo"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
            console=Console(file=err),
        )
        self.task: TaskID = self.bar.add_task("", total=None)
        self.bar.start()

    def __call__(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)

    def close(self) -> None:
        """Stop drawing (the bar's final state stays on ``err``)."""
        self.bar.stop()


def run_demo(opts: DemoOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the demo; print the summary to ``out``. Returns 0 when every output is identical.
    ``opts.device == "cuda"`` where CUDA (or cuda-python / Triton, which the GPU arenas need) is
    missing raises :class:`~kvd.errors.Unavailable` before anything starts, as does an
    ``opts.decode_device`` the host lacks or cannot reach by peer access (a malformed or mixed
    CPU/GPU pair: :class:`~kvd.errors.InvalidArgument`)."""
    t0 = time.perf_counter()
    n = opts.requests
    # No CUDA context in this process (resolve, place): the router never computes.
    if resolve(opts.device).type == "cuda":
        _require_gpu_stack()  # before place(), which asks cuda-python about peer access
    placement = place(opts.device, opts.decode_device)
    device = placement.prefill  # the prefill side and the colocated reference
    roles = {"prefill": placement.prefill, "decode": placement.decode}
    backend = choose_backend(opts.backend, err, device.type)
    # A ticket may wait behind up to max_inflight prompts before its Send, and nothing renews its
    # lease meanwhile: the decode engine asks for a long one (the daemon's other leases keep its TTL).
    cfg = EngineConfig(chunk=opts.chunk, spec_k=opts.spec_k, ticket_ttl=TICKET_TTL_S)
    models = build_models()
    requests = workload(n, opts.seed, quick=opts.quick)
    warm = warmup_requests(cfg)
    workdir = tempfile.mkdtemp(prefix="kvd-demo-")
    arena_dir = tempfile.mkdtemp(prefix="kvd-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    layout_path = os.path.join(workdir, "layout.json")
    with open(layout_path, "w", encoding="utf-8") as f:
        json.dump(models.layout.model_dump(mode="json"), f)
    ctx = mp.get_context("spawn")
    daemons: list[_Daemon] = []
    procs: list = []
    router = None
    try:
        # Everything starts at once; the engines connect when their daemon serves.
        ref_conn, ref_child = ctx.Pipe()
        ref = ctx.Process(target=_reference_main, args=(requests, warm, cfg, ref_child, str(device)),
                          name="kvd-demo-reference", daemon=True)
        ref.start()
        procs.append(ref)
        for name in ("prefill", "decode"):
            daemons.append(_Daemon(name, workdir, arena_dir, layout_path, backend, speculative=opts.spec_k > 0,
                                   device=roles[name], fault=opts.fault if name == "prefill" else None))
        conns = {}
        for d, budget in zip(daemons, (PREFILL_BYTES, DECODE_BYTES)):
            parent, child = ctx.Pipe()
            spec = EngineSpec(d.name, d.address, cfg, budget, device=str(roles[d.name]),
                              warm_moves=MOVE_LENGTHS if d.name == "decode" else ())
            p = ctx.Process(target=engine_main, args=(spec, child),
                            name=f"kvd-demo-{d.name}-engine", daemon=True)
            p.start()
            procs.append(p)
            conns[d.name] = parent
        for d in daemons:
            d.wait_serving()
        device_names: dict[str, str] = {}
        for name, conn in conns.items():
            msg = recv_or_raise(conn)
            if not isinstance(msg, Ready):
                raise RuntimeError(f"{name} engine did not start: {getattr(msg, 'error', msg)}")
            if msg.device != str(roles[name]):
                raise RuntimeError(f"{name} engine computes on {msg.device}, not on {roles[name]}")
            device_names[name] = msg.device_name
        router = Router(conns["prefill"], conns["decode"], max_inflight=opts.max_inflight)
        t_warm = time.perf_counter()
        _check_warmup(router.run(warm))  # start-up: every shape bucket once, through both daemons
        warm_s = time.perf_counter() - t_warm
        progress = _Progress(err)
        try:
            result = router.run(requests, progress)
        finally:
            progress.close()
        ref_conn.send("go")  # the colocated run, alone now (the engines idle)
        got = recv_or_raise(ref_conn)
        if isinstance(got, BaseException):
            raise got
        reference, ref_ttft = got
        reports = router.shutdown()
        router = None
        stats = {d.name: _daemon_stats(d.address) for d in daemons}
        for p in procs:
            p.join(30)
        wall = time.perf_counter() - t0
        differs = compare(result.completions, reference)
        ttft = ttft_figures(result, ref_ttft)
        _summary(out, opts, backend, models.layout, cfg, requests, result, reference, differs, reports, stats, wall, placement,
                 device_names, ttft=ttft, warm=(len(warm), warm_s))
        if opts.json_path:
            _write_json(opts.json_path, opts, backend, requests, differs, ttft, (len(warm), warm_s), wall, placement)
        return 1 if differs else 0
    finally:
        if router is not None:
            try:
                router.shutdown(timeout_s=5)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for d in daemons:
            d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        left = os.listdir(arena_dir)
        if left:
            print(f"kvd demo: WARNING: the daemons left arena files behind: {left} (removed now)", file=err)
        shutil.rmtree(arena_dir, ignore_errors=True)


def _device_lines(placement: Placement, names: dict[str, str], backend: str = "local") -> list[str]:
    """The summary's lines about devices: none on the CPU; one for a single GPU; one per role for
    two GPUs, plus a WARNING when the engines report different GPU models (bit-identity with the
    reference, which ran on the prefill GPU, is then not guaranteed). ``names``: role -> the
    GPU's name as the engine reported it."""
    pre, dec = placement
    if pre.type != "cuda":
        return []
    how = "(peer access)" if backend == "local" else "(Transfer Engine)"
    if not placement.split:
        return [f"device {pre} ({names.get('prefill', '')}): both daemons' arenas (CUDA VMM), both engines "
                f"and the colocated reference; {backend} backend GPU -> GPU"]
    lines = [
        f"prefill device {pre} ({names.get('prefill', '')}): prefill daemon's arena (CUDA VMM), prefill engine and the "
        "colocated reference",
        f"decode device  {dec} ({names.get('decode', '')}): decode daemon's arena (CUDA VMM) and decode engine; "
        f"{backend} backend {pre} -> {dec} {how}",
    ]
    if names.get("prefill") != names.get("decode"):
        lines.append(
            f"WARNING: the two GPUs are different models ({names.get('prefill')!r} vs {names.get('decode')!r}): cuBLAS "
            "may pick other kernels on each, so outputs identical to the reference (run on the prefill GPU) are not "
            "guaranteed; use two GPUs of one model"
        )
    return lines


def _require_gpu_stack() -> None:
    """The GPU demo's daemons and reference need cuda-python (the VMM arena) and Triton (page
    moves); say so before anything starts instead of in a daemon's log."""
    import importlib.util

    from kvd.memory.cuda import driver

    driver()  # Unavailable, with how to install it, when cuda-python is missing
    if importlib.util.find_spec("triton") is None:
        raise Unavailable("--device cuda needs Triton (the GPU arenas move pages with Triton kernels); install triton "
                          "matching torch, or use --device cpu")


def _daemon_stats(address: str):
    from kvd.client import Client

    with Client.connect(address, name="kvd-demo-observer", timeout=5) as kv:
        return kv.stats()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _check_warmup(res: RouterResult) -> None:
    """A warm-up request that failed is a broken start-up: say which, before anything is timed."""
    bad = [f"{rid}: {c.error}" for rid, c in sorted(res.completions.items()) if c.error]
    if bad:
        raise RuntimeError(f"the warm-up failed ({len(bad)} request(s)): {'; '.join(bad[:4])}")


def ttft_figures(result: RouterResult, colocated_s: dict[str, float]) -> dict[str, dict[str, float]]:
    """Milliseconds, p50 / p95 / max, of: ``pd`` (router-observed TTFT: submission to first
    token), ``pd_prefill`` (the prefill engine's own time: allocate to its last Send), and
    ``colocated`` (the reference's prefill, one request at a time); ``ratio``: PD over
    colocated at p50 and p95, for TTFT (``pd_*``) and the prefill alone (``prefill_*``)."""
    def fig(values: list[float]) -> dict[str, float]:
        ms = [v * 1e3 for v in values]
        return {"p50": statistics.median(ms) if ms else 0.0, "p95": _pct(ms, 0.95), "max": max(ms, default=0.0)}

    pd = fig(list(result.ttft_s.values()))
    pre = fig([f.prefill_s for f in result.firsts.values() if not f.error])
    col = fig(list(colocated_s.values()))

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    return {
        "pd": pd, "pd_prefill": pre, "colocated": col,
        "ratio": {"pd_p50": ratio(pd["p50"], col["p50"]), "pd_p95": ratio(pd["p95"], col["p95"]),
                  "prefill_p50": ratio(pre["p50"], col["p50"]), "prefill_p95": ratio(pre["p95"], col["p95"])},
    }


def _write_json(path: str, opts: DemoOptions, backend: str, requests: list[Request], differs: list[str],
                ttft: dict[str, dict[str, float]], warm: tuple[int, float], wall: float, placement: Placement) -> None:
    doc = {
        "requests": len(requests), "identical": len(requests) - len(differs), "differ": differs, "backend": backend,
        "device": str(placement.prefill), "decode_device": str(placement.decode), "quick": opts.quick,
        "warmup": {"requests": warm[0], "seconds": round(warm[1], 3)},
        "ttft_ms": {k: {q: round(v, 3) for q, v in d.items()} for k, d in ttft.items()},
        "wall_s": round(wall, 3),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _summary(out: TextIO, opts: DemoOptions, backend: str, layout, cfg: EngineConfig, requests: list[Request], result,
             reference: dict[str, Completion], differs: list[str], reports: dict, stats: dict, wall: float,
             placement: Placement = Placement(torch.device("cpu"), torch.device("cpu")),
             device_names: dict[str, str] | None = None, *, ttft: dict[str, dict[str, float]],
             warm: tuple[int, float]) -> None:
    w = TargetConfig().window
    plens = [len(r.prompt) for r in requests]
    comps = result.completions.values()
    dec = reports.get("decode", {})
    pre = reports.get("prefill", {})
    nbytes = sum(f.nbytes for f in result.firsts.values())
    send_s = sum(f.send_seconds for f in result.firsts.values())
    chunks = sum(f.chunks for f in result.firsts.values())
    decode_tokens = sum(max(0, len(c.tokens) - 1) for c in comps)
    pd, pre_t, col, ratio = ttft["pd"], ttft["pd_prefill"], ttft["colocated"], ttft["ratio"]
    ps, ds = stats["prefill"], stats["decode"]
    identical = len(requests) - len(differs)
    rows = [
        ("requests", f"{len(requests)}  (prompts {min(plens)}..{max(plens)} tokens: {sum(p < w for p in plens)} shorter than "
                     f"the {w}-token SWA window, {sum(p >= 4 * w for p in plens)} four or more windows long)"),
        ("outputs identical to colocated", f"{identical} / {len(requests)}" + ("" if not differs else f"   DIFFER: {', '.join(differs[:8])}")),
        ("warm-up", f"{warm[0]} requests before timing, {warm[1]:.1f} s (every shape bucket, through both engines and "
                    "daemons; not timed or compared, counted in the engine and daemon figures below)"),
        ("time to first token", f"p50 {pd['p50']:.1f} ms   p95 {pd['p95']:.1f} ms   max {pd['max']:.1f} ms   "
                                f"(PD, at the router: admission, queue behind earlier prompts, prefill, Sends)"),
        ("  PD prefill alone", f"p50 {pre_t['p50']:.1f} ms   p95 {pre_t['p95']:.1f} ms   max {pre_t['max']:.1f} ms   "
                               "(prefill engine: allocate .. last Send)"),
        ("  colocated", f"p50 {col['p50']:.1f} ms   p95 {col['p95']:.1f} ms   max {col['max']:.1f} ms   "
                        "(reference prefill, one request at a time, alone)"),
        ("  PD / colocated", f"TTFT p50 x{ratio['pd_p50']:.2f}  p95 x{ratio['pd_p95']:.2f};  prefill alone "
                             f"p50 x{ratio['prefill_p50']:.2f}  p95 x{ratio['prefill_p95']:.2f}"),
        ("decode", f"{decode_tokens:,d} tokens in {result.decode_window_s:.1f} s = {decode_tokens / max(result.decode_window_s, 1e-9):,.0f} tokens/s"
                   + (f"   (speculative k={cfg.spec_k}: {dec.get('accepted', 0):,d} of {dec.get('proposed', 0):,d} draft tokens accepted)" if cfg.spec_k else "")),
        ("KV bytes moved", f"{nbytes / 2**20:,.2f} MiB in {chunks} Send calls; {send_s:.2f} s inside Send = "
                           f"{nbytes / max(send_s, 1e-9) / 1e9:.3f} GB/s (per call: lease, data, commit; the Allocate that began each transfer had its ticket checked once and its chunks planned)"),
        ("compactions", f"{ds.pool.compactions_done} on the decode node ({dec.get('compactions_refused', 0)} refused for live leases, "
                        f"then done around them; {ds.pool.pages_moved:,d} pages moved)"),
        ("retractions", f"{dec.get('retractions', 0)} offloaded to host, {dec.get('restores', 0)} restored; "
                        f"{dec.get('deferred', 0)} admissions waited for memory"),
        ("leases", f"{dec.get('recv_leases', 0)} RECV + {pre.get('send_leases', 0)} SEND; live at end {ds.leases_live + ps.leases_live}, "
                   f"expired {ds.leases_expired_total + ps.leases_expired_total}"),
        ("stale refusals", f"{ds.stale_refusals_total + ps.stale_refusals_total}"),
        ("wall time", f"{wall:.1f} s"),
    ]
    if opts.fault:
        print(f"\nkvd demo: FAULT INJECTED (test only): {opts.fault}", file=out)
    print(f"\nkvd demo: prefill node -> decode node over {backend}{' (tcp)' if backend == 'mooncake' else ' (UCX)' if backend == 'nixl' else ''}; "
          f"layout {layout.name} ({layout.fingerprint}); chunked prefill {cfg.chunk} tokens; "
          f"post-capture budgets {PREFILL_BYTES >> 20} MiB / {DECODE_BYTES >> 20} MiB", file=out)
    for line in _device_lines(placement, device_names or {}, backend):
        print(line, file=out)
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 60), file=out)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)
    print("-" * (width + 60), file=out)
    if not dec.get("retractions") or not ds.pool.compactions_done:
        print("NOTE: no retraction or no compaction this run (not enough memory pressure); try more --requests", file=out)
    print("PASS: every output is identical to the colocated reference" if not differs
          else f"FAIL: {len(differs)} output(s) differ from the colocated reference", file=out)
