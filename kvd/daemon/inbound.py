"""What the node asks of the inbound transfers its RECV leases admit, and a stand-in for none.

The node decides when a receiving request ends; whether its pages must stay pinned meanwhile
(a sender may still be writing them) is the business of the receiving side of the handoff
(:class:`kvd.handoff.inbox.Inbox`), which lives above this layer. The node sees it only through
:class:`Inbound`, so the daemon imports nothing of the handoff; whoever assembles a daemon
attaches one (:meth:`kvd.handoff.inbox.Inbox.attach`). Every method is called under the node's lock.
"""

from __future__ import annotations

from typing import Protocol

from kvd.records import TransferRef

__all__ = ["Inbound", "NoInbound"]


class Inbound(Protocol):
    """The inbound transfers of one node, as the node's own paths (leases, ends, sweep) see them."""

    ready_total: int
    failed_total: int
    bytes_total: int

    def expect(self, rid: str, lease_id: int) -> None:
        """A RECV lease was granted for ``rid``: a sender may now begin."""

    def forget(self, rid: str) -> None:
        """``rid``'s transfer is over for the node (its request or its RECV lease is gone)."""

    def bell(self, rid: str) -> int:
        """The doorbell slot of ``rid``'s transfer (kvd.memory.doorbells), -1 for none."""

    def fenced(self, rid: str) -> bool:
        """Whether ``rid`` failed while a sender may still be writing (its free must wait)."""

    def end(self, rid: str, reason: str) -> tuple[bool, tuple[str, TransferRef] | None]:
        """The receiving request ``rid`` (or its RECV lease) ends: ``(fenced, the sender to tell)``."""

    def sweep(self) -> list[str]:
        """Time out silent senders and ended fences; the rids whose fence ended."""

    def excuse(self, stalled_s: float) -> None:
        """This process did not run for ``stalled_s`` (:meth:`Node.sweep`): no sender's silence
        counts over that time."""

    def lapse(self, rid: str) -> None:
        """If ``rid``'s RECV lease ran out, fail its transfer now as :meth:`sweep` would (fenced
        when a sender began), before anything can forget it: :meth:`sweep` for one request."""

    def inbound(self) -> list[tuple[str, str, str, int, float]]:
        """``(rid, sender, state, bytes committed, started)`` of every inbound transfer (kvd top)."""


class NoInbound:
    """The inbound transfers of a node that was attached none: there never are any, so every
    request ends outright and nothing is fenced."""

    ready_total = failed_total = bytes_total = 0

    def expect(self, rid: str, lease_id: int) -> None:
        pass

    def forget(self, rid: str) -> None:
        pass

    def bell(self, rid: str) -> int:
        return -1

    def fenced(self, rid: str) -> bool:
        return False

    def end(self, rid: str, reason: str) -> tuple[bool, tuple[str, TransferRef] | None]:
        return False, None

    def sweep(self) -> list[str]:
        return []

    def excuse(self, stalled_s: float) -> None:
        pass

    def lapse(self, rid: str) -> None:
        pass

    def inbound(self) -> list[tuple[str, str, str, int, float]]:
        return []
