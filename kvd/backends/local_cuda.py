"""Same-host backend for CUDA arenas: import the peer's arena chunks and copy on the GPU.

The endpoint is this daemon's handle socket (:mod:`kvd.ipc.fdpass`). A writer fetches the peer's
chunk fds once (credential: the shared peer token), maps them for *its own* GPU
(:func:`kvd.memory.vmm.import_arena`) and keeps the mapping, keyed by the peer's endpoint and
checked against its ``region_id`` and backing ``generation``; it maps again when the ticket
promises more bytes than are mapped, or the peer's backing changed, or the peer restarted.

Same GPU or another GPU of the host. The peer's arena lives on the GPU its handle header names
(by UUID; :func:`kvd.memory.cuda.device_for` finds it in this process). When that is this
daemon's own GPU, the mapping is an ordinary one. When it is another GPU, the chunks are mapped
for this daemon's GPU with peer access (``cuMemSetAccess`` for the local device on memory that
physically lives on the peer's: NVLink where present), the peer's GPU is recorded with the
mapping (``_Import.home``), and the kernel on the local GPU writes through it. A peer GPU this
process cannot see, or cannot reach by peer access, is refused with FailedPrecondition naming
both GPUs before anything is mapped.

    prefill daemon (cuda:0)                         decode daemon (cuda:1)
    arena on cuda:0 ──move_pages on cuda:0──▶ mapping of D's chunks ═NVLink═▶ arena on cuda:1
                                             (tensor of cuda:0, home 1)

The copy. Source is this arena's tensor, destination the imported one; the planner's blocks
(absolute addresses) become runs over ``[N, g]`` byte-row views of both, ``g`` the gcd of every
offset and length (so every block is whole rows), and :func:`kvd.copy.kernels.move_pages` moves them
in one Triton launch on this daemon's GPU (the source's device: the staged run table, the table
kernel and the move kernel all go on that device's current stream), followed by a CUDA event.
``write_async`` returns there, with the copies queued; its waiter synchronizes the event (only
these copies, not the whole stream): the receiver is told READY as soon as the waiter returns,
and for a cross-GPU write the stores over the link are complete when the kernel is. ``write``
is both at once. A sender of many requests (``Outbox.send_many``) queues the next request's
copies before it waits for the previous request's, so the GPU never waits for Python.

Copy strategy (:func:`kvd.copy.blocks.copy_strategy`, a pure function). Few large blocks go through the copy
engines (:func:`kvd.copy.blocks.copy_engine_blocks`): every block of a write batch in one ``cuMemcpyBatchAsync``
(across GPUs, device-to-device copies the driver routes over NVLink: 390 GB/s on H200, what one
memcpy of the same bytes moves, against the kernel's 316-319 and 370 for a memcpy per block; on
the same GPU 1.9 TB/s against the kernel's 1.3), or, across GPUs only, one memcpy per block
where the driver lacks the batch call. Many small blocks, or the same GPU without the batch
call: the kernel (one launch; far faster than thousands of memcpy calls). Both go on the
backend's own stream of this GPU (the batch call refuses the legacy default stream).
``strategies`` counts the choices made.

Liveness. An imported chunk keeps the peer's physical memory alive even after the peer died (the
import holds a reference), so a write never faults; it may only land in memory nobody owns any
more. The writer therefore checks the peer before the copy (dead or another ``region_id`` ->
Unavailable, nothing written) and after it (-> Aborted: the bytes are lost), and drops the
mapping of a dead peer at once: it pins a whole arena of GPU memory. The check is a watch
(:func:`kvd.ipc.fdpass.watch`, opened with the mapping): a zero-timeout poll of a connection the peer's
handle server keeps open, no round trip. Anything on it (EOF when the peer died or stopped, a
byte when its backing changed) -> the watch is spent and the writer falls back to a ping of
the handle socket, which decides as before (and a new watch is opened with the next mapping
check). No watch (a server without the op): pings, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvd.ipc import fdpass
from kvd.memory.arena import Arena
from kvd.backends.base import Backend, Landed, PeerRegion, Wiring
from kvd.errors import (
    Aborted,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    Unavailable,
)
from kvd.ipc.fdpass import HandleHeader
from kvd.copy.blocks import COPY_ENGINE, KERNEL, batch_usable, copy_blocks, copy_engine_blocks, copy_strategy

__all__ = ["CudaLocalBackend"]

log = logging.getLogger("kvd.backends.local_cuda")

#: Seconds to wait for a peer's handle server; a dead peer answers at once (connection refused).
_PROBE_TIMEOUT_S = 2.0

def _import(header: HandleHeader, fds: list[int], device: torch.device) -> tuple[Any, torch.Tensor]:
    """Map a peer's export for ``device``; the seam CPU tests replace (they map memfds instead)."""
    from kvd.memory.vmm import import_arena

    return import_arena(header, fds, device)


def _locate(header: HandleHeader) -> int | None:
    """This process's index of the GPU the peer's arena lives on (None: the header names no GPU).
    FailedPrecondition when this process does not see it. A seam: CPU tests stub it."""
    if header.device < 0:
        return None
    from kvd.memory.cuda import device_for

    return device_for(header.gpu_uuid, header.device)


def _can_access(dev: int, home: int) -> bool:
    """Whether kernels on ``dev`` can write memory on ``home`` (peer access). A seam."""
    from kvd.memory.cuda import can_access_peer

    return can_access_peer(dev, home)


def _label(index: int) -> str:
    from kvd.memory.cuda import gpu_label

    return gpu_label(index)


@dataclass(slots=True)
class _Import:
    """One peer arena mapped into this process."""

    owner: Any  # ImportedVmm: close() unmaps (and the GC does, for a replaced mapping)
    view: torch.Tensor  # uint8 over the peer's [0, size)
    region_id: str
    generation: int
    size: int
    home: int | None = None  # the GPU the peer's memory lives on, when not this daemon's (peer access)
    watch: fdpass.Watch | None = None  # the peer's handle server, watched (None: ping instead)

    def watched(self) -> bool:
        """True when the watch vouches that the peer is alive with this region and generation."""
        w = self.watch
        return w is not None and w.quiet()

    def close(self) -> None:
        """Unmap now (only when no write can be using it)."""
        self.view = None  # type: ignore[assignment]
        if self.watch is not None:
            self.watch.close()
        self.owner.close()


class CudaLocalBackend(Backend):
    """Writes into CUDA arenas of peer daemons on the same host (see the module docstring).

    ``endpoint`` is this daemon's handle socket path (what peers fetch this arena's fds from; it
    goes into tickets). ``token`` is the shared peer token presented to peers' handle servers.
    Only a CUDA arena (``handle().kind == "cuda-vmm"``) can be registered."""

    name = "local"
    arena_kinds = frozenset({"cuda-vmm"})
    draft_vectors = True

    @classmethod
    def create(cls, wiring: Wiring) -> CudaLocalBackend:
        """Advertises the daemon's handle socket and presents its peer token."""
        return cls(wiring.handle_endpoint, token=wiring.peer_token)

    def __init__(self, endpoint: str, *, token: str | None = None, timeout: float = _PROBE_TIMEOUT_S) -> None:
        super().__init__()
        self._endpoint = endpoint
        self._token = token or ""
        self.timeout = timeout
        self._src: torch.Tensor | None = None  # uint8 over the registered range
        self._dev: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None  # where the copies and their events go (CUDA arenas)
        self._peers: dict[str, _Import] = {}
        self._peers_lock = threading.Lock()
        #: Liveness checks: ``polls`` answered by a quiet watch, ``pings`` by a round trip;
        #: ``liveness_s`` the seconds spent in both. ``strategies``: copies per strategy.
        self.polls = self.pings = 0
        self.liveness_s = 0.0
        self.strategies: dict[str, int] = {KERNEL: 0, COPY_ENGINE: 0}

    @property
    def endpoint(self) -> str:
        """This daemon's handle socket path."""
        if not self._endpoint:
            raise FailedPrecondition("local cuda backend: no handle socket to advertise; the daemon passes one")
        return self._endpoint

    # -- registration -----------------------------------------------------------------------

    def register(self, arena: Arena) -> float:
        """See :meth:`Backend.register`; refuses arenas that are not CUDA arenas (InvalidArgument)."""
        self._check_open()
        kind = arena.handle().kind
        if kind != "cuda-vmm":
            raise InvalidArgument(f"the local cuda backend registers cuda-vmm arenas only, not {kind!r}; use LocalBackend for shm")
        self._dev = arena.device
        return super().register(arena)

    def _register(self, arena: Arena) -> None:
        self._src = arena.tensor()  # a view, no copy: [0, backed) at this moment
        if self._src.is_cuda and self._stream is None:
            # The copies' own stream: batched copy-engine writes refuse the legacy default stream.
            self._stream = torch.cuda.Stream(device=self._src.device)

    def _unregister(self) -> None:
        self._src = None

    def _close(self) -> None:
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for m in peers:
            try:
                m.close()
            except Exception:
                pass

    # -- peers ------------------------------------------------------------------------------

    def _ping(self, endpoint: str) -> HandleHeader:
        t = time.perf_counter()
        try:
            return fdpass.ping(endpoint, token=self._token, timeout=self.timeout)
        finally:
            self.pings += 1
            self.liveness_s += time.perf_counter() - t

    def _poll(self, m: _Import) -> bool:
        """Whether ``m``'s watch vouches for the peer (a zero-timeout poll; False: ask by ping)."""
        t = time.perf_counter()
        ok = m.watched()
        if ok:
            self.polls += 1
        self.liveness_s += time.perf_counter() - t
        return ok

    def _watch(self, endpoint: str, region_id: str, generation: int) -> fdpass.Watch | None:
        """A watch of the peer's handle server, when it serves one for this region and generation
        (None otherwise: the writer pings). Never raises: liveness falls back to pings."""
        try:
            w = fdpass.watch(endpoint, token=self._token, timeout=self.timeout)
        except Exception as exc:  # an older server (InvalidArgument), busy, gone: ping instead
            log.debug("no watch of %s: %s", endpoint, exc)
            return None
        if w.header.region_id != region_id or w.header.generation != generation:
            w.close()  # changed between the fetch and the watch: the next write pings and maps again
            return None
        return w

    def _drop(self, endpoint: str, m: _Import | None = None) -> None:
        """Forget (and unmap, when nobody else can be using it) the mapping of a dead peer."""
        with self._peers_lock:
            cur = self._peers.get(endpoint)
            if cur is not None and (m is None or cur is m):
                del self._peers[endpoint]
                _close_watch(cur)
        # Not unmapped here: a write in another thread may still copy through it; the last
        # reference unmaps it (ImportedVmm closes itself when collected).

    def _mapping(self, peer: PeerRegion, head: HandleHeader) -> _Import:
        """The mapping of ``peer`` that matches the peer's ``head`` and covers the ticket.

        Fetching, importing and opening a watch talk to the peer: they run outside the lock, so
        a peer that hangs stalls only the writers to it (the lock guards the dict, no I/O)."""

        def current(m: _Import | None) -> bool:
            return m is not None and m.region_id == head.region_id and m.generation == head.generation and m.size >= peer.backed_bytes

        with self._peers_lock:
            m = self._peers.get(peer.endpoint)
            if current(m) and m.watched():  # type: ignore[union-attr]
                return m  # type: ignore[return-value]
            if not current(m):
                self._peers.pop(peer.endpoint, None)
                self._prune()
                m = None
        if m is not None:  # current but its watch is spent (a notify) or never opened: watch again
            w = self._watch(peer.endpoint, m.region_id, m.generation)
            with self._peers_lock:
                old, m.watch = m.watch, w
            if old is not None:
                old.close()  # spent: its poll answers not quiet whatever the fd is now
            return m
        new = self._map(peer)
        with self._peers_lock:
            cur = self._peers.get(peer.endpoint)
            if current(cur):  # another writer mapped it meanwhile: use that one
                keep, spare = cur, new
            else:
                self._peers[peer.endpoint] = keep = new
                spare = None
        if spare is not None:
            spare.close()
        return keep  # type: ignore[return-value]

    def _prune(self) -> None:
        """Drop mappings whose watch fired (called with the lock, before a new import): the peer
        died, stopped or changed its backing, so the mapping is dead or stale either way, and
        a dead peer's mapping pins its whole arena. Local checks only: no I/O under the lock, so
        a peer that hangs cannot stall the writers to every other peer. A mapping without a
        watch (a server without the op) is dropped by its next write's failed ping instead."""
        for ep, m in list(self._peers.items()):
            if m.watch is not None and not m.watch.quiet():
                del self._peers[ep]
                _close_watch(m)

    def _map(self, peer: PeerRegion) -> _Import:
        handles = fdpass.fetch(peer.endpoint, token=self._token, timeout=self.timeout)
        h = handles.header
        try:
            if h.region_id != peer.region_id:
                raise Unavailable(
                    f"peer arena {peer.region_id!r} is gone: {peer.endpoint} now serves {h.region_id!r} (the peer "
                    "restarted); nothing was written"
                )
            if h.backed < peer.backed_bytes:
                raise Aborted(
                    f"peer arena {peer.region_id!r} exports {h.backed:,d} bytes but its ticket promises "
                    f"{peer.backed_bytes:,d}; the peer shrank under a live lease"
                )
            if self._dev is None:
                raise InternalError("local cuda backend: mapping a peer before an arena was registered")
            home = self._reachable(peer, h)
            owner, view = _import(h, handles.fds, self._dev)
        finally:
            for fd in handles.fds:
                os.close(fd)  # the mapping keeps the memory alive
        return _Import(owner, view, h.region_id, h.generation, h.backed, home, self._watch(peer.endpoint, h.region_id, h.generation))

    def _reachable(self, peer: PeerRegion, h: HandleHeader) -> int | None:
        """The peer's GPU when it is another GPU than this daemon's (None: the same GPU, or no
        GPU named); FailedPrecondition, naming both GPUs, when this daemon cannot write there."""
        dev = self._dev
        if dev is None or dev.type != "cuda":
            return None
        own = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            home = _locate(h)
        except FailedPrecondition as exc:
            raise FailedPrecondition(
                f"peer arena {peer.region_id!r} lives on GPU {h.gpu_uuid or '?'} (cuda:{h.device} of the peer), which "
                f"this daemon (arena on {_label(own)}) does not see; nothing was written. Run both daemons with the "
                "same CUDA_VISIBLE_DEVICES and pick each one's GPU with cuda_device"
            ) from exc
        if home is None or home == own:
            return None
        if not _can_access(own, home):
            raise FailedPrecondition(
                f"peer arena {peer.region_id!r} lives on {_label(home)}, and this daemon's GPU {_label(own)} has no "
                f"peer access to it (torch.cuda.can_device_access_peer({own}, {home}) is false: no NVLink or PCIe P2P "
                "between them); nothing was written. Put both daemons on one GPU, on GPUs with peer access, or use "
                "backend=mooncake"
            )
        return home

    # -- the copy ---------------------------------------------------------------------------

    def _issue(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> Landed:
        """Check the peer, queue the copies on the backend's stream of this GPU and record an
        event after them; the waiter waits for that event, then checks the peer again. The
        waiter's ``phases`` say where the time went (seconds: ``issue:peer`` the mapping and
        liveness check, ``issue:prep`` the strategy and offsets, ``issue:copy`` the copy call,
        ``issue:event`` the event; ``write:wait`` the wait for it, ``write:after`` the checks
        after), for the Send's reply (:meth:`kvd.handoff.flight.Flight.note`)."""
        pc = time.perf_counter
        t0 = pc()
        src = self._src
        if src is None:  # Backend.write_async checked that an arena is registered
            raise InternalError("local cuda backend: write reached the copy with no registered source view")
        m = self._peers.get(peer.endpoint)
        if m is None or m.region_id != peer.region_id or m.size < peer.backed_bytes or not self._poll(m):
            # No mapping that a quiet watch vouches for: ask the peer (a round trip) and map.
            m = self._checked_mapping(peer)
        t1 = pc()
        lo = self.registered[0]
        strategy = copy_strategy(m.home, lens, batch=batch_usable())
        done = None
        stream = self._stream
        try:
            s_off, d_off = [a - lo for a in srcs], [a - peer.base for a in dsts]
            t2 = pc()
            if strategy == COPY_ENGINE:
                copy_engine_blocks(src, m.view, s_off, d_off, lens, m.home, stream)
            else:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    copy_blocks(src, m.view, s_off, d_off, lens)
            t3 = pc()
            if stream is not None:
                # Both strategies issue on the backend's stream of the source's device (this
                # daemon's GPU; the mapping is a tensor of it too, even when the memory lives on
                # a peer GPU). The waiter waits for these copies by an event, not the whole
                # stream: with several Sends at once, a stream sync would also wait for copies
                # other Sends queued after these.
                done = torch.cuda.Event()
                done.record(stream)
        except (RuntimeError, ValueError) as exc:  # a CUDA error from the launch; Triton refusing a pointer
            if stream is not None:  # copies queued before the failure must not land after the caller was told
                with contextlib.suppress(RuntimeError):
                    stream.synchronize()
            raise Aborted(f"copy into peer arena {peer.region_id!r} failed: {exc}; its bytes in these blocks are undefined") from exc
        t4 = pc()
        phases = {"issue:peer": t1 - t0, "issue:prep": t2 - t1, "issue:copy": t3 - t2, "issue:event": t4 - t3}

        def landed() -> None:
            w0 = pc()
            if done is not None:
                # The receiver is told READY once the waiter returns: every byte must have landed.
                try:
                    done.synchronize()
                except RuntimeError as exc:  # a CUDA error raised by the copies
                    raise Aborted(f"copy into peer arena {peer.region_id!r} failed: {exc}; its bytes in these blocks are undefined") from exc
            w1 = pc()
            self._after(peer, m, strategy, lens)
            phases["write:wait"], phases["write:after"] = w1 - w0, pc() - w1

        landed.phases = phases  # type: ignore[attr-defined]  # read by Flight.note
        return landed

    def _after(self, peer: PeerRegion, m: _Import, strategy: str, lens: list[int]) -> None:
        """The copies landed: count them, then check the peer is still the one written to
        (Aborted, the mapping dropped, when it died or was replaced meanwhile)."""
        self.strategies[strategy] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("wrote %d blocks (%d bytes) into %s by %s (home %s)", len(lens), sum(lens), peer.region_id, strategy, m.home)
        self._account(sum(lens))
        if self._poll(m):
            return
        try:
            after = self._ping(peer.endpoint)
        except Unavailable as exc:
            self._drop(peer.endpoint, m)
            raise Aborted(f"peer arena {peer.region_id!r} lost its owner during the write ({exc}); its bytes are undefined") from exc
        if after.region_id != m.region_id:
            self._drop(peer.endpoint, m)
            raise Aborted(f"peer arena {peer.region_id!r} was replaced during the write (now {after.region_id!r}); its bytes are undefined")

    def _checked_mapping(self, peer: PeerRegion) -> _Import:
        """Ping the peer (Unavailable, mapping dropped, when it is dead or restarted) and return
        the mapping matching its answer (mapped again, with a new watch, when needed)."""
        try:
            head = self._ping(peer.endpoint)
        except Unavailable as exc:
            self._drop(peer.endpoint)
            raise Unavailable(f"peer arena {peer.region_id!r} ({peer.endpoint}) does not answer: {exc}; nothing was written") from exc
        if head.region_id != peer.region_id:
            self._drop(peer.endpoint)
            raise Unavailable(
                f"peer arena {peer.region_id!r} is gone: {peer.endpoint} now serves {head.region_id!r} (the peer "
                "restarted); nothing was written"
            )
        return self._mapping(peer, head)


def _close_watch(m: _Import) -> None:
    """Close a dropped mapping's watch now (its fd, not left to the collector). A write still
    polling it sees "not quiet" and re-checks the peer by a ping, which a dropped peer fails."""
    if m.watch is not None:
        m.watch.close()
