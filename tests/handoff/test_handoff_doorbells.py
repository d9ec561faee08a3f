"""Issue 16: the decode engine reads a READY transfer on its daemon's doorbell board instead of
asking (no WaitReady call), over the engine socket; anything else -- not ready yet, failed, a
client without the board, a request freed -- still asks the daemon and hears the same answer."""

from __future__ import annotations

import daemon_kit as dk
import grpc

from kvd import errors as E
from kvd.client import TransferState

WAITS = "kvd_rpc_duration_seconds_count"


def waits(side) -> float:
    """WaitReady calls the daemon answered (both transports feed one series)."""
    return sum(side.counter(WAITS, method="WaitReady", code=code) for code in ("OK", "NOT_FOUND"))


def test_a_ready_transfer_is_read_on_its_doorbell_without_a_call(hp):
    rid = dk.rid("bell")
    hp.p.alloc(rid, 70)
    dst, lease = hp.d.c.allocate_recv(rid, 70)
    hp.d.live.add(rid)
    assert hp.d.c.transport == "fast" and lease.bell > 0, lease
    before = waits(hp.pair.decode)
    assert hp.d.c.wait_ready(rid, 0).state is TransferState.WAITING  # not ready: the daemon answers
    assert waits(hp.pair.decode) == before + 1
    r = hp.p.c.send(rid, lease.ticket, free=True)
    hp.p.live.discard(rid)
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is TransferState.READY and st.nbytes == r.nbytes and st.reason == "", st
    assert waits(hp.pair.decode) == before + 1  # read on the doorbell: no call
    grpc_client = hp.pair.decode.connect("decode-grpc", transport="grpc")
    try:  # no board over gRPC: it asks, and hears the same
        assert grpc_client.wait_ready(rid, 5) == st
    except E.PermissionDenied:
        pass  # another session may not wait on it: what matters is that it asked
    assert waits(hp.pair.decode) >= before + 1
    assert hp.d.free(rid) == 1
    with dk.expect(E.NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        hp.d.c.wait_ready(rid, 0)  # freed: its doorbell is forgotten, the daemon answers
    hp.check()


def test_a_failed_transfer_is_told_by_the_daemon_with_its_reason(hp):
    rid, src, dst, lease = hp.setup_request(24, prefix="bell-failed")
    assert lease.bell > 0
    assert hp.d.c.abort(rid, "the decode engine gave up") is False  # no sender began
    before = waits(hp.pair.decode)
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is TransferState.FAILED and "gave up" in st.reason, st
    assert waits(hp.pair.decode) == before + 1
    hp.p.free(rid)
    hp.d.free(rid)
    hp.check()
