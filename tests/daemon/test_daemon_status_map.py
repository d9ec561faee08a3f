"""The one exception <-> status-code mapping (kvd.status) is complete and round-trips."""

from __future__ import annotations

import grpc
import pytest

from kvd import errors as E
from kvd.status import CODES, from_rpc_error, to_status

ALL = [getattr(E, name) for name in E.__all__]


class FakeRpcError(grpc.RpcError):
    """What the client sees: a code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()):
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def make(cls: type[E.KvdError]) -> E.KvdError:
    if cls is E.CapacityError:
        return cls("does not fit: 4,096 bytes short", 4096)
    if cls is E.Pinned:
        return cls("compaction refused: lease 3", ("lease 3 (recv on 'a')", "lease 9 (send on 'b')"))
    return cls(f"a {cls.__name__} for the test")


def test_every_public_exception_is_mapped():
    assert set(ALL) == set(CODES), "kvd.errors.__all__ and kvd.status.CODES disagree"
    assert all(issubclass(c, E.KvdError) for c in ALL)
    # Subclasses come before their bases, so the most specific class wins.
    order = list(CODES)
    for i, cls in enumerate(order):
        assert not any(issubclass(later, cls) and later is not cls for later in order[i + 1 :]), cls


@pytest.mark.parametrize("cls", ALL, ids=[c.__name__ for c in ALL])
def test_round_trip(cls):
    exc = make(cls)
    code, msg, md = to_status(exc)
    assert code == CODES[cls] and msg == str(exc)
    assert dict(md)["kvd-error"] == cls.__name__
    back = from_rpc_error(FakeRpcError(code, msg, md))
    assert type(back) is cls
    assert msg in str(back)
    if cls is E.CapacityError:
        assert back.shortfall_bytes == 4096
    if cls is E.Pinned:
        assert back.holders == exc.holders


def test_subclass_without_its_own_entry_maps_to_its_nearest_parent():
    class Special(E.StaleEpoch):
        pass

    code, _, md = to_status(Special("x"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and dict(md)["kvd-error"] == "StaleEpoch"


def test_unplanned_exceptions_are_internal_and_say_bug():
    code, msg, md = to_status(ZeroDivisionError("boom"))
    assert code == grpc.StatusCode.INTERNAL and "a bug in kvd" in msg and "ZeroDivisionError: boom" in msg
    assert type(from_rpc_error(FakeRpcError(code, msg, md))) is E.InternalError


@pytest.mark.parametrize(
    "code,cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, E.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, E.NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, E.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, E.CapacityError),
        (grpc.StatusCode.UNAVAILABLE, E.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, E.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, E.Aborted),
        (grpc.StatusCode.UNIMPLEMENTED, E.KvdError),
    ],
)
def test_codes_without_kvd_metadata_map_to_the_general_class(code, cls):
    """Errors raised by gRPC itself (no kvd-error metadata): the class for the code."""
    back = from_rpc_error(FakeRpcError(code, "transport said no"))
    assert type(back) is cls and "transport said no" in str(back)


def test_unknown_class_name_in_metadata_falls_back_to_the_code():
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone", (("kvd-error", "FromTheFuture"),)))
    assert type(back) is E.NotFound


class _Refusing:
    """Peer calls whose Commit raises ``exc`` (anything goes at the hello)."""

    exc: BaseException = E.KvdError("unset")

    def authorize(self, presented: str) -> None:
        pass

    def commit(self, request):
        raise self.exc


def test_the_peer_socket_raises_what_grpc_raises():
    """Each class crosses the peer socket (kvd.server.peer_socket) as it crosses gRPC: the same
    class, message and extras (shortfall, holders), through the same mapping."""
    import shutil
    import tempfile

    from kvd.handoff import SocketRoute
    from kvd.server.peer_conns import PeerConnections
    from kvd.server.peer_socket import PeerSocketServer
    from kvd.v1 import kvd_pb2 as pb

    calls = _Refusing()
    where = tempfile.mkdtemp(prefix="kvd-sm-")  # short: tmp_path can outgrow a socket path
    with PeerSocketServer(f"{where}/p.sock", calls, "boot") as srv:  # type: ignore[arg-type]
        pc = PeerConnections(token=None, timeout=5.0)
        for cls in [*ALL, ZeroDivisionError]:
            calls.exc = make(cls) if cls is not ZeroDivisionError else ZeroDivisionError("boom")
            over_grpc = from_rpc_error(FakeRpcError(*to_status(calls.exc)))
            with pytest.raises(E.KvdError) as info:
                pc.call(pc.checkout(SocketRoute(srv.path, "boot")), "Commit", pb.CommitRequest())
            got = info.value
            assert type(got) is type(over_grpc) and str(got) == str(over_grpc), (cls, got, over_grpc)
            assert getattr(got, "shortfall_bytes", None) == getattr(over_grpc, "shortfall_bytes", None)
            assert getattr(got, "holders", None) == getattr(over_grpc, "holders", None)
        assert pc.idle == 1, "every refusal left the connection in step"
        pc.close()
    shutil.rmtree(where)
