"""Mooncake's CUDA build on kvd's GPU memory: what each transport can register and move, GPU A ->
GPU B between two processes (the facts behind ``kvd/backends/mooncake.py``'s CUDA rules).

    bash bench/gpu_check.sh mooncake-probe                    # on the GPU machine (installs .whl/)
    python3 bench/mooncake_cuda_probe.py [--sizes 64,1024] [--cases torch_p2p,nvlink_intra,tcp]

Cases, each in a fresh pair of processes (A, the initiator, on GPU A; B, its child and the
target, on GPU B; default 0 -> 1, 0 -> 0 on a one-GPU host) under a hard timeout:

* ``torch_p2p``: the baseline, in one process: ``dst_on_B.copy_(src_on_A)`` (peer copy, NVLink).
* ``nvlink_intra`` (``MC_INTRANODE_NVLINK=1``: Mooncake's intra-node NVLink transport only):
  registers a torch buffer (cudaMalloc) and a kvd arena (``CudaVmmArena``: cuMemCreate/cuMemMap)
  on both sides and reports each ``register_memory`` return code, then writes arena -> torch
  and torch -> torch (the destination must be registered; the source is not checked).
* ``tcp`` (``MC_FORCE_TCP=1``): kvd arena -> kvd arena, one ``transfer_sync_write`` per size
  and a ``batch_transfer_sync_write`` of 4 MiB pieces.

Every write that returns 0 is checked: B zeroes its buffer first, both sides then compute a
position-weighted checksum on the GPU. Output: a table; ``$OUT/mooncake_probe.json`` and
``$OUT/mooncake_probe_cases.log`` (every case's processes' stderr: Mooncake's glog at INFO, which
names the transport it installed). Needs torch, cuda-python and the CUDA build of Mooncake
(``bench/mooncake_wheel.py``); bundled system libraries the host lacks are put on
``LD_LIBRARY_PATH`` for the case processes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
PIECE = 4 * MiB
#: Characters of one case's log kept in mooncake_probe_cases.log (head and tail).
LOG_CAP = 4 * MiB
OUT = Path(os.environ.get("OUT") or "/tmp/mooncake-probe")
#: case -> (environment, (source kinds, destination kinds), timeout s)
CASES = {
    "torch_p2p": ({}, ((), ()), 40),
    "nvlink_intra": ({"MC_INTRANODE_NVLINK": "1"}, (("vmm", "torch"), ("torch", "vmm")), 45),
    "tcp": ({"MC_FORCE_TCP": "1"}, (("vmm",), ("vmm",)), 90),
}
#: Selectors the machine may have set; each case sets its own.
SELECTORS = ("MC_INTRANODE_NVLINK", "MC_FORCE_TCP", "MC_FORCE_MNNVL", "MC_FORCE_HCA", "MC_TCP_PROTO")


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---- buffers (in A and B) -----------------------------------------------------------------------


class Buffer:
    """``torch``: torch.empty on the caching allocator (plain cudaMalloc); ``vmm``: kvd's arena."""

    def __init__(self, kind: str, nbytes: int, dev: int) -> None:
        import torch

        self.kind, self.dev = kind, dev
        if kind == "torch":
            self.owner = None
            self.t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
        else:
            from kvd.memory.vmm import CudaVmmArena

            self.owner = CudaVmmArena(nbytes, nbytes, device=dev)
            self.t = self.owner.tensor()
        self.ptr = self.t.data_ptr()

    def fill(self, seed: int) -> None:
        import torch

        g = torch.Generator(device=self.t.device).manual_seed(seed)
        self.t.view(torch.int64).random_(generator=g)
        torch.cuda.synchronize(self.dev)

    def zero(self, n: int) -> None:
        import torch

        self.t[:n].zero_()
        torch.cuda.synchronize(self.dev)

    def checksum(self, n: int) -> str:
        """Sum and position-weighted sum of the int64 words (wrapping): the same on any device."""
        import torch

        v, s1, s2, step = self.t[:n].view(torch.int64), 0, 0, 1 << 24
        for off in range(0, v.numel(), step):
            c = v[off : off + step]
            w = torch.arange(off, off + c.numel(), device=c.device, dtype=torch.int64) * 2654435761 + 97
            s1 = (s1 + int(c.sum())) & (2**64 - 1)
            s2 = (s2 + int((c * w).sum())) & (2**64 - 1)
        return f"{s1:016x}{s2:016x}"


def engine():
    """An initialised TransferEngine (P2P handshake) and its session name."""
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")  # the protocol argument picks nothing
    if rc != 0:
        raise RuntimeError(f"initialize returned {rc}")
    return te, f"127.0.0.1:{te.get_rpc_port()}"


# ---- B: the target ------------------------------------------------------------------------------


def target(args: argparse.Namespace) -> None:
    import torch

    torch.cuda.set_device(args.dst_dev)
    bufs = {k: Buffer(k, args.bytes, args.dst_dev) for k in args.kinds.split(",")}
    te, session = engine()
    emit({"session": session, "buffers": {k: {"ptr": b.ptr, "reg_rc": te.register_memory(b.ptr, args.bytes)} for k, b in bufs.items()}})
    for line in sys.stdin:  # {"op": "zero" | "checksum" | "quit", "kind": ..., "len": ...}
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        b = bufs[cmd["kind"]]
        if cmd["op"] == "zero":
            b.zero(cmd["len"])
            emit({"ok": True})
        else:
            emit({"checksum": b.checksum(cmd["len"])})
    os._exit(0)  # skip the engine's teardown: the case is over


# ---- A: the initiator of one case ---------------------------------------------------------------


def initiator(args: argparse.Namespace) -> None:
    import torch

    src_kinds, dst_kinds = CASES[args.case][1]
    sizes = [int(x) * MiB for x in args.sizes.split(",")]
    top = max(sizes)
    torch.cuda.set_device(args.src_dev)
    res: dict = {"case": args.case, "runs": []}
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", "--kinds", ",".join(dst_kinds), "--bytes", str(top),
         "--dst-dev", str(args.dst_dev)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(obj: dict) -> dict:
        child.stdin.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return json.loads(child.stdout.readline())  # type: ignore[union-attr]

    try:
        res["target"] = b_info = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        te, _ = engine()
        srcs = {k: Buffer(k, top, args.src_dev) for k in src_kinds}
        res["src_reg"] = {}
        for i, (k, b) in enumerate(srcs.items()):
            b.fill(1234 + i)
            res["src_reg"][k] = te.register_memory(b.ptr, top)
        emit({"partial": res})
        for sk, src in srcs.items():
            for dk in dst_kinds:
                dst = b_info["buffers"][dk]
                if dst["reg_rc"] != 0:
                    res["runs"].append({"combo": f"{sk}->{dk}", "op": "-", "note": f"destination not registered (rc {dst['reg_rc']})"})
                    continue
                for n in sizes:
                    for op in ("sync", "batch"):
                        run = {"combo": f"{sk}->{dk}", "op": op, "size": n}
                        res["runs"].append(run)
                        ask({"op": "zero", "kind": dk, "len": n})
                        offs = list(range(0, n, PIECE))
                        times, rcs = [], []
                        for _ in range(args.reps if op == "sync" else 1):
                            t0 = time.perf_counter()
                            if op == "sync":
                                rc = te.transfer_sync_write(b_info["session"], src.ptr, dst["ptr"], n)
                            else:
                                rc = te.batch_transfer_sync_write(b_info["session"], [src.ptr + o for o in offs],
                                                                  [dst["ptr"] + o for o in offs], [min(PIECE, n - o) for o in offs])
                            times.append(time.perf_counter() - t0)
                            rcs.append(rc)
                            if rc != 0 or times[-1] > 3:
                                break
                        run.update(rc=rcs, s=times)
                        if all(r == 0 for r in rcs):
                            run["GBps"] = n / min(times) / 1e9
                            same = ask({"op": "checksum", "kind": dk, "len": n})["checksum"] == src.checksum(n)
                            run["verify"] = "OK" if same else "MISMATCH"
                        emit({"partial": res})  # survives a timeout kill
    except Exception as exc:  # noqa: BLE001 -- reported in the table
        traceback.print_exc()
        res["error"] = f"{type(exc).__name__}: {exc}"
    try:
        ask({"op": "quit"})
    except Exception:  # noqa: BLE001 -- the target died: its log says why
        pass
    child.kill()
    emit({"result": res})
    os._exit(0)


def torch_p2p(args: argparse.Namespace) -> None:
    import torch

    a, b = args.src_dev, args.dst_dev
    res: dict = {"case": "torch_p2p", "peer_access": a == b or torch.cuda.can_device_access_peer(a, b), "runs": []}
    for n in [int(x) * MiB for x in args.sizes.split(",")]:
        src = Buffer("torch", n, a)
        src.fill(7)
        dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{b}")
        times = []
        for _ in range(6):
            dst.zero_()
            torch.cuda.synchronize(b)
            t0 = time.perf_counter()
            dst.copy_(src.t)
            torch.cuda.synchronize(a)
            torch.cuda.synchronize(b)
            times.append(time.perf_counter() - t0)
        same = torch.equal(dst.to(src.t.device), src.t)
        res["runs"].append({"combo": "torch->torch", "op": "dst.copy_(src)", "size": n, "rc": [0], "s": times[1:],
                            "GBps": n / min(times[1:]) / 1e9, "verify": "OK" if same else "MISMATCH"})
        del src, dst
        torch.cuda.empty_cache()
    emit({"result": res})


# ---- the orchestrator ---------------------------------------------------------------------------


def case_env() -> dict[str, str]:
    """This environment, plus the bundled system libraries the host lacks (bench/mooncake_wheel.py)."""
    from mooncake_wheel import libdir

    env = {k: v for k, v in os.environ.items() if k not in SELECTORS}
    env.update(PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False", MC_LOG_LEVEL="INFO",
               MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER="8192", MC_TRANSFER_TIMEOUT="15")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        extra = libdir(Path(list(spec.submodule_search_locations)[0]).parent)
        if extra:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (extra, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def run_case(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    extra, _, timeout = CASES[name]
    role = ["--role", "torch_p2p"] if name == "torch_p2p" else ["--role", "initiator", "--case", name]
    cmd = [sys.executable, __file__, *role, "--sizes", args.sizes, "--reps", str(args.reps),
           "--src-dev", str(args.src_dev), "--dst-dev", str(args.dst_dev)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**env, **extra}, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            status = f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the case and its target
            out, _ = p.communicate()
            status = f"killed after {timeout} s"
        err.seek(0)
        text = err.read()
    res: dict = {"case": name, "runs": []}
    for line in (out or "").splitlines():
        msg = json.loads(line)
        res = msg.get("result") or msg.get("partial") or res
    # Mooncake's own line: "Using <name> transport ..." or "MC_FORCE_TCP is set, using TCP transport only".
    m = re.search(r"[Uu]sing (.+?) transport", text)
    res["transport"] = m.group(1) if m else "?"
    res.update(status=status, seconds=time.perf_counter() - t0, env=extra)
    # One log for every case (a device call brings back at most 8 files), each case's part capped.
    if len(text) > LOG_CAP:
        text = text[: LOG_CAP // 4] + "\n[... cut ...]\n" + text[-(LOG_CAP * 3 // 4) :]
    with open(OUT / "mooncake_probe_cases.log", "a") as f:
        f.write(f"===== {name}: {' '.join(f'{k}={v}' for k, v in extra.items())} {status}\n{text}\n")
    return res


def table(results: list[dict]) -> None:
    print(f"\n{'case':13s} {'transport':17s} {'combo':13s} {'op':15s} {'size':>9s} {'rc':>6s} {'GB/s':>8s}  verify / note")
    for r in results:
        for run in r["runs"] or [{}]:
            rc = ",".join(str(x) for x in run.get("rc", [])) or "-"
            gbps = f"{run['GBps']:.2f}" if "GBps" in run else ""
            size = f"{run['size'] // MiB} MiB" if "size" in run else ""
            print(f"{r['case']:13s} {r.get('transport', ''):17s} {run.get('combo', ''):13s} {run.get('op', ''):15s} {size:>9s} "
                  f"{rc[:6]:>6s} {gbps:>8s}  {run.get('verify', run.get('note', r.get('error', r['status'])))}")
        if r["case"] != "torch_p2p":
            regs = {k: v.get("reg_rc") for k, v in (r.get("target") or {}).get("buffers", {}).items()}
            print(f"{'':13s} register_memory: source {r.get('src_reg')}, destination {regs}; {r['status']}"
                  + (f"; {r['error']}" if r.get("error") else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("main", "target", "initiator", "torch_p2p"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES), help=f"which cases (default {','.join(CASES)})")
    ap.add_argument("--sizes", default="64,1024", help="MiB per write (default 64,1024)")
    ap.add_argument("--reps", type=int, default=3, help="timed sync writes per size (default 3; fewer when one takes > 3 s)")
    ap.add_argument("--src-dev", type=int, default=0, help="GPU of the initiator (default 0)")
    ap.add_argument("--dst-dev", type=int, help="GPU of the target (default 1, or 0 on a one-GPU host)")
    args = ap.parse_args()
    if args.role != "main":
        {"target": target, "initiator": initiator, "torch_p2p": torch_p2p}[args.role](args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/mooncake_cuda_probe.py needs a CUDA device")
        return 2
    if args.dst_dev is None:
        args.dst_dev = 1 if torch.cuda.device_count() >= 2 else 0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mooncake_probe_cases.log").unlink(missing_ok=True)
    env = case_env()
    build = subprocess.run([sys.executable, "-c", "from kvd.backends.mooncake import build_info; print(build_info().describe())"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    print(f"GPUs {args.src_dev} -> {args.dst_dev} of {torch.cuda.device_count()} ({torch.cuda.get_device_name(args.src_dev)}), "
          f"torch {torch.__version__}; mooncake: {(build.stdout or build.stderr).strip().splitlines()[-1:]}", flush=True)
    results = []
    for name in args.cases.split(","):
        results.append(run_case(name, args, env))
        print(f"--- {name}: {results[-1]['status']} in {results[-1]['seconds']:.1f} s", flush=True)
    table(results)
    (OUT / "mooncake_probe.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\nJSON and the cases' logs in {OUT}")
    bad = [r for r in results if any(run.get("verify") == "MISMATCH" for run in r["runs"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
