"""The peer socket between two real daemons (``kvd/server/peer_socket.py``): a Send whose ticket
names the decode daemon's peer socket makes CheckTicket and Commit there, not over gRPC, with
the same bytes landing; a refusal reads the same either way; a socket that belongs to another
daemon, or none at all, leaves the Send on gRPC; a wrong token is refused as over gRPC; a daemon
that serves no peer socket is reached over gRPC.

Which path a call took is read from the daemons' metrics: ``kvd_peer_calls_total{method, path}``
on the caller, ``kvd_peer_socket_calls_total{method, code}`` and the gRPC
``kvd_rpc_duration_seconds_count{method, code}`` on the receiver. Framing and the caller's pool
are tested without daemons in ``tests/test_peer_socket.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import daemon_kit as dk
import handoff_kit as hk
import pytest
import torch

from kvd.client import TransferState
from kvd.errors import KvdError, NotFound, PermissionDenied, StaleEpoch
from kvd.v1 import kvd_pb2 as pb

READY, WAITING = TransferState.READY, TransferState.WAITING
TOKENS = 103
HOT = ("CheckTicket", "Commit")


def _calls(side: hk.Side, methods: tuple[str, ...] = HOT) -> Counter:
    """Peer calls (CheckTicket and Commit unless told) ``side`` made by path, and answered by way
    and code: ``("made", method, "socket"|"grpc")``, ``("socket", method, code)``, ``("grpc", method, code)``."""
    out: Counter = Counter()
    for (name, labels), v in side.samples().items():
        lab = dict(labels)
        if lab.get("method") not in methods:
            continue
        if name == "kvd_peer_calls_total":
            out[("made", lab["method"], lab["path"])] += int(v)
        elif name == "kvd_peer_socket_calls_total":
            out[("socket", lab["method"], lab["code"])] += int(v)
        elif name == "kvd_rpc_duration_seconds_count":
            out[("grpc", lab["method"], lab["code"])] += int(v)
    return out


def _since(side: hk.Side, before: Counter, methods: tuple[str, ...] = HOT) -> dict:
    return dict(_calls(side, methods) - before)


def _route(ticket: bytes, path: str) -> bytes:
    """The ticket with another peer socket path ("": none, as a daemon without one issues)."""
    t = pb.Ticket.FromString(ticket)
    t.peer_socket = path
    return t.SerializeToString()


def _both_ways(hp, rid: str, ticket: bytes) -> tuple[KvdError, KvdError]:
    """The error a Send of ``ticket`` raises over the peer socket, then over gRPC."""
    errs = []
    for blob in (ticket, _route(ticket, "")):
        with pytest.raises(KvdError) as info:
            hp.p.c.send(rid, blob)
        errs.append(info.value)
    return errs[0], errs[1]


def test_a_send_goes_over_the_peer_socket_and_lands_as_over_grpc(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    assert pb.Ticket.FromString(lease.ticket).peer_socket == hp.pair.decode.peer_socket
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    p0, d0 = _calls(hp.pair.prefill), _calls(hp.pair.decode)

    hp.p.c.send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    over_socket = hp.d.arena.clone()
    exp = hk.expected_arena(before_d, before_p, hk.moved(src, dst, TOKENS, state=True))
    assert torch.equal(over_socket, exp), hk.diff_summary(over_socket, exp)
    assert _since(hp.pair.prefill, p0) == {("made", "CheckTicket", "socket"): 1, ("made", "Commit", "socket"): 1}
    assert _since(hp.pair.decode, d0) == {("socket", "CheckTicket", "OK"): 1, ("socket", "Commit", "OK"): 1}

    # The same request again into the same pages, its ticket naming no peer socket: gRPC.
    hp.d.arena.copy_(before_d)
    again = hp.d.c.acquire_lease(rid, "recv")
    p1, d1 = _calls(hp.pair.prefill), _calls(hp.pair.decode)
    hp.p.c.send(rid, _route(again.ticket, ""))
    assert hp.d.c.wait_ready(rid, 5).state is READY
    assert torch.equal(hp.d.arena, over_socket), hk.diff_summary(hp.d.arena, over_socket)
    assert _since(hp.pair.prefill, p1) == {("made", "CheckTicket", "grpc"): 1, ("made", "Commit", "grpc"): 1}
    assert _since(hp.pair.decode, d1) == {("grpc", "CheckTicket", "OK"): 1, ("grpc", "Commit", "OK"): 1}
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 0
    hp.check()


def test_a_refused_ticket_reads_the_same_over_the_socket_and_grpc(hp):
    rid, src, dst, lease = hp.setup_request(40)
    before_d = hp.d.arena.clone()
    p_used, d_used = hp.p.used(), hp.d.used()
    t = pb.Ticket.FromString(lease.ticket)
    cases = [("lease_id", t.lease_id + 1000, NotFound, "NOT_FOUND"), ("epoch", t.epoch + 1000, StaleEpoch, "FAILED_PRECONDITION")]
    for field, value, cls, code in cases:
        forged = pb.Ticket.FromString(lease.ticket)
        setattr(forged, field, value)
        d0 = _calls(hp.pair.decode)
        over_socket, over_grpc = _both_ways(hp, rid, forged.SerializeToString())
        assert type(over_socket) is type(over_grpc) is cls, (over_socket, over_grpc)
        assert str(over_socket) == str(over_grpc), (str(over_socket), str(over_grpc))
        assert _since(hp.pair.decode, d0) == {("socket", "CheckTicket", code): 1, ("grpc", "CheckTicket", code): 1}

    # A ticket from another boot names the socket of a daemon that is not that boot: the hello
    # fails, the CheckTicket goes over gRPC, and the socket never sees it.
    forged = pb.Ticket.FromString(lease.ticket)
    forged.boot_id = "a-boot-that-never-was"
    d0 = _calls(hp.pair.decode)
    over_socket, over_grpc = _both_ways(hp, rid, forged.SerializeToString())
    assert type(over_socket) is type(over_grpc) is StaleEpoch and str(over_socket) == str(over_grpc)
    assert _since(hp.pair.decode, d0) == {("grpc", "CheckTicket", "FAILED_PRECONDITION"): 2}

    # Both pools as they were: nothing written, the transfer still waiting, no SEND lease.
    assert torch.equal(hp.d.arena, before_d)
    assert hp.d.c.wait_ready(rid, 0).state is WAITING
    assert hp.p.used() == p_used and hp.d.used() == d_used
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 1
    hp.check()
    hp.p.c.send(rid, lease.ticket)  # the real ticket still works, over the socket
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.check()


def test_heartbeats_take_the_socket_too(hp):
    """Between chunks the sender's heartbeats go where its CheckTicket and Commit went: the
    receiver's liveness is judged on the path the transfer uses."""
    rid, src, dst, lease = hp.setup_request(TOKENS)
    beat = ("Heartbeat",)
    hp.p.c.send(rid, lease.ticket, end=40, last=False)
    d0 = _calls(hp.pair.decode, beat)
    dk.wait_for(lambda: _since(hp.pair.decode, d0, beat).get(("socket", "Heartbeat", "OK"), 0) >= 2, 5.0, "two heartbeats on the socket")
    hp.p.c.send(rid, lease.ticket, start=40, last=True)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    assert not [k for k in _since(hp.pair.decode, d0, beat) if k[0] == "grpc"], "a heartbeat went over gRPC"
    hp.check()


@pytest.mark.parametrize("where", ["the prefill daemon's own", "nobody's"])
def test_a_socket_of_another_daemon_or_none_leaves_the_send_on_grpc(hp, where):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    path = hp.pair.prefill.peer_socket if where.startswith("the") else "/nonexistent/kvd.sock.peer"
    assert where != "the prefill daemon's own" or Path(path).exists()
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    p0, d0 = _calls(hp.pair.prefill), _calls(hp.pair.decode)
    hp.p.c.send(rid, _route(lease.ticket, path))
    assert hp.d.c.wait_ready(rid, 5).state is READY
    exp = hk.expected_arena(before_d, before_p, hk.moved(src, dst, TOKENS, state=True))
    assert torch.equal(hp.d.arena, exp), hk.diff_summary(hp.d.arena, exp)
    # The prefill daemon's own socket refused the hello (another boot expected): it answered
    # no call, and everything went over gRPC.
    assert _since(hp.pair.prefill, p0) == {("made", "CheckTicket", "grpc"): 1, ("made", "Commit", "grpc"): 1}
    assert _since(hp.pair.decode, d0) == {("grpc", "CheckTicket", "OK"): 1, ("grpc", "Commit", "OK"): 1}
    hp.check()


# ---- daemons configured otherwise --------------------------------------------------------------------


def _pair(root: Path, prefill: dict, decode: dict) -> tuple[hk.Side, hk.Side, hk.Engine, hk.Engine]:
    """Two in-process daemons set apart by ``prefill`` / ``decode``, and an engine session on each."""
    pair = hk.make_pair(root, "local", "inproc", prefill=prefill, decode=decode)
    return pair.prefill, pair.decode, hk.Engine(pair.prefill, "prefill-engine"), hk.Engine(pair.decode, "decode-engine")


def _request(p: hk.Engine, d: hk.Engine, rid: str, tokens: int = 40):
    p.alloc(rid, tokens)
    d.alloc(rid, tokens, receive=True)
    return d.c.acquire_lease(rid, "recv")


def _stop(*sides: hk.Side) -> None:
    for s in sides:
        s.t.check()
        assert s.stop() == 0


def test_a_wrong_token_is_refused_the_same_both_ways(tmp_path):
    ps, ds, p, d = _pair(tmp_path, {"peer_token": "wrong"}, {"peer_token": "s3cret"})
    try:
        lease = _request(p, d, "r1")
        stats = d.c.stats()
        over_socket, over_grpc = [], []
        for blob, out in ((lease.ticket, over_socket), (_route(lease.ticket, ""), over_grpc)):
            with pytest.raises(PermissionDenied) as info:
                p.c.send("r1", blob)
            out.append(str(info.value))
        assert over_socket == over_grpc and "configure the same peer_token" in over_socket[0]
        # Refused at the hello: no call reached the decode node, which is as it was.
        assert ds.t.daemon.peer_socket.answered() == {} and ds.t.daemon.peer_socket.refused >= 1
        assert d.c.stats() == stats and d.c.wait_ready("r1", 0).state is WAITING
        assert p.c.stats().leases_live == 0
    finally:
        _stop(ps, ds)


def test_a_decode_daemon_without_a_peer_socket_is_reached_over_grpc(tmp_path):
    ps, ds, p, d = _pair(tmp_path, {}, {"peer_socket": ""})
    try:
        assert ds.t.daemon.peer_socket is None and not Path(ds.peer_socket).exists()
        assert "peer-socket" not in d.c.info().capabilities and "peer-socket" in p.c.info().capabilities
        lease = _request(p, d, "r1")
        assert pb.Ticket.FromString(lease.ticket).peer_socket == ""
        p.c.send("r1", lease.ticket)
        assert d.c.wait_ready("r1", 5).state is READY
        assert ps.t.daemon.link.calls() == {("CheckTicket", "grpc"): 1, ("Commit", "grpc"): 1}
    finally:
        _stop(ps, ds)


def test_the_decode_daemon_killed_with_a_socket_connection_held(hp):
    """The first chunk goes over the socket (its connection stays pooled); the decode daemon
    dies; the next chunk fails as Unavailable or Aborted, no lease or page left behind (the
    failure tests cover the restart; this pins that the socket was in use when it died)."""
    rid, src, dst, lease = hp.setup_request(TOKENS)
    p0 = _calls(hp.pair.prefill)
    hp.p.c.send(rid, lease.ticket, end=40, last=False)
    assert _since(hp.pair.prefill, p0) == {("made", "CheckTicket", "socket"): 1, ("made", "Commit", "socket"): 1}
    p_used = hp.p.used()
    hp.pair.decode.kill()
    with pytest.raises(KvdError) as info:
        hp.p.c.send(rid, lease.ticket, start=40, last=True)
    assert type(info.value).__name__ in ("Unavailable", "Aborted"), info.value
    dk.wait_for(lambda: hp.p.c.stats().leases_live == 0, 3.0, "the SEND lease released")
    assert hp.p.used() == p_used
    hp.p.assert_accounted()
    if hp.pair.prefill.node is not None:
        hp.pair.prefill.node.check()
    hp.pair.decode.restart()
    hp.d.reconnect()
