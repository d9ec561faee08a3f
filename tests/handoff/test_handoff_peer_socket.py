"""The peer socket between two real daemons (``kvd/server/peer_socket.py``): a Send whose ticket
names the decode daemon's peer socket makes CheckTicket and Commit there, not over gRPC, with
the same bytes landing; a refusal reads the same either way; a socket that belongs to another
daemon, or none at all, leaves the Send on gRPC; a wrong token is refused as over gRPC; a daemon
that serves no peer socket is reached over gRPC.

Tickets are sealed (``kvd/ticket.py``), so a test cannot reroute one by rewriting its
``peer_socket``: the gRPC way is a second decode daemon serving no peer socket (``bare`` / ``hg``
of conftest), or, for a field check behind the seal, a ticket the in-process daemon seals again.

Which path a call took is read from the daemons' metrics: ``kvd_peer_calls_total{method, path}``
on the caller, ``kvd_peer_socket_calls_total{method, code}`` and the gRPC
``kvd_rpc_duration_seconds_count{method, code}`` on the receiver. Framing and the caller's pool
are tested without daemons in ``tests/test_peer_socket.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import daemon_kit as dk
import handoff_kit as hk
import os

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


def _refused(engine: hk.Engine, rid: str, ticket: bytes) -> KvdError:
    """The error a Send of ``ticket`` by ``engine`` raises."""
    with pytest.raises(KvdError) as info:
        engine.c.send(rid, ticket)
    return info.value


def _bump(field: str) -> Callable[[pb.Ticket], None]:
    """An edit moving the integer ``field`` of a ticket 1000 on."""
    return lambda t: setattr(t, field, getattr(t, field) + 1000)


def test_a_send_goes_over_the_peer_socket_and_lands_as_over_grpc(hp, hg):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    assert hk.ticket_body(lease.ticket).peer_socket == hp.pair.decode.peer_socket
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    p0, d0 = _calls(hp.pair.prefill), _calls(hp.pair.decode)

    hp.p.c.send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    over_socket = hp.d.arena.clone()
    exp = hk.expected_arena(before_d, before_p, hk.moved(src, dst, TOKENS, state=True))
    assert torch.equal(over_socket, exp), hk.diff_summary(over_socket, exp)
    assert _since(hp.pair.prefill, p0) == {("made", "CheckTicket", "socket"): 1, ("made", "Commit", "socket"): 1}
    assert _since(hp.pair.decode, d0) == {("socket", "CheckTicket", "OK"): 1, ("socket", "Commit", "OK"): 1}

    # The same request again, to a decode daemon serving no peer socket (its ticket names none):
    # over gRPC, and the same bytes land, page for page, in its own pages.
    dst2 = hg.alloc(rid, TOKENS, receive=True)
    hk.randomize(hg.arena, hp.seed + 2)
    before_g = hg.arena.clone()
    again = hg.c.acquire_lease(rid, "recv")
    assert hk.ticket_body(again.ticket).peer_socket == ""
    p1, g1 = _calls(hp.pair.prefill), _calls(hg.side)
    hp.p.c.send(rid, again.ticket)
    assert hg.c.wait_ready(rid, 5).state is READY
    pages2 = hk.moved(src, dst2, TOKENS, state=True)
    exp2 = hk.expected_arena(before_g, before_p, pages2)
    assert torch.equal(hg.arena, exp2), hk.diff_summary(hg.arena, exp2)
    for g, (_, d) in hk.moved(src, dst, TOKENS, state=True).items():
        got, want = hk.rows(hg.arena, hk.PB[g])[pages2[g][1].long()], hk.rows(over_socket, hk.PB[g])[d.long()]
        assert torch.equal(got, want), f"group {g}: the bytes over gRPC differ from those over the socket"
    assert _since(hp.pair.prefill, p1) == {("made", "CheckTicket", "grpc"): 1, ("made", "Commit", "grpc"): 1}
    assert _since(hg.side, g1) == {("grpc", "CheckTicket", "OK"): 1, ("grpc", "Commit", "OK"): 1}
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 0 and hg.c.stats().leases_live == 0
    hp.check()
    hg.assert_accounted()


def test_a_refused_ticket_reads_the_same_over_the_socket_and_grpc(hp, hg):
    """The same refusal over the decode daemon's peer socket and over gRPC (to ``hg``'s daemon,
    which serves none, for the same request): a rewritten field breaks the seal; in-process, the
    field checks behind the seal too (the daemon seals the edit again, once naming no socket); a
    ticket of another boot goes over gRPC both times."""
    rid, src, dst, lease = hp.setup_request(40)
    hg.alloc(rid, 40, receive=True)
    hk.randomize(hg.arena, hp.seed + 2)
    bare = hg.c.acquire_lease(rid, "recv")
    before_d, before_g = hp.d.arena.clone(), hg.arena.clone()
    p_used, d_used, g_used = hp.p.used(), hp.d.used(), hg.used()
    decode, other = hp.pair.decode, hg.side
    for field in ("lease_id", "epoch"):
        d0, g0 = _calls(decode), _calls(other)
        over_socket = _refused(hp.p, rid, hk.tampered(lease.ticket, _bump(field)))
        over_grpc = _refused(hp.p, rid, hk.tampered(bare.ticket, _bump(field)))
        assert type(over_socket) is type(over_grpc) is PermissionDenied, (over_socket, over_grpc)
        assert str(over_socket) == str(over_grpc) and "seal" in str(over_socket), (str(over_socket), str(over_grpc))
        assert _since(decode, d0) == {("socket", "CheckTicket", "PERMISSION_DENIED"): 1}, field
        assert _since(other, g0) == {("grpc", "CheckTicket", "PERMISSION_DENIED"): 1}, field

    if decode.mode == "inproc":  # only an in-process daemon's key can seal an edit
        for field, cls, code in (("lease_id", NotFound, "NOT_FOUND"), ("epoch", StaleEpoch, "FAILED_PRECONDITION")):
            edit = _bump(field)
            via_socket = hk.resealed(decode, lease.ticket, edit)
            via_grpc = hk.resealed(decode, lease.ticket, lambda t, edit=edit: (edit(t), setattr(t, "peer_socket", "")))
            d0 = _calls(decode)
            over_socket, over_grpc = _refused(hp.p, rid, via_socket), _refused(hp.p, rid, via_grpc)
            assert type(over_socket) is type(over_grpc) is cls, (over_socket, over_grpc)
            assert str(over_socket) == str(over_grpc), (str(over_socket), str(over_grpc))
            assert _since(decode, d0) == {("socket", "CheckTicket", code): 1, ("grpc", "CheckTicket", code): 1}

    # A ticket from another boot names the socket of a daemon that is not that boot: the hello
    # fails, the CheckTicket goes over gRPC, and the socket never sees it. The refusal names the
    # boot of the daemon that refused it, and reads the same otherwise.
    def another(t: pb.Ticket) -> None:
        t.boot_id = "a-boot-that-never-was"

    d0, g0 = _calls(decode), _calls(other)
    over_socket = _refused(hp.p, rid, hk.tampered(lease.ticket, another))
    over_grpc = _refused(hp.p, rid, hk.tampered(bare.ticket, another))
    boot_d, boot_g = hk.ticket_body(lease.ticket).boot_id, hk.ticket_body(bare.ticket).boot_id
    assert type(over_socket) is type(over_grpc) is StaleEpoch and boot_d in str(over_socket)
    assert str(over_socket).replace(boot_d, boot_g) == str(over_grpc), (str(over_socket), str(over_grpc))
    assert _since(decode, d0) == {("grpc", "CheckTicket", "FAILED_PRECONDITION"): 1}
    assert _since(other, g0) == {("grpc", "CheckTicket", "FAILED_PRECONDITION"): 1}

    # Every pool as it was: nothing written, the transfers still waiting, no SEND lease.
    assert torch.equal(hp.d.arena, before_d) and torch.equal(hg.arena, before_g)
    assert hp.d.c.wait_ready(rid, 0).state is WAITING and hg.c.wait_ready(rid, 0).state is WAITING
    assert hp.p.used() == p_used and hp.d.used() == d_used and hg.used() == g_used
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 1 and hg.c.stats().leases_live == 1
    hp.check()
    hp.p.c.send(rid, lease.ticket)  # the real tickets still work: over the socket, over gRPC
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.p.c.send(rid, bare.ticket)
    assert hg.c.wait_ready(rid, 5).state is READY
    hp.check()
    hg.assert_accounted()


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
def test_a_socket_of_another_daemon_or_none_leaves_the_send_on_grpc(hp, where, tmp_path):
    """The ticket names the decode daemon's peer socket, but at that path the sender reaches the
    prefill daemon's own socket (as it would with the decode daemon on another host, serving the
    same path) or nothing. The decode daemon is one of the test's own: the prefill daemon leaves a
    route that failed to gRPC for a while, and the shared pair's routes must stay as they are."""
    lone = hk.sibling(hp.pair.decode, tmp_path, "decode-lone")
    e = hk.Engine(lone, "decode-engine-lone")
    try:
        rid = dk.rid("req")
        src = hp.p.alloc(rid, TOKENS)
        dst = e.alloc(rid, TOKENS, receive=True)
        hk.randomize(hp.p.arena, hp.seed)
        hk.randomize(e.arena, hp.seed + 1)
        lease = e.c.acquire_lease(rid, "recv")
        path = hk.ticket_body(lease.ticket).peer_socket
        assert path == lone.peer_socket and Path(path).exists()
        own = hp.pair.prefill.peer_socket
        assert where != "the prefill daemon's own" or Path(own).exists()
        before_d, before_p = e.arena.clone(), hp.p.arena.clone()
        p0, d0 = _calls(hp.pair.prefill), _calls(lone)
        os.rename(path, path + ".aside")  # the decode daemon still listens, on the inode moved aside
        try:
            if where.startswith("the"):
                os.symlink(own, path)
            hp.p.c.send(rid, lease.ticket)
        finally:
            if os.path.islink(path):
                os.unlink(path)
            os.rename(path + ".aside", path)
        assert e.c.wait_ready(rid, 5).state is READY
        exp = hk.expected_arena(before_d, before_p, hk.moved(src, dst, TOKENS, state=True))
        assert torch.equal(e.arena, exp), hk.diff_summary(e.arena, exp)
        # The prefill daemon's own socket refused the hello (another boot expected): it answered
        # no call, and everything went over gRPC.
        assert _since(hp.pair.prefill, p0) == {("made", "CheckTicket", "grpc"): 1, ("made", "Commit", "grpc"): 1}
        assert _since(lone, d0) == {("grpc", "CheckTicket", "OK"): 1, ("grpc", "Commit", "OK"): 1}
        hp.check()
        e.assert_accounted()
        lone.t.check()
    finally:
        e.close_attachment()
        assert lone.stop() == 0


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
    gs = hk.sibling(ds, tmp_path, "decode-bare", peer_socket="")  # the same token, no peer socket: gRPC
    g = hk.Engine(gs, "decode-engine-grpc")
    try:
        lease = _request(p, d, "r1")
        g.alloc("r1", 40, receive=True)
        bare = g.c.acquire_lease("r1", "recv")
        assert hk.ticket_body(bare.ticket).peer_socket == ""
        stats, g_stats = d.c.stats(), g.c.stats()
        over_socket, over_grpc = [], []
        for blob, out in ((lease.ticket, over_socket), (bare.ticket, over_grpc)):
            with pytest.raises(PermissionDenied) as info:
                p.c.send("r1", blob)
            out.append(str(info.value))
        assert over_socket == over_grpc and "configure the same peer_token" in over_socket[0]
        # Refused at the hello: no call reached the decode node, which is as it was; the other
        # refused the CheckTicket over gRPC and is as it was too.
        assert ds.t.daemon.peer_socket.answered() == {} and ds.t.daemon.peer_socket.refused >= 1
        assert d.c.stats() == stats and d.c.wait_ready("r1", 0).state is WAITING
        assert g.c.stats() == g_stats and g.c.wait_ready("r1", 0).state is WAITING
        assert p.c.stats().leases_live == 0
    finally:
        _stop(ps, ds, gs)


def test_a_decode_daemon_without_a_peer_socket_is_reached_over_grpc(tmp_path):
    ps, ds, p, d = _pair(tmp_path, {}, {"peer_socket": ""})
    try:
        assert ds.t.daemon.peer_socket is None and not Path(ds.peer_socket).exists()
        assert "peer-socket" not in d.c.info().capabilities and "peer-socket" in p.c.info().capabilities
        lease = _request(p, d, "r1")
        assert hk.ticket_body(lease.ticket).peer_socket == ""
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
