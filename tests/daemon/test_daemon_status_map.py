"""The one exception <-> status-code table (kvd.errors.CODES) is complete and round-trips, over
gRPC (kvd.rpc.status) and over both Unix sockets (the peer socket and the handle socket)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvd import errors as E
from kvd.errors import CODES
from kvd.rpc.status import code_from_int, from_rpc_error, to_status

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
    if cls is E.Unavailable:
        return cls("engine socket serves 256 connections already", retry_after_s=0.5)
    return cls(f"a {cls.__name__} for the test")


def test_every_public_exception_is_mapped():
    assert set(ALL) == set(CODES), "kvd.errors.__all__ and kvd.errors.CODES disagree"
    assert all(issubclass(c, E.KvdError) for c in ALL)
    # Subclasses come before their bases, so the most specific class wins.
    order = list(CODES)
    for i, cls in enumerate(order):
        assert not any(issubclass(later, cls) and later is not cls for later in order[i + 1 :]), cls


@pytest.mark.parametrize("cls", ALL, ids=[c.__name__ for c in ALL])
def test_round_trip(cls):
    exc = make(cls)
    code, msg, md = to_status(exc)
    assert code == code_from_int(CODES[cls]) and code.name == CODES[cls].name and msg == str(exc)
    assert dict(md)["kvd-error"] == cls.__name__
    back = from_rpc_error(FakeRpcError(code, msg, md))
    assert type(back) is cls
    assert str(back) == msg
    if cls is E.CapacityError:
        assert back.shortfall_bytes == 4096
    if cls is E.Pinned:
        assert back.holders == exc.holders
    if cls is E.Unavailable:
        assert back.retry_after_s == 0.5


def test_an_unavailable_says_whether_to_retry_and_a_bad_hint_is_no_hint():
    """A busy refusal carries its retry hint (the client keeps the daemon's doorbells); a daemon
    gone carries none. A hint that is not a finite number of seconds >= 0 reads as none."""
    code, msg, md = to_status(E.Unavailable("the peer is gone"))
    assert "kvd-retry-after-s" not in dict(md)
    assert from_rpc_error(FakeRpcError(code, msg, md)).retry_after_s is None
    for bad in ("soon", "-1", "nan", "inf", ""):
        hinted = (("kvd-error", "Unavailable"), ("kvd-retry-after-s", bad))
        back = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "busy", hinted))
        assert type(back) is E.Unavailable and back.retry_after_s is None, bad


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
        (grpc.StatusCode.RESOURCE_EXHAUSTED, E.KvdError),  # gRPC's limit, not the pool's: never CapacityError
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


@pytest.mark.parametrize("details", ["Stream removed", "Received message larger than max (67108869 vs. 67108864)"])
def test_bare_resource_exhausted_is_a_transport_error_not_capacity(details):
    """gRPC's own RESOURCE_EXHAUSTED (metadata or a message over its limit, no kvd-error) is not
    the pool's capacity: an engine that caught CapacityError would wait for memory in vain. Only
    the status kvd itself sends, with its metadata, is a CapacityError."""
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details))
    assert type(back) is E.KvdError and not isinstance(back, E.CapacityError)
    assert str(back).startswith(f"RESOURCE_EXHAUSTED: {details}") and "not the pool's capacity" in str(back)
    code, msg, md = to_status(E.CapacityError("does not fit: 4,096 bytes short", 4096))
    kvd_own = from_rpc_error(FakeRpcError(code, msg, md))
    assert type(kvd_own) is E.CapacityError and kvd_own.shortfall_bytes == 4096


def test_status_messages_and_holders_are_bounded():
    """A status fits gRPC's metadata limit whatever the exception says: the message is cut to
    MAX_MESSAGE_BYTES (whole characters, saying how long it was), a Pinned error's holders to
    whole labels within MAX_HOLDERS_BYTES and a count of the rest."""
    from kvd.limits import MAX_MESSAGE_BYTES

    for text in ("x" * (1 << 20), "é" * (1 << 19)):
        exc = E.NotFound(f"request {text} is not allocated")
        _, msg, _ = to_status(exc)
        assert len(msg.encode()) <= MAX_MESSAGE_BYTES and msg.startswith("request ") and f"{len(str(exc).encode()):,d} bytes in all" in msg
    holders = tuple(f"lease {i} (recv on {'r' * 200!r})" for i in range(1000))
    _, _, md = to_status(E.Pinned("compaction refused", holders))
    joined = dict(md)["kvd-holders"]
    assert len(joined.encode()) <= E.MAX_HOLDERS_BYTES + 16 and joined.endswith(" more")
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "compaction refused", md))
    assert back.holders[0] == holders[0] and back.holders[-1].startswith("...")
    # Printable ASCII only (gRPC refuses anything else in a metadata value): other characters escaped.
    _, _, md = to_status(E.Pinned("compaction refused", ("lease 1 (recv on 'é\x01')",)))
    assert dict(md)["kvd-holders"] == "lease 1 (recv on '\\xe9\\x01')"
    short = ("lease 3 (recv on 'a')", "lease 9 (send on 'b')")
    assert dict(to_status(E.Pinned("x", short))[2])["kvd-holders"] == ";".join(short)  # nothing cut when it fits


def test_unknown_class_name_in_metadata_falls_back_to_the_code():
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone", (("kvd-error", "FromTheFuture"),)))
    assert type(back) is E.NotFound


RAISED = [*ALL, ZeroDivisionError]


def raised(cls: type[BaseException]) -> BaseException:
    return ZeroDivisionError("boom") if cls is ZeroDivisionError else make(cls)


class _Refusing:
    """Handlers that raise ``exc``: the peer socket's Commit, the handle socket's exporter
    (anything goes at the peer socket's hello)."""

    exc: BaseException = E.KvdError("unset")

    def authorize(self, presented: str) -> None:
        pass

    def commit(self, request):
        raise self.exc

    def commit_then(self, request):  # the peer socket's Commit (the wake after the reply)
        raise self.exc

    def export(self, want_fds: bool):
        raise self.exc


@contextlib.contextmanager
def _socket(kind: str, handlers: _Refusing) -> Iterator[Callable[[], object]]:
    """A real server of ``kind`` in this process whose handler raises ``handlers.exc``, and a
    call to it from a client; after the calls, the server answered each with a refusal."""
    from kvd.ipc.fdpass import HandleServer, fetch
    from kvd.records import SocketRoute
    from kvd.server.peer_conns import PeerConnections
    from kvd.server.peer_socket import PeerSocketServer
    from kvd.v1 import kvd_pb2 as pb

    where = tempfile.mkdtemp(prefix="kvd-sm-")  # short: tmp_path can outgrow a socket path
    try:
        if kind == "peer socket":
            with PeerSocketServer(f"{where}/p.sock", handlers, "boot") as srv:  # type: ignore[arg-type]
                pc = PeerConnections(token=None, timeout=5.0)
                yield lambda: pc.call(pc.checkout(SocketRoute(srv.path, "boot")), "Commit", pb.CommitRequest())
                assert pc.idle == 1, "every refusal left the connection in step"
                pc.close()
        else:
            with HandleServer(f"{where}/h.sock", handlers.export) as srv:
                yield lambda: fetch(srv.path)
                assert srv.refused == len(RAISED) and srv.served == 0
    finally:
        shutil.rmtree(where)


@pytest.mark.parametrize("kind", ["peer socket", "handle socket"])
def test_each_unix_socket_raises_what_grpc_raises(kind):
    """Each class a server handler raises crosses the peer socket (kvd.server.peer_socket) and the
    handle socket (kvd.ipc.fdpass) as it crosses gRPC: the same class, the same message, the same
    extras (shortfall, holders), through the same table (kvd.errors)."""
    handlers = _Refusing()
    with _socket(kind, handlers) as call:
        for cls in RAISED:
            handlers.exc = raised(cls)
            over_grpc = from_rpc_error(FakeRpcError(*to_status(handlers.exc)))
            with pytest.raises(E.KvdError) as info:
                call()
            got = info.value
            if cls is ZeroDivisionError:  # not raised on purpose: a bug, INTERNAL on every transport
                assert type(got) is type(over_grpc) is E.InternalError, got
                assert "a bug in kvd" in str(got) and "ZeroDivisionError: boom" in str(got), got
                continue
            assert (type(got), str(got)) == (type(over_grpc), str(over_grpc)) == (cls, str(handlers.exc)), (cls, got, over_grpc)
            assert getattr(got, "shortfall_bytes", None) == getattr(over_grpc, "shortfall_bytes", None) == getattr(handlers.exc, "shortfall_bytes", None)
            assert getattr(got, "holders", None) == getattr(over_grpc, "holders", None) == getattr(handlers.exc, "holders", None)
            assert getattr(got, "retry_after_s", None) == getattr(over_grpc, "retry_after_s", None) == getattr(handlers.exc, "retry_after_s", None)
