"""Operating a daemon: health, reflection, metrics, ``kvd status``, SIGTERM, and the arena shared
with a second process (DESIGN §3 attach, §6 observability)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import weakref

import grpc
import proc_kit
import pytest
import torch
from daemon_kit import (
    REPO,
    child,
    expect,
    rid,
    samples,
    scrape,
    serve_args,
    start_inproc,
    start_subproc,
    stop_inproc,
    stop_subproc,
    wait_for,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from google.protobuf import descriptor_pb2

from kvd import errors as E
from kvd.cli import main as cli_main
from kvd.client import Client, TransferState
from kvd.rpc.engine_wire import fast_path
from kvd.v1 import kvd_pb2 as pb

C = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_health_and_reflection(target, via):
    with grpc.insecure_channel(getattr(target, via)) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvd.v1.Kvd", "kvd.v1.Peer"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="kvd.v1.Nope"), timeout=5)
        assert info.value.code() == C.NOT_FOUND

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvd.v1.Kvd"),
        ]
        listed, found = list(refl.ServerReflectionInfo(iter(reqs), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"kvd.v1.Kvd", "kvd.v1.Peer", "grpc.health.v1.Health"} <= names
    fd = descriptor_pb2.FileDescriptorProto.FromString(found.file_descriptor_response.file_descriptor_proto[0])
    assert fd.name == "kvd/v1/kvd.proto" and fd.package == "kvd.v1"
    served = {s.name: [m.name for m in s.method] for s in fd.service}
    assert served["Kvd"] == [m.name for m in pb.DESCRIPTOR.services_by_name["Kvd"].methods]
    assert served["Peer"] == ["CheckTicket", "Commit", "AbortReceive", "AbortSend", "Heartbeat", "TransferMetadata"]


@pytest.fixture(params=["inproc", "subproc"])
def metered(request, tmp_path, transport):
    """A daemon with its metrics endpoint on (in-process: one of its own; subprocess: the shared one)."""
    if request.param == "subproc":
        yield request.getfixturevalue("subproc")
        return
    t = start_inproc(tmp_path, metrics_port=0)
    t.transport = transport
    yield t
    stop_inproc(t)


def test_metrics_expose_every_series(metered):
    t = metered
    c = t.connect(name="metered")
    rs = [rid(f"m{i}") for i in range(4)]
    vs = c.allocate_many([(r, 16) for r in rs])
    c.free(rs[0], rs[1])
    lease = c.acquire_lease(rs[2], "recv")
    with pytest.raises(E.Pinned):
        c.compact()
    c.compact(around_pinned=True)
    with pytest.raises(E.NotFound):
        c.vectors("no-such")
    with pytest.raises(E.StaleEpoch):
        c.acquire_lease(rs[3], "send", vectors=vs[3])  # rs[3] moved in the compaction
    expired = c.stats().leases_expired_total  # the shared daemon has a past
    c.acquire_lease(rs[3], "send", ttl=0.05)
    # at least one more: another test's lease on the shared daemon may expire in the same sweep
    wait_for(lambda: c.stats().leases_expired_total >= expired + 1, 3.0, "the short lease to expire")
    text = scrape(t.metrics_port)
    st = c.stats()
    s = samples(text)

    def v(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in s, f"{name}{labels} missing from /metrics"
        return s[key]

    p = st.pool
    assert v("kvd_pool_reserved_bytes") == p.reserved_bytes == 1 << 20
    assert v("kvd_pool_backed_bytes") == p.backed_bytes
    assert v("kvd_pool_gap_bytes") == p.gap_bytes
    for g in p.groups:
        assert v("kvd_group_used_bytes", group=g.name) == g.used_pages * g.page_bytes
        assert v("kvd_group_pages_used", group=g.name) == g.used_pages
        assert v("kvd_group_pages_free", group=g.name) == g.free_pages
        assert v("kvd_group_pages_capacity", group=g.name) == g.capacity_pages
    assert v("kvd_group_pages_used", group="full") >= 8  # rs[2] and rs[3]: 4 pages each
    assert v("kvd_requests_live") == p.requests_live >= 2
    assert v("kvd_leases_live") == st.leases_live >= 1
    assert v("kvd_leases_expired_total") == st.leases_expired_total >= 1
    assert v("kvd_sessions_live") == st.sessions_live >= 1
    assert v("kvd_compactions_total", outcome="done") == p.compactions_done >= 1
    assert v("kvd_compactions_total", outcome="refused") == p.compactions_refused >= 1
    assert v("kvd_stale_epoch_refusals_total") == st.stale_refusals_total >= 1
    # RPC latency by method and final status code
    ok = v("kvd_rpc_duration_seconds_count", method="Allocate", code="OK")
    assert ok >= 1 and v("kvd_rpc_duration_seconds_bucket", method="Allocate", code="OK", le="+Inf") == ok
    assert v("kvd_rpc_duration_seconds_sum", method="Allocate", code="OK") > 0
    assert v("kvd_rpc_duration_seconds_count", method="GetVectors", code="NOT_FOUND") >= 1
    assert v("kvd_rpc_duration_seconds_count", method="Compact", code="FAILED_PRECONDITION") >= 1
    assert v("kvd_rpc_duration_seconds_count", method="AcquireLease", code="FAILED_PRECONDITION") >= 1
    assert "# TYPE kvd_rpc_duration_seconds histogram" in text
    # the process's own series, as any Python exporter has them
    assert v("process_resident_memory_bytes") > 0 and v("process_open_fds") > 0
    assert v("python_gc_collections_total", generation="2") >= 0
    assert any(k[0] == "python_info" for k in s)
    c.release_lease(lease.lease_id)


def test_settle_heap_freezes_what_lives_and_still_collects_garbage():
    """serve() freezes the started daemon's heap: a full collection no longer walks it (a 100+ ms
    stall of every call), and cycles made afterwards are still collected."""
    from kvd.server.app import settle_heap

    class Node:
        pass

    try:
        frozen = settle_heap()
        # Other threads of this worker (daemons of earlier tests winding down) may free frozen
        # objects meanwhile: the count only drops that way, by a little.
        assert frozen > 10_000 and frozen * 0.99 <= gc.get_freeze_count() <= frozen  # pytest, torch, grpc: all of it
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        assert dead() is None
        assert frozen * 0.99 <= gc.get_freeze_count() <= frozen  # collections leave the frozen alone (unfrozen: 0)
    finally:
        gc.unfreeze()


def test_cli_status_prints_the_pool(subproc, inproc, capsys):
    c = subproc.connect()
    c.allocate(rid(), 40)
    epoch = c.info().epoch
    r = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "status", "--address", subproc.tcp],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"epoch={epoch}" in out and "layout=tiny-hybrid" in out
    for group in ("full", "swa", "state", "draft"):
        assert re.search(rf"^{group}\s+(up|down|float)\s", out, re.M), out
    assert re.search(r"^full\s+down\s+2\.0 KiB\s+10\s", out, re.M), out  # used pages: 40 tokens / 4 per page
    assert "requests  live=1" in out
    # In-process main() against the in-process daemon, and against nothing.
    assert cli_main(["status", "--address", inproc.unix]) == 0
    assert "epoch=1" in capsys.readouterr().out
    assert cli_main(["status", "--address", inproc.unix + ".missing"]) == 2
    assert "Unavailable" in capsys.readouterr().err


def _sigterm_a_thread(pid: int) -> None:
    """SIGTERM one of ``pid``'s threads other than its main thread (``tgkill``), as the kernel may
    deliver a signal sent to the process."""
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, "the daemon runs no thread but its main one"
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    if tgkill(pid, others[-1], signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.parametrize("to", ["process", "thread"])
def test_sigterm_drains_and_cleans_up(tmp_path, to):
    """SIGTERM drains the daemon whichever of its threads the kernel hands it to: a signal that
    landed on a grpc or kvd thread was never handled (the main thread slept in a lock), and the
    daemon ran on until it was killed undrained -- seen as a health Watch waiting out its deadline."""
    t = start_subproc(tmp_path, grace_s=0.3)
    try:
        c = t.connect()
        c.allocate(rid(), 8)
        shm = f"/dev/shm/{t.region_id}"
        assert os.path.exists(shm) and os.path.exists(t.unix.removeprefix("unix:"))
        with grpc.insecure_channel(t.tcp) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="kvd.v1.Kvd"), timeout=20)
            assert next(watch).status == SERVING
            if to == "thread":
                _sigterm_a_thread(t.proc.pid)
            else:
                t.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING  # reported before the drain
            assert t.proc.wait(10) == 0
        with expect(E.Unavailable, C.UNAVAILABLE, "UNAVAILABLE"):
            c.stats()
        assert not os.path.exists(t.unix.removeprefix("unix:")), "socket file left behind"
        assert not os.path.exists(shm), "arena file left in /dev/shm"
        assert "signal 15: draining" in (tmp_path / "daemon.stderr").read_text()
    finally:
        assert stop_subproc(t) == 0


_HELD_START = """
import argparse, sys
from kvd.cli import cmd_serve, serve_parser

def hold(daemon):  # the start-up, held until the test says go
    print("starting", flush=True)
    sys.stdin.readline()

ap = argparse.ArgumentParser()
serve_parser(ap.add_subparsers(dest="cmd", required=True))
sys.exit(cmd_serve(ap.parse_args(sys.argv[1:]), on_start=hold))
"""


def test_a_sigterm_during_start_up_stops_the_daemon_once_started(tmp_path):
    """A SIGTERM before the daemon announced itself (a pod deleted while it starts: torch, the
    arena, the backend take seconds) stops it once started, cleanly and without announcing it.
    Before, it had no handler yet: as a container's PID 1 the kernel dropped the signal and the
    pod waited out its grace period; as here, not PID 1, it died undrained, its files left."""
    sock = tmp_path / "kvd.sock"
    p = subprocess.Popen([sys.executable, "-c", _HELD_START, *serve_args(tmp_path, grace_s=0.3)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert p.stdout.readline() == "starting\n", p.stderr.read()  # type: ignore[union-attr]
        with Client.connect(f"unix:{sock}", name="probe") as c:
            shm = f"/dev/shm/{c.info().envelopes[0].region_id}"
        assert os.path.exists(shm)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert p.poll() is None, f"a SIGTERM during start-up killed the daemon (exit {p.returncode}), undrained"
        out, err = p.communicate("go\n", timeout=30)
        assert p.returncode == 0, err
        assert "kvd: serving" not in out, "a daemon told to stop while it started announced itself"
        assert "signal 15: draining" in err
        assert not sock.exists(), "socket file left behind"
        assert not os.path.exists(shm), "arena file left in /dev/shm"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)


_READER = """
import json, sys
import torch
from kvd.client import Client
addr, pb, pages, mark = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
with Client.connect(addr, name="reader") as c:
    att = c.attach()
    seen = [bytes(att.tensor[p * pb:(p + 1) * pb].numpy()).hex() for p in pages]
    att.tensor[mark * pb:(mark + 1) * pb] = torch.arange(pb).remainder(251).to(torch.uint8)
    att.close()
print(json.dumps({"session": c.session_id, "pages": seen}))
"""


def test_second_process_sees_the_bytes(target):
    c = target.connect(name="writer")
    r, other = rid("shared"), rid("mark")
    v, w = c.allocate_many([(r, 16), (other, 4)])
    att = c.attach()
    try:
        g = torch.Generator().manual_seed(3)
        for kv in att.views["full"]:
            kv.k[v.full.long()] = torch.randn(kv.k[v.full.long()].shape, generator=g)
            kv.v[v.full.long()] = torch.randn(kv.v[v.full.long()].shape, generator=g)
        pb_full = 2048
        mine = [bytes(att.tensor[p * pb_full:(p + 1) * pb_full].numpy()).hex() for p in v.full.tolist()]
        assert all(set(h) != {"0"} for h in mine)
        mark = int(w.full[0])
        with child(_READER, target.unix, str(pb_full), ",".join(map(str, v.full.tolist())), str(mark)) as p:
            out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        got = json.loads(out)
        assert got["session"] != c.session_id  # its own session
        assert got["pages"] == mine
        # ...and this process sees what the other one wrote.
        want = torch.arange(pb_full).remainder(251).to(torch.uint8)
        assert torch.equal(att.tensor[mark * pb_full:(mark + 1) * pb_full], want)
    finally:
        att.close()
    target.check()


def test_a_daemon_out_of_files_waits_quietly_and_serves_again(tmp_path):
    """A daemon at its open-file limit pauses its accept loops instead of spinning: accept()
    fails at once while the connection stays queued, and it used to try again at once, a core
    busy and a traceback logged per try (~2 MB/s), until files were freed. Now one error names
    the limit, the pending connection is served once files free up, and the metric counts the
    pauses."""
    limit = 160
    t = start_subproc(tmp_path, nofile=(limit, limit))
    hogs: list[socket.socket] = []
    try:
        grpc_path = t.unix.removeprefix("unix:")
        # Plain connections to the gRPC socket: grpc accepts each and holds its fd.
        while proc_kit.open_files(t.proc.pid) < limit and len(hogs) < 2 * limit:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(grpc_path)
            hogs.append(s)
            if len(hogs) % 16 == 0:
                time.sleep(0.05)  # let grpc accept what is queued
        wait_for(lambda: proc_kit.open_files(t.proc.pid) >= limit, timeout=10, what="the daemon at its open-file limit")
        # An engine connects to the fast socket: queued, not accepted while no file is free.
        engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        engine.connect(fast_path(grpc_path))
        # ...and a scraper to /metrics (prometheus_client's accept loop spun here too).
        scraper = socket.create_connection(("127.0.0.1", t.metrics_port))
        err = tmp_path / "daemon.stderr"
        wait_for(lambda: "fast socket on" in err.read_text(), timeout=10, what="the accept loop's error")
        wait_for(lambda: "metrics endpoint on" in err.read_text(), timeout=10, what="the metrics server's error")
        cpu0 = proc_kit.cpu_seconds(t.proc.pid)
        time.sleep(1.0)
        busy = proc_kit.cpu_seconds(t.proc.pid) - cpu0
        log = err.read_text()
        assert log.count("fast socket on") == 1 and "Traceback" not in log, log[-2000:]
        assert log.count("metrics endpoint on") == 1, log[-2000:]
        assert "cannot accept connections" in log
        assert f"this process may open {limit} files" in log
        assert "ulimit" in log  # the message says what to change
        assert busy < 0.5, f"the daemon used {busy:.2f} s of CPU in 1 s while it could not accept"
        engine.close()
        scraper.close()
        for s in hogs:
            s.close()
        hogs.clear()
        c = t.connect()  # the engine socket (and gRPC) serve again
        c.allocate(rid(), 8)
        wait_for(lambda: err.read_text().count("accepting connections again") >= 2, timeout=10, what="the accept loops back")
        starved = samples(scrape(t.metrics_port))
        assert starved[("kvd_socket_accept_starved_total", (("socket", "engine"),))] >= 1
        assert starved[("kvd_socket_accept_starved_total", (("socket", "metrics"),))] >= 1
    finally:
        for s in hogs:
            s.close()
        assert stop_subproc(t) == 0


def test_idle_connections_to_metrics_cost_the_daemon_a_bounded_number_of_threads(tmp_path, monkeypatch, caplog):
    """Clients that open connections to /metrics and send nothing (a scanner, a client that means
    harm): prometheus_client's server started a thread for each and read it without a timeout,
    for good -- 1,000 idle connections were 1,000 more daemon threads, still there 30 s later,
    until the daemon met its thread limit and its own threads (engine connections, Sends) could
    not start. Now at most METRICS_CONNECTIONS are served at once, each idle one is closed after
    METRICS_IDLE_S, and a scrape behind them is answered."""
    from kvd.server import metrics as m

    monkeypatch.setattr(m._MetricsHandler, "timeout", 0.5)
    t = start_inproc(tmp_path, metrics_port=0)
    idle: list[socket.socket] = []
    try:
        def serving() -> int:
            return sum(1 for th in threading.enumerate() if "process_request_thread" in th.name)

        assert scrape(t.metrics_port)  # served before
        for _ in range(8 * m.METRICS_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", t.metrics_port), timeout=10))
        wait_for(lambda: t.daemon.metrics.collector.http.waited >= 1, timeout=10, what="the metrics server at its bound")
        assert serving() <= m.METRICS_CONNECTIONS
        t0 = time.monotonic()
        assert "kvd_pool_reserved_bytes" in scrape_within(t.metrics_port, 30)  # behind all of them
        took = time.monotonic() - t0
        assert took < 8 * 0.5 + 5, f"a scrape waited {took:.1f} s behind {len(idle)} idle clients"
        for s in idle:  # each was closed by the daemon
            assert s.recv(1) == b""
        wait_for(lambda: serving() == 0, timeout=10, what="the idle connections' threads to end")
        assert "Traceback" not in caplog.text
        assert sum("the most it serves at once" in r.getMessage() for r in caplog.records) == 1
        c = t.connect()
        c.allocate(rid(), 8)  # the daemon serves on
    finally:
        for s in idle:
            s.close()
        stop_inproc(t)


def scrape_within(port: int, timeout: float) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def test_serve_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path):
    t = start_subproc(tmp_path, nofile=(256, 4096))
    try:
        limits = open(f"/proc/{t.proc.pid}/limits").read()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert row.split()[3:5] == ["4096", "4096"], row
    finally:
        assert stop_subproc(t) == 0


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_waits_over_grpc_never_take_every_thread(tmp_path, flavour):
    """More WaitReady calls over gRPC than the daemon has threads for them (an engine waiting on
    every pending transfer, or a client that means harm): the server's other calls -- a health
    check, another engine's call, a heartbeat -- are still answered at once, sessions live, and
    every wait still ends as its transfer does, within its timeout. Before, 16 blocked waits
    took all of gRPC's threads: a health check waited seconds (a kubelet restarts the pod) and
    sessions whose heartbeats queued were reaped for silence."""
    import asyncio

    from kvd.client import AsyncClient
    from kvd.handoff.inbox import inbox_of
    from kvd.server.service import GRPC_WAIT_SLOTS, GRPC_WORKERS

    t = start_inproc(tmp_path)
    rids = [rid(f"w{i}") for i in range(GRPC_WORKERS + 4)]
    allocated = threading.Event()
    got: dict[str, tuple[TransferState, float]] = {}

    def waits() -> None:  # the decode engine: a RECV lease on each request, then a wait on each
        if flavour == "sync":
            c = t.connect(tcp=True, name="waiter")
            for r in rids:
                c.allocate_recv(r, 8)
            allocated.set()

            def one(r: str) -> None:
                got[r] = (c.wait_ready(r, 8.0).state, time.monotonic())

            ths = [threading.Thread(target=one, args=(r,)) for r in rids]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            return

        async def run() -> None:
            async with await AsyncClient.connect(t.tcp, name="waiter", transport="grpc") as ac:
                for r in rids:
                    await ac.allocate_recv(r, 8)
                allocated.set()

                async def one(r: str) -> None:
                    got[r] = ((await ac.wait_ready(r, 8.0)).state, time.monotonic())

                await asyncio.gather(*(one(r) for r in rids))

        asyncio.run(run())

    waiter = threading.Thread(target=waits)
    try:
        t0 = time.monotonic()
        waiter.start()
        assert allocated.wait(10)
        time.sleep(0.5)  # every wait sent: GRPC_WAIT_SLOTS block, the rest are refused and call again
        with grpc.insecure_channel(t.tcp) as ch:
            h0 = time.monotonic()
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvd.v1.Kvd"), timeout=5)
            took = time.monotonic() - h0
        assert st.status == SERVING and took < 1.0, f"a health check took {took:.2f} s behind the waits"
        other = t.connect(tcp=True, name="other")
        e0 = time.monotonic()
        other.echo()
        assert time.monotonic() - e0 < 1.0, "another engine's call waited behind the waits"
        time.sleep(3.5)  # past the session TTL (3 s): the waiter's heartbeats were answered throughout
        assert t.node.stats().sessions_live == 2, "a session was reaped while its calls queued"
        assert not got, f"a wait ended before its transfer did, {min(at for _, at in got.values()) - t0:.2f} s after the start: {got}"
        a0 = time.monotonic()
        for r in rids:  # the transfers end (FAILED: aborted on this side, no sender began)
            inbox_of(t.node).abort_local(r, "ended by the test")
        waiter.join(15)
        assert not waiter.is_alive()
        assert sorted(got) == sorted(rids)
        assert all(s is TransferState.FAILED for s, _ in got.values()), got
        late = max(at for _, at in got.values()) - a0
        assert late < 2.0, f"a wait saw its transfer end {late:.2f} s after it did (refused waits call again every 0.2 s)"
        assert time.monotonic() - t0 < 9.0
        print(f"\n{len(rids)} waits over gRPC ({GRPC_WAIT_SLOTS} blocked at once): health check {took * 1000:.0f} ms; the last "
              f"wait ended {late * 1000:.0f} ms after its transfer")
    finally:
        for r in rids:
            with contextlib.suppress(Exception):
                inbox_of(t.node).abort_local(r, "test over")
        waiter.join(15)
        stop_inproc(t)
