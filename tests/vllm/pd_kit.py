"""Processes for the vLLM tier: kvd daemons, vLLM engines (tests/vllm/engine_proc.py), tickets.

Every engine and daemon is its own process; engines talk only to the daemon beside them."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENV = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1", HF_HUB_OFFLINE="1",
           TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
           VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")


def prompts(lengths: list[int], salt: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ids 4..511: no special tokens); another ``salt``, other
    prompts (prompt i of one length is a prefix of prompt i of a longer one, within a salt)."""
    return [[4 + ((i * 131 + j * 37 + j * j + salt * 8191) % 508) for j in range(n)] for i, n in enumerate(lengths)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVING = re.compile(r"kvd: serving on (?P<unix>unix:[^\s,;]+)")
_METRICS = re.compile(r"metrics on :(?P<port>\d+)")


@dataclass
class Daemon:
    proc: subprocess.Popen
    address: str
    log: Path
    metrics_port: int

    def rpc_counts(self) -> Counter[str]:
        """Calls this daemon answered so far (gRPC and the engine socket), by method, any status.
        Under pytest only (``daemon_kit`` is on its path; bench/vllm_pd.py imports this kit too)."""
        from daemon_kit import samples, scrape

        out: Counter[str] = Counter()
        for (name, labels), n in samples(scrape(self.metrics_port)).items():
            if name == "kvd_rpc_duration_seconds_count":
                out[dict(labels)["method"]] += int(n)
        return out

    @classmethod
    def start(cls, tmp: Path, name: str, layout: Path | str | None = None, *extra: str) -> Daemon:
        """A daemon on ``tmp/name.sock``; without ``layout`` it takes the first engine's (layout_from_engine)."""
        sock = tmp / f"{name}.sock"
        log = tmp / f"{name}.daemon.log"
        argv = [sys.executable, "-m", "kvd.cli", "serve", "--listen-unix", str(sock),
                *(["--layout", str(layout)] if layout else ["--layout-from-engine"]),
                "--backend", "local", "--arena-bytes", str(64 << 20), "--peer-timeout-s", "0.5", "--metrics-port", "0", *extra]
        err = open(log, "w")  # noqa: SIM115 -- the child holds it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
        err.close()
        line = proc.stdout.readline()  # type: ignore[union-attr]
        m, port = _SERVING.search(line), _METRICS.search(line)
        if not m or not port:
            proc.kill()
            raise RuntimeError(f"kvd daemon {name} did not start: {line!r} {log.read_text()[-2000:]}")
        return cls(proc, m["unix"], log, int(port["port"]))

    def restarted(self, layout: Path | None = None) -> Daemon:
        """This daemon stopped and a new one started on its socket: a new boot and arena, with
        ``layout`` (None: none until an engine proposes one); the old log kept beside as ``.1``."""
        self.stop()
        name = self.log.name.removesuffix(".daemon.log")
        self.log.replace(self.log.with_name(self.log.name + ".1"))
        return Daemon.start(self.log.parent, name, layout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def kv_config(role: str, address: str, **extra: object) -> str:
    return json.dumps({"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.connectors.vllm", "kv_role": role,
                       "kv_connector_extra_config": {"kvd_address": address, **extra}})


class Engine:
    """A vLLM engine process answering jobs on stdin (see engine_proc.py)."""

    def __init__(self, tmp: Path, name: str, model: str, kv: str | None = None, layout_out: Path | None = None,
                 env: dict | None = None, extra: list[str] | None = None) -> None:
        self.log = tmp / f"{name}.engine.log"
        argv = [sys.executable, str(HERE / "engine_proc.py"), model, *(extra or [])]
        if kv:
            argv += ["--kv", kv]
        if layout_out:
            argv += ["--layout-out", str(layout_out)]
        err = open(self.log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                     cwd=REPO, env={**os.environ, **ENV, **(env or {})})
        err.close()
        self.name = name
        # A thread reads stdout: select() on the pipe under a buffered reader hung the tier (the
        # READY or RESULT line sat in the reader's buffer behind a vLLM log line, the pipe empty).
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name=f"engine-{name}-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line)
        self._lines.put("")  # EOF: the engine died

    def ready(self, timeout: float = 240) -> Engine:
        line = self._line(timeout)
        if line.strip() != "READY":
            raise RuntimeError(f"engine {self.name} did not start: {line!r}\n{self.tail()}")
        return self

    def _line(self, timeout: float) -> str:
        """The next READY / RESULT line (vLLM logs to stdout too); '' once the engine died."""
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.dump_stacks()
                raise TimeoutError(f"engine {self.name}: no answer in {timeout} s\n{self.tail(12000)}") from None
            if not line:
                self._lines.put("")  # later calls see the EOF too
                return line
            if line.startswith(("READY", "RESULT ")):
                return line

    def submit(self, prompts: list[list[int]], params: list[dict | None] | None = None, max_tokens: int = 32) -> None:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params, "max_tokens": max_tokens}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def result(self, timeout: float = 240) -> dict:
        line = self._line(timeout)
        if not line.startswith("RESULT "):
            raise RuntimeError(f"engine {self.name}: {line!r}\n{self.tail()}")
        return json.loads(line[len("RESULT "):])

    def abort_after(self, prompts: list[list[int]], params: list[dict | None], steps: int) -> dict:
        """The prompts added, the engine stepped ``steps`` times, the unfinished ones aborted (a
        client gone mid-request), then a few idle steps: ``{"finished_before_abort": [...]}``."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params, "max_tokens": 1, "abort_after_steps": steps}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.result()

    def busy(self, prompts: list[list[int]], params: list[dict | None] | None, background: int, max_tokens: int = 1) -> dict:
        """The prompts added while ``background`` other requests decode: per prompt, the engine steps
        and seconds from its arrival to its first token (engine_proc.busy)."""
        job = {"prompts": prompts, "params": params, "max_tokens": max_tokens, "busy": background}
        self.proc.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.result()

    def run(self, prompts: list[list[int]], params: list[dict | None] | None = None, max_tokens: int = 32) -> dict:
        self.submit(prompts, params, max_tokens)
        return self.result()

    def dump_stacks(self) -> None:
        """Every thread's stack into the engine log (engine_proc registers SIGUSR1 with faulthandler)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)

    def copy_stats(self) -> dict:
        """The connector's CopyStats so far (engine started with a kv config)."""
        self.proc.stdin.write(json.dumps({"stats": True}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.result()["copy_stats"]

    def scheduler(self) -> dict:
        """``{"preemptions": n, "ticket_stats": {...} | None, "requests": n, "free_blocks": n,
        "blocks": n}``: requests the scheduler preempted so far, the decode connector's TicketStats
        (None without a ticket book), the requests vLLM holds now, its free and all KV blocks."""
        self.proc.stdin.write(json.dumps({"scheduler": True}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.result()

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait(5)


def ticket(port: int, prompt: list[int]) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/kvd/tickets", data=json.dumps({"prompt_token_ids": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def transfer(port: int, rid: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/kvd/transfers/{rid}", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def wait_state(port: int, rids: list[str], states: set[str], timeout: float = 60) -> list[dict | None]:
    end = time.monotonic() + timeout
    while True:
        st = [transfer(port, r) for r in rids]
        if all(s is not None and s["state"] in states for s in st) or time.monotonic() > end:
            return st
        time.sleep(0.05)


# -- OpenAI servers (vLLM's api_server) and `kvd proxy`, for the proxy's tier test and bench --

#: The servers' environment: the engine core in its own process (vLLM's default for a server).
SERVER_ENV = {k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
#: A chat template for the tiny tokenizer (it has none); give both servers the same one.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def start_server(tmp: Path, name: str, model: str, port: int, kv: str, *, max_len: int = 1024) -> subprocess.Popen:
    """``python -m vllm.entrypoints.openai.api_server`` on ``port`` with kvd's connector (``kv``);
    its log in ``tmp/name.server.log``. Not waited for: :func:`wait_up`."""
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = open(tmp / f"{name}.server.log", "w")  # noqa: SIM115 -- the child holds it
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port), "--model", model,
            "--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager", "--no-enable-prefix-caching",
            "--block-size", "32", "--seed", "0", "--chat-template", str(template), "--kv-transfer-config", kv]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **SERVER_ENV})


def wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Until ``url``/health answers; RuntimeError with the log's tail if ``proc`` exits or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise RuntimeError(f"no server on {url} after {timeout} s: {log.read_text()[-3000:]}")


def start_proxy(tmp: Path, name: str, prefill: list[str], decode: list[tuple[str, str]]) -> tuple[str, subprocess.Popen]:
    """``kvd proxy`` over ``prefill`` URLs and ``decode`` (URL, ticket URL) pairs, answering; its URL."""
    port = free_port()
    log = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "kvd.cli", "proxy", "--listen", f"127.0.0.1:{port}", "--prefill-timeout", "60"]
    for u in prefill:
        argv += ["--prefill", u]
    for u, t in decode:
        argv += ["--decode", u, "--tickets", t]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, log, 60)
    return url, proc


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
