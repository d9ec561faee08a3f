"""The daemon's side of handle passing: who may have the arena's chunk fds, and what they get.

A CUDA arena is shared by fds (:mod:`kvd.ipc.fdpass`), not by a file path. :class:`ArenaHandles`
is the exporter and the authorizer a :class:`~kvd.ipc.fdpass.HandleServer` runs with:

* **who** -- an engine with a live session of this node (the same session id its gRPC calls
  carry), or a peer daemon presenting ``peer_token``; when no token is configured, peers are
  allowed, the same rule as the Peer gRPC service.
* **what** -- the chunks covering the backed prefix ``[0, backed)`` and nothing past it: the
  header says ``backed`` and importers map exactly that many bytes (the last chunk may reach
  past ``backed`` by the part the arena could not cut off; its tail is never in a view).

``generation`` changes whenever the backing changed (finalize, resize): an importer that holds a
mapping of an older generation maps again, since a shrink-then-grow replaces chunks under the
same addresses.
"""

from __future__ import annotations

import hmac
import os

from kvd.memory.vmm import gpu_uuid
from kvd.errors import FailedPrecondition, PermissionDenied
from kvd.ipc.fdpass import MAX_FDS, HandleHeader, HandleRequest
from kvd.daemon.node import Node

__all__ = ["ArenaHandles"]


class ArenaHandles:
    """Exporter and authorizer of this daemon's CUDA arena (see the module docstring)."""

    def __init__(self, node: Node, token: str | None = None) -> None:
        self.node = node
        self.token = token or ""
        self._generation = 0  # changed only under the node's lock (finalize/resize), read as one int
        arena = node.pool.arena
        dev = arena.device
        self.device = dev.index if dev.type == "cuda" and dev.index is not None else -1
        self.gpu_uuid = gpu_uuid(self.device) if self.device >= 0 else ""

    def backing_changed(self) -> None:
        """Call after every change of the arena's backing (``Node.on_backing_change``, which runs
        under the node's lock)."""
        self._generation += 1

    def authorize(self, req: HandleRequest) -> None:
        """An engine's session must be live here (NotFound otherwise); a peer needs the token."""
        if req.session:
            self.node.touch(req.session)  # NotFound: unknown or expired session
            return
        # Constant time, as the peer socket's check: the socket answers at once, so a plain
        # comparison would tell a prober how much of the token it had right.
        if self.token and not hmac.compare_digest(req.token.encode(), self.token.encode()):
            raise PermissionDenied(
                "handle request without the right peer token; configure the same peer_token on both daemons "
                "(engines present their session id instead)"
            )

    def export(self, want_fds: bool) -> tuple[HandleHeader, list[int]]:
        """The header and, with ``want_fds``, one new fd per chunk covering ``[0, backed)``.

        An export holds the node's lock, so the backing cannot change between reading the chunk
        list and exporting it. A ping (no fds) takes no lock: a peer's liveness probe must not
        wait behind this node's work. The fds belong to the caller (the server closes them)."""
        if not want_fds:
            pool = self.node.pool
            arena = pool.arena
            return self._header(arena.region_id, pool.boot_id, arena.backed, ()), []
        with self.node.lock:
            pool = self.node.pool
            arena = pool.arena
            backed = arena.backed
            chunks = [(off, size) for off, size in arena.chunks if off < backed]
            if not chunks:
                raise FailedPrecondition(
                    f"arena {arena.region_id} has no backed bytes to share yet; finalize the pool first"
                )
            if len(chunks) > MAX_FDS:
                raise FailedPrecondition(
                    f"arena {arena.region_id} is backed by {len(chunks)} chunks, more than the {MAX_FDS} fds one "
                    "message can carry; back a smaller arena (chunks are at most 1 GiB each)"
                )
            header = self._header(arena.region_id, pool.boot_id, backed, tuple(size for _, size in chunks))
            exported = arena.export_fds()
            # Chunks past the backed prefix (none today: the arena releases them on shrink) are
            # never handed out.
            for fd, _ in exported[len(chunks) :]:
                os.close(fd)
            return header, [fd for fd, _ in exported[: len(chunks)]]

    def _header(self, region_id: str, boot_id: str, backed: int, sizes: tuple[int, ...]) -> HandleHeader:
        return HandleHeader(
            region_id=region_id, boot_id=boot_id, backed=backed, sizes=sizes, generation=self._generation,
            device=self.device, gpu_uuid=self.gpu_uuid,
        )
