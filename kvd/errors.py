"""The one exception tree of kvd.

Every error kvd raises on purpose is a :class:`KvdError`. Each class has one status code, in
one table at the end of this module (:data:`CODES`): :func:`to_status` turns an exception into
``(code, message, metadata)`` and :func:`from_status` turns that back into the same class with
the same message. Every transport carries that triple: gRPC (``kvd.rpc.status``: a grpc.StatusCode
and trailing metadata), the peer socket (a PeerStatus message) and the handle socket (a JSON
header, ``kvd.ipc.fdpass``). So engine code catches the same exceptions whether it runs the pool
in-process or talks to a daemon, over any of them::

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

import enum
from collections.abc import Mapping
from typing import NamedTuple

from kvd.limits import MAX_MESSAGE_BYTES, clip

# The exception tree, which ``kvd`` re-exports. The status table (Code, CODES, Status, to_status,
# from_status) is for the transports and stays out of the package namespace.
__all__ = [
    "KvdError",
    "InvalidArgument",
    "LayoutMismatch",
    "NotFound",
    "SessionGone",
    "AlreadyExists",
    "PermissionDenied",
    "CapacityError",
    "LimitReached",
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


class SessionGone(NotFound):
    """The daemon does not know the caller's session: it restarted, or it reaped the session
    after a TTL without a call. The session's requests and leases are gone with it. A kvd client
    that meets it raises it for the call at hand, so its caller learns that what it held is gone,
    and opens a new session at once (the next call runs there) -- unless it attached the arena:
    its views and its engine's in-flight work use the old session's pages, so it refuses every
    call until the engine reconnects."""


class AlreadyExists(KvdError):
    """A request id that is already live."""


class PermissionDenied(KvdError):
    """The object belongs to another client session."""


class CapacityError(KvdError):
    """The pool cannot fit the allocation now. ``shortfall_bytes`` says by how much."""

    def __init__(self, message: str, shortfall_bytes: int = 0) -> None:
        super().__init__(message)
        self.shortfall_bytes = int(shortfall_bytes)


class LimitReached(KvdError):
    """A bound on what clients may hold at once in the daemon (its sessions, one request's
    leases) is reached; nothing changed. Release what is no longer used (close clients, release
    leases) and call again. Not the pool's memory: that is :class:`CapacityError`."""


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
    """A peer daemon or a transfer backend cannot be reached or is not installed.
    ``retry_after_s``: set when the daemon is up but refused the call for now (all its socket
    connections taken): the same call may succeed after that long. None: it may be gone."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(KvdError, TimeoutError):
    """A wait ran out of time before the awaited state was reached."""


class InternalError(KvdError, RuntimeError):
    """An invariant of the pool is broken. This is a bug in kvd; please report it."""


# ---- the status of each class: the one table every transport uses ------------------------------


class Code(enum.IntEnum):
    """The canonical RPC status codes (google.rpc.Code): the numbers ``grpc.StatusCode`` carries."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


#: Most specific first; every class of the tree is listed (a test keeps this honest).
CODES: dict[type[KvdError], Code] = {
    LayoutMismatch: Code.INVALID_ARGUMENT,
    InvalidArgument: Code.INVALID_ARGUMENT,
    SessionGone: Code.NOT_FOUND,
    NotFound: Code.NOT_FOUND,
    AlreadyExists: Code.ALREADY_EXISTS,
    PermissionDenied: Code.PERMISSION_DENIED,
    CapacityError: Code.RESOURCE_EXHAUSTED,
    LimitReached: Code.RESOURCE_EXHAUSTED,
    StaleEpoch: Code.FAILED_PRECONDITION,
    Pinned: Code.FAILED_PRECONDITION,
    NotFinalized: Code.FAILED_PRECONDITION,
    FailedPrecondition: Code.FAILED_PRECONDITION,
    Aborted: Code.ABORTED,
    Unavailable: Code.UNAVAILABLE,
    DeadlineExceeded: Code.DEADLINE_EXCEEDED,
    InternalError: Code.INTERNAL,
    KvdError: Code.UNKNOWN,
}

#: Metadata keys: the class (two classes share a code: StaleEpoch and Pinned are both
#: FAILED_PRECONDITION), a CapacityError's shortfall, a Pinned error's lease labels, a busy
#: refusal's retry hint (an Unavailable's ``retry_after_s``).
ERROR_KEY, SHORTFALL_KEY, HOLDERS_KEY = "kvd-error", "kvd-shortfall-bytes", "kvd-holders"
RETRY_KEY = "kvd-retry-after-s"

_BY_NAME: dict[str, type[KvdError]] = {cls.__name__: cls for cls in CODES}
# A code with no class named (e.g. a status gRPC itself raised) maps to the most general class
# with that code: CODES lists subclasses before their bases, so the last one listed wins. Except
# RESOURCE_EXHAUSTED: without kvd's metadata it is gRPC's own (a message or metadata over its
# limit, a server out of threads), not the pool's capacity -- a CapacityError would make an
# engine wait for memory that is not the problem. It stays the general class, named by its code.
_BY_CODE: dict[int, type[KvdError]] = {
    **{code: cls for cls, code in CODES.items() if code != Code.RESOURCE_EXHAUSTED},
    Code.CANCELLED: Aborted,
}
#: Bytes of a Pinned error's holders in its metadata; whole labels only, the rest counted. With
#: a message of MAX_MESSAGE_BYTES (percent-encoded: up to 3x) the status stays under gRPC's 8 KiB.
MAX_HOLDERS_BYTES = 1024


class Status(NamedTuple):
    """What a transport carries for an exception: :func:`to_status` makes it, :func:`from_status`
    raises it again."""

    code: Code
    message: str
    metadata: tuple[tuple[str, str], ...]  # ERROR_KEY always; SHORTFALL_KEY / HOLDERS_KEY / RETRY_KEY where they apply


def to_status(exc: BaseException) -> Status:
    """The status of an exception raised below a transport's edge. Anything but a KvdError was
    not raised on purpose: INTERNAL, saying it is a bug (never a traceback as INVALID_ARGUMENT).
    The message is cut to :data:`~kvd.limits.MAX_MESSAGE_BYTES` and a Pinned error's holders to
    :data:`MAX_HOLDERS_BYTES`, so the status always fits gRPC's metadata limit."""
    if not isinstance(exc, KvdError):
        msg = clip(f"internal error (a bug in kvd): {type(exc).__name__}: {exc}", MAX_MESSAGE_BYTES)
        return Status(Code.INTERNAL, msg, ((ERROR_KEY, "InternalError"),))
    cls = next(c for c in type(exc).__mro__ if c in CODES)
    md: list[tuple[str, str]] = [(ERROR_KEY, cls.__name__)]
    if isinstance(exc, CapacityError):
        md.append((SHORTFALL_KEY, str(exc.shortfall_bytes)))
    if isinstance(exc, Pinned):
        md.append((HOLDERS_KEY, _holders(exc.holders)))
    if isinstance(exc, Unavailable) and exc.retry_after_s is not None:
        md.append((RETRY_KEY, f"{exc.retry_after_s:g}"))
    return Status(CODES[cls], clip(str(exc), MAX_MESSAGE_BYTES), tuple(md))


def _holders(holders: tuple[str, ...]) -> str:
    """``holders`` joined by ';', as many whole labels as fit :data:`MAX_HOLDERS_BYTES`, then
    ``...N more``. Printable ASCII only: gRPC refuses any other byte in a metadata value (the
    whole call then fails as INTERNAL "Invalid metadata"), so a label's other characters (a
    request id's) are escaped as Python does (``\\xe9``)."""
    kept: list[str] = []
    size = 0
    for i, h in enumerate(holders):
        h = h if h.isascii() and h.isprintable() else h.encode("unicode_escape").decode("ascii")
        size += len(h) + 1
        if size > MAX_HOLDERS_BYTES:
            kept.append(f"...{len(holders) - i} more")
            break
        kept.append(h)
    return ";".join(kept)


def from_status(code: int, message: str, metadata: Mapping[str, str]) -> KvdError:
    """The exception a status stands for (the inverse of :func:`to_status`): the class the
    metadata names, with the same message and extras; without a class it knows, the most general
    class of ``code``, its message prefixed with the code's name where the class alone would not
    say what happened (UNAVAILABLE, or a code kvd never sends). RESOURCE_EXHAUSTED without a class
    is a transport limit, not the pool's capacity: a plain KvdError, never CapacityError."""
    named = _BY_NAME.get(metadata.get(ERROR_KEY, ""))
    cls = named or _BY_CODE.get(code, KvdError)
    if cls is CapacityError:
        return CapacityError(message, int(metadata.get(SHORTFALL_KEY, "0") or 0))
    if cls is Pinned:
        return Pinned(message, tuple(h for h in metadata.get(HOLDERS_KEY, "").split(";") if h))
    if cls is Unavailable and named is not None:
        return Unavailable(message, _retry_after(metadata.get(RETRY_KEY)))
    if named is None and cls in (KvdError, Unavailable):
        try:
            name = Code(code).name
        except ValueError:
            name = f"status {code}"
        if code == Code.RESOURCE_EXHAUSTED:
            message += " (gRPC's own status, without kvd's error metadata: a transport limit, not the pool's capacity)"
        return cls(f"{name}: {message}")
    return cls(message)


def _retry_after(value: str | None) -> float | None:
    """A retry hint as sent (seconds, finite and >= 0); anything else is no hint."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0.0 <= seconds < float("inf") else None
