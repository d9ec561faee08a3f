"""Leases: time-limited grants that pin a request's physical pages during a transfer.

A SEND lease pins the sender's pages while a backend reads them; a RECV lease pins the
receiver's pages while a peer may write them (and is what a ticket names). While a lease pins a
page, compaction will not move it and the request cannot be freed. Leases expire after their
TTL unless renewed; :meth:`LeaseTable.expire` hands back the expired ones so the owner can
reclaim.

Lease ids are never reused within a boot, so a late message naming a released lease can never
act on a newer one (fencing together with the pool's boot id and epoch).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.errors import InternalError, InvalidArgument, NotFound
from kvd.limits import quote
from kvd.records import LeaseKind

__all__ = ["Lease", "LeaseTable"]


@dataclass(slots=True)
class Lease:
    lease_id: int
    rid: str
    kind: LeaseKind
    session: str  # client session that holds it
    boot_id: str
    epoch: int  # pool epoch the holder's vectors were made at
    ttl: float  # seconds
    expires_at: float  # on the table's clock
    granted_at: float = 0.0  # on the table's clock (kvd top's ages)

    def label(self) -> str:
        return f"lease {self.lease_id} ({self.kind.value} on {quote(self.rid)})"


class LeaseTable:
    """All live leases of one daemon. Not thread-safe: the node serialises calls."""

    def __init__(self, *, default_ttl: float = 10.0, max_ttl: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.default_ttl = default_ttl
        self.max_ttl = max_ttl
        self.clock = clock
        self._leases: dict[int, Lease] = {}
        # rid -> its leases (lease id -> lease), the same objects: every free, lease and Send asks
        # for one request's leases, which must not cost a scan of every live lease
        self._by_rid: dict[str, dict[int, Lease]] = {}
        self._next_id = 1
        self.expired_total = 0

    def check_ttl(self, ttl: float | None) -> float:
        """The TTL a lease asked for with ``ttl`` gets (None or 0: the default); InvalidArgument
        outside ``(0, max_ttl]``. Changes nothing."""
        return self._ttl(ttl)

    def _ttl(self, ttl: float | None) -> float:
        if ttl is None or ttl == 0:
            return self.default_ttl
        if not (0 < ttl <= self.max_ttl):
            raise InvalidArgument(f"lease ttl must be in (0, {self.max_ttl}] seconds, got {ttl}")
        return float(ttl)

    def acquire(self, rid: str, kind: LeaseKind, *, session: str, boot_id: str, epoch: int, ttl: float | None = None) -> Lease:
        t = self._ttl(ttl)
        now = self.clock()
        lease = Lease(self._next_id, rid, kind, session, boot_id, epoch, t, now + t, now)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._by_rid.setdefault(rid, {})[lease.lease_id] = lease
        return lease

    def _forget(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        mine = self._by_rid[lease.rid]
        del mine[lease.lease_id]
        if not mine:
            del self._by_rid[lease.rid]

    def get(self, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self.clock():
            raise NotFound(f"lease {lease_id} is not live (expired, released, or never granted); acquire a new one")
        return lease

    def renew(self, lease_id: int, ttl: float | None = None) -> Lease:
        lease = self.get(lease_id)
        lease.ttl = self._ttl(ttl) if ttl else lease.ttl
        lease.expires_at = self.clock() + lease.ttl
        return lease

    def hold(self, lease_id: int, ttl: float) -> bool:
        """Keep lease ``lease_id`` for ``ttl`` seconds from now, even past its TTL, as long as it
        is still in the table (:meth:`expire` has not removed it): a fence, whose pages a writer
        may still reach, must not lapse on the TTL its holder asked for. False if it is gone."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.ttl = self._ttl(ttl)
        lease.expires_at = self.clock() + lease.ttl
        return True

    def postpone(self, seconds: float) -> None:
        """Move every lease's deadline ``seconds`` later (the process did not run that long:
        :meth:`Node.sweep`'s ``stalled_s``). One that ran out before the pause stays run out."""
        for lease in self._leases.values():
            lease.expires_at += seconds

    def release(self, lease_id: int) -> Lease:
        lease = self.get(lease_id)
        self._forget(lease)
        return lease

    def expire(self) -> list[Lease]:
        """Remove and return every lease whose TTL has run out."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            self._forget(lease)
        self.expired_total += len(gone)
        return gone

    def drop(self, lease_id: int) -> None:
        """Forget a lease without the liveness check (reclaiming a dead session)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._forget(lease)

    def live(self, lease_id: int) -> bool:
        """Whether lease ``lease_id`` exists and has not run out."""
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at > self.clock()

    def count(self, rid: str) -> int:
        """Leases of ``rid`` in the table, expired ones not yet swept included (no scan)."""
        mine = self._by_rid.get(rid)
        return len(mine) if mine else 0

    def for_rid(self, rid: str) -> list[Lease]:
        mine = self._by_rid.get(rid)
        if not mine:
            return []
        now = self.clock()
        return [lease for lease in mine.values() if lease.expires_at > now]

    def for_session(self, session: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.session == session]

    def pinned(self) -> dict[str, str]:
        """rid -> labels of the live leases that pin it (for compaction's refusal message)."""
        now = self.clock()
        out: dict[str, list[str]] = {}
        for lease in self._leases.values():
            if lease.expires_at > now:
                out.setdefault(lease.rid, []).append(lease.label())
        return {rid: ", ".join(labels) for rid, labels in out.items()}

    def check(self) -> None:
        """InternalError unless the per-request index holds exactly the table's leases."""
        indexed = {lid: lease for mine in self._by_rid.values() for lid, lease in mine.items()}
        if indexed != self._leases or any(not mine or any(x.rid != rid for x in mine.values()) for rid, mine in self._by_rid.items()):
            raise InternalError(f"lease table: the per-request index ({sorted(indexed)}) disagrees with the table ({sorted(self._leases)})")

    def all(self) -> list[Lease]:
        """Every lease still in the table (including ones past their TTL not yet expired)."""
        return list(self._leases.values())

    def __len__(self) -> int:
        now = self.clock()
        return sum(1 for lease in self._leases.values() if lease.expires_at > now)
