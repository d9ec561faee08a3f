"""Who may touch a transfer (issue 13 part 6): only its owner, and only the sender that began it.

* Prefill side: a session that does not hold the request, sending with the owner's untampered
  ticket (Send, SendMany, BeginSend), is refused PermissionDenied before it touches the owner's
  open transfer: the decode side stays RECEIVING with its RECV lease, and the owner's next Send
  lands.
* Decode side (the Peer service, raw gRPC as another daemon would call it): a Commit or
  AbortReceive is honoured only from the sender that began the transfer with CheckTicket (the
  ``sender`` both carry). A Commit on a WAITING transfer (no data can have arrived) or from
  another sender, an AbortReceive of a WAITING transfer or from another sender, and a CheckTicket
  of a transfer another sender began are FailedPrecondition, nothing changed; another sender's
  heartbeat does not keep the transfer alive (it is answered as dead to that sender).

One in-process pair (backend local), so that ``Node.check()`` runs after each test.
"""

from __future__ import annotations

import daemon_kit as dk
import grpc
import handoff_kit as hk
import pytest

from kvd.client import TransferState
from kvd.errors import PermissionDenied
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

WAITING, RECEIVING, READY, FAILED = TransferState.WAITING, TransferState.RECEIVING, TransferState.READY, TransferState.FAILED


@pytest.fixture(scope="module")
def rpair(tmp_path_factory):
    p = hk.make_pair(tmp_path_factory.mktemp("peer-rules"), "local", "inproc")
    yield p
    for s in p.sides:
        s.stop()


@pytest.fixture
def engines(rpair):
    p, d = hk.Engine(rpair.prefill, "prefill-engine"), hk.Engine(rpair.decode, "decode-engine")
    yield p, d
    for e in (p, d):
        e.close_attachment()
    for s in rpair.sides:
        s.t.close_clients()
        dk.wait_for(lambda s=s: s.node.stats().leases_live == 0 and s.node.stats().pool.requests_live == 0, hk.FENCE_S + 3.0,
                    f"{s.role}: everything of the test gone")
        s.node.check()


def test_another_session_cannot_send_in_or_end_the_owners_open_transfer(rpair, engines):
    p, d = engines
    rid = dk.rid("owned")
    src = p.alloc(rid, 70)
    dst = d.alloc(rid, 70, receive=True)
    hk.randomize(p.arena, 1)
    hk.randomize(d.arena, 2)
    before_d, before_p = d.arena.clone(), p.arena.clone()
    lease = d.c.acquire_lease(rid, "recv")
    assert p.c.begin_send(rid, lease.ticket) is True
    first = p.c.send(rid, lease.ticket, start=0, end=40, last=False)

    intruder = rpair.prefill.connect("intruder")
    for attempt in (
        lambda: intruder.send(rid, lease.ticket, start=40, last=True),
        lambda: intruder.send(rid, lease.ticket, start=0, end=40, last=False),
        lambda: intruder.begin_send(rid, lease.ticket),
    ):
        with pytest.raises(PermissionDenied, match="another client session"):
            attempt()
    (out,) = intruder.send_many([(rid, lease.ticket)])
    assert isinstance(out, PermissionDenied), out
    # The owner's transfer is untouched: still receiving, its RECV lease live, nothing aborted.
    assert d.c.wait_ready(rid, 0).state is RECEIVING
    assert d.c.stats().leases_live == 1
    assert _only_first_chunk_landed(p, d, src, dst, before_d, before_p)

    last = p.c.send(rid, lease.ticket, start=40, last=True)
    st = d.c.wait_ready(rid, 5)
    assert st.state is READY and st.nbytes == first.nbytes + last.nbytes, st
    pages = hk.moved(src, dst, dst.tokens, state=True)
    exp = hk.expected_arena(before_d, p.arena, pages)
    assert bool((d.arena == exp).all()), hk.diff_summary(d.arena, exp)
    intruder.close()
    p.free(rid)
    d.free(rid)


def _only_first_chunk_landed(p, d, src, dst, before_d, before_p) -> bool:
    """The decode arena holds exactly the first chunk's pages (tokens [0, 40)) and the prefill
    arena is unchanged: the intruder's calls wrote nothing."""
    exp = hk.expected_arena(before_d, p.arena, hk.moved(src, dst, 40, state=False))
    return bool((d.arena == exp).all()) and bool((p.arena == before_p).all())


# ---- the receiver's rules (Peer service) --------------------------------------------------------


def _ref(ticket: bytes) -> pb.TransferRef:
    t = hk.ticket_body(ticket)
    return pb.TransferRef(boot_id=t.boot_id, lease_id=t.lease_id, rid=t.rid)


def _refused(call, match: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.code() is grpc.StatusCode.FAILED_PRECONDITION, exc.value
    assert match in exc.value.details(), exc.value.details()


def test_commit_and_abort_only_from_the_sender_that_began(rpair, engines):
    _, d = engines
    peer = pb_grpc.PeerStub(grpc.insecure_channel(rpair.decode.t.tcp))
    a, w = dk.rid("begun"), dk.rid("waiting")
    for rid in (a, w):
        d.alloc(rid, 24, receive=True)
    ta, tw = (d.c.acquire_lease(rid, "recv").ticket for rid in (a, w))
    ra, rw = _ref(ta), _ref(tw)

    # WAITING: nobody began, so nobody may commit it (it would be READY without data) or abort it.
    _refused(lambda: peer.Commit(pb.CommitRequest(ref=rw, last=True, bytes=1, sender="s-a")), "no sender has begun")
    _refused(lambda: peer.AbortReceive(pb.PeerAbortRequest(ref=rw, reason="x", drained=True, sender="s-a")), "no sender has begun")
    assert d.c.wait_ready(w, 0).state is WAITING

    # Begun by s-a: another sender may neither begin it again, commit it, nor abort it.
    peer.CheckTicket(pb.CheckTicketRequest(ticket=ta, sender="s-a"))
    _refused(lambda: peer.CheckTicket(pb.CheckTicketRequest(ticket=ta, sender="s-b")), "one sender per request")
    _refused(lambda: peer.Commit(pb.CommitRequest(ref=ra, last=True, bytes=1, sender="s-b")), "begun by sender 's-a'")
    _refused(lambda: peer.Commit(pb.CommitRequest(ref=ra, last=True, bytes=1)), "begun by sender 's-a'")
    _refused(lambda: peer.AbortReceive(pb.PeerAbortRequest(ref=ra, reason="x", drained=True, sender="s-b")), "begun by sender 's-a'")
    # s-b's heartbeat is told the transfer is not its own (dead to it) and keeps nothing alive.
    assert list(peer.Heartbeat(pb.HeartbeatRequest(sender="s-b", refs=[ra])).dead_lease_ids) == [ra.lease_id]
    st = d.c.wait_ready(a, 0)
    assert st.state is RECEIVING and st.nbytes == 0, st
    assert d.c.stats().leases_live == 2

    # The sender that began it: its commit counts, the last one makes it READY.
    peer.Commit(pb.CommitRequest(ref=ra, last=False, bytes=7, sender="s-a"))
    peer.Commit(pb.CommitRequest(ref=ra, last=True, bytes=5, sender="s-a"))
    st = d.c.wait_ready(a, 0)
    assert st.state is READY and st.nbytes == 12, st
    d.c.release_lease(hk.ticket_body(tw).lease_id)
    d.free(a, w)
    rpair.decode.node.check()


def test_the_sender_that_began_may_abort_and_its_drained_abort_ends_the_fence(rpair, engines):
    _, d = engines
    peer = pb_grpc.PeerStub(grpc.insecure_channel(rpair.decode.t.tcp))
    rid = dk.rid("abort")
    d.alloc(rid, 24, receive=True)
    t = d.c.acquire_lease(rid, "recv").ticket
    ref = _ref(t)
    peer.CheckTicket(pb.CheckTicketRequest(ticket=t, sender="s-a"))
    peer.AbortReceive(pb.PeerAbortRequest(ref=ref, reason="mid-way", drained=False, sender="s-a"))
    st = d.c.wait_ready(rid, 0)
    assert st.state is FAILED and "mid-way" in st.reason, st
    assert d.c.stats().leases_live == 1  # fenced: its writes may still land
    _refused(lambda: peer.AbortReceive(pb.PeerAbortRequest(ref=ref, reason="x", drained=True, sender="s-b")), "begun by sender 's-a'")
    assert d.c.stats().leases_live == 1
    peer.AbortReceive(pb.PeerAbortRequest(ref=ref, reason="drained now", drained=True, sender="s-a"))
    assert d.c.stats().leases_live == 0  # the fence ended at once, not fence_s later
    d.free(rid)
