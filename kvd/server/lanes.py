"""The gRPC server's threads by service, how it drops clients that stopped answering, and what calls
waiting for a thread may hold.

grpcio's sync server runs every call on a thread of a pool, from before its request is read to its
last reply, so a call whose client sends nothing holds a thread for as long as the client waits.
With one pool for everything, 16 such calls took the daemon's whole gRPC surface: 16 reflection
streams left open (grpcurl, grpcui or any tool that browses the API keeps one per session), or 16
unary calls whose request never came (a client stopped mid-send, or one line of any gRPC
client), and the kubelet's gRPC probe, peers' Commits and every engine call over gRPC waited.
Three defences, used together by :class:`~kvd.server.app.Daemon`:

* **Lanes.** kvd's engine-facing service keeps the main pool; the health service, reflection and
  the Peer service each get a pool of their own (grpcio's per-behaviour ``experimental_thread_pool``,
  which ``grpc_health`` itself takes). Reflection streams then hold only reflection's threads, a
  health check never queues behind kvd's calls, and peers' Commits and heartbeats never queue
  behind engines' calls (a client holding the main pool would otherwise fail every transfer
  other daemons send here). A Peer call whose metadata lacks the peer token (where one is set)
  runs on a pool of two threads of its own, where the handler refuses it as before: calls
  without the token cannot hold the peers' threads. The lane is picked before a thread is taken
  (from the call's metadata, which arrives before its request). Each lane counts its busy
  threads and queued calls (:meth:`Lanes.stats`: the ``kvd_grpc_lane_*`` gauges).
* **Keepalive.** The server pings every connection with calls in flight each ``keepalive_s``
  and closes one whose client does not answer within as long (gRPC's default waits two hours):
  a stopped, frozen or vanished client's calls end and give their threads back.
* **Bounded reads** (:data:`FLOOD_OPTIONS`). gRPC's transport reads a call's request before a
  thread takes the call, as far as the stream's flow-control window lets it, and its BDP probe
  grows that window: 400 calls of 4 MB each queued behind busy threads had a test server hold
  1.1 GB. With the probe off a queued call holds at most its stream's first 64 KiB (0.23 GB for
  the same 400), and the calls being served hold their requests (at most the daemon's
  ``max_request_bytes`` each, 4 MiB by default). kvd's messages are small: the probe is for bulk
  streams.

What these do not cover: a live client that holds calls open on purpose can still take the main
pool's threads, so engines' calls over gRPC wait (peers' calls and probes do not); and with no
peer token set, anyone who reaches the port can hold the peer lane the same way (the chart's
network policy and a peer token are the defences). grpcio's asyncio server reads requests
without a thread, but on this code's 2-core VMs it cost 0.3-0.9 ms more per call
(docs/benchmarks.md), which peers' cross-host Commits would pay on every handoff.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from kvd.records import LaneStats

__all__ = ["FLOOD_OPTIONS", "HEALTH_THREADS", "PEER_THREADS", "REFLECTION_THREADS", "STRANGER_THREADS", "Lanes", "keepalive_options"]

#: Threads of the health service's lane: probes and Watch streams' updates (Watch holds none).
#: As many as the main pool had for everything: a client that holds health checks open must hold
#: as many as before to stall the probes. The pool starts threads only as calls need them.
HEALTH_THREADS = 16
#: Threads of reflection's lane: at most this many reflection streams are served at once, the
#: rest wait for one to close.
REFLECTION_THREADS = 4
#: Threads of the Peer service's lane: other daemons' CheckTicket, Commit, Heartbeat and aborts
#: over gRPC (each a lookup; a same-host sender uses the peer socket instead).
PEER_THREADS = 16
#: Threads that refuse Peer calls without the peer token.
STRANGER_THREADS = 2

#: gRPC server options that keep a queued call's request out of the daemon until a thread reads it.
FLOOD_OPTIONS = [("grpc.http2.bdp_probe", 0)]

_HEALTH = "grpc.health.v1.Health"
_PEER = "kvd.v1.Peer"
_REFLECTION = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """gRPC server options that ping each connection with calls in flight every ``keepalive_s``
    and drop it when an answer takes longer than that."""
    ms = max(1, round(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        # The timer that closes the connection is this one (a minute by default): with the
        # keepalive's own timeout alone, a stopped client's calls still held their threads 20 s on.
        ("grpc.http2.ping_timeout_ms", ms),
        # gRPC stops pinging after two pings with no data between them: a call whose request
        # never comes sends no data, which is the case the pings are for.
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Lane(ThreadPoolExecutor):
    """A pool that counts its calls: grpcio hands it each call before the call's request is
    read, so a call held open without one counts as busy, as it holds a thread."""

    def __init__(self, name: str, threads: int) -> None:
        super().__init__(max_workers=threads, thread_name_prefix=f"kvd-rpc-{name}" if name != "kvd" else "kvd-rpc")
        self.name = name
        self.threads = threads
        self._count = threading.Lock()
        self._queued = 0
        self._busy = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def run() -> Any:
            with self._count:
                self._queued -= 1
                self._busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._count:
                    self._busy -= 1

        with self._count:
            self._queued += 1
        try:
            return super().submit(run)
        except BaseException:  # shut down: never queued
            with self._count:
                self._queued -= 1
            raise

    def stats(self) -> LaneStats:
        with self._count:
            return LaneStats(self.name, self.threads, self._busy, self._queued)


class Lanes:
    """The gRPC server's thread pools: ``main`` (the engine-facing Kvd service: give it to ``grpc.server``),
    and the health service's, reflection's and the Peer service's own, which :meth:`interceptor`
    routes their calls to. ``peer``: whether a Peer call presenting this token (its ``token_key``
    metadata, "" when absent) is from a peer (:func:`kvd.server.peer_calls.token_ok`); the others
    go to ``strangers``. Shut down with :meth:`close` after the server stopped."""

    def __init__(self, workers: int, *, peer: Callable[[str], bool], token_key: str) -> None:
        self.main = _Lane("kvd", workers)
        self.health = _Lane("health", HEALTH_THREADS)
        self.reflection = _Lane("reflection", REFLECTION_THREADS)
        self.peer = _Lane("peer", PEER_THREADS)
        self.strangers = _Lane("strangers", STRANGER_THREADS)
        self._all = (self.main, self.peer, self.health, self.reflection, self.strangers)
        self._by_service = {_HEALTH: self.health, **{name: self.reflection for name in _REFLECTION}}
        self._is_peer = peer
        self._token_key = token_key

    def interceptor(self) -> grpc.ServerInterceptor:
        """The interceptor that puts each call on its lane's pool. List it first in the server's
        interceptors, so it sees the handler the others made."""
        return _LaneInterceptor(self)

    def pool_for(self, method: str, metadata: Iterable[tuple[str, Any]]) -> ThreadPoolExecutor | None:
        """The pool a call of ``method`` ("/service/Method") with ``metadata`` runs on; None: the
        main pool (the server's own)."""
        service = method.lstrip("/").split("/", 1)[0]
        if service == _PEER:
            token = next((v for k, v in metadata if k == self._token_key), "")
            return self.peer if isinstance(token, str) and self._is_peer(token) else self.strangers
        return self._by_service.get(service)

    def stats(self) -> list[LaneStats]:
        """Each lane's threads, busy threads and queued calls now (``kvd`` is the main pool)."""
        return [lane.stats() for lane in self._all]

    def close(self) -> None:
        for lane in self._all:
            lane.shutdown(wait=False, cancel_futures=True)


class _LaneInterceptor(grpc.ServerInterceptor):
    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        pool = self._lanes.pool_for(handler_call_details.method, handler_call_details.invocation_metadata or ())
        if handler is None or pool is None:
            return handler
        return _on_pool(handler, pool)


def _on_pool(handler: grpc.RpcMethodHandler, pool: ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour run on ``pool`` (the attribute grpcio's server reads)."""
    de, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_pinned(handler.unary_unary, pool), de, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_pinned(handler.unary_stream, pool), de, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_pinned(handler.stream_unary, pool), de, ser)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_pinned(handler.stream_stream, pool), de, ser)
    return handler


def _pinned(behavior: Callable[..., Any], pool: ThreadPoolExecutor) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return behavior(*args, **kwargs)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    # health's Watch answers through a callback and returns at once (no thread held per watcher):
    # keep that, or every open Watch would hold one of the lane's threads.
    run.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)  # type: ignore[attr-defined]
    return run
