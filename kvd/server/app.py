"""Assemble and run a daemon: node + gRPC server + peer socket + health + reflection + metrics + sweeper.

``Daemon.start(settings)`` builds everything and binds (port 0 picks a port: tests use that), and a
failure at any step undoes every step before it, in reverse order;
``serve(settings)`` runs until SIGTERM/SIGINT, then stops accepting, reports NOT_SERVING, drains
in-flight calls for ``grace_s`` and releases the arena.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import resource
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvd.backends.base import Backend
from kvd.backends.registry import backend_class, draft_capable, make_backend
from kvd.memory.arena import Arena, ShmArena, reap_stale
from kvd.memory.doorbells import Doorbells
from kvd.config import Settings
from kvd.errors import InternalError, InvalidArgument, Unavailable
from kvd.ipc.fdpass import HandleServer
from kvd.handoff.link import run_every
from kvd.handoff.outbox import Outbox
from kvd.handoff.inbox import Inbox
from kvd.pool.layout import GroupKind, Layout
from kvd.limits import MAX_ID_BYTES, too_long
from kvd.daemon.node import Node
from kvd.pool.pool import Pool
from kvd.pool.models import load_model
from kvd.pool.presets import load_layout
from kvd.server.handles import ArenaHandles
from kvd.server.lanes import FLOOD_OPTIONS, Lanes, keepalive_options
from kvd.server.metrics import Metrics
from kvd.server.peer_calls import PeerCalls, token_ok
from kvd.handoff.ticket import Tickets
from kvd.server.peer_link import DaemonPeerLink
from kvd.server.engine_socket import EngineSocketServer, fast_path
from kvd.server.peer_socket import MAX_FRAME, PeerSocketServer
from kvd.server.signals import StopSignals
from kvd.server.service import GRPC_WORKERS, TOKEN_KEY, Endpoint, KvdService, PeerService, add_to_server
from kvd.ipc.unix_socket import check_path, open_to_group
from kvd.v1 import kvd_pb2 as pb

__all__ = ["Daemon", "handle_socket_path", "peer_socket_path", "raise_open_files", "serve", "settle_heap", "validate"]

log = logging.getLogger("kvd.server")

#: The arena kind (``Arena.handle().kind``) each ``arena`` setting makes (:func:`_make_arena`).
_ARENA_KINDS = {"shm": "shm", "cuda": "cuda-vmm"}
#: Exchanges the handle socket serves at once. A peer's local backend pings it before and after
#: every write batch, so N concurrent senders hold up to N slots, and a finished exchange frees its
#: slot only when its thread next gets the GIL (ms on a busy daemon): 8 concurrent senders were
#: at the old limit of 8. Each slot is a short-lived thread; pings carry no fds.
_HANDLE_CLIENTS = 64
#: A sweep this much later than due means the process did not run meanwhile (Node.sweep's
#: stalled_s); a busy host makes sweeps late by milliseconds, a pause or a CPU quota by more.
STALL_S = 0.1
#: ... and one this long is worth a warning in the log (shorter ones only count in kvd_stalls).
STALL_WARN_S = 1.0


def validate(settings: Settings, handle_path: str | None = None, peer_path: str | None = None) -> Layout:
    """Refuse unsupported combinations at start-up with a message that says what to change.
    Returns the layout (loaded once: it may be a file). ``handle_path``: where an arena=cuda
    daemon will serve its handles (default :func:`handle_socket_path`); ``peer_path``: where it
    will serve its peer socket (default :func:`peer_socket_path`)."""
    layout = load_model(settings.model, tp=settings.tp, draft=settings.draft) if settings.model else load_layout(settings.layout)
    peer_path = peer_path or peer_socket_path(settings)
    if peer_path:
        check_path(peer_path, "peer_socket")
    if settings.speculative and not layout.has(GroupKind.DRAFT):
        raise InvalidArgument(
            f"speculative=true but layout {layout.name!r} has no draft group; use a layout with a draft group "
            "or turn speculative off"
        )
    backend = None if settings.backend == "none" else backend_class(settings.backend, _ARENA_KINDS[settings.arena])
    if settings.speculative and not (backend is not None and backend.draft_vectors):
        raise InvalidArgument(
            f"speculative=true needs a backend that carries separate draft vectors ({draft_capable()}); "
            f"backend={settings.backend!r} cannot: set backend, or turn speculative off"
        )
    if backend is not None:
        # Unavailable with the install commands (mooncake with arena=cuda: of the CUDA build),
        # InvalidArgument for a transport variable kvd cannot run with; sets the transport's
        # environment defaults before it loads.
        info = backend.startup_check(_ARENA_KINDS[settings.arena])
        if info is not None:
            log.info("%s backend: %s", settings.backend, info)
    if settings.arena == "cuda":
        _check_cuda(settings, handle_path or handle_socket_path(settings))
    return layout


def _check_cuda(settings: Settings, handle_path: str) -> None:
    if not torch.cuda.is_available():
        raise Unavailable(
            "arena=cuda needs a CUDA device, but torch.cuda.is_available() is false on this host (no GPU, no driver, "
            "or a CPU-only torch build); run the daemon on a GPU node or set arena=shm"
        )
    count = torch.cuda.device_count()
    if settings.cuda_device >= count:
        raise InvalidArgument(
            f"cuda_device={settings.cuda_device} does not exist: this process sees {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES applies); set cuda_device below {count}"
        )
    from kvd.memory.cuda import driver

    driver()  # Unavailable naming the cuda-python package when it is missing
    check_path(handle_path)


def _beside(settings: Settings, suffix: str) -> str:
    """``<listen_unix><suffix>`` (absolute), else a fresh name in the temp directory (a daemon
    without a Unix listener): where a daemon's other sockets live by default."""
    if settings.listen_unix:
        return os.path.abspath(settings.listen_unix) + suffix
    return os.path.join(tempfile.gettempdir(), f"kvd-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}")


def handle_socket_path(settings: Settings) -> str:
    """Where a CUDA arena's fds are handed out: ``handle_socket``, else ``<listen_unix>.handles``,
    else a fresh name in the temp directory (a daemon without a Unix listener)."""
    return settings.handle_socket or _beside(settings, ".handles")


def peer_socket_path(settings: Settings) -> str | None:
    """Where a sender on this host calls this daemon without gRPC (:mod:`kvd.server.peer_socket`):
    ``peer_socket``, else ``<listen_unix>.peer``, else a fresh name in the temp directory. None
    when ``peer_socket`` is '' (off) or the daemon runs no backend (it receives no handoffs)."""
    if settings.peer_socket == "" or settings.backend == "none":
        return None
    return settings.peer_socket or _beside(settings, ".peer")


def _make_arena(settings: Settings) -> Arena:
    backed = 0 if settings.post_capture else settings.arena_bytes
    if settings.arena == "cuda":
        from kvd.memory.vmm import CudaVmmArena

        return CudaVmmArena(settings.reserved, backed, device=settings.cuda_device)
    for path in reap_stale(settings.arena_dir):
        log.warning("removed %s: an arena file left by a daemon that died without cleaning up", path)
    return ShmArena(settings.reserved, backed, directory=settings.arena_dir, mode=0o660 if settings.group_access else 0o600,
                    allocate=settings.arena_fallocate)


def _undo(stack: contextlib.ExitStack, what: str, fn: Callable[..., object], *args: object) -> None:
    """Push the undo of a start-up step. An undo that fails is logged and the others still run:
    the error that stopped the start-up is the one raised."""

    def run() -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- undoing the rest matters more
            log.exception("start-up failed; undoing %s failed too", what)

    stack.callback(run)


def _bind(server: grpc.Server, address: str, setting: str) -> int:
    """Bind ``address`` on ``server`` (its port: the one picked for port 0); Unavailable naming
    the setting when it cannot be bound (gRPC raises RuntimeError, or returns port 0 in older
    releases)."""
    cause: RuntimeError | None = None
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        port, cause = 0, exc
    if port == 0:
        raise Unavailable(f"could not bind {setting}={address}: address in use or not permitted; set {setting} to a free address") from cause
    return port


def _serve_metrics(metrics: Metrics, host: str, port: int) -> None:
    """Start the /metrics endpoint on ``host:port`` (the settings' metrics_host / metrics_port);
    Unavailable naming the port and the setting to change when it cannot bind."""
    try:
        metrics.serve(host, port)
    except OSError as exc:
        raise Unavailable(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; "
            "set metrics_port to a free port (0 picks one) or stop the process that holds it"
        ) from exc


@dataclass
class Daemon:
    settings: Settings
    node: Node
    server: grpc.Server
    health: health.HealthServicer
    addresses: list[str]  # what clients dial: "unix:/path", "127.0.0.1:port"
    metrics: Metrics | None
    backend: Backend | None = None
    outbox: Outbox | None = None
    link: DaemonPeerLink | None = None
    handles: HandleServer | None = None  # arena=cuda: hands the arena's fds to engines and peers
    peer_socket: PeerSocketServer | None = None  # a same-host sender's calls (CheckTicket, Commit, ...)
    tickets: Tickets | None = None  # mints and checks this boot's tickets (its key never leaves the process)
    engine_socket: EngineSocketServer | None = None  # the engine's calls without gRPC (<listen_unix>.fast)
    doorbells: Doorbells | None = None  # inbound transfers' states, mapped read-only by engines (kvd.memory.doorbells)
    lanes: Lanes | None = None  # the gRPC server's thread pools (kvd.server.lanes)
    _stop: threading.Event = field(default_factory=threading.Event)
    _sweeper: threading.Thread | None = None

    @classmethod
    def start(cls, settings: Settings) -> Daemon:
        """Build and start everything; the daemon serves once this returns.

        Transactional: every step that started something (arena, handle socket, gRPC listeners,
        backend, peer link, peer socket, metrics endpoint, threads) registers its undo as it
        succeeds, and a failure at any later step undoes them all in reverse order, then raises
        the failure: a start that fails leaves no socket file, listener, thread or arena behind,
        and the same settings can start again at once."""
        # Computed once: without a Unix listener the name is fresh each time it is derived.
        handle_path = handle_socket_path(settings) if settings.arena == "cuda" else None
        peer_path = peer_socket_path(settings)
        layout = validate(settings, handle_path, peer_path)
        with contextlib.ExitStack() as undo:
            d = cls._start(settings, layout, handle_path, peer_path, undo)
            undo.pop_all()  # it serves: from here on Daemon.stop undoes it
        arena = d.node.pool.arena
        shown = "(the layout of the first engine)" if settings.layout_from_engine else layout.name
        log.info("kvd serving %s on %s (pool %s)", shown, ", ".join(d.addresses), f"{arena.reserved:,d} B reserved")
        return d

    @classmethod
    def _start(
        cls, settings: Settings, layout: Layout, handle_path: str | None, peer_path: str | None, undo: contextlib.ExitStack
    ) -> Daemon:
        """The steps of :meth:`start`, each followed by its undo pushed on ``undo``."""
        if settings.torch_threads:
            _undo(undo, "the torch thread count", torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(settings.torch_threads)
        arena = _make_arena(settings)
        _undo(undo, "the arena", arena.close)
        pool = Pool(layout, arena, post_capture=settings.post_capture)
        node = Node(
            pool,
            session_ttl=settings.session_ttl_s,
            lease_ttl=settings.lease_ttl_s,
            layout_from_engine=settings.layout_from_engine,
        )
        # The doorbell board goes to engines over the engine socket: kept only where one is served.
        doorbells = Doorbells() if settings.listen_unix and settings.fast_socket else None
        if doorbells is not None:
            _undo(undo, "the doorbell board", doorbells.close)
        Inbox.attach(node, peer_timeout=settings.peer_timeout_s, fence_s=settings.fence_s, doorbells=doorbells)
        metrics = Metrics(node)
        handle_server: HandleServer | None = None
        peer_server: PeerSocketServer | None = None
        if arena.handle().kind == "cuda-vmm":
            if handle_path is None:
                raise InternalError("a cuda-vmm arena without a handle socket path (validate() gives one for arena=cuda)")
            exporter = ArenaHandles(node, settings.peer_token)
            node.on_backing_change.append(exporter.backing_changed)
            handle_server = HandleServer(
                handle_path, exporter.export, authorize=exporter.authorize, max_clients=_HANDLE_CLIENTS,
                group=settings.group_access,
            ).start()
            _undo(undo, "the handle socket", handle_server.stop)
            # After the generation moved: watchers (peers' backends) ask again before the next write.
            node.on_backing_change.append(handle_server.notify)
        # Health, reflection and peers' calls on pools of their own, clients that stop answering
        # dropped, requests bounded: kvd.server.lanes says what held every gRPC thread before.
        lanes = Lanes(GRPC_WORKERS, peer=functools.partial(token_ok, settings.peer_token), token_key=TOKEN_KEY)
        _undo(undo, "the gRPC thread pools", lanes.close)
        metrics.collector.lanes = lanes
        server = grpc.server(
            lanes.main,
            interceptors=[lanes.interceptor(), metrics.interceptor()],
            options=[
                ("grpc.max_receive_message_length", settings.max_request_bytes), ("grpc.max_send_message_length", MAX_FRAME),
                *keepalive_options(settings.grpc_keepalive_s),
                *FLOOD_OPTIONS,
            ],
        )
        addresses: list[str] = []
        serving = False

        def close_grpc() -> None:
            # gRPC binds in add_insecure_port but releases its listeners (and unlinks its Unix
            # socket) only when a started server stops: start one that bound and never started.
            if addresses and not serving:
                server.start()
            server.stop(None).wait()
            if settings.listen_unix and f"unix:{settings.listen_unix}" in addresses and os.path.exists(settings.listen_unix):
                os.unlink(settings.listen_unix)

        _undo(undo, "the gRPC server", close_grpc)
        if settings.listen_unix:
            if os.path.exists(settings.listen_unix):
                os.unlink(settings.listen_unix)  # a stale socket from a dead daemon
            _bind(server, f"unix:{settings.listen_unix}", "listen_unix")
            addresses.append(f"unix:{settings.listen_unix}")
            if settings.group_access:
                # gRPC created the file with the umask's mode; nothing is served before start().
                open_to_group(settings.listen_unix)
        if settings.listen_tcp:
            port = _bind(server, settings.listen_tcp, "listen_tcp")
            host = settings.listen_tcp.rsplit(":", 1)[0]
            addresses.append(f"{host}:{port}")
        peer = settings.advertise or (addresses[-1] if settings.listen_tcp else addresses[0])
        if n := too_long(peer, MAX_ID_BYTES):  # it is the sender's name in every Peer call, held to that bound
            raise InvalidArgument(f"this daemon's peer address is {n:,d} bytes, over the limit of {MAX_ID_BYTES}: set advertise to a shorter address")
        caps = ["post-capture", "offload", "compaction-around-pins", "draft-vectors"]
        if handle_server is not None:
            caps.append("cuda-arena")
        backend = outbox = link = None
        if settings.backend != "none":
            link = DaemonPeerLink(token=settings.peer_token, timeout=settings.peer_timeout_s)
            _undo(undo, "the peer link", link.close)
            backend = make_backend(
                settings.backend,
                host=settings.transfer_host,
                arena_kind=arena.handle().kind,
                handle_endpoint=handle_server.path if handle_server else "",
                peer_token=settings.peer_token,
                locator=peer,
                fetch_metadata=link.transfer_metadata,
            )
            _undo(undo, "the backend", backend.close)
            backend.register(arena)
            # Register the whole arena again whenever its backing changes (post-capture sizing).
            def reregister() -> None:
                backend.register(arena)

            node.on_backing_change.append(reregister)
            outbox = Outbox(node, backend, link, address=peer)
            _undo(undo, "the outbox's notice threads", outbox.close)
            metrics.collector.outbox = outbox
            metrics.collector.link = link
            caps.append("handoff")
        if peer_path:
            caps.append("peer-socket")
        endpoint = Endpoint(
            peer_address=peer,
            backend=settings.backend,
            transfer_endpoint=backend.endpoint if backend else "",
            capabilities=tuple(caps),
            handle_socket=handle_server.path if handle_server else "",
            peer_socket=peer_path or "",
        )
        # One key per boot: the engine-facing service mints with it, both peer transports check.
        tickets = Tickets(node, endpoint.issuer)
        calls = PeerCalls(node, settings.peer_token, outbox, tickets)
        if peer_path:  # before any ticket can name it
            peer_server = PeerSocketServer(peer_path, calls, pool.boot_id, timeout=settings.peer_timeout_s,
                                           max_request=settings.max_request_bytes).start()
            _undo(undo, "the peer socket", peer_server.stop)
            metrics.collector.peer_socket = peer_server
        if backend is not None:
            # Tickets name the current registration (nixl's endpoint changes with it), after the
            # register hook above.
            def _renamed(backend: Backend = backend) -> None:
                endpoint.transfer_endpoint = backend.endpoint
                tickets.issuer = endpoint.issuer

            node.on_backing_change.append(_renamed)
        kvd_service = KvdService(node, endpoint, outbox, link, tickets)
        add_to_server(server, kvd_service, "Kvd")
        engine_server: EngineSocketServer | None = None
        if settings.listen_unix and settings.fast_socket:
            engine_server = EngineSocketServer(
                fast_path(os.path.abspath(settings.listen_unix)), kvd_service, group=settings.group_access,
                observe=lambda method, code, s: metrics.rpc_seconds.labels(method, code).observe(s),  # one series for both transports
                doorbells=doorbells, max_request=settings.max_request_bytes,
            ).start()
            _undo(undo, "the engine socket", engine_server.stop)
            endpoint.engine_socket = engine_server.path  # advertised in Session and PoolInfo
            metrics.collector.engine_socket = engine_server
        add_to_server(server, PeerService(node, endpoint, calls), "Peer")
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        names = (
            pb.DESCRIPTOR.services_by_name["Kvd"].full_name,
            pb.DESCRIPTOR.services_by_name["Peer"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        server.start()
        serving = True
        for name in ("", *names[:2]):
            hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        if settings.metrics_port is not None:
            _serve_metrics(metrics, settings.metrics_host, settings.metrics_port)
            _undo(undo, "the metrics endpoint", metrics.close)
        d = cls(
            settings, node, server, hs, addresses, metrics,
            backend=backend, outbox=outbox, link=link, handles=handle_server, peer_socket=peer_server, tickets=tickets,
            engine_socket=engine_server, doorbells=doorbells, lanes=lanes,
        )
        _undo(undo, "the sweeper and heartbeat threads", d._stop.set)  # both leave at their next wait
        d._sweeper = threading.Thread(target=d._sweep, name="kvd-sweeper", daemon=True)
        d._sweeper.start()
        if outbox is not None:
            # Receivers fail a transfer after peer_timeout_s without news: beat well inside it.
            run_every(settings.peer_timeout_s / 4, d._stop, outbox.heartbeat_once, "kvd-heartbeat")
        return d

    @property
    def address(self) -> str:
        return self.addresses[0]

    def _sweep(self) -> None:
        interval = self.settings.sweep_interval_s
        due = time.monotonic() + interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            # Woken much later than due: this process did not run meanwhile, and what its clients
            # and senders sent then waits unread. The node moves their silences on by that much.
            now = time.monotonic()
            late, due = now - due, now + interval
            try:
                if late >= STALL_WARN_S:
                    log.warning("the daemon did not run for %.2f s (paused, or CPU-throttled: see kvd_stalled_seconds); "
                                "its clients' and senders' silences and deadlines are moved on by as much", late)
                leases, sessions = self.node.sweep(late if late > STALL_S else 0.0)
                for lease in leases:
                    log.info("%s expired", lease.label())
                for sid in sessions:
                    log.warning("session %s went silent past its TTL: its leases were released and requests freed", sid)
            except Exception:  # the sweeper must never die
                log.exception("sweeper")

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting, report NOT_SERVING, drain in-flight calls, release the arena."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(self.settings.grace_s if grace is None else grace).wait()
        if self.lanes is not None:
            self.lanes.close()
        if self.engine_socket is not None:
            self.engine_socket.stop()  # engines see EOF: their next call is Unavailable, as over gRPC
        if self.peer_socket is not None:
            self.peer_socket.stop()  # callers see EOF and use gRPC, which is stopped too: Unavailable
        if self.metrics:
            self.metrics.close()
        if self.outbox is not None:
            self.outbox.close()
        if self.link is not None:
            self.link.close()
        if self.backend is not None:
            self.backend.close()
        if self.handles is not None:
            self.handles.stop()  # unlinks the socket; engines' and peers' mappings stay valid
        if self.doorbells is not None:
            self.doorbells.close()  # engines' read-only mappings stay valid until they unmap
        self.node.pool.arena.close()
        if self.settings.listen_unix and os.path.exists(self.settings.listen_unix):
            os.unlink(self.settings.listen_unix)

    def wait(self) -> None:
        self._stop.wait()


def settle_heap() -> int:
    """Collect once, then move every object alive now out of the garbage collector's sight
    (:func:`gc.freeze`); returns how many. A started daemon holds ~190k objects (torch, grpc, the
    pool's tables) that live as long as it does, and a full collection walks them all with the
    interpreter lock held: 130-160 ms on a 2-core VM, a stall of every call in flight. Frozen,
    they are never walked again; what the daemon allocates while serving is collected as before.
    For a process that runs one daemon (:func:`serve`): objects frozen are never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def raise_open_files() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit
    now. Every engine and peer connection, mapping and watch holds a file: a soft limit of 1,024
    (a shell's default) runs out long before the hard limit an operator granted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:  # the most setrlimit allows
                hard = int(f.read())
        except (OSError, ValueError):
            return soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def serve(settings: Settings, *, on_start: Callable[[Daemon], None] | None = None, stops: StopSignals | None = None) -> None:
    """Run a daemon in the foreground until SIGTERM or SIGINT. ``stops``: the handlers ``kvd
    serve`` installed first thing (a SIGTERM during start-up stops the daemon once started);
    installed here when not given; closed once a signal came. ``on_start`` (test launchers only,
    :mod:`kvd.demo.faults`) sees the started daemon before it announces itself."""
    stops = stops if stops is not None else StopSignals((signal.SIGTERM,))
    try:
        files = raise_open_files()
        d = Daemon.start(settings)
        log.info("this process may open %d files", files)
        if on_start is not None:
            try:
                on_start(d)
            except BaseException:
                d.stop(0)
                raise
        settle_heap()
        stops.listen(signal.SIGINT)  # until now Ctrl-C stopped the start-up (KeyboardInterrupt)
        signum = stops.wait(lambda: print(
            f"kvd: serving on {', '.join(d.addresses)}" + (f"; metrics on :{d.metrics.port}" if d.metrics and d.metrics.port else ""),
            flush=True))
    finally:
        stops.close()
    log.info("signal %d: draining for up to %.1fs", signum, settings.grace_s)
    d.stop()
