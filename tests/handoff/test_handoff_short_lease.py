"""A RECV lease that runs out on its TTL (``allocate_recv(ttl=)`` shorter than the sender's
heartbeat) while its transfer is RECEIVING: that transfer alone fails, fenced -- its pages stay
pinned until the fence ends -- and the other transfers to the same receiver carry on."""

from __future__ import annotations

import time

import daemon_kit as dk
import handoff_kit as hk
import pytest

from kvd import errors as E
from kvd.client import TransferState

READY, RECEIVING, FAILED = TransferState.READY, TransferState.RECEIVING, TransferState.FAILED

SHORT_TTL = 0.2  # under the heartbeat interval (peer_timeout_s / 4 = 0.25 s)


def _begun(hp, prefix: str, ttl: float | None):
    """``rid`` allocated on both sides (the decode side's RECV lease with ``ttl``), its transfer
    begun by the prefill engine's Allocate with the ticket. Returns ``(rid, src, dst, lease)``."""
    rid = dk.rid(prefix)
    dst, lease = hp.d.c.allocate_recv(rid, 16, ttl=ttl)
    hp.d.live.add(rid)
    src = hp.p.c.allocate(rid, 16, ticket=lease.ticket)
    hp.p.live.add(rid)
    dk.wait_for(lambda: hp.d.c.wait_ready(rid, 0).state is RECEIVING, 5, f"{rid} receiving")
    return rid, src, dst, lease


def test_a_lapsed_recv_lease_fails_its_transfer_alone(hp):
    short, _, _, short_lease = _begun(hp, "short-ttl", SHORT_TTL)
    rid, src, dst, lease = _begun(hp, "healthy", None)
    # Several heartbeats name both, past the short lease's TTL and past peer_timeout.
    time.sleep(hk.PEER_TIMEOUT_S * 1.5)
    st = hp.d.c.wait_ready(short, 0)
    assert st.state is FAILED and "RECV lease expired" in st.reason, st
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING  # the heartbeat kept it alive
    hk.randomize(hp.p.arena, hp.seed)
    hk.randomize(hp.d.arena, hp.seed + 1)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    hp.p.c.send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, dst.tokens, state=True)
    with pytest.raises(E.KvdError):
        hp.p.c.send(short, short_lease.ticket)  # refused: nothing of it lands
    assert hp.d.c.wait_ready(short, 0).state is FAILED
    hp.p.free(short, rid)
    hp.d.free(short, rid)
    hp.check()


def test_a_lapsed_recv_lease_keeps_its_pages_fenced(hp):
    """The sender began and may still write: the engine's free of the request is deferred until
    the fence ends, not done at once."""
    short, _, dst, _ = _begun(hp, "short-fence", SHORT_TTL)
    dk.wait_for(lambda: hp.d.c.wait_ready(short, 0).state is FAILED, 3, f"{short} failed")
    assert hp.d.c.stats().leases_live == 1  # the lapsed lease, held as the fence
    held = hp.d.used()
    hp.d.free(short)
    time.sleep(4 * hk.DAEMON_OPTS["sweep_interval_s"])  # sweeps that would free an unfenced request
    assert hp.d.used() == held, "a request a sender may still write was freed before its fence ended"
    hp.p.free(short)
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    hp.check()
