"""The gRPC edge of kvd's one status table (:data:`kvd.errors.CODES`), used at both ends of a call.

The server turns an exception into ``(code, message, trailing metadata)`` with :func:`to_status`;
the client turns a ``grpc.RpcError`` back into the most specific kvd exception with
:func:`from_rpc_error`. Both are :func:`kvd.errors.to_status` / :func:`kvd.errors.from_status`
with the code as a ``grpc.StatusCode``: the table, the metadata keys (``kvd-error`` names the class,
``kvd-shortfall-bytes`` a CapacityError's shortfall, ``kvd-holders`` a Pinned error's lease
labels) and the way back live in :mod:`kvd.errors`, where the Unix sockets below the gRPC edge
(``kvd.server.peer_socket``, ``kvd.ipc.fdpass``) use them too, so a refusal raises the same class
with the same message over every transport.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from kvd import errors as E

__all__ = ["to_status", "from_rpc_error", "from_status", "code_from_int"]

_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    """The status code with this wire number (UNKNOWN for a number gRPC does not define)."""
    return _BY_INT.get(value, grpc.StatusCode.UNKNOWN)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Status code, message and trailing metadata for an exception raised by the core."""
    code, message, metadata = E.to_status(exc)
    return code_from_int(code), message, metadata


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


def from_status(code: grpc.StatusCode, details: str, md: Mapping[str, str]) -> E.KvdError:
    """The kvd exception a status code, message and trailing metadata (as :func:`to_status`
    made them) stand for."""
    return E.from_status(code.value[0], details, md)
