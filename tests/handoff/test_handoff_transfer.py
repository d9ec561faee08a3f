"""Issue 4, the working paths and the refusals: a request's KV moves prefill -> decode byte for
byte (hybrid layout: full + SWA tail + state + draft, pages scattered by churn and compaction),
in one Send or in chunks; a wrong ticket is refused before any byte is written.

Every test runs on each variant of ``pair`` (see conftest): two subprocess daemons over
``local`` and over ``mooncake`` (TCP), and two in-process daemons (``local``) whose nodes are
checked after every scenario.
"""

from __future__ import annotations

import threading
import time

import daemon_kit as dk
import grpc
import handoff_kit as hk
import pytest
import torch

from kvd.client import TransferState
from kvd.records import SEND_PHASES
from kvd.errors import FailedPrecondition, InvalidArgument, LayoutMismatch, NotFound, PermissionDenied, StaleEpoch
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import vectors_to_pb

READY, WAITING, RECEIVING, FAILED = TransferState.READY, TransferState.WAITING, TransferState.RECEIVING, TransferState.FAILED

# 103 tokens: 26 full pages (the last one partly filled), 13 draft pages (page size 8), and on a
# receiver the SWA tail of the 32-token window: pages (103 - 32) // 4 = 17 .. 25.
TOKENS = 103


def test_one_send_moves_exactly_the_request_pages(hp):
    for e in (hp.p, hp.d):
        info = e.c.info()
        assert info.backend == hp.pair.backend and "handoff" in info.capabilities and info.layout.name == "tiny-hybrid"
    rid, src, dst, lease = hp.setup_request(TOKENS)
    # The churn left both requests in scattered pages: runs must be found, not assumed.
    assert not hk.one_run(src.full) and not hk.one_run(dst.full), (src.full.tolist(), dst.full.tolist())
    # A receiver binds only the SWA window tail; the sender computed (and holds) every SWA page.
    assert dst.swa_first_page == (TOKENS - hk.WINDOW) // hk.PS_FULL == 17
    assert dst.swa.numel() == hk.ceil_div(TOKENS, hk.PS_FULL) - 17 and src.swa.numel() == 26
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    hp.check()

    r = hp.p.c.send(rid, lease.ticket)
    st = hp.d.c.wait_ready(rid, 5)

    assert st.state is READY and st.reason == "", st
    pages = hp.assert_landed(src, dst, before_d, before_p, TOKENS, state=True)
    assert r.pages == {g: s.numel() for g, (s, _) in pages.items()} == {"full": 26, "swa": 9, "draft": 13, "state": 1}
    assert r.nbytes == st.nbytes == sum(s.numel() * hk.PB[g] for g, (s, _) in pages.items())
    # Page-major: a block carries every layer of a run of pages; at least one block per group.
    assert 4 <= r.blocks <= sum(r.pages.values())
    # READY released the RECV lease; the sender released its SEND lease after the write.
    assert hp.d.c.stats().leases_live == 0 and hp.p.c.stats().leases_live == 0
    hp.check()
    # The request stays allocated on both sides until the engines free it.
    assert hp.p.free(rid) == 1 and hp.d.free(rid) == 1
    hp.check()


def test_chunked_send_lands_progressively_and_state_moves_last(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    total = 0
    for t0, t1 in ((0, 37), (37, 70)):
        r = hp.p.c.send(rid, lease.ticket, start=t0, end=t1, last=False)
        total += r.nbytes
        # Where the Send's time went, step by step; only the first chunk checks the ticket.
        # The steps (SEND_PHASES) add up to seconds; the other keys say where parts of them went.
        steps = ["prep", "lease", "plan", "check", "issue", "write", "commit", "release"]
        if t0:
            steps.remove("check")
        done = {k: v for k, v in r.phases.items() if k in SEND_PHASES}
        assert list(done) == steps and all(v >= 0 for v in r.phases.values()), r.phases
        assert sum(done.values()) == pytest.approx(r.seconds, rel=1e-6, abs=1e-9)
        # The handler's own share (outside seconds) and the local backend's parts of issue.
        assert {"ticket", "call"} <= set(r.phases) and r.phases["call"] >= r.seconds, r.phases
        if hp.pair.backend == "local":
            assert r.phases["issue:peer"] + r.phases["issue:copy"] <= r.phases["issue"], r.phases
        t = time.monotonic()
        st = hp.d.c.wait_ready(rid, 0.2)  # not ready: the wait runs out and says so
        assert st.state is RECEIVING and st.nbytes == total, st
        assert time.monotonic() - t >= 0.15  # it waited its timeout out
        hp.assert_landed(src, dst, before_d, before_p, t1, state=False)  # the state slot is untouched
        hp.check()
        if t1 == 37:
            # Page 9 holds tokens 36..39 and draft page 4 tokens 32..39: the engine writes tokens
            # 37.. only now. The next chunk must carry these pages again, with the new bytes.
            hk.rows(hp.p.arena, hk.PB["full"])[int(src.full[9])] = 7
            hk.rows(hp.p.arena, hk.PB["draft"])[int(src.draft[4])] = 9
            before_p = hp.p.arena.clone()
    assert r.pages.get("swa") == 1  # [37, 70): request pages 9..17, of which only 17 is in the tail
    r = hp.p.c.send(rid, lease.ticket, start=70, last=True)
    total += r.nbytes
    st = hp.d.c.wait_ready(rid, 5)
    assert st.state is READY and st.nbytes == total, st
    hp.assert_landed(src, dst, before_d, before_p, TOKENS, state=True)
    assert int(hk.rows(hp.d.arena, hk.PB["full"])[int(dst.full[9])][0]) == 7
    assert hp.d.c.stats().leases_live == 0 and hp.p.c.stats().leases_live == 0
    hp.check()


def test_wait_ready_times_out_waiting_and_wakes_on_ready(hp):
    rid, src, dst, lease = hp.setup_request(40, scatter=False)
    t = time.monotonic()
    st = hp.d.c.wait_ready(rid, 0.3)
    assert st.state is WAITING and st.nbytes == 0, st
    assert time.monotonic() - t >= 0.25  # it waited its timeout out
    assert hp.d.c.wait_ready(rid, 0).state is WAITING
    # A waiter blocked with a long timeout returns as soon as the last chunk commits.
    out = {}

    def waiter():
        out["st"] = hp.d.c.wait_ready(rid, 20)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.2)
    hp.p.c.send(rid, lease.ticket)
    th.join(10)  # well inside the waiter's own 20 s: it woke on READY, not at its timeout
    assert not th.is_alive() and out["st"].state is READY, out
    hp.check()


def test_layout_mismatch_is_refused_before_any_write(hp, narrow):
    m = hk.Engine(narrow, "decode-narrow-engine")
    rid = dk.rid("mm")
    hp.p.alloc(rid, 40)
    hk.randomize(hp.p.arena, hp.seed)
    m.alloc(rid, 40, receive=True)
    hk.randomize(m.arena, hp.seed + 1)
    before = m.arena.clone()
    lease = m.c.acquire_lease(rid, "recv")
    with dk.expect(LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT, "fingerprint"):
        hp.p.c.send(rid, lease.ticket)
    # A ticket whose fingerprint was rewritten to the sender's still names 1 KiB full pages:
    # the planner compares page bytes per group and refuses before writing at a wrong stride (and
    # before the receiver, which would refuse the broken seal, hears of it).
    fingerprint = hp.p.c.info().layout.fingerprint
    forged = hk.tampered(lease.ticket, lambda t: setattr(t, "layout_fingerprint", fingerprint))
    with dk.expect(LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT, "page bytes"):
        hp.p.c.send(rid, forged)
    assert torch.equal(m.arena, before), hk.diff_summary(m.arena, before)
    # The receiver was never contacted: its transfer still waits, its lease still pins.
    assert m.c.wait_ready(rid, 0).state is WAITING
    assert m.c.stats().leases_live == 1
    assert hp.p.c.stats().leases_live == 0
    m.c.release_lease(lease.lease_id)
    assert m.free(rid) == 1 and hp.p.free(rid) == 1
    m.assert_accounted()
    assert m.c.stats().leases_live == 0
    m.close_attachment()
    narrow.t.close_clients()
    hp.check()


def test_tampered_page_bytes_are_refused_and_the_real_ticket_still_works(hp):
    rid, src, dst, lease = hp.setup_request(TOKENS, scatter=False)
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    def halve_swa(t: pb.Ticket) -> None:
        for e in t.envelopes:
            if e.group == "swa":
                e.page_bytes //= 2

    # The sender's own check refuses it, before the receiver (whose seal it breaks) hears of it.
    with dk.expect(LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT, "group swa: page bytes"):
        hp.p.c.send(rid, hk.tampered(lease.ticket, halve_swa))
    assert torch.equal(hp.d.arena, before_d)
    assert hp.d.c.wait_ready(rid, 0).state is WAITING and hp.p.c.stats().leases_live == 0
    hp.p.c.send(rid, lease.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, dst, before_d, before_p, TOKENS, state=True)
    hp.check()


def test_garbage_tickets_are_invalid_argument(hp):
    rid, src, dst, lease = hp.setup_request(20, scatter=False)
    other = dk.rid("other")
    hp.p.alloc(other, 20)
    before_d = hp.d.arena.clone()
    cases = [
        (b"", "ticket is empty"),
        (b"garbage, not a ticket", "ticket"),
        (lease.ticket[: len(lease.ticket) // 2], "ticket"),
        (hk.ticket_body(lease.ticket).SerializeToString(), "not sealed"),  # the body alone, as tickets travelled before
        (hk.tampered(lease.ticket, lambda t: setattr(t, "version", 99)), "version 99"),
        (hk.tampered(lease.ticket, lambda t: t.CopyFrom(pb.Ticket(version=2, rid=rid))), "incomplete"),
    ]
    for blob, phrase in cases:
        with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, phrase):
            hp.p.c.send(rid, blob)
    # A real ticket, but for another request.
    with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, f"ticket is for request {rid!r}"):
        hp.p.c.send(other, lease.ticket)
    # A range outside the request.
    with dk.expect(InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "not inside the request"):
        hp.p.c.send(rid, lease.ticket, start=10, end=50)
    assert torch.equal(hp.d.arena, before_d)
    assert hp.d.c.wait_ready(rid, 0).state is WAITING
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 1
    hp.check()


def test_stale_tickets_are_refused_and_never_written(hp):
    rid, src, dst, lease = hp.setup_request(60)
    old = lease.ticket
    # Compaction cannot move pinned pages: release the RECV lease first, then churn and compact.
    hp.d.c.release_lease(lease.lease_id)
    hp.d.free(*sorted(hp.d.live - {rid}))
    comp = hp.d.c.compact()
    moved = hp.d.c.vectors(rid)
    assert comp.pages_moved > 0 and moved.epoch > dst.epoch and not torch.equal(moved.full, dst.full)
    hk.randomize(hp.d.arena, hp.seed + 2)
    before_d = hp.d.arena.clone()
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, f"lease {lease.lease_id} is not live"):
        hp.p.c.send(rid, old)
    assert torch.equal(hp.d.arena, before_d)

    # Offload + restore: new pages, new epoch; the ticket issued before is dead too.
    lease2 = hp.d.c.acquire_lease(rid, "recv")
    hp.d.c.release_lease(lease2.lease_id)
    hp.d.c.offload(rid)
    restored = hp.d.c.restore(rid)
    assert restored.epoch > moved.epoch
    before_d = hp.d.arena.clone()
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "is not live"):
        hp.p.c.send(rid, lease2.ticket)
    assert torch.equal(hp.d.arena, before_d)

    # The receiver's own fence: a ticket naming a live lease but quoting vectors of an older
    # epoch (the physical ids before the restore, now someone else's or free) is refused: at the
    # seal when a carrier rewrote it, and (in-process, where the daemon can seal the edit itself)
    # by the epoch check behind the seal.
    probe = dk.rid("probe")
    hp.p.alloc(probe, 60)
    hp.d.alloc(probe, 60, receive=True)
    old_vec = hp.d.c.vectors(probe)
    hp.d.c.offload(probe)
    hp.d.c.restore(probe)
    live = hp.d.c.acquire_lease(probe, "recv")

    def to_old(t: pb.Ticket) -> None:
        t.vectors.CopyFrom(vectors_to_pb(old_vec))
        t.epoch = old_vec.epoch

    before_d = hp.d.arena.clone()
    with dk.expect(PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, "does not carry this daemon's seal"):
        hp.p.c.send(probe, hk.tampered(live.ticket, to_old))
    assert torch.equal(hp.d.arena, before_d)
    if hp.pair.decode.mode == "inproc":
        with dk.expect(StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION, "stale"):
            hp.p.c.send(probe, hk.resealed(hp.pair.decode, live.ticket, to_old))
        assert torch.equal(hp.d.arena, before_d)
    hp.d.c.abort(probe, "test done")
    hp.d.free(probe)
    hp.p.free(probe)

    # A fresh ticket for the moved request works, into its new pages.
    fresh = hp.d.c.acquire_lease(rid, "recv")
    before_p = hp.p.arena.clone()
    hp.p.c.send(rid, fresh.ticket)
    assert hp.d.c.wait_ready(rid, 5).state is READY
    hp.assert_landed(src, restored, before_d, before_p, 60, state=True)
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 0
    hp.check()


def test_abort_without_a_transfer_is_not_found(hp):
    rid = dk.rid("idle")
    hp.d.alloc(rid, 16, receive=True)
    hp.p.alloc(rid, 16)
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "no transfer in progress"):
        hp.d.c.abort(rid, "nothing to abort")
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "no transfer in progress"):
        hp.p.c.abort(rid, "nothing to abort")
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "not allocated"):
        hp.d.c.abort(dk.rid("never"), "unknown")
    with dk.expect(NotFound, grpc.StatusCode.NOT_FOUND, "acquire a RECV lease first"):
        hp.d.c.wait_ready(rid, 0)
    hp.check()


def test_send_on_a_daemon_without_backend_is_failed_precondition(tmp_path):
    t = dk.start_inproc(tmp_path)  # backend defaults to none
    try:
        c = t.connect(name="engine")
        assert "handoff" not in c.info().capabilities
        c.allocate("r", 8)
        with dk.expect(FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "backend=none"):
            c.send("r", b"anything")
        with dk.expect(FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "backend=none"):
            c.send_many([("r", b"anything")])
        t.node.check()
    finally:
        dk.stop_inproc(t)
