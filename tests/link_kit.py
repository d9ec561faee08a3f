"""A fake peer link for the pure-core handoff tests (not a test module).

:class:`CheckingLink` is a :class:`~kvd.handoff.link.PeerLink` into a receiving :class:`~kvd.daemon.node.Node`
of this process: the calls a sender's Outbox makes reach the receiver as they would through a
daemon (``kvd.server.peer_calls.PeerCalls``), minus the wire. Used by
``tests/test_handoff_core.py`` and ``tests/test_handoff_many.py``; the loopback tier
(``tests/handoff``) runs the real link between daemons.
"""

from __future__ import annotations

from collections.abc import Callable

from kvd.records import TicketInfo
from kvd.daemon.node import Node
from kvd.handoff.ticket import check_fields

__all__ = ["CheckingLink"]


class CheckingLink:
    """A PeerLink into ``receiver``, in-process, checking tickets as the receiving daemon does.

    * ``check_ticket`` runs the receiver's own check (``kvd.handoff.ticket.check_fields``, then ``Inbox.begin``:
      what ``PeerCalls.check_ticket`` does after the seal); the raw ticket bytes a Send carries are the keys
      :meth:`register` gives.
    * ``events`` records every call in order: ``("check", rid)``, ``("commit", rid)``,
      ``("abort", rid)``, ``("abort_send", rid)``, ``("heartbeat", "rid,rid,...")`` (pass a list
      to share it, e.g. with a recording backend); ``aborts`` the AbortReceive calls as
      ``(rid, reason, drained)``.
    * ``before_check[rid]`` runs once inside the check, before the receiver sees the ticket (the
      window in which a Send has registered its transfer but the receiver has not accepted it; a
      hook that raises is the receiver refusing); ``after_check[rid]`` once, after it accepted.
    """

    def __init__(self, receiver: Node, events: list[tuple[str, str]] | None = None) -> None:
        self.receiver = receiver
        self.tickets: dict[bytes, TicketInfo] = {}
        self.events: list[tuple[str, str]] = [] if events is None else events
        self.before_check: dict[str, Callable[[], object]] = {}
        self.after_check: dict[str, Callable[[], object]] = {}
        self.aborts: list[tuple[str, str, bool]] = []

    def register(self, t: TicketInfo) -> bytes:
        """The raw bytes that stand for ticket ``t`` in a Send (what the wire's ticket bytes are)."""
        raw = f"{t.rid}/{t.boot_id}/{t.lease_id}/{t.epoch}".encode()
        self.tickets[raw] = t
        return raw

    def check_ticket(self, address, ticket, sender, via=None):
        t = self.tickets[ticket]
        self.events.append(("check", t.rid))
        hook = self.before_check.pop(t.rid, None)
        if hook is not None:
            hook()
        check_fields(self.receiver, t)
        self.receiver.inbox.begin(t.ref, sender)
        hook = self.after_check.pop(t.rid, None)
        if hook is not None:
            hook()

    def start_check(self, address, ticket, sender, via=None):
        return lambda: self.check_ticket(address, ticket, sender, via)

    def commit(self, address, ref, last, nbytes, sender, via=None):
        self.events.append(("commit", ref.rid))
        self.receiver.inbox.commit(ref, last, nbytes, sender)

    def abort_receive(self, address, ref, reason, drained, sender, via=None):
        self.events.append(("abort", ref.rid))
        self.aborts.append((ref.rid, reason, drained))
        self.receiver.inbox.abort(ref, reason, drained, sender)

    def abort_send(self, address, ref, reason):
        self.events.append(("abort_send", ref.rid))  # a receiver's call: a sender never makes it

    def heartbeat(self, address, sender, refs, via=None):
        self.events.append(("heartbeat", ",".join(r.rid for r in refs)))
        return self.receiver.inbox.heartbeat(sender, refs)
