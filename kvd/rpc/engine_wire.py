"""The engine socket's wire table: which Kvd rpc each frame kind is, and where the socket lives.

Shared by the server (:mod:`kvd.server.engine_socket`) and the client (:mod:`kvd.client.fast`),
so neither imports the other. The frames themselves are :mod:`kvd.ipc.frames`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from google.protobuf.message import Message

from kvd.v1 import kvd_pb2 as pb

__all__ = ["Method", "METHODS", "METHOD_IDS", "FAST_SUFFIX", "DOORBELLS", "WAITS", "fast_path"]

#: The engine socket's path is the gRPC Unix listener's with this suffix.
FAST_SUFFIX = ".fast"


def fast_path(listen_unix: str) -> str:
    """Where a daemon listening on ``listen_unix`` serves its engine socket."""
    return listen_unix + FAST_SUFFIX


class Method(NamedTuple):
    """One Kvd rpc the engine socket serves: its frame kind, name and message types."""

    id: int
    name: str
    request: type[Message]
    response: type[Message]


#: The Kvd rpcs in frame-kind order from 1. Part of the wire: append, never reorder or reuse.
_ORDER = (
    "OpenSession", "KeepAlive", "CloseSession", "GetInfo", "GetStats", "GetActivity", "Attach",
    "Allocate", "CanAllocate", "Extend", "Free", "GetVectors", "AcquireLease", "RenewLease", "ReleaseLease",
    "Compact", "Finalize", "Offload", "Restore", "BeginSend", "Send", "SendMany", "WaitReady", "Abort", "Echo",
    "ProposeLayout", "WaitEnded",
)


def _methods(order: Sequence[str]) -> dict[int, Method]:
    svc = pb.DESCRIPTOR.services_by_name["Kvd"]
    out = {}
    for i, name in enumerate(order, start=1):
        d = svc.methods_by_name[name]
        out[i] = Method(i, name, getattr(pb, d.input_type.name), getattr(pb, d.output_type.name))
    return out


#: A frame kind of the socket itself, not a Kvd rpc: an empty request on a connection that acts for
#: a session, answered with a ``Doorbells`` message and a read-only descriptor of the daemon's
#: doorbell board (SCM_RIGHTS; kvd.memory.doorbells), or a refusal.
DOORBELLS = 255

#: What the socket serves, by frame kind.
METHODS: dict[int, Method] = _methods(_ORDER)
METHOD_IDS: dict[str, int] = {m.name: m.id for m in METHODS.values()}

#: The rpcs that wait (their request's ``timeout_seconds``): a daemon may cut one short or refuse it
#: for want of a wait slot, and a client sends it again for what is left of its timeout.
WAITS = frozenset(("WaitReady", "WaitEnded"))
