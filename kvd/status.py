"""The one mapping between kvd's exception tree and gRPC status codes, used at both edges.

The server turns an exception into ``(code, message, trailing metadata)`` with :func:`to_status`;
the client turns a ``grpc.RpcError`` back into the most specific kvd exception with
:func:`from_rpc_error`. The peer socket (``kvd.server.peer_socket``) carries the same triple in
its error frames and maps it back with :func:`from_status`, so a refusal raises the same class
with the same message over either transport. The trailing key ``kvd-error`` carries the exception class name so that
two classes sharing a code (``StaleEpoch`` and ``Pinned`` are both FAILED_PRECONDITION) come
back as themselves; ``kvd-shortfall-bytes`` carries a CapacityError's shortfall and
``kvd-holders`` a Pinned error's lease labels.
"""

from __future__ import annotations

import grpc

from kvd import errors as E

__all__ = ["CODES", "to_status", "from_rpc_error", "from_status", "code_from_int"]

#: Most specific first; every class of the tree is listed (a test keeps this honest).
CODES: dict[type[E.KvdError], grpc.StatusCode] = {
    E.LayoutMismatch: grpc.StatusCode.INVALID_ARGUMENT,
    E.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    E.NotFound: grpc.StatusCode.NOT_FOUND,
    E.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    E.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    E.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    E.StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
    E.Pinned: grpc.StatusCode.FAILED_PRECONDITION,
    E.NotFinalized: grpc.StatusCode.FAILED_PRECONDITION,
    E.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    E.Aborted: grpc.StatusCode.ABORTED,
    E.Unavailable: grpc.StatusCode.UNAVAILABLE,
    E.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    E.InternalError: grpc.StatusCode.INTERNAL,
    E.KvdError: grpc.StatusCode.UNKNOWN,
}

_BY_NAME: dict[str, type[E.KvdError]] = {cls.__name__: cls for cls in CODES}
# A status code with no kvd-error metadata (e.g. raised by grpc itself) maps to the most general
# class with that code: CODES lists subclasses before their bases, so the last one listed wins.
_BY_CODE: dict[grpc.StatusCode, type[E.KvdError]] = {code: cls for cls, code in CODES.items()} | {
    grpc.StatusCode.CANCELLED: E.Aborted,
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Status code, message and trailing metadata for an exception raised by the core."""
    if not isinstance(exc, E.KvdError):
        # Not raised on purpose: a bug. Say so rather than leak a traceback as INVALID_ARGUMENT.
        return grpc.StatusCode.INTERNAL, f"internal error (a bug in kvd): {type(exc).__name__}: {exc}", (
            ("kvd-error", "InternalError"),
        )
    cls = next(c for c in type(exc).__mro__ if c in CODES)
    md: list[tuple[str, str]] = [("kvd-error", cls.__name__)]
    if isinstance(exc, E.CapacityError):
        md.append(("kvd-shortfall-bytes", str(exc.shortfall_bytes)))
    if isinstance(exc, E.Pinned):
        md.append(("kvd-holders", ";".join(exc.holders)))
    return CODES[cls], str(exc), tuple(md)


_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    """The status code with this wire number (UNKNOWN for a number gRPC does not define)."""
    return _BY_INT.get(value, grpc.StatusCode.UNKNOWN)


def from_rpc_error(err: grpc.RpcError) -> E.KvdError:
    """The kvd exception a ``grpc.RpcError`` stands for (the caller raises it ``from err``)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    md = {}
    try:
        md = {k: v for k, v in (err.trailing_metadata() or ())}
    except Exception:  # some transport errors carry no metadata
        pass
    return from_status(code, details, md)


def from_status(code: grpc.StatusCode, details: str, md: dict[str, str]) -> E.KvdError:
    """The kvd exception a status code, message and trailing metadata (as :func:`to_status`
    made them) stand for."""
    cls = _BY_NAME.get(md.get("kvd-error", ""), _BY_CODE.get(code, E.KvdError))
    if cls is E.CapacityError:
        return E.CapacityError(details, int(md.get("kvd-shortfall-bytes", "0") or 0))
    if cls is E.Pinned:
        holders = tuple(h for h in md.get("kvd-holders", "").split(";") if h)
        return E.Pinned(details, holders)
    if cls is E.KvdError or code == grpc.StatusCode.UNAVAILABLE and cls is E.Unavailable:
        return cls(f"{code.name}: {details}")
    return cls(details)
