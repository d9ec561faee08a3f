"""Helpers for the tier-2 daemon tests: start a daemon in-process or as a subprocess, wait for
conditions, assert kvd errors together with their gRPC status codes, scrape metrics.

Not a test module (no ``test_`` prefix); ``tests/daemon/conftest.py``, the handoff, deploy and GPU
tests import it as ``daemon_kit`` (``tests/kits`` is on the path: pyproject's pytest ``pythonpath``).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvd import errors as E
from kvd.memory.arena import ShmArena
from kvd.client import Client
from kvd.config import load_settings
from kvd.records import NodeStats
from kvd.server.app import Daemon

#: One small arena for every daemon here: 512 full pages of tiny-hybrid (2 KiB each).
ARENA_BYTES = 1 << 20
#: Defaults for test daemons: short TTLs so expiry tests run in well under a second.
DAEMON_DEFAULTS: dict[str, Any] = dict(
    arena_bytes=ARENA_BYTES,
    session_ttl_s=3.0,
    lease_ttl_s=5.0,
    sweep_interval_s=0.05,
    grace_s=1.0,
)

REPO = Path(__file__).resolve().parents[2]
#: /dev/shm paths of every arena a daemon started here created (checked at the end of the session).
ARENAS: list[str] = []
#: the subset whose daemon was stopped here (a daemon still serving another test folder is not checked)
STOPPED: set[str] = set()


def rid(prefix: str = "r") -> str:
    """A request id no other test uses (the subprocess daemon is shared by a whole session)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def counted(client: Client) -> list[str]:
    """The names of the calls ``client`` makes from now on, at its transport's own entry (a call
    answered from a doorbell never shows; a wait a gRPC daemon refused and the client sent again
    shows once)."""
    seen: list[str] = []
    raw = client._raw

    def spy(method: str, request: Any, timeout: float | None) -> Any:
        seen.append(method)
        return raw(method, request, timeout)

    client._raw = spy  # type: ignore[method-assign]
    return seen


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; fail the test naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def expect(cls: type[E.KvdError], code: grpc.StatusCode, phrase: str) -> Iterator[pytest.ExceptionInfo]:
    """The block raises exactly ``cls`` (not a subclass), caused by an RpcError with ``code``,
    and its message contains ``phrase``."""
    with pytest.raises(E.KvdError) as info:
        yield info
    exc = info.value
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    cause = exc.__cause__
    assert isinstance(cause, grpc.RpcError), f"{type(exc).__name__} was not raised from a grpc.RpcError: {cause!r}"
    assert cause.code() == code, f"status {cause.code()} != {code} ({exc})"
    assert phrase in str(exc), f"{phrase!r} not in message {str(exc)!r}"


@contextlib.contextmanager
def expect_rpc(code: grpc.StatusCode, phrase: str, kvd_error: str | None = None) -> Iterator[pytest.ExceptionInfo]:
    """A raw stub call fails with ``code``, ``phrase`` in its details and, if given, the
    ``kvd-error`` trailing metadata naming the exception class."""
    with pytest.raises(grpc.RpcError) as info:
        yield info
    err = info.value
    assert err.code() == code, f"status {err.code()} != {code} ({err.details()})"
    assert phrase in (err.details() or ""), f"{phrase!r} not in details {err.details()!r}"
    if kvd_error is not None:
        md = dict(err.trailing_metadata() or ())
        assert md.get("kvd-error") == kvd_error, f"kvd-error {md.get('kvd-error')!r} != {kvd_error!r}"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- daemons -------------------------------------------------------------------------------


@dataclass
class Target:
    """A running daemon as the tests see it. ``node`` is set for the in-process kind only."""

    kind: str  # "inproc" | "subproc"
    unix: str  # "unix:/path"
    tcp: str  # "127.0.0.1:port"
    metrics_port: int
    region_id: str
    node: Any = None
    daemon: Daemon | None = None
    proc: subprocess.Popen | None = None
    clients: list = field(default_factory=list)
    #: how connect() reaches the Unix address: "fast" (the engine socket) or "grpc" (TCP is gRPC)
    transport: str = "fast"

    def connect(self, *, tcp: bool = False, **kw: Any) -> Client:
        kw.setdefault("transport", "grpc" if tcp else self.transport)
        c = Client.connect(self.tcp if tcp else self.unix, **kw)
        self.clients.append(c)
        return c

    def snapshot(self, client: Client) -> NodeStats:
        """The node's stats: read in-process when we can, else over the wire."""
        return self.node.stats() if self.node is not None else client.stats()

    def check(self) -> None:
        """Every invariant of the node (in-process only: a subprocess's node is out of reach)."""
        if self.node is not None:
            self.node.check()

    def close_clients(self) -> None:
        while self.clients:
            self.clients.pop().close()


def start_inproc(tmp_path: Path, **overrides: Any) -> Target:
    """A daemon in this process. Metrics are off unless ``metrics_port`` is given: stopping the
    exporter's HTTP server takes half a second (its poll interval), too slow for every test."""
    settings = load_settings(
        **{**DAEMON_DEFAULTS, "listen_unix": str(tmp_path / "kvd.sock"), "listen_tcp": "127.0.0.1:0", **overrides}
    )
    d = Daemon.start(settings)
    unix = next(a for a in d.addresses if a.startswith("unix:")) if settings.listen_unix else ""
    tcp = next(a for a in d.addresses if not a.startswith("unix:")) if settings.listen_tcp else ""
    if isinstance(d.node.pool.arena, ShmArena):  # a CUDA arena leaves no file to check for
        ARENAS.append(d.node.pool.arena.path)
    port = d.metrics.port if d.metrics and d.metrics.port else 0
    return Target("inproc", unix, tcp, port, d.node.pool.arena.region_id, node=d.node, daemon=d)


def stop_inproc(t: Target) -> None:
    t.close_clients()
    assert t.daemon is not None
    t.daemon.stop(0)
    STOPPED.add(f"/dev/shm/{t.region_id}")
    assert not os.path.exists(f"/dev/shm/{t.region_id}"), f"arena file {t.region_id} left in /dev/shm"
    assert not os.path.exists(t.unix.removeprefix("unix:")), "socket file left behind"


_SERVING = re.compile(r"kvd: serving on unix:(?P<unix>\S+), (?P<tcp>127\.0\.0\.1:\d+); metrics on :(?P<metrics>\d+)")


def serve_args(tmp_path: Path, *extra: str, **overrides: Any) -> list[str]:
    """``serve`` and its flags as :func:`start_subproc` runs it (the test defaults, ``overrides``)."""
    argv = ["serve", "--listen-unix", str(tmp_path / "kvd.sock"), "--listen-tcp", "127.0.0.1:0", "--metrics-port", "0", *extra]
    for k, v in {**DAEMON_DEFAULTS, **overrides}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def start_subproc(tmp_path: Path, *extra: str, nofile: tuple[int, int] | None = None, **overrides: Any) -> Target:
    """``python -m kvd.cli serve`` on a Unix socket and loopback port 0; waits for its banner.
    ``nofile``: the (soft, hard) limit on open files it starts with."""
    argv = [sys.executable, "-m", "kvd.cli", *serve_args(tmp_path, *extra, **overrides)]
    err = open(tmp_path / "daemon.stderr", "w")  # noqa: SIM115 -- the child holds it open
    limit = None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, preexec_fn=limit)
    err.close()
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        m = _SERVING.search(line)
        if not m:
            proc.kill()
            proc.wait(5)
            pytest.fail(f"daemon did not start: stdout {line!r}, stderr {(tmp_path / 'daemon.stderr').read_text()}")
        unix, tcp = f"unix:{m['unix']}", m["tcp"]
        with Client.connect(unix, name="probe") as c:
            region = c.info().envelopes[0].region_id
        ARENAS.append(f"/dev/shm/{region}")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        raise
    return Target("subproc", unix, tcp, int(m["metrics"]), region, proc=proc)


def stop_subproc(t: Target, timeout: float = 10.0) -> int:
    """SIGTERM the daemon and wait; kill it if it does not exit. Returns the exit status."""
    t.close_clients()
    STOPPED.add(f"/dev/shm/{t.region_id}")
    p = t.proc
    assert p is not None
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    if p.stdout:
        p.stdout.close()
    return p.returncode


@contextlib.contextmanager
def child(code: str, *args: str, timeout: float = 30.0) -> Iterator[subprocess.Popen]:
    """A ``python -c code args...`` subprocess (text stdout), killed at the end if still alive."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout)
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]
