"""The engine socket advertised (issue 16): OpenSession's reply and PoolInfo say where the daemon
serves it, and a client that found none beside its address moves its session there."""

from __future__ import annotations

import asyncio
import os

import grpc
from daemon_kit import rid, start_inproc, stop_inproc

from kvd.client import AsyncClient, Client
from kvd.rpc.convert import grpc_target
from kvd.rpc.engine_wire import fast_path
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc


def _alias(target, tmp_path) -> str:
    """A second name for the daemon's gRPC socket, with no ``.fast`` beside it: the convention
    finds nothing there, only the advertisement can."""
    link = tmp_path / "alias" / "kvd.sock"
    link.parent.mkdir()
    link.symlink_to(target.unix.removeprefix("unix:"))
    assert not os.path.exists(fast_path(str(link)))
    return f"unix:{link}"


def test_session_and_info_name_the_engine_socket(inproc):
    want = fast_path(os.path.abspath(inproc.unix.removeprefix("unix:")))
    with grpc.insecure_channel(grpc_target(inproc.unix)) as ch:
        s = pb_grpc.KvdStub(ch).OpenSession(pb.OpenSessionRequest(name="raw"), timeout=5)
    assert s.engine_socket == want
    assert inproc.connect().info().engine_socket == want


def test_no_engine_socket_advertises_none(tmp_path):
    t = start_inproc(tmp_path, fast_socket=False)
    try:
        c = t.connect(transport="auto")
        assert c.transport == "grpc" and c.info().engine_socket == ""
    finally:
        stop_inproc(t)


def test_a_client_moves_its_session_to_the_advertised_socket(inproc, tmp_path):
    addr = _alias(inproc, tmp_path)
    c = Client.connect(addr, name="aliased")
    inproc.clients.append(c)
    assert c.transport == "fast"  # without the advertisement: "grpc" (nothing beside the alias)
    r = rid("adv")
    vec, lease = c.allocate_recv(r, 64)
    assert vec.tokens == 64 and lease.ticket
    assert inproc.node.stats().sessions_live == 1  # the session gRPC opened, not a second one
    c.release_lease(lease.lease_id)
    assert c.free(r) == 1
    forced = Client.connect(addr, transport="grpc")
    inproc.clients.append(forced)
    assert forced.transport == "grpc"  # forced gRPC stays there


def test_the_async_client_moves_too(inproc, tmp_path):
    addr = _alias(inproc, tmp_path)

    async def go():
        async with await AsyncClient.connect(addr, name="aliased-async") as c:
            assert c.transport == "fast"
            assert await c.echo(b"x") == b"x"

    asyncio.run(go())


def test_another_daemons_socket_at_the_advertised_path_keeps_grpc(inproc, tmp_path):
    (tmp_path / "other").mkdir()
    other = start_inproc(tmp_path / "other")
    try:
        assert inproc.daemon is not None and inproc.daemon.engine_socket is not None
        # A wrong advertisement: the hello names a session the other daemon never opened.
        inproc.daemon.engine_socket.service.endpoint.engine_socket = fast_path(other.unix.removeprefix("unix:"))
        c = Client.connect(_alias(inproc, tmp_path), name="misled")
        inproc.clients.append(c)
        assert c.transport == "grpc"
        assert c.info().boot_id == inproc.node.pool.boot_id
        assert other.node.stats().sessions_live == 0
    finally:
        stop_inproc(other)
