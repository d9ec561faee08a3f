"""Cross-node backend: Mooncake Transfer Engine, peer-to-peer handshake, no metadata server.

Each backend owns one ``TransferEngine`` initialised with ``P2PHANDSHAKE``; the endpoint is
``"<host>:<rpc port>"`` and goes into tickets as ``transfer_endpoint``. A write is
``batch_transfer_sync_write`` in batches of at most ``max_batch`` blocks, blocks longer than
``max_block`` split into pieces.

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
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvd.arena import Arena
from kvd.backends.base import INSTALL_HINT, Backend, PeerRegion
from kvd.errors import Aborted, InvalidArgument, Unavailable

__all__ = ["MooncakeBackend", "check_installed"]

# Applied before the first import of mooncake.engine; an operator's own setting wins.
_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",  # INFO and WARNING lines are per-connection chatter
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",  # > max_batch (see the module docstring)
}


def check_installed() -> None:
    """Raise Unavailable (with the install command) unless ``mooncake.engine`` imports.

    Use this instead of importing ``mooncake.engine`` yourself: the engine reads its logging
    settings on first import, so this module's environment defaults must come first."""
    _engine_class()


def _engine_class() -> Any:
    """``mooncake.engine.TransferEngine``, or Unavailable with the install command."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return importlib.import_module("mooncake.engine").TransferEngine
    except ImportError as exc:
        # The non-CUDA wheel links libibverbs even for TCP: the message names the missing .so.
        raise Unavailable(f"the mooncake backend is not installed ({exc}); run: {INSTALL_HINT}") from exc


class MooncakeBackend(Backend):
    """Mooncake Transfer Engine over ``protocol`` ("tcp" anywhere, "rdma" with ``device_names``).

    Args:
        host: address peers use to reach this node (advertised, not bound; see module docstring).
        protocol: "tcp" or "rdma".
        device_names: RDMA devices, comma-separated (e.g. "mlx5_0,mlx5_1"); "" for tcp.
        max_batch: blocks per ``batch_transfer_sync_write`` call (<= the engine's queue limit).
        max_block: bytes per transfer item; longer blocks are split.

    Raises Unavailable when the package is missing or the engine does not start."""

    name = "mooncake"

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
        engine = _engine_class()()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise Unavailable(f"mooncake engine did not start on {host} over {protocol} {device_names!r} (rc={rc}); see its log on stderr")
        self._engine: Any = engine
        self._endpoint = f"{host}:{engine.get_rpc_port()}"

    @property
    def endpoint(self) -> str:
        """``"host:port"``: the peer session name other engines connect to."""
        return self._endpoint

    def _register(self, arena: Arena) -> None:
        rc = self._engine.register_memory(arena.base, arena.backed)
        if rc != 0:
            raise Unavailable(f"mooncake could not register {arena.backed:,d} bytes at {arena.base:#x} (rc={rc})")

    def _unregister(self) -> None:
        # A failure here leaves a stale registration in the engine; registering again still works.
        self._engine.unregister_memory(self.registered[0])

    def _close(self) -> None:
        # Dropping the engine stops its threads and closes its ports (~0.4 s).
        self._engine = None

    def _write(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        s, d, n = _split(srcs, dsts, lens, self.max_block)
        written = 0
        for i in range(0, len(s), self.max_batch):
            j = i + self.max_batch
            rc = self._engine.batch_transfer_sync_write(peer.endpoint, s[i:j], d[i:j], n[i:j])
            if rc != 0:
                raise self._failure(peer, rc, written, sum(n))
            nbytes = sum(n[i:j])
            written += nbytes
            self._account(nbytes)

    def _failure(self, peer: PeerRegion, rc: int, written: int, total: int) -> Exception:
        """Unavailable when nothing moved and the peer does not answer a probe, else Aborted."""
        if written == 0 and self._engine.send_probe(peer.endpoint) != 0:
            return Unavailable(f"mooncake peer {peer.endpoint} ({peer.region_id!r}) cannot be reached; nothing was written")
        return Aborted(
            f"mooncake write to {peer.endpoint} ({peer.region_id!r}) failed (rc={rc}) after {written:,d} of "
            f"{total:,d} bytes; the engine's log on stderr says why"
        )


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
