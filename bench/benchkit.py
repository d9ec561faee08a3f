"""What the CPU benchmarks share: a kvd daemon in its own process, a decode engine's waiting in
its own process (:class:`ApartWaiter`), and CPU accounting so a report can say how busy the
machine was while it measured (these VMs are noisy).

    python bench/benchkit.py waiter ADDRESS NAME    # the ApartWaiter's process (started by it)
"""

from __future__ import annotations

import argparse

import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class BenchDaemon:
    """``python -m kvd.cli serve`` on a private Unix socket (plus TCP loopback if asked)."""

    proc: subprocess.Popen
    unix: str
    tmp: str
    tcp: str | None = None
    metrics_port: int | None = None  # when started with --metrics-port

    @classmethod
    def spawn(cls, *args: str, cpus: set[int] | None = None, root: str = ROOT) -> BenchDaemon:
        """Start the process; call :meth:`wait_ready` before use (spawn several, then wait:
        their start-ups overlap). ``cpus``: run it (every thread) on these cores only. ``root``:
        the checkout whose kvd it runs (another one's: a baseline in the same run)."""
        tmp = tempfile.mkdtemp(prefix="kvd-bench-")
        sock = os.path.join(tmp, "kvd.sock")
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen-unix", sock, "--log-level", "WARNING", *args]
        # root first, then whatever the caller had (a GPU machine's extra packages live there).
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": path}, preexec_fn=pin)
        return cls(proc, f"unix:{sock}", tmp)

    def wait_ready(self) -> BenchDaemon:
        """Wait for the "serving" line (recording the TCP address), then keep draining the
        daemon's output so the pipe never fills and blocks it."""
        seen = []
        for line in self.proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            m = re.match(r"kvd: serving on (.*?)(;|$)", line.strip())
            if m:
                self.tcp = next((a for a in m.group(1).split(", ") if not a.startswith("unix:")), None)
                port = re.search(r"metrics on :(\d+)", line)
                self.metrics_port = int(port.group(1)) if port else None
                break
        if self.proc.poll() is not None or not os.path.exists(self.unix[len("unix:"):]):
            self.stop()
            raise RuntimeError(f"daemon did not start: {' '.join(self.proc.args)}\n{''.join(seen)}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        return self

    def rpc_clock(self) -> dict[str, tuple[float, int]]:
        """Per method, ``(seconds, calls)`` the daemon's ``kvd_rpc_duration_seconds`` holds now
        (every status code summed): its own clock of each engine call, from the frame's head
        read (the engine socket) or the call's start (gRPC) to the reply sent. Needs
        ``--metrics-port``; the scrape is the daemon's HTTP thread, not one of its calls."""
        from prometheus_client.parser import text_string_to_metric_families

        if self.metrics_port is None:
            raise RuntimeError("rpc_clock: the daemon was started without --metrics-port")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, list[float]] = {}
        for fam in text_string_to_metric_families(text):
            if fam.name != "kvd_rpc_duration_seconds":
                continue
            for sm in fam.samples:
                got = out.setdefault(sm.labels["method"], [0.0, 0.0])
                if sm.name.endswith("_sum"):
                    got[0] += sm.value
                elif sm.name.endswith("_count"):
                    got[1] += sm.value
        return {k: (v[0], int(v[1])) for k, v in out.items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


class ApartWaiter:
    """The decode engine as another process, as in a deployment: its own interpreter (so its
    replies are not decoded under the sender's GIL) and its own session on the decode daemon
    (``Client.connect(address)``), driven over a pipe, off the timed path: :meth:`receive`
    allocates requests ``receive=True`` with their RECV leases and gives their tickets,
    :meth:`arm` starts a WaitReady per request and returns once each is about to be issued,
    :meth:`collect` gives each answer with the moment it arrived there (``time.perf_counter()``,
    CLOCK_MONOTONIC on Linux: comparable with this process's clock), :meth:`free` frees.
    Commands are JSON lines on the child's stdin; every answer is one JSON line on its stdout
    (``{"error": ...}`` for a refusal, raised here as RuntimeError)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @classmethod
    def spawn(cls, address: str, name: str) -> ApartWaiter:
        """Start the process; call :meth:`wait_started` before use (spawn several, then wait)."""
        clock = time.get_clock_info("perf_counter").implementation
        if "CLOCK_MONOTONIC" not in clock:  # another process's stamps would be on another clock
            raise RuntimeError(f"perf_counter is {clock}, not CLOCK_MONOTONIC: stamps of two processes do not compare")
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, os.path.abspath(__file__), "waiter", address, name]
        return cls(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                    env={**os.environ, "PYTHONPATH": path}))

    def _ask(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        return self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"waiter process {' '.join(self.proc.args[-2:])} exited with {self.proc.wait()}")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(f"waiter process: {got['error']}")
        return got

    def wait_started(self) -> ApartWaiter:
        """Block until the child holds its session (and a few warm connections)."""
        self._answer()
        return self

    def receive(self, reqs: list[tuple[str, int]], *, one_call: bool = False) -> tuple[dict[str, bytes], float]:
        """Allocate each ``(rid, tokens)`` receive=True and take its RECV lease (``one_call``:
        ``allocate_recv``; else allocate + acquire_lease, compacting once on CapacityError);
        returns the tickets and the seconds the calls took in the child."""
        got = self._ask(op="receive", reqs=reqs, one_call=one_call)
        return {rid: bytes.fromhex(t) for rid, t in got["tickets"].items()}, got["s"]

    def arm(self, rids: list[str], timeout: float = 120.0) -> None:
        """Start WaitReady for each of ``rids`` (a thread each, in the child); returns when every
        thread is about to issue its call (give it a head start before the Send)."""
        self._ask(op="wait", rids=rids, timeout=timeout)

    def collect(self) -> dict[str, tuple[Any, float]]:
        """The armed WaitReady answers: per rid, its TransferStatus and the child's perf_counter()
        when it arrived."""
        from kvd.client import TransferStatus
        from kvd.records import TransferState

        got = self._answer()
        return {rid: (TransferStatus(rid, TransferState(x["state"]), x["reason"], x["nbytes"]), x["at"]) for rid, x in got["ready"].items()}

    def free(self, rids: list[str]) -> float:
        """Free ``rids``; the seconds the call took in the child."""
        return self._ask(op="free", rids=rids)["s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]  -- EOF: the child closes its session and exits
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _waiter_main(address: str, name: str) -> None:
    """The :class:`ApartWaiter` child: one session on ``address``, commands from stdin."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing else may write to the answer pipe
    from kvd.client import Client
    from kvd.errors import CapacityError

    pc = time.perf_counter
    c = Client.connect(address, name=name, timeout=300)
    # Warm a few connections (a WaitReady holds one until its answer): echoes at once.
    echoes = [threading.Thread(target=c.echo) for _ in range(8)]
    for t in echoes:
        t.start()
    for t in echoes:
        t.join()
    out.write(json.dumps({"started": c.session_id}) + "\n")
    waiters: list[threading.Thread] = []
    ready: dict[str, dict] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "receive":
                a, tickets = pc(), {}
                for rid, tokens in cmd["reqs"]:
                    if cmd["one_call"]:
                        tickets[rid] = c.allocate_recv(rid, tokens)[1].ticket.hex()
                        continue
                    try:
                        c.allocate(rid, tokens, receive=True)
                    except CapacityError:
                        c.compact()
                        c.allocate(rid, tokens, receive=True)
                    tickets[rid] = c.acquire_lease(rid, "recv").ticket.hex()
                answer: dict = {"tickets": tickets, "s": pc() - a}
            elif cmd["op"] == "wait":
                ready = {}
                going = [threading.Event() for _ in cmd["rids"]]

                def wait(rid: str, going: threading.Event, timeout: float = cmd["timeout"]) -> None:
                    going.set()
                    st = c.wait_ready(rid, timeout)
                    at = pc()  # the answer is in: the decode engine may go on
                    ready[rid] = {"state": st.state.value, "reason": st.reason, "nbytes": st.nbytes, "at": at}

                waiters = [threading.Thread(target=wait, args=(rid, g)) for rid, g in zip(cmd["rids"], going)]
                for t in waiters:
                    t.start()
                for g in going:
                    g.wait()
                out.write(json.dumps({"armed": len(waiters)}) + "\n")
                for t in waiters:
                    t.join()
                missing = [rid for rid in cmd["rids"] if rid not in ready]
                answer = {"error": f"WaitReady raised for {missing} (see the traceback above)"} if missing else {"ready": ready}
            elif cmd["op"] == "free":
                a = pc()
                c.free(*cmd["rids"])
                answer = {"s": pc() - a}
            else:
                answer = {"error": f"unknown op {cmd['op']!r}"}
        except Exception as exc:  # noqa: BLE001 -- the parent raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
    c.close()


def add_baseline_tree(ap: argparse.ArgumentParser) -> None:
    """``--baseline-tree DIR``: another checkout's kvd, run the same way in the same run."""
    ap.add_argument("--baseline-tree", default=None, metavar="DIR", help="another checkout's kvd, run the same way")


def trees(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(name, checkout root)`` to run: this one, then ``--baseline-tree``'s as "base"."""
    return [("this", ROOT)] + ([("base", os.path.abspath(args.baseline_tree))] if args.baseline_tree else [])


def cpu_set(spec: str) -> set[int]:
    """``"2-5,8"`` -> {2, 3, 4, 5, 8} (the taskset list syntax)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_model() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def cpu_snap() -> tuple[float, float]:
    """(all CPUs' total seconds, busy seconds) from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    hz = os.sysconf("SC_CLK_TCK")
    return sum(v) / hz, (sum(v) - v[3] - v[4]) / hz  # idle and iowait are not busy


def others_line(cpu0: tuple[float, float], own0: float) -> str:
    """How much CPU processes other than this bench (and its children) used since ``cpu0`` /
    ``own0`` (from :func:`cpu_snap` / :func:`own_cpu`), as a report line that flags a busy machine."""
    (tot0, busy0), (tot1, busy1) = cpu0, cpu_snap()
    others = max(0.0, (busy1 - busy0) - (own_cpu() - own0))
    share = others / max(1e-9, tot1 - tot0)
    return f"other processes used {others:.1f} CPU-s ({share:.0%} of the machine)" + (
        "; the numbers are disturbed, run again on a quiet machine" if share > 0.05 else ""
    )


def own_cpu() -> float:
    """CPU seconds of this process and its waited-for children (the daemons, the clients)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def med(xs: list[float]) -> float:
    """The median, NaN for nothing measured."""
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (the sample at rank ``q * n``), NaN for nothing measured."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def log_uniform(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` token counts, log-uniform in [``lo``, ``hi``], fixed by ``seed`` (a mixed workload)."""
    rnd = random.Random(seed)
    return [int(round(math.exp(rnd.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


if __name__ == "__main__":
    if sys.argv[1:2] != ["waiter"] or len(sys.argv) != 4:
        sys.exit("usage: benchkit.py waiter ADDRESS NAME")
    _waiter_main(sys.argv[2], sys.argv[3])
