"""Cross-node backend: Mooncake Transfer Engine, peer-to-peer handshake, no metadata server.

Each backend owns one ``TransferEngine`` initialised with ``P2PHANDSHAKE``; the endpoint is
``"<host>:<rpc port>"`` and goes into tickets as ``transfer_endpoint``. A write is batches of
at most ``max_batch`` blocks, blocks longer than ``max_block`` split into pieces, all submitted
at once (``batch_transfer_async_write``); its waiter waits for them
(``get_batch_transfer_status``), so the engine moves one request's bytes while the daemon
commits the one before and prepares the next (SendMany).

Things to know about the engine (0.3.13, measured on loopback):

* It listens on all interfaces: the handshake port on 0.0.0.0 and the TCP data port on ``*``,
  whatever ``host`` says (``host`` is only the address advertised to peers). Firewall it.
* Errors are a return code (-1) plus a glog line on stderr; there are no exceptions and no
  error text to read back. This class classifies a failure by probing the peer
  (``send_probe``): unreachable and nothing written yet -> Unavailable, else Aborted.
* Over TCP it does not check that *source* addresses are registered (it reads any mapped
  memory), so this class checks them against the registered range itself.
* A dead peer costs about 1 s per write (reconnect attempts with backoff) before -1. A peer
  that is alive but stuck (stopped, swapping) blocks a write until the engine's progress
  timeout: 30 s by default, ``MC_TCP_PROGRESS_TIMEOUT_SEC`` to change it (read per process).
* ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` must exceed the largest batch (the default fails
  batches above ~1024 with queue-full warnings); this module sets it to 8192 unless set.
* ``initialize`` logs "Local segment descriptor not found" once; it is harmless.
* The ``protocol`` argument of ``initialize`` does not pick the transport (it only sets up the
  engine's buffer allocator): the engine installs RDMA when it finds HCAs (or ``MC_FORCE_HCA``
  is set) and TCP otherwise; ``MC_FORCE_TCP`` forces TCP. A write returns once the peer has
  applied it (TCP framing v2; ``MC_TCP_PROTO=1`` forces the legacy framing, which reports a
  write done when it left the socket buffer, so it is refused: Commit follows every write).

CUDA arenas (``arena: cuda``). The installed build says what it was compiled with:
``mooncake.engine.SUPPORT_CUDA`` (and ``SUPPORT_INTRA_NVLINK``; flags since 0.3.12) is True in
``mooncake-transfer-engine`` and False in ``mooncake-transfer-engine-non-cuda``
(:func:`build_info`). Only a CUDA build may register a CUDA arena: the CPU build would read a
device pointer as host memory (a crash, not an error). The CUDA build registers the arena's
device range ``[base, base + backed)`` as it is; which transport carries it:

* TCP (no HCA, or ``MC_FORCE_TCP``): both sides see device memory (``cudaPointerGetAttributes``)
  and stage it through host buffers with a synchronous ``cudaMemcpy``, CUDA virtual memory
  included. Measured on 2x H200 (0.3.13.post1, GPU 0 -> GPU 1, two processes): 1.6-1.7 GB/s
  for 64 MiB-1 GiB, byte-exact; a peer copy over NVLink is ~390 GB/s.
* RDMA (HCAs found): GPUDirect RDMA; the engine exports the registered range as a dma-buf
  (``cuMemGetHandleForAddressRange``), which CUDA allows for virtual memory only when it was
  created RDMA-capable: :class:`~kvd.memory.vmm.CudaVmmArena` does that where the device
  supports it. Not yet run with kvd (no RDMA NICs on the GPU hosts so far); open: whether the
  engine's export covers an arena of several physical chunks (it asks ``cuMemGetAddressRange``
  for the allocation around the base), and whether the receiver needs a flush before its GPU
  reads what the NIC wrote.
* Intra-node NVLink (``MC_INTRANODE_NVLINK`` set, CUDA build): refused. It registers memory
  through ``cudaIpcGetMemHandle``, which refuses CUDA virtual memory: register_memory returns -1
  for a kvd arena (measured, as source and as destination). Same-host GPUs use ``backend:
  local``, which maps the peer's arena itself and copies over NVLink.

No device synchronisation before a write: the daemon's own GPU work on its arena (compaction,
restore) waits for itself before returning (``Pool._settle``), and the engines' KV writes happen
in other processes, where only the engine can order them (it waits for its stream before Send:
``kvd.engine.device.Fenced``); a sync in the daemon would not see their streams anyway. The TCP
path's copies are synchronous on both sides, and the peer acknowledges a write only after its
copy into device memory returned, so Commit (READY) follows bytes that landed.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvd.memory.arena import Arena
from kvd.backends.base import INSTALL_HINT, Backend, Landed, PeerRegion
from kvd.errors import Aborted, InvalidArgument, KvdError, Unavailable

__all__ = ["MooncakeBackend", "BuildInfo", "build_info", "check_installed", "CUDA_INSTALL_HINT"]

#: What a GPU host runs to get the CUDA build (both wheels install the package ``mooncake``).
CUDA_INSTALL_HINT = "pip uninstall -y mooncake-transfer-engine-non-cuda && pip install mooncake-transfer-engine"

# Applied before the first import of mooncake.engine; an operator's own setting wins.
_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",  # INFO and WARNING lines are per-connection chatter
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",  # > max_batch (see the module docstring)
}
#: Variables that change what a write means (read by the engine at initialize; see _refusal).
_TRANSPORT_ENV = ("MC_INTRANODE_NVLINK", "MC_TCP_PROTO")


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """What the installed ``mooncake.engine`` was compiled with (its ``SUPPORT_*`` flags)."""

    cuda: bool | None  # USE_CUDA: device pointers are GPU memory to it; None: no flag (older than 0.3.12)
    intra_nvlink: bool  # USE_INTRA_NVLINK: MC_INTRANODE_NVLINK switches to the intra-node NVLink transport

    def describe(self) -> str:
        if self.cuda is None:
            return "a Mooncake build that does not say whether it has CUDA (no mooncake.engine.SUPPORT_CUDA: older than 0.3.12)"
        return "the CUDA build" if self.cuda else "the CPU-only build (mooncake.engine.SUPPORT_CUDA is False)"


def check_installed(*, cuda_arena: bool = False) -> BuildInfo:
    """The installed build, after refusing what cannot work; call it at start-up.

    Unavailable (with the install command) unless ``mooncake.engine`` imports, or when
    ``cuda_arena`` and the build is not the CUDA build; InvalidArgument for a transport
    variable kvd cannot run with (``MC_INTRANODE_NVLINK``, ``MC_TCP_PROTO=1``). Use this instead
    of importing ``mooncake.engine`` yourself: the engine reads its logging settings on first
    import, so this module's environment defaults must come first."""
    info = build_info()
    refusal = _refusal(info, cuda_arena, os.environ)
    if refusal is not None:
        raise refusal
    return info


def build_info() -> BuildInfo:
    """The ``SUPPORT_*`` flags of the installed ``mooncake.engine`` (Unavailable when it does not import)."""
    mod = _engine_module()
    cuda = getattr(mod, "SUPPORT_CUDA", None)
    return BuildInfo(cuda=None if cuda is None else bool(cuda), intra_nvlink=bool(getattr(mod, "SUPPORT_INTRA_NVLINK", False)))


def _refusal(info: BuildInfo, cuda_arena: bool, env: Mapping[str, str]) -> KvdError | None:
    """Why this build and environment cannot move this kind of arena (None: they can). Pure."""
    if env.get("MC_TCP_PROTO") == "1":
        return InvalidArgument(
            "MC_TCP_PROTO=1 makes Mooncake use its legacy TCP framing, in which a write reports success when its "
            "last bytes left the socket buffer, not when the peer applied them; kvd tells the receiver READY as soon "
            "as a write returns: unset MC_TCP_PROTO"
        )
    if "MC_INTRANODE_NVLINK" in env and (cuda_arena or info.intra_nvlink):
        if cuda_arena:
            why = (
                "it registers memory through cudaIpcGetMemHandle, which refuses CUDA virtual memory (cuMemCreate/"
                "cuMemMap), and that is what kvd's cuda arena is: register_memory fails (-1) for it"
            )
            fix = (
                "unset MC_INTRANODE_NVLINK (Mooncake then takes RDMA where it finds HCAs, else TCP), or for GPUs of "
                "one host use backend=local (kvd maps the peer's arena and copies over NVLink itself)"
            )
        else:
            why = "it registers device memory only, and an arena=shm pool is host memory"
            fix = "unset MC_INTRANODE_NVLINK (Mooncake then takes RDMA where it finds HCAs, else TCP)"
        return InvalidArgument(
            f"MC_INTRANODE_NVLINK is set: Mooncake would move data only over its intra-node NVLink transport, and {why}; {fix}"
        )
    if cuda_arena and info.cuda is not True:
        return Unavailable(
            f"arena=cuda with backend=mooncake needs Mooncake's CUDA build, but this is {info.describe()}, which "
            f"{'may' if info.cuda is None else 'would'} read the arena's device pointers as host memory; on the GPU "
            f"host run: {CUDA_INSTALL_HINT} "
            "(or use backend=local for GPUs of one host)"
        )
    return None


def _engine_module() -> Any:
    """``mooncake.engine``, or Unavailable saying what is missing (:func:`diagnose`)."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise Unavailable(diagnose(exc, _installed_wheel(), [lib for lib in SYSTEM_LIBRARIES if not _loads(lib)])) from exc


#: The system libraries both wheels link (even for TCP), and the Debian packages that hold them.
SYSTEM_LIBRARIES = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1", "libcurl.so.4": "libcurl4"}
_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def _installed_wheel() -> str | None:
    for dist in _WHEELS:
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _loads(lib: str) -> bool:
    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def diagnose(exc: ImportError, wheel: str | None, missing_libs: list[str]) -> str:
    """Why ``mooncake.engine`` did not import, and the command that fixes it. Pure: ``wheel`` is
    the installed Mooncake wheel (None: none), ``missing_libs`` the :data:`SYSTEM_LIBRARIES` that
    do not load."""
    if wheel is None:
        return f"the mooncake backend is not installed (no Mooncake wheel: {exc}); run: {INSTALL_HINT}"
    if "libcuda" in str(exc) or "libcudart" in str(exc):
        return (
            f"the mooncake backend does not load ({exc}): {wheel} is Mooncake's CUDA build, which needs a GPU driver "
            f"(libcuda.so.1) and the CUDA 12 runtime (libcudart.so.12); on a host without them run: "
            f"pip uninstall -y {wheel} && pip install mooncake-transfer-engine-non-cuda"
        )
    if missing_libs:
        pkgs = " ".join(SYSTEM_LIBRARIES[lib] for lib in missing_libs)
        return (
            f"the mooncake backend does not load: {wheel} is installed, but the system libraries it links are missing "
            f"({', '.join(missing_libs)}; {exc}); run: apt-get install -y {pkgs}"
        )
    return f"the mooncake backend does not load: {wheel} is installed but mooncake.engine fails to import ({exc}); run: pip install --force-reinstall {wheel}"


class MooncakeBackend(Backend):
    """Mooncake Transfer Engine over ``protocol`` ("tcp" anywhere, "rdma" with ``device_names``).

    Args:
        host: address peers use to reach this node (advertised, not bound; see module docstring).
        protocol: "tcp" or "rdma".
        device_names: RDMA devices, comma-separated (e.g. "mlx5_0,mlx5_1"); "" for tcp.
        max_batch: blocks per submitted batch (<= the engine's queue limit).
        max_block: bytes per transfer item; longer blocks are split.

    Raises Unavailable when the package is missing or the engine does not start, and what
    :func:`check_installed` raises for the environment. A CUDA arena can be registered only
    with the CUDA build (see the module docstring)."""

    name = "mooncake"

    @classmethod
    def missing(cls) -> str | None:
        """What is missing for this backend (:func:`diagnose`), None when ``mooncake.engine`` imports."""
        try:
            _engine_module()
        except Unavailable as exc:
            return str(exc)
        return None

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device_names: str = "",
        max_batch: int = 512,
        max_block: int = 64 << 20,
    ) -> None:
        super().__init__()
        if protocol not in ("tcp", "rdma"):
            raise InvalidArgument(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if protocol == "rdma" and not device_names:
            raise InvalidArgument("mooncake over rdma needs device_names, e.g. 'mlx5_0'")
        if max_batch <= 0 or max_block <= 0:
            raise InvalidArgument(f"max_batch and max_block must be positive, got {max_batch} and {max_block}")
        self.host, self.protocol, self.max_batch, self.max_block = host, protocol, max_batch, max_block
        self.build = build_info()
        # What the engine reads at initialize: checked again when a CUDA arena is registered.
        self._env = {k: os.environ[k] for k in _TRANSPORT_ENV if k in os.environ}
        refusal = _refusal(self.build, False, self._env)
        if refusal is not None:
            raise refusal
        engine = _engine_module().TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise Unavailable(f"mooncake engine did not start on {host} over {protocol} {device_names!r} (rc={rc}); see its log on stderr")
        self._engine: Any = engine
        self._endpoint = f"{host}:{engine.get_rpc_port()}"

    @property
    def endpoint(self) -> str:
        """``"host:port"``: the peer session name other engines connect to."""
        return self._endpoint

    def register(self, arena: Arena) -> float:
        """See :meth:`Backend.register`. A CUDA arena (handle kind ``cuda-vmm``) is refused before
        the engine sees it unless this is the CUDA build and ``MC_INTRANODE_NVLINK`` was not set
        when the engine started (Unavailable / InvalidArgument, as :func:`check_installed`)."""
        if arena.handle().kind == "cuda-vmm":
            refusal = _refusal(self.build, True, self._env)
            if refusal is not None:
                raise refusal
        return super().register(arena)

    def _register(self, arena: Arena) -> None:
        # A CUDA arena's device range registers as it is: the CUDA build tells device memory
        # from host memory by the pointer (see the module docstring for what each transport does).
        rc = self._engine.register_memory(arena.base, arena.backed)
        if rc != 0:
            raise Unavailable(f"mooncake could not register {arena.backed:,d} bytes at {arena.base:#x} (rc={rc})")

    def _unregister(self) -> None:
        # A failure here leaves a stale registration in the engine; registering again still works.
        self._engine.unregister_memory(self.registered[0])

    def _close(self) -> None:
        # Dropping the engine stops its threads and closes its ports (~0.4 s).
        self._engine = None

    def _issue(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> Landed:
        """Submit every batch now (``batch_transfer_async_write``); the waiter waits for all of
        them (``get_batch_transfer_status``). The engine's threads move the bytes in between, so
        a SendMany prepares and commits neighbouring requests while this one moves."""
        s, d, n = _split(srcs, dsts, lens, self.max_block)
        total = sum(n)
        ids: list[int] = []
        for i in range(0, len(s), self.max_batch):
            j = i + self.max_batch
            bid = self._engine.batch_transfer_async_write(peer.endpoint, s[i:j], d[i:j], n[i:j])
            if bid in _NO_BATCH:
                # Refused at submission (the peer's segment did not open, or the queue refused it):
                # nothing of this batch moves; the ones before it must land or fail first.
                before = bool(ids) and self._engine.get_batch_transfer_status(ids) != 0
                raise self._failure(peer, -1, 0 if not ids else -1 if before else sum(n[:i]), total)
            ids.append(bid)

        def landed() -> None:
            rc = self._engine.get_batch_transfer_status(ids)
            if rc != 0:
                # One failed batch: which others landed is not reported. With one batch, nothing
                # confirmed landed (as a synchronous write's first batch).
                raise self._failure(peer, rc, 0 if len(ids) == 1 else -1, total)
            self._account(total, len(ids))

        return landed

    def _failure(self, peer: PeerRegion, rc: int, written: int, total: int) -> Exception:
        """Unavailable when nothing was confirmed written (``written`` 0) and the peer does not
        answer a probe, else Aborted (``written`` -1: how much landed is unknown)."""
        if written == 0 and self._engine.send_probe(peer.endpoint) != 0:
            return Unavailable(f"mooncake peer {peer.endpoint} ({peer.region_id!r}) cannot be reached; nothing was written")
        landed = "an unknown part" if written < 0 else f"{written:,d}"
        return Aborted(
            f"mooncake write to {peer.endpoint} ({peer.region_id!r}) failed (rc={rc}) after {landed} of "
            f"{total:,d} bytes; the engine's log on stderr says why"
        )


#: What ``batch_transfer_async_write`` returns for a batch it did not submit: 0, or -1 as the
#: engine's unsigned batch id type (the peer's segment did not open).
_NO_BATCH = (0, (1 << 64) - 1, -1)


def _split(srcs: list[int], dsts: list[int], lens: list[int], max_block: int) -> tuple[list[int], list[int], list[int]]:
    """Blocks cut into pieces of at most ``max_block`` bytes (returns the inputs when none is longer)."""
    if max(lens) <= max_block:
        return srcs, dsts, lens
    s: list[int] = []
    d: list[int] = []
    n: list[int] = []
    for a, b, k in zip(srcs, dsts, lens):
        for off in range(0, k, max_block):
            s.append(a + off)
            d.append(b + off)
            n.append(min(max_block, k - off))
    return s, d, n
