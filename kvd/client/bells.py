"""A client's side of its daemon's doorbell board (:mod:`kvd.memory.doorbells`).

The board is mapped the first time this client takes a RECV lease that names a slot (over the
engine socket: :func:`kvd.client.fast.fetch_doorbells`; a daemon that refused it busy -- every
connection in use, or this one evicted -- is asked again at the next such lease); each such lease's slot is remembered by
request id until the client frees it. :meth:`Bells.state` reads a transfer's slot: no call. A board
that cannot be mapped (gRPC, a daemon that predates doorbells) leaves every read to the daemon,
and so does a client whose daemon went away (:meth:`Bells.close`: the client's heartbeat calls it
when the daemon no longer answers or no longer knows the session, since a dead daemon's board
stays as it was).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvd.errors import KvdError, Unavailable
from kvd.memory.doorbells import DoorbellView
from kvd.records import TransferState

__all__ = ["Bells", "MAX_BELLS"]

log = logging.getLogger("kvd.client")

#: RECV leases whose doorbell a client remembers (the oldest is dropped past this: its reads then
#: go to the daemon).
MAX_BELLS = 1 << 16


class Bells:
    """``fetch``: maps the daemon's board, returning the view and the daemon's boot id (None: this
    client has no board). Thread-safe."""

    def __init__(self, fetch: Callable[[], tuple[DoorbellView, str]] | None) -> None:
        self._fetch = fetch
        self._board: DoorbellView | None = None
        self._boot = ""
        self._by_rid: dict[str, tuple[int, int]] = {}  # rid -> (slot, lease id)
        self._lock = threading.Lock()

    def note(self, rid: str, bell: int, lease_id: int, boot_id: str) -> None:
        """A RECV lease on ``rid`` named slot ``bell - 1`` (0: none) of boot ``boot_id``'s board."""
        if not bell:
            return
        with self._lock:
            if self._board is None and self._fetch is not None:
                fetch, self._fetch = self._fetch, None  # tried once ...
                try:
                    self._board, self._boot = fetch()
                except Unavailable as exc:
                    if exc.retry_after_s is not None:  # ... unless the daemon was only busy: the next lease tries again
                        self._fetch = fetch
                    log.debug("kvd client: no doorbell board yet (%s); wait_ready asks the daemon", exc)
                except (KvdError, OSError, ValueError) as exc:
                    log.debug("kvd client: no doorbell board (%s); wait_ready asks the daemon", exc)
            if self._board is None or boot_id != self._boot:
                return
            if len(self._by_rid) >= MAX_BELLS:
                del self._by_rid[next(iter(self._by_rid))]
            self._by_rid[rid] = (bell - 1, lease_id)

    def forget(self, rids: Sequence[str]) -> None:
        with self._lock:
            for rid in rids:
                self._by_rid.pop(rid, None)

    def state(self, rid: str) -> tuple[TransferState, int] | None:
        """``(state, bytes committed)`` of ``rid``'s transfer on its doorbell, or None: no
        doorbell for it here (ask the daemon)."""
        hit = self._by_rid.get(rid)
        board = self._board
        return board.read(*hit) if hit is not None and board is not None else None

    def close(self) -> None:
        """Forget every doorbell and unmap the board; reads go to the daemon from now on."""
        with self._lock:
            self._by_rid.clear()
            board, self._board, self._fetch = self._board, None, None
        if board is not None:
            board.close()
