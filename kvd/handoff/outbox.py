"""The sending side of the handoff: :class:`Outbox`, owned by the prefill daemon.

``send`` validates the ticket with the receiver before the first byte (the receiver checks it
while this daemon takes its SEND lease and plans the blocks; ``begin`` does it ahead, when the
prefill engine gets the ticket, and plans the Sends then too: :mod:`kvd.handoff.ahead`), writes
them in bounded batches checking for an abort between batches, commits, and releases the lease
only after its writes landed. ``send_many`` does the same for many independent requests at once,
pipelined (its items and their records: :mod:`kvd.handoff.flight`); ``send`` is ``send_many`` of
one. ``heartbeat_once`` tells each receiver this sender is alive and learns of aborts on the
receiving side. ``ended`` (the node's hook) hears of every request of this node that ended and
aborts what it still sends toward the receiver, and tells the senders of inbound transfers given
up mid-way. The receiving side is :mod:`kvd.handoff.inbox`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from kvd.backends.base import Backend, PeerRegion
from kvd.errors import Aborted, InternalError, InvalidArgument, KvdError, PermissionDenied
from kvd.records import Ends, Envelope, IndexVectors, LeaseKind, OutboxStats, SendResult, SocketRoute, TicketInfo, TransferRef
from kvd.handoff.link import PeerLink
from kvd.handoff.notices import Notices
from kvd.limits import quote
from kvd.handoff.ahead import plan_ahead
from kvd.handoff.flight import BeginItem, Flight, Outbound, SendItem, check_batch_size, refuse_duplicates
from kvd.handoff.plan import Plan, check_envelopes, check_range, plan_chunk
from kvd.handoff.ticket import check_for_sender
from kvd.handoff.ticket import read as read_ticket

if TYPE_CHECKING:
    from kvd.daemon.node import Node

__all__ = ["Outbox", "MAX_AHEAD_CHUNKS"]

log = logging.getLogger("kvd.handoff.outbox")

#: The most chunks :meth:`Outbox.begin` plans ahead for one request.
MAX_AHEAD_CHUNKS = 1024


class Outbox:
    """Outbound transfers of one (prefill) node: runs ``Send`` / ``SendMany`` and the heartbeats."""

    def __init__(
        self,
        node: Node,
        backend: Backend,
        link: PeerLink,
        *,
        address: str,
        batch_blocks: int = 256,
        lease_ttl: float = 30.0,
    ) -> None:
        self.node = node
        self.backend = backend
        self.link = link
        self.address = address
        self.batch_blocks = batch_blocks
        self.lease_ttl = lease_ttl
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], Outbound] = {}  # (receiver boot, receiver lease) -> transfer
        self._by_raw: dict[bytes, Outbound] = {}  # the same transfers by their ticket's bytes (read_ticket)
        self.bytes_total = 0
        self.sent_total = 0
        self.failed_total = 0
        self.calls_total = 0  # send / send_many calls (each item also counts as a Send above)
        self.items_total = 0  # items those calls carried
        self.planned_ahead_total = 0  # items whose plan begin made (still valid at the Send)
        # Peer calls that the end of a request owes (ended): made there, never under the node's lock.
        self._notices = Notices(link, address)
        node.on_ended.append(self.ended)
        # Test only, never configured (kvd.demo.faults): edits the destination vectors this
        # daemon plans from, after every check of the ticket -- a buggy sender misplacing KV.
        self.dest_fault: Callable[[IndexVectors], IndexVectors] | None = None

    def close(self) -> None:
        """Stop the notice threads (notices not yet sent are dropped: the peers' heartbeats and
        timeouts stand in for them)."""
        with contextlib.suppress(ValueError):
            self.node.on_ended.remove(self.ended)
        self._notices.close()

    def send(self, session: str, rid: str, ticket: TicketInfo, raw: bytes, t0: int, t1: int | None, last: bool) -> SendResult:
        """Move tokens ``[t0, t1)`` of ``rid`` to the ticket's receiver: :meth:`send_many` of one
        item, its failure raised."""
        (r,) = self.send_many(session, [SendItem(rid, ticket, raw, t0, t1, last)])
        if isinstance(r, KvdError):
            raise r
        return r

    def send_many(self, session: str, items: Sequence[SendItem | KvdError]) -> list[SendResult | KvdError]:
        """Move each item's tokens to its receiver, pipelined; returns one outcome per item, in
        order: its SendResult, or the kvd error it failed with. An item given as an error (its
        ticket did not parse) is returned in its place untouched.

        Each item is a Send of its own: refused before any write, and before its receiver hears
        of it, when its ticket or range is wrong; once its receiver accepted the ticket, any
        failure tells that receiver at once (drained: its writes were waited for first), and
        the other items go on. Its SEND lease is released once its writes returned.

        Pipeline (one thread; "prep" = check sent, lease, plan, check answer; the copies run on
        their own where the backend issues them asynchronously: the CUDA local backend)::

            daemon  prep 0 │ issue 0 │ prep 1 │ issue 1 │ wait 0 │ commit 0 │ prep 2 │ issue 2 │ wait 1 │ commit 1 │ ...
            device           copies 0 ──────────────────┤ copies 1 ──────────────────────────────────┤ copies 2 ...

        Item i's copies are queued behind item i-1's before the daemon waits for those, so while
        the device copies item i the daemon commits item i-1 and prepares item i+1: the device
        idles only when that takes longer than item i's copies.

        Raises (nothing sent) InvalidArgument for no item or more than :data:`MAX_SEND_ITEMS`,
        and for two items of one request or one ticket (chunks of a request, or a request to two
        receivers, go in separate calls)."""
        check_batch_size(len(items))
        refuse_duplicates(items)
        with self._lock:  # counters are bumped by every gRPC worker thread
            self.calls_total += 1
            self.items_total += len(items)
        out: list[SendResult | KvdError | None] = [None] * len(items)
        flights: list[Flight] = []
        prev: Flight | None = None
        try:
            for i, item in enumerate(items):
                f = None
                if isinstance(item, KvdError):
                    out[i] = item
                else:
                    f = Flight(i, item)
                    flights.append(f)
                    try:
                        self._prepare(session, f)
                        self._issue(f)
                        f.step("issue")
                    except Exception as exc:  # noqa: BLE001 -- the item's outcome; the others go on
                        out[i], f = self._fail(session, f, exc), None
                # Item i's copies are queued behind item i-1's: now wait for those and commit it.
                if prev is not None:
                    out[prev.index] = self._complete(session, prev)
                prev = f
            if prev is not None:
                out[prev.index] = self._complete(session, prev)
        finally:
            # Reached with flights unfinished only when something beyond a kvd error (an
            # interrupt) cut the loop: their writes must still return before their leases go.
            for f in flights:
                if not f.finished:
                    f.drain()
                    self._finish(session, f)
        return out  # type: ignore[return-value]  # every slot was filled

    # -- the steps of one item ---------------------------------------------------------------

    def begin(
        self, session: str, rid: str, ticket: TicketInfo, raw: bytes, *, chunk_tokens: int = 0, wait: bool = True,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> bool:
        """Open the transfer of ``rid`` to the ticket's receiver before its first Send: the
        receiver checks the ticket now (CheckTicket) and the transfer is RECEIVING there, so the
        Sends that follow -- the first included -- skip that round trip, as later chunks do. A
        prefill engine calls it when the ticket arrives, while the prompt still computes.

        It also plans the request's Sends from its vectors now, without a lease: the whole
        request (every token, ``last``), or with ``chunk_tokens`` each chunk of that many tokens
        (the final one ``last``), as a chunked prefill sends them. A Send of such a range finds
        its plan when the request still has the same pages (none bound, released or moved since:
        compaction, extend, free) and skips planning; any other range, or a request that
        changed, plans at the Send. InvalidArgument, before the receiver hears of it, for more
        than :data:`MAX_AHEAD_CHUNKS` chunks.

        ``wait=False`` (Allocate with a ticket): :meth:`begin_many` of this one -- the check is
        sent and not waited for; ``defer`` takes the sending.

        Returns False when the transfer was open already (nothing asked). Refuses what the
        first Send would refuse before its first byte (the ticket for another layout, backend or
        request; its range of envelopes; the receiver's refusal: StaleEpoch, NotFound, ...) and a
        request this session does not hold here; nothing changes then, on either side. Once
        open, the transfer lives as one between two chunks does: heartbeats keep it, an abort on
        either side ends it, and the receiver's RECV lease bounds it."""
        if not wait:
            (opened,) = self.begin_many(session, (BeginItem(rid, ticket, raw, chunk_tokens),), defer)
            return opened
        env = self.precheck(rid, ticket, chunk_tokens)
        self.node.own(session, rid)
        ob = self._enter(session, rid, ticket, raw)
        try:
            if ob.began or ob.checking:
                return False
            pending = self.link.start_check(ticket.peer_address, raw, self.address, ticket.via)
            pending()
            ob.began = True
            if ob.aborted:  # the request ended (or was aborted) while the receiver checked
                self._notices.tell_receiver(ticket, ob.aborted)
                raise Aborted(f"transfer of {quote(rid)} was aborted: {ob.aborted}")
            ob.ahead = plan_ahead(self.node, session, rid, ticket, env, chunk_tokens, self._dest)
            return True
        finally:
            self._leave(ob, last=False)

    def begin_many(
        self, session: str, items: Sequence[BeginItem], defer: Callable[[Callable[[], None]], None] | None = None
    ) -> list[bool]:
        """:meth:`begin` without waiting (Allocate with tickets) of every item, all or nothing.
        Returns, per item, whether it opened the transfer (False: open already, nothing asked).

        Each receiver's check is sent and not waited for; its answer is collected by the first
        Send (its refusal raised there, before any byte, as a Send without begin meets it), else
        by the heartbeat loop, an abort or the request's end -- whichever comes first
        (:meth:`_settle`). ``defer``: sending the checks and planning are handed to it (the
        engine socket runs them once the caller has its reply); a Send that comes first sends
        its check itself.

        Refused at once, before any receiver hears of any item: what :meth:`precheck` refuses,
        a request this session does not hold, a ticket whose transfer is listed here for another
        session or request or was aborted (its request ended, its check not answered yet). Every
        item's transfer is registered before the first check is sent or deferred, so such a
        refusal forgets the transfers this call registered and raises, leaving both sides as
        they were: the caller may then end its requests without a receiver to tell."""
        entered: list[tuple[Outbound, BeginItem, list[Envelope]]] = []
        try:
            for it in items:
                env = self.precheck(it.rid, it.ticket, it.chunk_tokens)
                self.node.own(session, it.rid)
                entered.append((self._enter(session, it.rid, it.ticket, it.raw), it, env))
        except BaseException:
            # No check went out: uncounted, a transfer this call registered has not begun and
            # is forgotten (one open before keeps its own counts).
            for ob, _, _ in entered:
                self._leave(ob, last=False)
            raise
        opened = []
        for ob, it, env in entered:
            if ob.began or ob.checking:
                self._leave(ob, last=False)
                opened.append(False)
            else:
                self._park(session, ob, it, env, defer)
                opened.append(True)
        return opened

    def _park(
        self, session: str, ob: Outbound, it: BeginItem, env: list[Envelope], defer: Callable[[Callable[[], None]], None] | None
    ) -> None:
        """Leave ``ob``'s check to be sent (now, or by ``defer``) and collected later; this call's
        count of ``active`` stays with the check until then, so that nothing forgets the transfer
        meanwhile. Planning runs while the receiver checks. Never raises (a failure to send is
        kept as the answer; plan_ahead never raises)."""
        ticket, raw = it.ticket, it.raw
        ob.unsent = lambda: self.link.start_check(ticket.peer_address, raw, self.address, ticket.via)

        def start() -> None:
            self._send_parked(ob)
            ob.ahead = plan_ahead(self.node, session, it.rid, ticket, env, it.chunk_tokens, self._dest)

        if defer is None:
            start()
        else:
            defer(start)

    def precheck(self, rid: str, ticket: TicketInfo, chunk_tokens: int = 0) -> list[Envelope]:
        """What :meth:`begin` refuses from the ticket alone, before anyone hears of it: another
        layout, backend or request; envelopes out of range; too many chunks. Returns this pool's
        envelopes (checked against the ticket's); changes nothing."""
        check_for_sender(ticket, rid, self.node.layout, self.backend.name)
        n = ticket.vectors.tokens
        if chunk_tokens and -(-n // chunk_tokens) > MAX_AHEAD_CHUNKS:
            raise InvalidArgument(
                f"begin_send: chunks of {chunk_tokens:,d} tokens cut the request's {n:,d} tokens into "
                f"{-(-n // chunk_tokens):,d} chunks; at most {MAX_AHEAD_CHUNKS:,d} are planned ahead: give the prefill chunk "
                "(larger), or 0 for one Send of the whole request"
            )
        env = self.node.pool.envelopes()
        check_envelopes(self.node.layout, env, ticket.envelopes)
        return env

    @staticmethod
    def _send_parked(ob: Outbound) -> None:
        """Send the check :meth:`begin` left unsent, unless that happened already (it takes
        ``ob.settling``); a failure to send is kept as the answer."""
        with ob.settling:
            Outbox._send_unsent(ob)

    @staticmethod
    def _send_unsent(ob: Outbound) -> None:
        """Under ``ob.settling``: ``ob.unsent`` sent, its waiter (or its failure) in ``ob.pending``."""
        unsent = ob.unsent
        if unsent is None:
            return
        try:
            ob.pending = unsent()
        except KvdError as exc:
            def failed(exc: KvdError = exc) -> object:
                raise exc

            ob.pending = failed
        finally:
            ob.unsent = None  # after pending is set: ``parked`` holds throughout, read without the lock

    def _settle(self, ob: Outbound) -> bool:
        """Collect the receiver's answer to the check :meth:`begin` left running, once (a Send,
        the heartbeat loop, an abort and the request's end may all try), sending it first if
        that was deferred and has not happened yet: the transfer has begun from then on, or the
        refusal is raised to the caller that collected it. Returns whether this call collected
        an accepted check (False: there was none left to collect)."""
        with ob.settling:
            self._send_unsent(ob)
            pending, ob.pending = ob.pending, None
            if pending is None:
                return False
            try:
                pending()
                ob.began = True
            finally:
                self._leave(ob, last=False)  # the count begin left with the check
            return True

    def _settle_ended(self, ob: Outbound, forget: bool = True) -> None:
        """On a notice thread: a transfer whose check was still running ended (its request, an
        abort on either side): once the receiver's answer is in, a receiver that accepted the
        ticket is told (nothing of it was written); one that refused it has nothing to hear.
        ``forget``: drop the transfer then (its request is gone); else it stays listed, aborted,
        so that the engine's next Send hears why (the receiver's abort)."""
        try:
            self._settle(ob)
        except KvdError:
            return
        # Accepted, whoever collected the answer (the heartbeat may have, meanwhile); a Send
        # in it tells the receiver itself, and one that ended forgot it, having told it.
        key = (ob.ticket.boot_id, ob.ticket.lease_id)
        with self._lock:
            if not (ob.began and ob.active == 0 and self._open.get(key) is ob):
                return
        self._notices.tell_receiver(ob.ticket, ob.aborted or "the sender's transfer ended before its first Send")
        with self._lock:
            if forget and ob.active == 0 and self._open.get(key) is ob:
                self._forget(key)

    def _dest(self, ticket: TicketInfo) -> IndexVectors:
        """The destination vectors to plan from: the ticket's (unless a test set :attr:`dest_fault`)."""
        return ticket.vectors if self.dest_fault is None else self.dest_fault(ticket.vectors)

    def _enter(self, session: str, rid: str, ticket: TicketInfo, raw: bytes) -> Outbound:
        """The ticket's transfer (registered if new), counted active; Aborted if it was aborted.
        PermissionDenied for other ticket bytes than the transfer's: a Send after the first skips
        the receiver's check, so it must carry the very ticket the receiver checked (and this
        daemon planned from). PermissionDenied, before anything of the transfer changes, for a
        session other than the one that opened it (callers check :meth:`Node.own` first; this
        holds even if the request changed hands meanwhile). Each call is matched by one
        :meth:`_leave`."""
        key = (ticket.boot_id, ticket.lease_id)
        with self._lock:
            ob = self._open.get(key)
            if ob is None:
                ob = self._open[key] = self._by_raw[raw] = Outbound(rid, ticket, raw, session)
            elif ob.session != session or ob.rid != rid:
                raise PermissionDenied(
                    f"the transfer under lease {ticket.lease_id} of receiver boot {ticket.boot_id!r} belongs to another client "
                    "session's request; only the session that began it may send in it"
                )
            elif ob.raw != raw:
                raise PermissionDenied(
                    f"ticket for {quote(rid)} under lease {ticket.lease_id} differs from the ticket its transfer began with; pass "
                    "the bytes of the decode daemon's RECV lease unchanged, the same in every Send"
                )
            if ob.aborted:
                raise Aborted(f"transfer of {quote(rid)} was aborted: {ob.aborted}")
            ob.active += 1
            return ob

    def _forget(self, key: tuple[str, int]) -> None:
        """Under the lock: the transfer under ``key`` is no longer open here."""
        ob = self._open.pop(key, None)
        if ob is not None:
            self._by_raw.pop(ob.raw, None)

    def read_ticket(self, raw: bytes) -> TicketInfo:
        """What a sender reads from ticket bytes ``raw`` (:func:`kvd.handoff.ticket.read`): the
        parse its open transfer began with when one is open (BeginSend, an earlier chunk), else
        parsed now. The same bytes parse alike, so a Send of an open transfer skips the parse
        (0.02-0.15 ms a Send: a ticket carries the request's destination vectors). InvalidArgument
        for bytes that are no ticket, as :func:`~kvd.handoff.ticket.read` raises."""
        with self._lock:
            ob = self._by_raw.get(raw)
        return ob.ticket if ob is not None else read_ticket(raw)

    def _leave(self, ob: Outbound, *, last: bool) -> None:
        """Uncount one call of ``ob``; forget it when it is done (``last``) or never accepted by
        the receiver, and no other call is in it. An aborted one stays listed, as an idle abort
        does (:meth:`abort_remote`), so that the engine's next Send hears why; the heartbeat loop
        drops it after ``lease_ttl``."""
        with self._lock:
            ob.active -= 1
            if ob.aborted and not ob.aborted_at:
                ob.aborted_at = time.monotonic()
            if (last or not ob.began) and ob.active == 0:
                self._forget((ob.ticket.boot_id, ob.ticket.lease_id))

    def _prepare(self, session: str, f: Flight) -> None:
        """Everything before the first byte: the ticket's own checks, the transfer registered,
        the receiver's check (sent first, waited for last; skipped once the transfer began), the
        SEND lease and the plan."""
        rid, ticket, t0, t1 = f.item.rid, f.item.ticket, f.item.start, f.item.end
        check_for_sender(ticket, rid, self.node.layout, self.backend.name)
        # Ownership first: a caller that does not hold the request must be refused before it
        # touches the open transfer at all (a failure below, once it began, aborts it).
        self.node.own(session, rid)
        ob = f.ob = self._enter(session, rid, ticket, f.item.raw)
        if ob.parked:
            # begin's check, answered by now in the common case (it ran while the engine went
            # from its Allocate to this Send): a refusal is raised before any byte.
            self._settle(ob)
        # A transfer the receiver accepted before (an earlier chunk, begin) fails there too if
        # this Send fails, whatever step it fails in.
        f.began = ob.began
        # Before the first byte the receiver confirms boot, epoch, lease and layout; it does so
        # while this daemon takes the lease and plans (a round trip hidden behind ~0.5 ms of
        # work). Once the transfer began (an earlier chunk, or :meth:`begin`) Sends skip it: the
        # RECV lease pins the receiver's pages until the transfer ends or fails, the heartbeat
        # reports an abort, and each commit re-checks.
        pending = None
        own_env = self.node.pool.envelopes()
        try:
            if not ob.began:
                # What the ticket alone can show is refused before the receiver hears of it.
                check_range(t0, t1 or ticket.vectors.tokens, ticket.vectors.tokens)
                check_envelopes(self.node.layout, own_env, ticket.envelopes)
                pending = self.link.start_check(ticket.peer_address, f.item.raw, self.address, ticket.via)
            # Plans made by begin hold while this pool's envelopes and the request's pages do.
            ahead = ob.ahead if ob.ahead is not None and ob.ahead.env == own_env else None
            f.step("prep")
            lease, src = self.node.acquire_lease(
                session, rid, LeaseKind.SEND, ttl=self.lease_ttl, known=ahead.src if ahead is not None else None
            )
            f.lease_id = lease.lease_id
            f.step("lease")
            end = src.tokens if not t1 else t1
            planned = ahead.plans.get((t0, end, f.item.last)) if ahead is not None and src is ahead.src else None
            if planned is not None:
                # Planned by begin from these very vectors, which the lease now pins.
                f.plan = planned
                with self._lock:
                    self.planned_ahead_total += 1
            else:
                f.plan = plan_chunk(self.node.layout, src, self._dest(ticket), own_env, ticket.envelopes, t0, end, f.item.last)
            f.step("plan")
        except BaseException:
            if pending is not None:
                # If the receiver accepted the ticket meanwhile, it learns of this failure at
                # once (nothing was written: its pages are free to reuse at once).
                with contextlib.suppress(KvdError):
                    pending()
                    f.began = ob.began = True
            raise
        if pending is not None:
            pending()  # the receiver's refusal, before any byte moves
            f.step("check")
        f.began = ob.began = True

    def _issue(self, f: Flight) -> None:
        """Issue the item's writes in batches of ``batch_blocks``, none after an abort."""
        ob, ticket = f.ob, f.item.ticket
        if ob is None or f.plan is None:
            raise InternalError(f"send of {quote(f.item.rid)}: writes issued before the transfer was prepared")
        env = ticket.envelopes[0]
        peer = PeerRegion(ticket.transfer_endpoint, env.base, env.backed_bytes, env.region_id)
        srcs, dsts, lens = f.plan.as_lists()
        step = self.batch_blocks
        for i in range(0, len(srcs), step):
            if ob.aborted:
                raise Aborted(f"transfer of {quote(ob.rid)} aborted after {f.issued:,d} bytes: {ob.aborted}")
            # One batch (a short request's every block) goes as it is: slicing copies.
            s, d, n = (srcs, dsts, lens) if len(srcs) <= step else (srcs[i : i + step], dsts[i : i + step], lens[i : i + step])
            w = self.backend.write_async(peer, s, d, n)
            f.waits.append(w)
            f.note(w)
            f.issued += sum(n)

    def _complete(self, session: str, f: Flight) -> SendResult | KvdError:
        """Wait for the item's writes, commit, release: its outcome."""
        try:
            err = f.drain()
            if err is not None:
                raise err
            f.step("write")
            if f.ob is not None and f.ob.aborted:
                # Stopped meanwhile (its request ended, an abort): never committed, even when
                # every byte was written -- the request's pages may be gone already.
                raise Aborted(f"transfer of {quote(f.item.rid)} aborted before its commit: {f.ob.aborted}")
            ticket = f.item.ticket
            self.link.commit(ticket.peer_address, ticket.ref, f.item.last, f.issued, self.address, ticket.via)
            f.step("commit")
        except Exception as exc:  # noqa: BLE001 -- the item's outcome
            return self._fail(session, f, exc)
        with self._lock:
            self.bytes_total += f.issued
            self.sent_total += f.item.last
            if f.ob is not None:
                f.ob.nbytes += f.issued
        self._finish(session, f)
        f.step("release")
        f.add_detail()
        plan = cast(Plan, f.plan)  # set by _prepare, which every issued item passed
        return SendResult(f.issued, len(plan.src), f.mark - f.t_start, dict(plan.pages), f.phases)

    def _fail(self, session: str, f: Flight, exc: Exception) -> KvdError:
        """The item failed with ``exc``: wait for whatever of it is still in flight, tell its
        receiver if it accepted the ticket, release. Returns the error (a bug as InternalError)."""
        err = exc if isinstance(exc, KvdError) else InternalError(f"internal error (a bug in kvd): {type(exc).__name__}: {exc}")
        if err is not exc:
            err.__cause__ = exc
            log.error("send of %s failed by a bug", f.item.rid, exc_info=exc)
        try:
            f.drain()  # the item failed already; a write failing too changes nothing
            with self._lock:
                self.failed_total += 1
            # A ticket refused by the receiver, or by what it shows alone, must not fail the
            # receiver's transfer (it may be forged or stale); once the receiver accepted it,
            # the receiver must learn at once, and nothing of this item can still land.
            if f.began and f.ob is not None:
                f.ob.aborted = f.ob.aborted or str(err)
                self._notices.tell_receiver(f.item.ticket, f"{type(err).__name__}: {err}")
        finally:
            self._finish(session, f)
        return err

    def _finish(self, session: str, f: Flight) -> None:
        """Release the item's SEND lease and uncount it (its writes have all returned)."""
        f.finished = True
        if f.lease_id is not None:
            try:
                self.node.release_lease(session, f.lease_id)
            except KvdError:
                pass  # expired meanwhile: nothing pins the pages anyway
        if f.ob is not None:
            self._leave(f.ob, last=f.item.last)

    def ended(self, e: Ends) -> None:
        """The node's hook (under its lock; never blocks): requests ended or inbound transfers
        were given up (:meth:`kvd.daemon.node.Node._end`).

        * Each transfer that a request of ``e.rids`` (of ``e.session``) still sends is aborted:
          an idle one (between chunks, or begun and no Send yet) is forgotten here and its
          receiver is told now, drained (nothing of it is in flight), so the decode engine's
          wait fails at once; a Send in progress stops at its next batch, or before its commit,
          waits for its writes and then tells the receiver itself.
        * Each sender of ``e.senders`` is told (AbortSend): its next Send is refused before it
          writes.

        The peer calls run on the outbox's notice threads, each within the link's deadline."""
        rids = set(e.rids)
        tell, settle = [], []
        with self._lock:
            for key, ob in list(self._open.items()):
                if ob.session != e.session or ob.rid not in rids:
                    continue
                told = False
                if not ob.aborted:
                    ob.aborted = f"request {quote(ob.rid)} ended at the sender before its last Send: {e.reason}"
                    if ob.began and ob.active == 0:
                        tell.append(ob)
                        told = True
                if ob.checking and not told:
                    settle.append(ob)  # its check's count keeps it listed until the answer is in
                if ob.active == 0:
                    self._forget(key)  # it names a request that is gone
        for ob in tell:
            self._notices.later(self._notices.tell_receiver, ob.ticket, ob.aborted)
        for ob in settle:
            self._notices.later(self._settle_ended, ob)
        for address, ref in e.senders:
            self._notices.later(self._notices.tell_sender, address, ref, f"the receiving request ended mid-transfer: {e.reason}")

    def abort_local(self, session: str, rid: str, reason: str) -> bool:
        """The prefill engine aborts its transfer(s) of ``rid``. Returns whether one was open."""
        with self._lock:
            parked = [ob for ob in self._open.values() if ob.rid == rid and ob.session == session and ob.checking]
        for ob in parked:  # their checks' answers first (or another collector's end): then nothing of them is in flight
            with contextlib.suppress(KvdError):
                self._settle(ob)
        with self._lock:
            obs = [ob for ob in self._open.values() if ob.rid == rid and ob.session == session]
            for ob in obs:
                ob.aborted = ob.aborted or f"aborted by the prefill engine: {reason}"
            idle = [ob for ob in obs if ob.active == 0]
            for ob in idle:
                self._forget((ob.ticket.boot_id, ob.ticket.lease_id))
        for ob in obs:
            # In-flight sends stop at their next batch and then report drained=True themselves.
            try:
                self.link.abort_receive(ob.ticket.peer_address, ob.ticket.ref, ob.aborted, ob.active == 0, self.address, ob.ticket.via)
            except KvdError:
                pass
        return bool(obs)

    def abort_remote(self, ref: TransferRef, reason: str) -> None:
        """The receiver aborted: stop writing at the next batch. An idle transfer (between
        chunks, or begun and no Send yet) stays listed for ``lease_ttl`` so the engine's next
        Send gets the reason; the heartbeat loop drops it after that.

        An idle transfer has nothing in flight, and no Send can start in it any more (it is
        aborted): the receiver hears so at once (AbortReceive, drained), so that the fence on
        its pages ends now rather than ``fence_s`` later. A Send in progress says so itself
        once its writes returned. One whose check begin left running is acknowledged once the
        check's answer is in (on a notice thread: this runs on the receiver's call)."""
        with self._lock:
            ob = self._open.get((ref.boot_id, ref.lease_id))
            ack = parked = False
            if ob is not None and (not ob.aborted or ob.presumed):
                ob.aborted, ob.aborted_at, ob.presumed = f"receiver aborted: {reason}", time.monotonic(), False
                ack = ob.began and ob.active == 0
                parked = ob.checking and not ack
        if parked and ob is not None:
            self._notices.later(self._settle_ended, ob, False)
        if ack:
            if ob is None:
                raise InternalError("abort_remote: an ack without its transfer")
            self._notices.tell_receiver(ob.ticket, ob.aborted)

    def heartbeat_once(self) -> None:
        """Tell every receiver with an open transfer that this sender is alive; stop transfers
        the receiver no longer accepts, and those whose receiver cannot be reached. Forgets
        transfers the receiver aborted while idle once ``lease_ttl`` has passed. Checks that
        :meth:`begin` left running and no Send collected yet are collected first (a refused one
        is forgotten; an accepted one is kept alive from now on)."""
        with self._lock:
            parked = [ob for ob in self._open.values() if ob.parked]
        for ob in parked:
            with contextlib.suppress(KvdError):
                self._settle(ob)
        with self._lock:
            now = time.monotonic()
            for key, ob in list(self._open.items()):
                if ob.aborted and ob.active == 0 and now - ob.aborted_at > self.lease_ttl:
                    self._forget(key)
            # One heartbeat per receiver, on the route its tickets offered (a restarted receiver
            # is another route: its old boot's transfers are asked about apart).
            by_peer: dict[tuple[str, SocketRoute | None], list[Outbound]] = {}
            for ob in self._open.values():
                # A Send still validating its ticket has not begun: nothing to keep alive yet.
                # An aborted one with a Send still in it is named too: its writes are in flight,
                # and the receiver keeps its fence while it hears of them.
                if ob.began and (not ob.aborted or ob.active):
                    by_peer.setdefault((ob.ticket.peer_address, ob.ticket.via), []).append(ob)
        for (address, via), obs in by_peer.items():
            try:
                dead = set(self.link.heartbeat(address, self.address, [ob.ticket.ref for ob in obs], via))
            except KvdError as exc:
                dead, why, answered = {ob.ticket.lease_id for ob in obs}, f"receiver {address} unreachable: {exc}", False
            else:
                why, answered = "the receiver no longer accepts this transfer", True
            with self._lock:
                for ob in obs:
                    if ob.ticket.lease_id not in dead or ob.aborted:
                        continue
                    if answered:
                        # The receiver dropped it. Kept listed like a receiver's abort (dropped
                        # after lease_ttl) so the engine's next Send hears why: this heartbeat
                        # can overtake the receiver's AbortSend (the peer socket is faster than
                        # gRPC), whose reason then replaces this one.
                        ob.aborted, ob.aborted_at, ob.presumed = why, time.monotonic(), True
                    else:
                        # Unreachable: stop it, and forget it once idle -- the engine's next Send
                        # asks the receiver again (a restarted one says so: StaleEpoch).
                        ob.aborted = why
                        if ob.active == 0:
                            self._forget((ob.ticket.boot_id, ob.ticket.lease_id))

    def open_transfers(self) -> list[tuple[str, str, str, int, float]]:
        """``(rid, receiver address, state, bytes committed, started)`` of every transfer in
        progress (kvd top): state ``sending`` while a Send runs, ``idle`` between chunks."""
        with self._lock:
            return [(ob.rid, ob.ticket.peer_address, "sending" if ob.active > ob.parked else "idle", ob.nbytes, ob.started)
                    for ob in self._open.values() if ob.active or not ob.aborted]

    def open_count(self) -> int:
        """Outbound transfers in progress (a transfer aborted while idle no longer counts)."""
        with self._lock:
            return self._open_now()

    def _open_now(self) -> int:
        return sum(1 for ob in self._open.values() if ob.active or not ob.aborted)

    def stats(self) -> OutboxStats:
        """Its counters and the transfers open, as one picture."""
        with self._lock:
            return OutboxStats(
                self.sent_total, self.failed_total, self.bytes_total, self._open_now(),
                self.calls_total, self.items_total, self.planned_ahead_total,
            )
