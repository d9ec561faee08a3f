"""What the CPU benchmarks share: a kvd daemon in its own process, and CPU accounting so a
report can say how busy the machine was while it measured (these VMs are noisy)."""

from __future__ import annotations

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
from dataclasses import dataclass

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
    def spawn(cls, *args: str, cpus: set[int] | None = None) -> BenchDaemon:
        """Start the process; call :meth:`wait_ready` before use (spawn several, then wait:
        their start-ups overlap). ``cpus``: run it (every thread) on these cores only."""
        tmp = tempfile.mkdtemp(prefix="kvd-bench-")
        sock = os.path.join(tmp, "kvd.sock")
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen-unix", sock, "--log-level", "WARNING", *args]
        # ROOT first, then whatever the caller had (a GPU machine's extra packages live there).
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


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


def log_uniform(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` token counts, log-uniform in [``lo``, ``hi``], fixed by ``seed`` (a mixed workload)."""
    rnd = random.Random(seed)
    return [int(round(math.exp(rnd.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]
