"""How one daemon reaches another (:class:`PeerLink`, implemented over gRPC and the peer socket
in :mod:`kvd.server.peer_link`), and the loop its periodic calls run on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvd.records import SocketRoute, TransferRef

__all__ = ["PeerLink", "run_every"]

log = logging.getLogger("kvd.handoff.inbox")


class PeerLink(Protocol):
    """How one daemon reaches another. Errors are kvd exceptions (Unavailable when unreachable,
    or when the connection broke during the call: a commit is never sent twice).

    ``via``: the same-host route the ticket offered. A sender's calls to the receiver may take it
    instead of ``address``, with the same outcome and errors: CheckTicket and Commit are the
    critical path of every Send, and the heartbeat and the abort go the same way so that the
    receiver's liveness is judged on the path the transfer uses. ``abort_send`` (receiver to
    sender) knows the sender by its address only."""

    def start_check(self, address: str, ticket: bytes, sender: str, via: SocketRoute | None = None) -> Callable[[], object]:
        """Send CheckTicket now; the returned function waits for the answer (raising the
        receiver's refusal). Call it exactly once: it returns the connection."""
        ...

    def commit(self, address: str, ref: TransferRef, last: bool, nbytes: int, sender: str, via: SocketRoute | None = None) -> None:
        """``sender``: this daemon, named as in its CheckTicket (the receiver refuses a commit
        from any other sender than the one that began the transfer)."""
        ...

    def abort_receive(
        self, address: str, ref: TransferRef, reason: str, drained: bool, sender: str, via: SocketRoute | None = None
    ) -> None: ...

    def abort_send(self, address: str, ref: TransferRef, reason: str) -> None: ...

    def heartbeat(self, address: str, sender: str, refs: list[TransferRef], via: SocketRoute | None = None) -> list[int]: ...


def run_every(interval: float, stop: threading.Event, fn: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread calling ``fn`` every ``interval`` seconds until ``stop`` is set."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                fn()
            except Exception:  # a housekeeping loop must never die
                log.exception("%s", name)

    t = threading.Thread(target=loop, name=name, daemon=True)
    t.start()
    return t
