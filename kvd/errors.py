"""The one exception tree of kvd.

Every error kvd raises on purpose is a :class:`KvdError`. The server maps each class to a
gRPC status code in one place (``kvd.server.status``) and the client maps status codes back
to these classes, so engine code catches the same exceptions whether it runs the pool
in-process or talks to a daemon::

    KvdError
    ├── InvalidArgument        caller mistake: a value is out of range or malformed
    │   └── LayoutMismatch     two layouts that must agree do not (fingerprint, page bytes)
    ├── NotFound               unknown request / lease / group
    ├── AlreadyExists          request id already in use
    ├── PermissionDenied       the request belongs to another client session
    ├── CapacityError          does not fit; carries the shortfall in bytes
    ├── FailedPrecondition     the call is valid but the pool's state forbids it now
    │   ├── StaleEpoch         a quoted boot id / epoch no longer describes the pool
    │   ├── Pinned             compaction would move pages a lease pins
    │   └── NotFinalized       post-capture sizing order violated
    ├── Aborted                a transfer was aborted by a peer or failed mid-way
    ├── Unavailable            a peer daemon or backend cannot be reached
    ├── DeadlineExceeded       a wait ran out of time
    └── InternalError          a broken invariant: always a bug in kvd

Messages always say what was wrong and what to change; tests assert on them.
"""

from __future__ import annotations

__all__ = [
    "KvdError",
    "InvalidArgument",
    "LayoutMismatch",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "CapacityError",
    "FailedPrecondition",
    "StaleEpoch",
    "Pinned",
    "NotFinalized",
    "Aborted",
    "Unavailable",
    "DeadlineExceeded",
    "InternalError",
]


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""


class InvalidArgument(KvdError, ValueError):
    """The caller passed a value that can never be right (negative size, malformed id, ...)."""


class LayoutMismatch(InvalidArgument):
    """Two layouts that must agree do not; the message names the first differing field."""


class NotFound(KvdError, LookupError):
    """An id (request, lease, group) that the pool does not know."""


class AlreadyExists(KvdError):
    """A request id that is already live."""


class PermissionDenied(KvdError):
    """The object belongs to another client session."""


class CapacityError(KvdError):
    """The pool cannot fit the allocation now. ``shortfall_bytes`` says by how much."""

    def __init__(self, message: str, shortfall_bytes: int = 0) -> None:
        super().__init__(message)
        self.shortfall_bytes = int(shortfall_bytes)


class FailedPrecondition(KvdError):
    """The call is well formed but the pool's current state forbids it."""


class StaleEpoch(FailedPrecondition):
    """A boot id or epoch quoted by the caller no longer describes the pool's addresses."""


class Pinned(FailedPrecondition):
    """Compaction would move pages that live leases pin. ``holders`` names the leases/requests."""

    def __init__(self, message: str, holders: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.holders = tuple(holders)


class NotFinalized(FailedPrecondition):
    """Post-capture sizing steps called out of order (resize before finalize, ...)."""


class Aborted(KvdError):
    """A transfer was aborted by either side or failed mid-way."""


class Unavailable(KvdError):
    """A peer daemon or a transfer backend cannot be reached or is not installed."""


class DeadlineExceeded(KvdError, TimeoutError):
    """A wait ran out of time before the awaited state was reached."""


class InternalError(KvdError, RuntimeError):
    """An invariant of the pool is broken. This is a bug in kvd; please report it."""
