"""The daemon's gRPC threads against calls that hold them (kvd.server.lanes).

grpcio's sync server keeps a pool thread for each call from before its request is read to its
last reply. Before the lanes, one pool of 16 served everything, so 16 open reflection streams or
16 unary calls whose request never came made every health check and kvd call wait. Each test
below holds more calls than the pool has threads, with real gRPC clients against a real daemon.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import proc_kit
import pytest
from daemon_kit import samples, scrape, start_inproc, start_subproc, stop_inproc, stop_subproc, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd.ipc.frames import MAX_REQUEST
from kvd.server.lanes import PEER_THREADS, REFLECTION_THREADS
from kvd.server.service import GRPC_WORKERS, TOKEN_KEY
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

HELD = GRPC_WORKERS + 4  # more than the main pool's threads


def _serving(address: str, timeout: float = 1.0) -> None:
    """A health check and a kvd call both answered within ``timeout`` (what a kubelet probe
    and a peer's Commit need), on a connection of their own."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        assert pb_grpc.KvdStub(ch).Echo(pb.EchoRequest(payload=b"ok"), timeout=timeout).payload == b"ok"


def _health_answers(address: str, timeout: float = 1.0) -> None:
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        assert got.status == health_pb2.HealthCheckResponse.SERVING


def _held_until(release: threading.Event, first: object) -> Iterator[object]:
    """A request stream that sends ``first`` (when given) and then nothing until ``release``."""
    if first is not None:
        yield first
    release.wait()


@contextlib.contextmanager
def _holding(
    address: str, start: Callable[[grpc.Channel, Iterator[object]], Any], first: object = None
) -> Iterator[tuple[list[Any], threading.Event]]:
    """HELD calls, each ``start(channel, requests)`` on a connection of its own, whose request
    streams send ``first`` (when given) and then nothing until the event is set (at the latest
    when the block ends, before their connections close)."""
    release = threading.Event()
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(HELD)]
    try:
        yield [start(ch, _held_until(release, first)) for ch in channels], release
    finally:
        release.set()
        for ch in channels:
            ch.close()


def _services(response: Any) -> set[str]:
    return {s.name for s in response.list_services_response.service}


def test_open_reflection_streams_hold_neither_kvds_calls_nor_health_checks(tmp_path):
    """A grpcui page or a stuck grpcurl keeps a reflection stream open. Twenty of them: health
    checks and kvd calls answer at once, reflection serves REFLECTION_THREADS of them, and once
    they close the queued ones are served and a new reflection call too."""
    t = start_inproc(tmp_path)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")

    def reflect(ch: grpc.Channel, requests: Iterator[object]) -> Any:
        return reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(requests)

    try:
        with _holding(t.tcp, reflect, ask) as (calls, release):
            # Which streams reach the lane's threads first is the server's to say: read every
            # stream's first answer on a thread of its own.
            answers: list[set[str] | None] = [None] * len(calls)

            def first(i: int) -> None:
                answers[i] = _services(next(calls[i]))

            readers = [threading.Thread(target=first, args=(i,), daemon=True) for i in range(len(calls))]
            for r in readers:
                r.start()
            end = time.monotonic() + 10
            while sum(a is not None for a in answers) < REFLECTION_THREADS and time.monotonic() < end:
                time.sleep(0.02)
            time.sleep(0.3)
            assert sum(a is not None for a in answers) == REFLECTION_THREADS, "the lane serves its threads' worth at once"
            _serving(t.tcp)
            _serving(t.unix)
            release.set()
            for r in readers:  # the queued ones are served once threads are free
                r.join(30)
            assert all(a is not None and "kvd.v1.Kvd" in a for a in answers), answers
            for c in calls:  # released: each ends after its one answer
                assert list(c) == []
        with grpc.insecure_channel(t.tcp) as ch:
            again = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([ask]), timeout=2)
            assert "kvd.v1.Kvd" in _services(next(again))
        t.check()
    finally:
        stop_inproc(t)


def test_health_checks_answer_while_calls_that_never_send_their_request_hold_kvds_threads(tmp_path):
    """Unary kvd calls whose request never comes (any gRPC client can start one: a request
    stream that yields nothing) hold the main pool's threads while their client lives: the
    kubelet's probe still answers. (kvd's own calls wait: the gap kvd.server.lanes names.)
    Released, each fails as the malformed call it is, and the daemon serves on. The lanes'
    gauges show it: every kvd thread busy and the rest queued, then none."""

    def echo(ch: grpc.Channel, requests: Iterator[object]) -> Any:
        call = ch.stream_unary("/kvd.v1.Kvd/Echo", request_serializer=bytes, response_deserializer=pb.EchoResponse.FromString)
        return call.future(requests)

    def lane(name: str) -> tuple[float, float, float]:
        got = samples(scrape(t.metrics_port))
        return tuple(got[(f"kvd_grpc_lane_{what}", (("lane", name),))] for what in ("threads", "busy_threads", "queued_calls"))  # type: ignore[return-value]

    t = start_inproc(tmp_path, metrics_port=0)
    try:
        with _holding(t.tcp, echo) as (futures, release):
            time.sleep(0.5)  # every call reached a thread
            assert not any(f.done() for f in futures)
            _health_answers(t.tcp)
            _health_answers(t.unix)
            assert lane("kvd") == (GRPC_WORKERS, GRPC_WORKERS, HELD - GRPC_WORKERS)
            assert lane("peer") == (PEER_THREADS, 0, 0)
            release.set()
            for f in futures:
                assert isinstance(f.exception(timeout=10), grpc.RpcError)
        _serving(t.tcp)
        wait_for(lambda: lane("kvd") == (GRPC_WORKERS, 0, 0), 5.0, "the kvd lane idle once the held calls ended")
        t.check()
    finally:
        stop_inproc(t)


_STALLED = r"""
import sys, threading, grpc
never = threading.Event()
def nothing():
    never.wait()
    yield b""
channels, calls = [], []
for _ in range(int(sys.argv[2])):
    ch = grpc.insecure_channel(sys.argv[1], options=[("grpc.use_local_subchannel_pool", 1)])
    channels.append(ch)
    calls.append(ch.stream_unary("/kvd.v1.Kvd/Echo", request_serializer=bytes, response_deserializer=bytes).future(nothing()))
print("ready", flush=True)
never.wait()
"""


def test_a_stopped_clients_calls_give_back_kvds_threads_within_the_keepalive(tmp_path):
    """A client process stopped (SIGSTOP: paused, swapped, its host frozen) with calls started
    and no request sent held the main pool's threads for as long as it stayed stopped (gRPC's
    own keepalive: two hours). The server pings its connections and drops one that does not
    answer: kvd calls are served again within about twice the keepalive."""
    keepalive_s = 0.5
    t = start_inproc(tmp_path, grpc_keepalive_s=keepalive_s)
    p = subprocess.Popen([sys.executable, "-c", _STALLED, t.tcp, str(HELD)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # its calls reached the daemon's threads
        proc_kit.stop(p.pid)
        t0 = time.monotonic()
        deadline = t0 + 10 * keepalive_s + 5
        while True:
            try:
                _serving(t.tcp, timeout=0.5)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert time.monotonic() < deadline, f"kvd's gRPC threads still held {time.monotonic() - t0:.1f} s after the client stopped"
        print(f"\nserved again {time.monotonic() - t0:.2f} s after the client stopped (keepalive {keepalive_s} s)")
        t.check()
    finally:
        p.kill()
        p.wait(10)
        stop_inproc(t)


def test_calls_queued_behind_busy_threads_do_not_bring_their_requests_into_the_daemon(tmp_path):
    """gRPC reads a call's request before a thread takes it, as far as flow control lets it, and
    its BDP probe widened the window until queued calls' whole requests sat in the daemon: a
    flood of calls with large requests behind busy threads grew it by their sum (64 calls of
    4 MB: ~256 MB). With the probe off each queued call holds at most its stream's first window.
    Once the threads are free every queued call is served, its request whole."""
    queued, size = 64, MAX_REQUEST - 64
    t = start_subproc(tmp_path)
    assert t.proc is not None

    def echo(ch: grpc.Channel, requests: Iterator[object]) -> Any:
        call = ch.stream_unary("/kvd.v1.Kvd/Echo", request_serializer=bytes, response_deserializer=pb.EchoResponse.FromString)
        return call.future(requests)

    channels = [grpc.insecure_channel(t.tcp, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
    try:
        with _holding(t.tcp, echo) as (held, release):
            time.sleep(0.5)  # every held call reached a thread
            before = proc_kit.resident_bytes(t.proc.pid)
            payloads = [bytes([i]) * size for i in range(queued)]
            futures = [pb_grpc.KvdStub(channels[i % len(channels)]).Echo.future(pb.EchoRequest(payload=p), timeout=120)
                       for i, p in enumerate(payloads)]
            time.sleep(3.0)  # the clients send what the windows let them
            grown = proc_kit.resident_bytes(t.proc.pid) - before
            assert not any(f.done() for f in futures), "the queued calls wait for a thread"
            assert grown < 64 << 20, f"{queued} queued calls of {size:,d} bytes grew the daemon by {grown / 2**20:.0f} MiB"
            release.set()
            for i, f in enumerate(futures):
                assert f.result(timeout=120).payload == payloads[i], f"call {i} answered with another payload"
        print(f"\n{queued} queued calls of {size:,d} bytes grew the daemon by {grown / 2**20:.1f} MiB")
    finally:
        for ch in channels:
            ch.close()
        stop_subproc(t)


def _heartbeat(address: str, token: str, timeout: float = 1.0) -> None:
    """A peer's Heartbeat over gRPC, on a connection of its own, answered within ``timeout``."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        pb_grpc.PeerStub(ch).Heartbeat(pb.HeartbeatRequest(sender="peer"), timeout=timeout, metadata=((TOKEN_KEY, token),))


def test_peers_calls_answer_while_engine_calls_or_calls_without_the_token_hold_threads(tmp_path):
    """Peers' Commits and heartbeats run on a lane of their own: calls that hold the engine-facing
    pool (a live client's calls whose request never comes) no longer hold them up, and neither do
    Peer calls that lack the peer token, which run apart and are refused as before."""

    def echo(ch: grpc.Channel, requests: Iterator[object]) -> Any:
        call = ch.stream_unary("/kvd.v1.Kvd/Echo", request_serializer=bytes, response_deserializer=pb.EchoResponse.FromString)
        return call.future(requests)

    def stranger(ch: grpc.Channel, requests: Iterator[object]) -> Any:
        call = ch.stream_unary("/kvd.v1.Peer/Heartbeat", request_serializer=bytes, response_deserializer=pb.HeartbeatResponse.FromString)
        return call.future(requests, metadata=((TOKEN_KEY, "not-it"),))

    t = start_inproc(tmp_path, peer_token="s3cret")
    try:
        for hold in (echo, stranger):
            with _holding(t.tcp, hold) as (futures, release):
                time.sleep(0.5)  # every call reached a thread
                assert not any(f.done() for f in futures)
                _heartbeat(t.tcp, "s3cret")
                _health_answers(t.tcp)
                release.set()
                for f in futures:
                    assert isinstance(f.exception(timeout=10), grpc.RpcError)
        with grpc.insecure_channel(t.tcp) as ch, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PeerStub(ch).Heartbeat(pb.HeartbeatRequest(sender="peer"), timeout=5, metadata=((TOKEN_KEY, "not-it"),))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "peer token" in (refused.value.details() or "")
        _serving(t.tcp)
        t.check()
    finally:
        stop_inproc(t)
