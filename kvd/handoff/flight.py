"""A Send on its way: the item asked for (:class:`SendItem`), the outbound transfer it sends in
(:class:`Outbound`), and where one item of a SendMany stands (:class:`Flight`).

The records of :class:`kvd.handoff.outbox.Outbox`'s pipeline, and the bounds of a SendMany's
items (checked before anything is sent).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvd.errors import InvalidArgument, KvdError
from kvd.limits import quote
from kvd.records import TicketInfo

if TYPE_CHECKING:
    from kvd.backends.base import Landed
    from kvd.handoff.ahead import Ahead
    from kvd.handoff.plan import Plan

__all__ = ["MAX_SEND_ITEMS", "SendItem", "BeginItem", "check_batch_size", "refuse_duplicates", "Outbound", "Flight"]

#: The most items one :meth:`~kvd.handoff.outbox.Outbox.send_many` call (one SendMany) takes.
MAX_SEND_ITEMS = 1024


class SendItem(NamedTuple):
    """One transfer of :meth:`~kvd.handoff.outbox.Outbox.send_many`: tokens ``[start, end)`` of
    ``rid`` (``end`` None: up to the request's length) to the receiver of ``ticket``; ``last``
    also moves the state slot and makes the request READY there. ``raw``: the ticket's bytes as the receiver
    issued them (its CheckTicket reads them)."""

    rid: str
    ticket: TicketInfo
    raw: bytes
    start: int = 0
    end: int | None = None
    last: bool = True


class BeginItem(NamedTuple):
    """One transfer of :meth:`~kvd.handoff.outbox.Outbox.begin_many`: ``rid`` to the receiver of
    ``ticket`` (``raw``: its bytes), planned ahead whole or, with ``chunk_tokens``, in chunks."""

    rid: str
    ticket: TicketInfo
    raw: bytes
    chunk_tokens: int = 0


def check_batch_size(n: int) -> None:
    """InvalidArgument unless ``n`` items make a SendMany: 1 to :data:`MAX_SEND_ITEMS`."""
    if n <= 0:
        raise InvalidArgument("SendMany needs at least one item; a Send of one request is Send")
    if n > MAX_SEND_ITEMS:
        raise InvalidArgument(f"SendMany takes at most {MAX_SEND_ITEMS} items, got {n:,d}; split them into several calls")


def refuse_duplicates(items: Sequence[SendItem | KvdError]) -> None:
    """InvalidArgument naming every item that repeats an earlier item's request or ticket."""
    by_rid: dict[str, int] = {}
    by_ticket: dict[tuple[str, int], int] = {}
    dups = []
    for i, it in enumerate(items):
        if isinstance(it, KvdError):
            continue
        j, k = by_rid.setdefault(it.rid, i), by_ticket.setdefault((it.ticket.boot_id, it.ticket.lease_id), i)
        if j != i:
            dups.append(f"items {j} and {i} both send request {quote(it.rid)}")
        elif k != i:
            dups.append(f"items {k} and {i} carry the same ticket (lease {it.ticket.lease_id} of receiver boot {it.ticket.boot_id!r})")
    if dups:
        raise InvalidArgument(
            f"SendMany: {'; '.join(dups)}. A call sends each request once, with one ticket (chunks of one request, or "
            "one request to two receivers, go in separate calls); nothing was sent"
        )


@dataclass(slots=True)
class Outbound:
    """An outbound transfer of :class:`~kvd.handoff.outbox.Outbox` (one receiver's RECV lease),
    from its first Send or begin to its last Send or its abort."""

    rid: str
    ticket: TicketInfo
    raw: bytes  # the ticket's bytes: every Send of this transfer must carry these (the receiver checked them)
    session: str
    aborted: str = ""  # reason, once the transfer must stop
    aborted_at: float = 0.0  # when the receiver aborted it (an idle entry answers later Sends a while)
    presumed: bool = False  # ``aborted`` is the heartbeat's inference; the receiver's own reason may follow
    active: int = 0  # Send calls in progress
    began: bool = False  # the receiver accepted the ticket at least once
    ahead: Ahead | None = None  # the Sends begin planned (the whole request, or each chunk)
    #: a check :meth:`Outbox.begin` left running (``wait=False``), collected once (:meth:`Outbox._settle`);
    #: while either is set the check holds one count of ``active``. ``unsent``: sends it (its
    #: caller deferred that past its reply) and returns ``pending``, what waits for the answer.
    unsent: Callable[[], Callable[[], object]] | None = None
    pending: Callable[[], object] | None = None
    settling: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.monotonic)  # kvd top's ages
    nbytes: int = 0  # bytes committed so far

    @property
    def parked(self) -> bool:
        """A check begin left running (sent or not) that nobody collected yet."""
        return self.pending is not None or self.unsent is not None

    @property
    def checking(self) -> bool:
        """:attr:`parked`, or its answer being collected now (``settling`` is held until that
        collector's count is off ``active``): whoever ends or aborts the transfer meanwhile must
        leave the receiver's notice to :meth:`Outbox._settle_ended`, as nobody else sends it."""
        return self.parked or self.settling.locked()


@dataclass(slots=True)
class Flight:
    """One item of a send_many on its way: where it stands, and what its end must undo."""

    index: int  # its place in the call
    item: SendItem
    t_start: float = field(default_factory=time.perf_counter)
    mark: float = 0.0  # end of the latest step (phases)
    phases: dict[str, float] = field(default_factory=dict)
    ob: Outbound | None = None  # set once counted in ob.active (the end uncounts it)
    lease_id: int | None = None  # its SEND lease (released when its writes have all returned)
    plan: Plan | None = None
    began: bool = False  # the receiver accepted the ticket for this item: writes may follow
    waits: list[Landed] = field(default_factory=list)  # writes issued and not yet waited for
    issued: int = 0  # bytes of the writes issued
    finished: bool = False
    detail: list[dict[str, float]] = field(default_factory=list)  # the backend's own timings per write (note)

    def __post_init__(self) -> None:
        self.mark = self.t_start

    def step(self, name: str) -> None:
        """Where a Send's time goes, reported with the result."""
        now = time.perf_counter()
        self.phases[name], self.mark = now - self.mark, now

    def note(self, landed: Landed) -> None:
        """Keep the timings a backend attached to a write's waiter (``landed.phases``: seconds
        by ``"issue:<part>"`` / ``"write:<part>"``, filled as the write is issued and waited
        for), for :meth:`add_detail`. Backends without them attach nothing."""
        ph = getattr(landed, "phases", None)
        if isinstance(ph, dict):
            self.detail.append(ph)

    def add_detail(self) -> None:
        """Add the backend's timings (:meth:`note`), summed over the item's writes, to
        :attr:`phases` after its steps: where the ``issue`` and ``write`` steps' time went."""
        for ph in self.detail:
            for k, v in ph.items():
                self.phases[k] = self.phases.get(k, 0.0) + v

    def drain(self) -> BaseException | None:
        """Wait for every write of this item issued and not yet waited for (each waiter once);
        returns the first failure."""
        first = None
        while self.waits:
            landed = self.waits.pop(0)
            try:
                landed()
            except Exception as exc:  # noqa: BLE001 -- the rest must still be waited for
                first = first or exc
        return first
