"""Issue 16: the decode engine reads a READY transfer on its daemon's doorbell board instead of
asking (no WaitReady call), over the engine socket; anything else -- not ready yet, failed, a
client without the board, a request freed -- still asks the daemon and hears the same answer."""

from __future__ import annotations

import daemon_kit as dk
import grpc

from kvd import errors as E
from kvd.client import TransferState


def test_a_ready_transfer_is_read_on_its_doorbell_without_a_call(hp):
    rid = dk.rid("bell")
    hp.p.alloc(rid, 70)
    dst, lease = hp.d.c.allocate_recv(rid, 70)
    hp.d.live.add(rid)
    assert hp.d.c.transport == "fast" and lease.bell > 0, lease
    assert hp.d.c.doorbell(rid) is TransferState.WAITING and hp.d.c.doorbell("not-" + rid) is None
    calls = dk.counted(hp.d.c)
    assert hp.d.c.wait_ready(rid, 0).state is TransferState.WAITING  # not ready: the daemon answers
    assert calls == ["WaitReady"]
    r = hp.p.c.send(rid, lease.ticket, free=True)
    hp.p.live.discard(rid)
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is TransferState.READY and st.nbytes == r.nbytes and st.reason == "", st
    assert calls == ["WaitReady"]  # read on the doorbell: no call
    assert hp.d.c.doorbell(rid) is TransferState.READY
    assert hp.d.free(rid) == 1
    assert hp.d.c.doorbell(rid) is None  # freed: its doorbell is forgotten
    with dk.expect(E.NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        hp.d.c.wait_ready(rid, 0)  # the daemon answers
    hp.check()


def test_a_failed_transfer_is_told_by_the_daemon_with_its_reason(hp):
    rid, src, dst, lease = hp.setup_request(24, prefix="bell-failed")
    assert lease.bell > 0
    assert hp.d.c.abort(rid, "the decode engine gave up") is False  # no sender began
    assert hp.d.c.doorbell(rid) is TransferState.FAILED
    calls = dk.counted(hp.d.c)
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is TransferState.FAILED and "gave up" in st.reason, st
    assert calls == ["WaitReady"]
    hp.p.free(rid)
    hp.d.free(rid)
    hp.check()


def test_a_client_without_the_board_asks_the_daemon(hp):
    rid = dk.rid("bell-grpc")
    hp.p.alloc(rid, 40)
    g = hp.pair.decode.connect("decode-grpc", transport="grpc")
    _, lease = g.allocate_recv(rid, 40)
    assert lease.bell > 0 and g.doorbell(rid) is None  # the slot is named, but gRPC maps no board
    r = hp.p.c.send(rid, lease.ticket, free=True)
    hp.p.live.discard(rid)
    calls = dk.counted(g)
    st = g.wait_ready(rid, 5)
    assert st.state is TransferState.READY and st.nbytes == r.nbytes
    assert calls == ["WaitReady"]
    assert g.free(rid) == 1
    hp.check()
