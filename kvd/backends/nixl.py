"""A NIXL data plane: one-sided UCX writes from this arena into a peer's (``backend: nixl``).

One NIXL agent per daemon with its UCX backend; the whole backed arena is registered once
(``DRAM`` for a shm arena, ``VRAM`` for a CUDA arena, the device's index as NIXL's device id)
and again after every ``set_backed``. No etcd, no NIXL listener port: a peer's agent metadata
(~300-450 bytes: UCX worker address, rkeys of its registration) comes over kvd's own
daemon-to-daemon call (``Peer.TransferMetadata``), once per peer and registration, and is cached.

Endpoint. ``"<agent>/<generation>/<mem>@<locator>"``: the agent's name (unique per process),
how many times it registered (a ticket naming a newer generation than the cached metadata makes
the writer fetch it again), the memory type of its arena (``DRAM`` / ``VRAM``: the remote
descriptors' type), and where the metadata is fetched (the daemon's peer address). The
``fetch`` callable given at construction does the fetching; the backend knows no RPC.

Writes. One NIXL transfer request (a batched ``WRITE``) per :meth:`write` (up to ``max_batch``
descriptors each; Send's blocks are far fewer), built from numpy ``(addr, len, devid)`` arrays
(``initialize_xfer``): NIXL's prepared descriptor lists (``prep_xfer_dlist`` +
``make_prepped_xfer``) select fixed slots by index, and a Send's blocks are coalesced page runs of
any length at any page, so there are no slots to prepare; ``initialize_xfer`` costs ~0.1 ms per
1,000 blocks (measured, docs/benchmarks.md). NIXL checks every remote descriptor against the
peer's registration on this side before anything moves (``NIXL_ERR_NOT_FOUND``): stale metadata
is fetched again once and the request rebuilt. Completion is kvd's own: the waiter progresses
the request (``check_xfer_state``) until DONE, then the caller commits over the peer link.

Progress. NIXL's progress thread busy-polls (its Python wrapper hard-codes a 0 delay), a whole
core per daemon, so it is off; instead the initiator progresses its own requests while it waits
(spinning with ``sleep(0)``: a waiting Send yields the GIL), and a kvd thread progresses the
agent every ``progress_interval_s`` (1 ms; ``get_new_notifs``) so that UCX wire-up and the tcp
transport, which need the *target* to progress, complete. cma (same host) writes without the
target's help. All agent calls hold one lock: the agent runs with ``NIXL_THREAD_SYNC_NONE``.

Peer failure. UCX runs with ``ucx_error_handling_mode=peer`` (NIXL's default; it needs tcp among
``UCX_TLS``: sm-only transports have no peer failure handler). A dead peer fails a write with
``NIXL_ERR_REMOTE_DISCONNECT`` (measured: < 2 ms after a kill -9 on loopback) -> Unavailable. A
request that neither completes nor fails within ``stall_s + bytes / 200 MB/s`` is released and
reported Aborted (a peer host that vanished without a reset).

Environment, applied before NIXL loads, where the operator did not set it: ``UCX_MODULES=^ib``
on hosts without InfiniBand (every process that created a UCX backend otherwise segfaults at exit
in the bundled libnl-route that UCX's ib module loads), ``NIXL_LOG_LEVEL=WARN``,
``UCX_WARN_UNUSED_ENV_VARS=n``. Hosts with InfiniBand keep the ib module (RDMA).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.memory.arena import Arena
from kvd.backends.base import Backend, Landed, PeerRegion
from kvd.errors import Aborted, FailedPrecondition, InvalidArgument, KvdError, Unavailable

__all__ = ["NixlBackend", "Fetch", "INSTALL_HINT", "missing", "check_installed", "parse_endpoint"]

#: What a CPU host runs (``nixl`` alone resolves CUDA torch and the nvidia-* wheels: GBs).
INSTALL_HINT = "pip install --no-deps nixl-cu12 nixl numpy"

#: ``fetch(locator, agent)``: the agent metadata of peer ``agent`` at ``locator`` (Unavailable
#: when it cannot be reached; NotFound/FailedPrecondition when it runs no such agent).
Fetch = Callable[[str, str], bytes]

_ENV_DEFAULTS = {"NIXL_LOG_LEVEL": "WARN", "UCX_WARN_UNUSED_ENV_VARS": "n"}
#: Bytes per second below which a write is taken for stalled (see the module docstring).
_STALL_RATE = 200e6


def _apply_env(env: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """The environment defaults of the module docstring (the operator's own settings win)."""
    for key, value in _ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if "UCX_MODULES" not in env and not _has_infiniband():
        env["UCX_MODULES"] = "^ib"


def _has_infiniband() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


_api: Any = None


def _nixl() -> Any:
    """NIXL's ``_api`` module (``nixl`` picks the wheel for this host's CUDA; ``nixl_cu12``
    directly where only it is installed), or Unavailable saying what is missing."""
    global _api
    if _api is None:
        _apply_env()
        try:
            _api = importlib.import_module("nixl._api")
        except ImportError:
            try:
                _api = importlib.import_module("nixl_cu12._api")
            except ImportError as exc:
                raise Unavailable(f"the nixl backend is not installed ({exc}); run: {INSTALL_HINT}") from exc
    return _api


def missing() -> str | None:
    """What is missing for this backend (a sentence with the command to run), None when nothing.
    Imports NIXL (so its environment defaults apply first)."""
    try:
        _nixl()
    except Unavailable as exc:
        return str(exc)
    return None


def check_installed() -> str:
    """NIXL's version; Unavailable (with the install command) when it does not import."""
    why = missing()
    if why is not None:
        raise Unavailable(why)
    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "nixl (version unknown)"


@dataclass(frozen=True, slots=True)
class _Endpoint:
    agent: str
    generation: int
    mem: str
    locator: str


def parse_endpoint(endpoint: str) -> _Endpoint:
    """``"<agent>/<generation>/<mem>@<locator>"`` (see the module docstring); InvalidArgument
    naming the form when ``endpoint`` is not one."""
    head, sep, locator = endpoint.partition("@")
    parts = head.split("/")
    if not sep or len(parts) != 3 or not parts[0] or not parts[1].isdigit() or parts[2] not in ("DRAM", "VRAM"):
        raise InvalidArgument(
            f"{endpoint!r} is not a nixl endpoint ('<agent>/<generation>/DRAM|VRAM@<locator>'); "
            "the peer runs another backend or an incompatible kvd: configure both daemons with backend=nixl"
        )
    return _Endpoint(parts[0], int(parts[1]), parts[2], locator)


class NixlBackend(Backend):
    """NIXL over UCX (see the module docstring).

    Args:
        locator: where peers fetch this agent's metadata (the daemon's peer address); goes into
            :attr:`endpoint`.
        fetch: how this backend fetches a peer's metadata (``fetch(locator, agent)``); None: it
            cannot write (a receive-only backend, or tests that only register).
        max_batch: descriptors per NIXL transfer request.
        max_block: bytes per descriptor; longer blocks are split (None: never).
        progress_interval_s: how often the kvd thread progresses the agent.
        stall_s: the fixed part of a write's deadline (see the module docstring).

    Raises Unavailable when NIXL is missing or its UCX backend does not start."""

    name = "nixl"

    @classmethod
    def missing(cls) -> str | None:
        """See :func:`missing`."""
        return missing()

    def __init__(
        self,
        locator: str = "",
        fetch: Fetch | None = None,
        *,
        max_batch: int = 1 << 16,
        max_block: int | None = None,
        progress_interval_s: float = 1e-3,
        stall_s: float = 1.0,
    ) -> None:
        super().__init__()
        if max_batch <= 0 or (max_block is not None and max_block <= 0) or progress_interval_s <= 0 or stall_s <= 0:
            raise InvalidArgument(
                f"max_batch, max_block, progress_interval_s and stall_s must be positive, got "
                f"{max_batch}, {max_block}, {progress_interval_s}, {stall_s}"
            )
        if "@" in locator:
            raise InvalidArgument(f"a nixl locator may not contain '@', got {locator!r}")
        api = _nixl()
        self.locator, self.max_batch, self.max_block, self.stall_s = locator, max_batch, max_block, stall_s
        self._fetch = fetch
        self.agent_name = f"kvd-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        except Exception as exc:  # nixl*Error or RuntimeError("No plugins available ...")
            raise Unavailable(
                f"NIXL's UCX backend did not start ({type(exc).__name__}: {exc}); UCX_TLS must keep tcp "
                "(peer-failure handling needs it)"
            ) from exc
        self._agent: Any = agent
        self.mem_types = tuple(agent.get_backend_mem_types("UCX"))
        self._lock = threading.Lock()  # every agent call (NIXL_THREAD_SYNC_NONE)
        self._reg: Any = None
        self._mem = "DRAM"
        self._devid = 0
        self._generation = 0
        self._peers: dict[str, int] = {}  # agent -> generation of its loaded metadata
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, args=(progress_interval_s,), name="kvd-nixl-progress", daemon=True)
        self._progress.start()

    @property
    def endpoint(self) -> str:
        """``"<agent>/<generation>/<mem>@<locator>"``; changes with every :meth:`register`."""
        return f"{self.agent_name}/{self._generation}/{self._mem}@{self.locator}"

    def metadata(self, agent: str) -> bytes:
        """This agent's metadata, for a peer's ``fetch``; FailedPrecondition when ``agent`` names
        another agent (this daemon restarted since the peer's ticket was issued)."""
        if agent != self.agent_name:
            raise FailedPrecondition(
                f"this daemon's nixl agent is {self.agent_name!r}, not {agent!r}: it restarted since the ticket was issued; "
                "acquire a new lease"
            )
        self._check_open()
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    # -- registration ----------------------------------------------------------------------

    def register(self, arena: Arena) -> float:
        """See :meth:`Backend.register`. A CUDA arena (handle kind ``cuda-vmm``) registers as
        ``VRAM`` on its device; Unavailable where the installed NIXL's UCX plugin has no VRAM."""
        kind = arena.handle().kind
        if kind not in ("shm", "cuda-vmm"):
            raise InvalidArgument(f"the nixl backend registers shm or cuda-vmm arenas, not {kind!r}")
        if kind == "cuda-vmm" and "VRAM" not in self.mem_types:
            raise Unavailable(
                f"arena=cuda with backend=nixl needs a NIXL whose UCX plugin handles VRAM; this one handles {list(self.mem_types)}: "
                "install the nixl-cu12 (or nixl-cu13) wheel matching the host's CUDA"
            )
        return super().register(arena)

    def _register(self, arena: Arena) -> None:
        if arena.handle().kind == "cuda-vmm":
            mem, devid = "VRAM", arena.device.index or 0
        else:
            mem, devid = "DRAM", 0
        with self._lock:
            try:
                self._reg = self._agent.register_memory([(arena.base, arena.backed, devid, "")], mem)
            except Exception as exc:
                raise Unavailable(f"nixl could not register {arena.backed:,d} bytes of {mem} at {arena.base:#x}: {type(exc).__name__}: {exc}") from exc
            self._mem, self._devid = mem, devid
            self._generation += 1

    def _unregister(self) -> None:
        with self._lock:
            reg, self._reg = self._reg, None
            if reg is not None:
                self._agent.deregister_memory(reg)
            self._generation += 1  # peers holding the old metadata fetch it again

    def _close(self) -> None:
        self._stop.set()
        self._progress.join(timeout=5)
        with self._lock:
            self._agent = None  # the agent's destructor closes UCX

    def _progress_loop(self, interval: float) -> None:
        """Progress the agent (UCX wire-up and tcp RMA need the target's progress) without a busy core."""
        while not self._stop.wait(interval):
            with self._lock:
                if self._agent is None:
                    return
                try:
                    self._agent.get_new_notifs()
                except Exception:  # noqa: BLE001 -- a notification error must not end progress
                    pass

    # -- writes ---------------------------------------------------------------------------

    def _issue(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> Landed:
        if self._fetch is None:
            raise FailedPrecondition("this nixl backend was made without a metadata fetch: it cannot write to peers")
        ep = parse_endpoint(peer.endpoint)
        s, d, n = _split(srcs, dsts, lens, self.max_block)
        total = int(n.sum())
        self._load(ep, refresh=False)
        handles: list[Any] = []
        try:
            for i in range(0, len(s), self.max_batch):
                j = i + self.max_batch
                handles.append(self._post(ep, peer, s[i:j], d[i:j], n[i:j]))
        except BaseException:
            self._release(handles)
            raise
        deadline = time.monotonic() + self.stall_s + total / _STALL_RATE

        def landed() -> None:
            try:
                for h in handles:
                    self._wait(h, ep, peer, deadline, total)
                self._account(total, len(handles))
            finally:
                self._release(handles)

        return landed

    def _load(self, ep: _Endpoint, *, refresh: bool) -> None:
        """Load the peer's metadata unless the cached one is as new as ``ep`` says (``refresh``:
        fetch again whatever the cache says)."""
        cached = self._peers.get(ep.agent)
        if cached is not None and not refresh and cached >= ep.generation:
            return
        meta = self._fetch(ep.locator, ep.agent)  # type: ignore[misc]  # Unavailable when unreachable
        with self._lock:
            if ep.agent in self._peers:
                self._agent.remove_remote_agent(ep.agent)
                del self._peers[ep.agent]
            try:
                got = self._agent.add_remote_agent(meta)
            except Exception as exc:
                raise Unavailable(f"nixl could not load peer {ep.agent!r}'s metadata: {type(exc).__name__}: {exc}") from exc
            name = got.decode() if isinstance(got, bytes) else str(got)
            if name != ep.agent:
                self._agent.remove_remote_agent(name)
                raise Unavailable(f"the daemon at {ep.locator!r} runs nixl agent {name!r}, not the ticket's {ep.agent!r}; nothing was written")
            # The generation the peer's metadata stands for is at least the ticket's.
            self._peers[ep.agent] = ep.generation

    def _post(self, ep: _Endpoint, peer: PeerRegion, s: np.ndarray, d: np.ndarray, n: np.ndarray) -> Any:
        """Build and post one transfer request; a remote descriptor the cached metadata does not
        cover (NIXL_ERR_NOT_FOUND, nothing moved) fetches the metadata again once."""
        zeros = np.zeros(len(n), np.uint64)
        local = np.stack([s, n, zeros + self._devid], axis=1)
        remote = np.stack([d, n, zeros + (self._devid if ep.mem == "VRAM" else 0)], axis=1)
        for attempt in (0, 1):
            with self._lock:
                try:
                    h = self._agent.initialize_xfer(
                        "WRITE", self._agent.get_xfer_descs(local, self._mem), self._agent.get_xfer_descs(remote, ep.mem), ep.agent
                    )
                except Exception as exc:
                    if _kind(exc) == "nixlNotFoundError" and attempt == 0:
                        refused = exc
                    else:
                        raise self._failure(exc, ep, peer, started=False) from exc
                else:
                    try:
                        st = self._agent.transfer(h)
                    except Exception as exc:
                        self._agent.release_xfer_handle(h)
                        raise self._failure(exc, ep, peer, started=False) from exc
                    if st == "ERR":
                        self._agent.release_xfer_handle(h)
                        raise self._failure(None, ep, peer, started=False)
                    return h
            self._load(ep, refresh=True)
        raise self._failure(refused, ep, peer, started=False)  # pragma: no cover -- the loop returns or raises

    def _wait(self, h: Any, ep: _Endpoint, peer: PeerRegion, deadline: float, total: int) -> None:
        while True:
            with self._lock:
                try:
                    st = self._agent.check_xfer_state(h)
                except Exception as exc:
                    raise self._failure(exc, ep, peer, started=True) from exc
            if st == "DONE":
                return
            if st == "ERR":
                raise self._failure(None, ep, peer, started=True)
            if time.monotonic() > deadline:
                raise Aborted(
                    f"nixl write of {total:,d} bytes to {ep.agent!r} at {ep.locator!r} ({peer.region_id!r}) did not complete in "
                    f"{self.stall_s:g} s + {_STALL_RATE / 1e6:.0f} MB/s; the peer's bytes in its blocks are undefined"
                )
            time.sleep(0)  # progress again, but let the daemon's other threads run

    def _release(self, handles: list[Any]) -> None:
        with self._lock:
            for h in handles:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception:  # noqa: BLE001 -- a request UCX still holds; NIXL frees it with the agent
                    pass

    def _failure(self, exc: Exception | None, ep: _Endpoint, peer: PeerRegion, *, started: bool) -> KvdError:
        kind = _kind(exc) if exc is not None else "ERR"
        where = f"{ep.agent!r} at {ep.locator!r} ({peer.region_id!r})"
        if kind == "nixlRemoteDisconnectError":
            self._peers.pop(ep.agent, None)  # a restarted peer is a new agent; this one is gone
            return Unavailable(f"nixl peer {where} cannot be reached (disconnected); nothing was written")
        if kind == "nixlNotFoundError":
            return Aborted(
                f"nixl peer {where} has not registered the blocks' destination (NIXL_ERR_NOT_FOUND, after fetching its "
                "metadata again): it resized its arena since the ticket was issued; nothing was written"
            )
        landed = "an unknown part of its bytes landed" if started else "nothing was written"
        return Aborted(f"nixl write to {where} failed ({kind}: {exc}); {landed}")


def _kind(exc: BaseException) -> str:
    return type(exc).__name__


def _split(srcs: list[int], dsts: list[int], lens: list[int], max_block: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint64 arrays of the blocks, cut into pieces of at most ``max_block`` bytes."""
    s, d, n = (np.asarray(v, dtype=np.uint64) for v in (srcs, dsts, lens))
    if max_block is None or int(n.max()) <= max_block:
        return s, d, n
    pieces = ((n + np.uint64(max_block - 1)) // np.uint64(max_block)).astype(np.int64)
    idx = np.repeat(np.arange(len(n)), pieces)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number within its block
    off = k.astype(np.uint64) * np.uint64(max_block)
    return s[idx] + off, d[idx] + off, np.minimum(np.uint64(max_block), n[idx] - off)
