"""The data-plane interface: register an arena once, write batches of blocks to a peer.

A backend moves bytes from this node's arena into a peer's arena; it knows nothing of pages,
requests or leases (the planner in :mod:`kvd.handoff.plan` turns those into blocks of absolute
addresses). One backend object serves one local arena and any number of peers::

    backend = make_backend("mooncake")   # kvd.backends.registry
    backend.register(arena)            # once; again after arena.set_backed(...)
    ticket.transfer_endpoint = backend.endpoint
    ...
    backend.write(PeerRegion(ep, base, backed, region_id), srcs, dsts, lens)
    landed = backend.write_async(peer, srcs, dsts, lens)   # copies issued ...
    landed()                                                 # ... and every byte landed

Addresses are absolute: ``srcs`` in this process's arena ``[base, base + registered)``,
``dsts`` in the peer's ``[peer.base, peer.base + peer.backed_bytes)`` (the peer's own
address space, as its ticket states it). Every block is checked against both ranges before
the first byte moves.

Failures, three ways (see :mod:`kvd.errors`):

* :class:`InvalidArgument` -- a block lies outside either range, lists of different lengths,
  a non-positive length. Raised before anything is written.
* :class:`Unavailable` -- the peer cannot be reached (nothing of this call was written), or
  the backend is not installed.
* :class:`Aborted` -- the write failed after it started; the peer's bytes in the blocks of
  this call are undefined. The caller aborts the transfer; it never retries blindly.

Asynchronous writes. :meth:`Backend.write_async` issues the copies and returns a waiter that
blocks until they landed, raising what :meth:`Backend.write` would have raised from then on; a
caller overlaps its own work (the next request's lease and plan, the previous one's commit)
with copies a device or an engine runs on its own. The CUDA local backend queues copies on its
GPU stream; Mooncake submits batches to its engine (``batch_transfer_async_write``, waited for
with ``get_batch_transfer_status``); the shm local backend writes synchronously inside
``write_async`` and returns a waiter with nothing left to wait for.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import add
from typing import ClassVar

import numpy as np

from kvd.errors import FailedPrecondition, InternalError, InvalidArgument, Unavailable
from kvd.memory.arena import Arena

__all__ = ["Backend", "PeerRegion", "Landed", "Wiring"]

#: What :meth:`Backend.write_async` returns: call it once; it returns when every byte landed.
Landed = Callable[[], None]


def _nothing_left() -> None:
    """The waiter of a write that was complete when it was issued."""

@dataclass(frozen=True, slots=True)
class PeerRegion:
    """Where a peer's arena lives, as its ticket states it."""

    endpoint: str  # the peer backend's `endpoint` (ticket field transfer_endpoint)
    base: int  # address of the peer arena's byte 0, in the peer's address space
    backed_bytes: int  # the peer promises [base, base + backed_bytes) stays backed while its lease lives
    region_id: str  # the peer arena's stable name (diagnostics; the local backend keys caches on the path)


@dataclass(frozen=True, slots=True)
class Wiring:
    """What a daemon offers every backend it makes (:meth:`Backend.create` takes what it needs)."""

    host: str = "127.0.0.1"  # the address peers use to reach this node's transport (mooncake)
    handle_endpoint: str = ""  # this daemon's handle socket (the local backend of a cuda-vmm arena)
    peer_token: str | None = None  # the shared secret presented to peers' handle servers
    locator: str = ""  # this daemon's peer address, where peers fetch transport metadata (nixl)
    fetch_metadata: Callable[[str, str], bytes] | None = None  # fetch(locator, agent): a peer's metadata (nixl)


class Backend(abc.ABC):
    """One local arena, registered once; batched writes to peers, synchronous or issued and
    waited for apart (:meth:`write_async`).

    Thread safety: :meth:`write` may run in several threads at once. :meth:`register` and
    :meth:`close` wait for writes in flight (an asynchronous one until its waiter returned) and
    hold new ones back meanwhile, so a write never sees a half-updated registration.

    Counters (read any time; updated after each batch the transport confirmed):
    ``bytes_written``, ``batches`` (transport submissions that succeeded) and
    ``registration_seconds`` (time the latest :meth:`register` took).

    Capabilities are class attributes, read before any instance exists (:mod:`kvd.backends.registry`
    picks a class by name and arena kind; the daemon checks settings against them at start-up).
    """

    #: The backend's name (the ``backend`` setting; several classes may share one, per arena kind).
    name: ClassVar[str] = "abstract"
    #: The arena kinds (``Arena.handle().kind``) this class registers.
    arena_kinds: ClassVar[frozenset[str]] = frozenset()
    #: Whether it carries a separate draft index vector (``speculative``: draft pages travel apart).
    draft_vectors: ClassVar[bool] = False

    @classmethod
    def missing(cls) -> str | None:
        """What this host lacks to run this backend: a sentence naming the missing Python package
        or system library and the command that installs it; None when nothing is missing."""
        return None

    @classmethod
    def startup_check(cls, arena_kind: str) -> str | None:
        """Refuse at start-up what cannot work on this host for an arena of ``arena_kind``:
        Unavailable saying what to install (default: :meth:`missing`), InvalidArgument for an
        environment the backend cannot run with. Returns what to log about the installed
        transport (None: nothing)."""
        why = cls.missing()
        if why is not None:
            raise Unavailable(why)
        return None

    @classmethod
    def create(cls, wiring: Wiring) -> Backend:
        """An instance, from what the daemon offers (default: ``cls()``)."""
        return cls()

    def __init__(self) -> None:
        self.registration_seconds = 0.0
        self.bytes_written = 0
        self.batches = 0
        self._arena: Arena | None = None
        # The registered range [lo, lo + size). A snapshot, not arena.backed: the transport only
        # knows what was registered, so writes are checked against exactly that.
        self._reg_lo = 0
        self._reg_size = 0
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closed = False

    # -- public surface ---------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """What a peer needs to reach this backend (goes into tickets as ``transfer_endpoint``)."""

    @property
    def registered(self) -> tuple[int, int]:
        """``(base, bytes)`` of the registered range; ``(0, 0)`` before :meth:`register`."""
        return self._reg_lo, self._reg_size

    def register(self, arena: Arena) -> float:
        """Register ``arena``'s whole backed prefix ``[base, base + backed)``; returns seconds taken.

        Call once after start-up and again after every ``arena.set_backed``: the previous range
        is unregistered first. Waits for writes in flight. Mutates the backend only; the arena
        is not touched."""
        with self._cond:
            self._check_open()
            self._cond.wait_for(lambda: self._in_flight == 0)
            t0 = time.perf_counter()
            if self._reg_size:
                self._unregister()
                self._reg_lo = self._reg_size = 0
                self._arena = None
            if arena.backed:
                self._register(arena)
            self._arena = arena
            self._reg_lo, self._reg_size = arena.base, arena.backed
            seconds = time.perf_counter() - t0
            self.registration_seconds = seconds
        return seconds

    def write(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Copy block ``i`` (``lens[i]`` bytes) from local ``srcs[i]`` to the peer's ``dsts[i]``.

        Synchronous: returns once every byte is confirmed written, or raises (InvalidArgument
        before any byte moves; Unavailable or Aborted from the transport). Destination blocks
        must not overlap each other (the planner never produces overlaps); the order in which
        blocks land is unspecified. ``write_async(...)()``."""
        self.write_async(peer, srcs, dsts, lens)()

    def write_async(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> Landed:
        """Issue the copies of :meth:`write` and return a waiter: calling it blocks until every
        byte landed and then checks what :meth:`write` checks after its copy (the peer still
        alive), raising what :meth:`write` would raise.

        Raises at once what is known before anything moves (InvalidArgument, Unavailable: the
        peer is gone, nothing written). Call the waiter exactly once (a second call is a bug:
        InternalError): until it returned the write counts as in flight, so :meth:`register`
        and :meth:`close` wait for it, and the peer's bytes in these blocks are undefined."""
        if not (len(srcs) == len(dsts) == len(lens)):
            raise InvalidArgument(f"write needs equally long lists, got {len(srcs)} srcs, {len(dsts)} dsts, {len(lens)} lens")
        if not srcs:
            return _nothing_left
        with self._cond:
            self._check_open()
            if self._arena is None:
                raise FailedPrecondition(f"{self.name} backend: register an arena before writing")
            self._in_flight += 1
            lo, size = self._reg_lo, self._reg_size
        try:
            self._check_blocks(peer, lo, size, srcs, dsts, lens)
            wait = self._issue(peer, srcs, dsts, lens)
        except BaseException:
            self._landed()
            raise
        called = False

        def landed() -> None:
            nonlocal called
            if called:
                raise InternalError(f"{self.name} backend: a write's waiter was called twice (a bug in the caller)")
            called = True
            try:
                wait()
            finally:
                self._landed()

        if (ph := getattr(wait, "phases", None)) is not None:
            landed.phases = ph  # type: ignore[attr-defined]  # a backend's own timings (kvd.handoff.flight.Flight.note)
        return landed

    def _landed(self) -> None:
        """A write is no longer in flight (issued and waited for, or refused)."""
        with self._cond:
            self._in_flight -= 1
            if not self._in_flight:  # what register and close wait for
                self._cond.notify_all()

    def close(self) -> None:
        """Unregister and release the transport. Idempotent; waits for writes in flight."""
        with self._cond:
            if self._closed:
                return
            self._cond.wait_for(lambda: self._in_flight == 0)
            self._closed = True
            try:
                if self._reg_size:
                    self._unregister()
            finally:
                self._reg_lo = self._reg_size = 0
                self._arena = None
                self._close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for implementations ----------------------------------------------------------------

    @abc.abstractmethod
    def _register(self, arena: Arena) -> None:
        """Register ``[arena.base, arena.base + arena.backed)`` (> 0 bytes) with the transport."""

    @abc.abstractmethod
    def _unregister(self) -> None:
        """Undo the last :meth:`_register` (``self.registered`` still names its range)."""

    def _write(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Move the (already validated) blocks; call :meth:`_account` per confirmed batch. A
        synchronous transport implements this; one that issues and waits apart overrides
        :meth:`_issue` instead."""
        raise InternalError(f"{type(self).__name__} implements neither _write nor _issue (a bug in kvd)")

    def _issue(self, peer: PeerRegion, srcs: list[int], dsts: list[int], lens: list[int]) -> Landed:
        """Start moving the (already validated) blocks; return what waits for them, then checks
        and accounts (raising as :meth:`write` does). Default: the whole :meth:`_write` now, and
        nothing left to wait for."""
        self._write(peer, srcs, dsts, lens)
        return _nothing_left

    @abc.abstractmethod
    def _close(self) -> None:
        """Release transport resources (called once, after unregistering)."""

    def _account(self, nbytes: int, batches: int = 1) -> None:
        with self._cond:
            self.bytes_written += nbytes
            self.batches += batches

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"{self.name} backend is closed")

    def _check_blocks(self, peer: PeerRegion, lo: int, size: int, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """InvalidArgument naming the first block outside its range; vectorised (10k blocks: ~1 ms)."""
        if len(lens) <= SMALL_CHECK:
            return _check_few(peer, lo, size, srcs, dsts, lens)
        # numpy, not torch: building the arrays is the cost here, and np.array on a list of ints
        # is ~7x faster than torch.tensor (4,096 blocks: 0.25 ms against 1.8 ms).
        try:
            s, d, n = (np.array(v) for v in (srcs, dsts, lens))
        except (TypeError, ValueError, OverflowError) as exc:  # ragged or unconvertible elements
            raise InvalidArgument(f"write takes lists of int addresses and lengths: {exc}") from exc
        for t, what in ((s, "srcs"), (d, "dsts"), (n, "lens")):
            if t.dtype != np.int64:  # floats, bools, values past 2**63 (uint64 or object)
                raise InvalidArgument(f"write takes int {what}, got elements of type {t.dtype}")
        # Written as differences so nothing overflows: lo <= s and s - lo <= size - n.
        bad_len = n <= 0
        bad_src = (s < lo) | (s - lo > size - n)
        bad_dst = (d < peer.base) | (d - peer.base > peer.backed_bytes - n)
        for mask, why in (
            (bad_len, "has a non-positive length"),
            (bad_src, f"reads outside this arena's registered range [{lo:#x}, {lo + size:#x})"),
            (bad_dst, f"writes outside peer {peer.region_id!r}'s backed range [{peer.base:#x}, {peer.base + peer.backed_bytes:#x})"),
        ):
            if bool(mask.any()):
                i = int(np.flatnonzero(mask)[0])
                raise InvalidArgument(
                    f"block {i} (src {srcs[i]:#x}, dst {dsts[i]:#x}, len {lens[i]}) {why}; nothing was written"
                )


#: Up to this many blocks a write's blocks are checked in plain Python: three numpy arrays and
#: their masks cost more than a loop over a few blocks (a 32k-token gemma request writes 17:
#: ~50 us of a Send's issue on the H200 host's cold cores, against a few for the loop).
SMALL_CHECK = 64


def _check_few(peer: PeerRegion, lo: int, size: int, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
    """:meth:`Backend._check_blocks` for a few blocks: the same refusals, in the same order
    (types, then lengths, sources, destinations; the first block of the first kind)."""
    hi, p_lo, p_hi = lo + size, peer.base, peer.base + peer.backed_bytes
    # Every condition below at once, over all blocks (the loops in C): blocks that pass them all
    # return here; otherwise the checks below name the first block that fails, kind by kind.
    if (
        set(map(type, srcs)) | set(map(type, dsts)) | set(map(type, lens)) == {int}
        and min(lens) > 0
        and min(srcs) >= lo
        and max(map(add, srcs, lens)) <= hi
        and min(dsts) >= p_lo
        and max(map(add, dsts, lens)) <= p_hi
    ):
        return
    for v, what in ((srcs, "srcs"), (dsts, "dsts"), (lens, "lens")):
        for x in v:
            if type(x) is not int:  # bool, float, numpy scalars: as the numpy check refuses them
                raise InvalidArgument(f"write takes int {what}, got elements of type {type(x).__name__}")
    for bad, why in (
        ((n <= 0 for n in lens), "has a non-positive length"),
        ((s < lo or s + n > hi for s, n in zip(srcs, lens)), f"reads outside this arena's registered range [{lo:#x}, {hi:#x})"),
        ((d < p_lo or d + n > p_hi for d, n in zip(dsts, lens)), f"writes outside peer {peer.region_id!r}'s backed range [{p_lo:#x}, {p_hi:#x})"),
    ):
        for i, b in enumerate(bad):
            if b:
                raise InvalidArgument(f"block {i} (src {srcs[i]:#x}, dst {dsts[i]:#x}, len {lens[i]}) {why}; nothing was written")
