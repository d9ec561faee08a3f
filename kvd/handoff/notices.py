"""The aborts a sending daemon owes its peers: told at once, or later on a few threads of their own.

:class:`kvd.handoff.outbox.Outbox` tells a receiver when a transfer it accepted fails (drained:
nothing of it is in flight any more), and, for the node's ``on_ended`` hook, the senders of
inbound transfers given up mid-way. What the hook owes runs here, never under the node's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvd.errors import KvdError
from kvd.handoff.link import PeerLink
from kvd.records import TicketInfo, TransferRef

__all__ = ["Notices"]

log = logging.getLogger("kvd.handoff.notices")


class Notices:
    """This daemon (``address``) telling its peers of aborts over ``link``. A peer that cannot be
    reached is logged, not raised: its heartbeats and timeouts stand in for the notice."""

    def __init__(self, link: PeerLink, address: str) -> None:
        self.link = link
        self.address = address
        # A few threads, so that one unreachable peer (its call's deadline) delays no other.
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvd-notice")

    def tell_receiver(self, ticket: TicketInfo, reason: str) -> None:
        """The ticket's receiver: this sender aborted its transfer, drained (AbortReceive)."""
        try:
            self.link.abort_receive(ticket.peer_address, ticket.ref, reason, True, self.address, ticket.via)
        except KvdError as exc:
            log.info("could not tell %s about the abort of %s: %s", ticket.peer_address, ticket.rid, exc)

    def tell_sender(self, address: str, ref: TransferRef, reason: str) -> None:
        """The sender at ``address``: its transfer ``ref`` was given up here (AbortSend)."""
        try:
            self.link.abort_send(address, ref, reason)
        except KvdError as exc:  # a sender gone: its receiver's fence runs out by itself
            log.info("could not tell sender %s about the abort of %s: %s", address, ref.rid, exc)

    def later(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` (a tell above, or the outbox's own) on the notice threads; dropped once closed."""
        try:
            self._threads.submit(fn, *args)
        except RuntimeError as exc:
            # Shut down (the daemon stops, its peers see it gone), or no thread could be started
            # (the process at its thread limit): then it stays queued for a thread started later.
            log.info("%s%r: not sent now: %s", fn.__name__, args, exc)

    def close(self) -> None:
        """Stop the threads; notices not yet sent are dropped."""
        self._threads.shutdown(wait=False, cancel_futures=True)
