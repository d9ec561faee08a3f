"""The one exporter: turns the daemon's plain stats records into Prometheus series, plus RPC latency.

Gauges are read from stats records at scrape time (a custom collector) -- :meth:`Node.stats
<kvd.daemon.node.Node.stats>`, and where the daemon runs them ``Outbox.stats``,
``DaemonPeerLink.stats`` and ``PeerSocketServer.stats`` -- so the core never imports
prometheus_client, the exporter reads no internals, and nothing is double-booked. Each daemon has its own
registry, so several daemons can live in one process (tests).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import CollectorRegistry, GCCollector, Histogram, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvd.handoff.outbox import Outbox
from kvd.daemon.node import Node
from kvd.ipc.http_server import BoundedThreads

if TYPE_CHECKING:
    from kvd.server.engine_socket import EngineSocketServer
    from kvd.server.lanes import Lanes
    from kvd.server.peer_link import DaemonPeerLink
    from kvd.server.peer_socket import PeerSocketServer

__all__ = ["METRICS_CONNECTIONS", "METRICS_IDLE_S", "Metrics"]

log = logging.getLogger("kvd.server.metrics")
#: Connections to /metrics served at once (a thread each; Prometheus scrapes one at a time, and
#: each request closes its connection): more wait to be accepted.
METRICS_CONNECTIONS = 16
#: A connection to /metrics that sends nothing for this long is closed (a scrape sends its
#: request at once).
METRICS_IDLE_S = 5.0

# Control-plane calls take tens of microseconds to milliseconds; transfers go to seconds.
_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _NodeCollector(Collector):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.outbox: Outbox | None = None  # set when the daemon runs a transfer backend
        self.link: DaemonPeerLink | None = None  # likewise: this daemon calling others
        self.peer_socket: PeerSocketServer | None = None  # set when it serves a peer socket
        self.engine_socket: EngineSocketServer | None = None  # set when it serves an engine socket
        self.http: BoundedThreads | None = None  # set when it serves /metrics
        self.lanes: Lanes | None = None  # set when it serves gRPC

    def collect(self) -> Iterator:
        s = self.node.stats()
        p = s.pool

        def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            g.add_metric(list((labels or {}).values()), value)
            return g

        def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            c = CounterMetricFamily(name, doc, labels=list(labels or {}))
            c.add_metric(list((labels or {}).values()), value)
            return c

        yield gauge("kvd_pool_reserved_bytes", "Address space reserved for the arena", p.reserved_bytes)
        yield gauge("kvd_pool_backed_bytes", "Arena bytes backed by memory", p.backed_bytes)
        yield gauge("kvd_pool_gap_bytes", "Free bytes between the groups' regions", p.gap_bytes)
        yield gauge("kvd_pool_epoch", "Pool epoch (changes when physical addresses move)", p.epoch)
        per_group = {
            "kvd_group_used_bytes": ("Bytes of pages in use, per group", lambda g: g.used_bytes),
            "kvd_group_pages_used": ("Pages in use, per group", lambda g: g.used_pages),
            "kvd_group_pages_free": ("Pages free (capacity - used), per group", lambda g: g.free_pages),
            "kvd_group_pages_capacity": ("Pages the group could hold alone", lambda g: g.capacity_pages),
            "kvd_group_hole_pages": ("Free pages inside the group's region (reclaimable by compaction)", lambda g: g.hole_pages),
        }
        for name, (doc, fn) in per_group.items():
            fam = GaugeMetricFamily(name, doc, labels=["group"])
            for g in p.groups:
                fam.add_metric([g.name], fn(g))
            yield fam
        yield gauge("kvd_requests_live", "Requests holding pages", p.requests_live)
        yield gauge("kvd_requests_offloaded", "Requests offloaded to host memory", p.requests_offloaded)
        yield gauge("kvd_leases_live", "Live transfer leases", s.leases_live)
        yield counter("kvd_leases_expired", "Leases reclaimed after their TTL", s.leases_expired_total)
        yield gauge("kvd_sessions_live", "Client sessions alive", s.sessions_live)
        yield counter("kvd_sessions_expired", "Client sessions reaped after going silent", s.sessions_expired_total)
        # Read off the node, not its Stats: a process-level fact, not the pool's.
        yield counter("kvd_stalls", "Times the daemon found it had not run for a while (paused, CPU-throttled): "
                      "silences and deadlines were moved on by that much", self.node.stalls_excused)
        yield counter("kvd_stalled_seconds", "Seconds the daemon did not run, as its sweeper saw it", self.node.stalled_seconds)
        comp = CounterMetricFamily("kvd_compactions", "Compactions by outcome", labels=["outcome"])
        comp.add_metric(["done"], p.compactions_done)
        comp.add_metric(["refused"], p.compactions_refused)
        yield comp
        yield counter("kvd_compaction_moved_bytes", "Bytes moved by compaction", p.bytes_moved)
        yield counter("kvd_stale_epoch_refusals", "Calls refused for quoting a stale boot id or epoch", s.stale_refusals_total)
        tr = CounterMetricFamily("kvd_transfers", "Transfers by direction and outcome", labels=["direction", "outcome"])
        tr.add_metric(["in", "done"], s.transfers_in_ready_total)
        tr.add_metric(["in", "failed"], s.transfers_in_failed_total)
        by = CounterMetricFamily("kvd_transfer", "KV bytes moved by handoffs, by direction", labels=["direction"], unit="bytes")
        by.add_metric(["in"], s.transfer_in_bytes_total)
        if self.outbox is not None:
            o = self.outbox.stats()
            tr.add_metric(["out", "done"], o.sent_total)
            tr.add_metric(["out", "failed"], o.failed_total)
            by.add_metric(["out"], o.bytes_total)
            yield gauge("kvd_transfers_open", "Outbound transfers in progress", o.open, {"direction": "out"})
            yield counter("kvd_send_calls", "Send and SendMany calls this daemon ran (a Send carries one item)", o.calls_total)
            yield counter("kvd_send_items", "Items those calls carried (each one transfer chunk, counted in kvd_transfers "
                          "like a Send)", o.items_total)
            yield counter("kvd_send_planned_ahead", "Send items that used the plan BeginSend made (the request's pages "
                          "unchanged since): they skipped planning", o.planned_ahead_total)
        yield tr
        yield by
        if self.link is not None:
            calls = CounterMetricFamily(
                "kvd_peer_calls", "Calls this daemon made to peer daemons, by method and path (socket: the peer's "
                "same-host peer socket; grpc)", labels=["method", "path"],
            )
            for (method, path), n in sorted(self.link.stats().calls.items()):
                calls.add_metric([method, path], n)
            yield calls
        if self.peer_socket is not None:
            ps = self.peer_socket.stats()
            served = CounterMetricFamily(
                "kvd_peer_socket_calls", "Calls peer daemons made on this daemon's peer socket, by method and status code",
                labels=["method", "code"],
            )
            for (method, code), n in sorted(ps.answered.items()):
                served.add_metric([method, code], n)
            yield served
            yield gauge("kvd_peer_socket_connections", "Peer socket connections open", ps.connections)
        if self.engine_socket is not None:
            es = self.engine_socket
            yield gauge("kvd_engine_socket_connections", "Engine socket connections open (at most kvd_engine_socket_max_connections)",
                        es.connections)
            yield gauge("kvd_engine_socket_max_connections", "Engine socket connections served at once", es.max_connections)
            closed = CounterMetricFamily(
                "kvd_engine_socket_closed", "Engine socket connections the daemon closed, by why: refused (every one in a "
                "call, a bad hello, a frame past the limit), evicted (idle longest, for a new one: a client leaking or "
                "hoarding connections shows here), cut (a WaitReady cut short, for a new one: clients holding a blocking "
                "wait per transfer), dropped (gone or too slow mid-frame)", labels=["reason"],
            )
            for reason, n in es.closed().items():
                closed.add_metric([reason], n)
            yield closed
        starved = CounterMetricFamily(
            "kvd_socket_accept_starved", "Times a socket of this daemon could not accept a connection for want of open "
            "files or buffers and paused (up to 0.1 s; the connection waited): compare process_open_fds with "
            "process_max_fds, and raise the open-file limit", labels=["socket"],
        )
        for name, srv in (("engine", self.engine_socket), ("peer", self.peer_socket), ("metrics", self.http)):
            if srv is not None:
                starved.add_metric([name], srv.starved)
        yield starved
        if self.lanes is not None:
            lanes = self.lanes.stats()
            for name, doc, field in (
                ("kvd_grpc_lane_threads", "Threads of a lane of the gRPC server (kvd: engines' calls; peer: other daemons' "
                 "calls; health; reflection; strangers: peer calls without the peer token)", "threads"),
                ("kvd_grpc_lane_busy_threads", "Threads of a gRPC lane holding a call: reading its request, running or "
                 "replying (all of them for long: calls held open without a request, or an overload)", "busy"),
                ("kvd_grpc_lane_queued_calls", "Calls waiting for a thread of their gRPC lane", "queued"),
            ):
                fam = GaugeMetricFamily(name, doc, labels=["lane"])
                for ln in lanes:
                    fam.add_metric([ln.lane], getattr(ln, field))
                yield fam


class _LatencyInterceptor(grpc.ServerInterceptor):
    """Times every unary call by method and final status code."""

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        hist = self.hist

        def timed(request, context):
            t0 = time.perf_counter()
            code = "OK"
            try:
                return inner(request, context)
            except Exception:
                c = context.code()
                code = c.name if c is not None else "UNKNOWN"
                raise
            finally:
                hist.labels(method, code).observe(time.perf_counter() - t0)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


class Metrics:
    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry()
        self.collector = _NodeCollector(node)
        self.registry.register(self.collector)
        # The process's own series, as on any Python exporter's default registry (kvd keeps its
        # own registry): process_* (RSS, CPU seconds, open fds), python_gc_* (collections by
        # generation: a daemon's calls stall while one runs) and python_info.
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.rpc_seconds = Histogram(
            "kvd_rpc_duration_seconds", "gRPC call latency by method and status code", ["method", "code"],
            buckets=_BUCKETS, registry=self.registry,
        )
        self.port: int | None = None

    def interceptor(self) -> grpc.ServerInterceptor:
        return _LatencyInterceptor(self.rpc_seconds)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on ``host:port`` (0: any free port) from a thread of its own, bounded
        (:class:`_MetricsServer`); the port. OSError when it cannot bind."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server = _MetricsServer((host, port), family)
        server.set_app(make_wsgi_app(self.registry))
        server.start("kvd-metrics")
        self.collector.http = server  # its pauses out of files are a series
        self.port = server.server_port
        return self.port

    def close(self) -> None:
        if self.collector.http is not None:
            self.collector.http.close()
            self.collector.http = None


class _MetricsHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_S

    def log_message(self, *args: object) -> None:
        pass  # a line per scrape on stderr


class _MetricsServer(BoundedThreads, WSGIServer):
    """prometheus_client's exposition app (:func:`make_wsgi_app`) on a server a client cannot
    grow without bound (:class:`~kvd.ipc.http_server.BoundedThreads`): prometheus_client's own
    server kept a thread per open connection, read without a timeout, for as long as the client
    held it -- 1,000 idle connections were 1,000 daemon threads."""

    def __init__(self, address: tuple[str, int], family: int) -> None:
        self.address_family = family  # IPv6 for an IPv6 metrics_host ('::')
        super().__init__(address, _MetricsHandler)
        self.bound("metrics endpoint", log, METRICS_CONNECTIONS)
