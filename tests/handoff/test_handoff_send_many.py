"""SendMany between two real daemons (every variant of ``pair``: subprocess daemons over
``local`` and ``mooncake``, in-process over ``local``): a batch moves the bytes the same Sends
one by one move; each item answers with its own outcome (the status its own Send would have
ended with); the whole call is refused, nothing sent, only for its shape (no item, too many,
one request twice)."""

from __future__ import annotations


import daemon_kit as dk
import grpc
import handoff_kit as hk
import torch

from kvd.client import SendResult, SendSpec, TransferState
from kvd.errors import InvalidArgument, NotFound
from kvd.records import SEND_PHASES
from kvd.handoff.flight import MAX_SEND_ITEMS

READY, WAITING = TransferState.READY, TransferState.WAITING


def test_send_many_moves_the_bytes_the_same_sends_move(hp):
    reqs = [hp.setup_request(n, scatter=i == 0, prefix=f"many{i}") for i, n in enumerate((103, 40, 7, 64))]
    before_d, before_p = hp.d.arena.clone(), hp.p.arena.clone()
    sent0 = hp.pair.prefill.counter("kvd_transfers_total", direction="out", outcome="done")
    items0 = hp.pair.prefill.counter("kvd_send_items_total")

    out = hp.p.c.send_many([(rid, lease.ticket) for rid, _, _, lease in reqs])

    assert len(out) == len(reqs) and out.seconds > 0
    exp = before_d
    for (rid, src, dst, _), r in zip(reqs, out):
        assert isinstance(r, SendResult), r
        assert [k for k in r.phases if k in SEND_PHASES] == list(SEND_PHASES) and r.nbytes > 0, r
        st = hp.d.c.wait_ready(rid, 5)
        assert st.state is READY and st.nbytes == r.nbytes, st
        exp = hk.expected_arena(exp, before_p, hk.moved(src, dst, dst.tokens, state=True))
    batched = hp.d.arena.clone()
    assert torch.equal(batched, exp), hk.diff_summary(batched, exp)
    assert torch.equal(hp.p.arena, before_p), "the sender's arena changed: a send only reads it"
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 0
    # Every item counts as a Send would.
    assert hp.pair.prefill.counter("kvd_transfers_total", direction="out", outcome="done") == sent0 + len(reqs)
    assert hp.pair.prefill.counter("kvd_send_items_total") == items0 + len(reqs)

    # The same requests again, one Send each, into the decode arena as it was: the same bytes.
    hp.d.arena.copy_(before_d)
    single = []
    for rid, _, _, _ in reqs:
        single.append(hp.p.c.send(rid, hp.d.c.acquire_lease(rid, "recv").ticket))
        assert hp.d.c.wait_ready(rid, 5).state is READY
    assert torch.equal(hp.d.arena, batched), hk.diff_summary(hp.d.arena, batched)
    assert [(r.nbytes, r.blocks, r.pages) for r in single] == [(r.nbytes, r.blocks, r.pages) for r in out]
    hp.check()


def test_send_many_answers_each_item_with_its_own_outcome(hp):
    ok = [hp.setup_request(40, scatter=False, prefix=f"ok{i}") for i in range(2)]
    wide = hp.setup_request(20, scatter=False, prefix="wide")
    gone = hp.setup_request(20, scatter=False, prefix="gone")
    hp.d.c.release_lease(gone[3].lease_id)  # its ticket now names a lease that is not live
    before_d = hp.d.arena.clone()

    out = hp.p.c.send_many([
        (ok[0][0], ok[0][3].ticket),
        ("never-parsed", b"garbage, not a ticket"),
        SendSpec(wide[0], wide[3].ticket, start=10, end=50),
        (gone[0], gone[3].ticket),
        (ok[1][0], ok[1][3].ticket),
    ])

    assert isinstance(out[0], SendResult) and isinstance(out[4], SendResult), out
    # Each failure is the class and message its own Send raises (the status travels per item).
    want = [(InvalidArgument, "ticket bytes do not parse"), (InvalidArgument, "not inside the request"), (NotFound, "is not live")]
    for got, (cls, phrase) in zip(out[1:4], want):
        assert type(got) is cls and phrase in str(got), got
    for rid, *_ in ok:
        assert hp.d.c.wait_ready(rid, 5).state is READY
    # A refusal the ticket shows leaves its receiver waiting, and no byte of it was written.
    assert hp.d.c.wait_ready(wide[0], 0).state is WAITING
    moved = hk.moved(wide[1], wide[2], 20, state=True)
    for g, (_, d) in moved.items():
        assert torch.equal(hk.rows(hp.d.arena, hk.PB[g])[d.long()], hk.rows(before_d, hk.PB[g])[d.long()]), g
    assert hp.p.c.stats().leases_live == 0 and hp.d.c.stats().leases_live == 1  # wide's RECV lease
    hp.d.c.release_lease(wide[3].lease_id)
    hp.check()


def test_send_many_refuses_the_whole_call_for_its_shape(hp):
    a = hp.setup_request(20, scatter=False, prefix="a")
    b = hp.setup_request(20, scatter=False, prefix="b")
    before_d = hp.d.arena.clone()
    code = grpc.StatusCode.INVALID_ARGUMENT
    with dk.expect(InvalidArgument, code, "at least one item"):
        hp.p.c.send_many([])
    with dk.expect(InvalidArgument, code, f"at most {MAX_SEND_ITEMS} items, got {MAX_SEND_ITEMS + 1:,d}"):
        hp.p.c.send_many([("r", b"x")] * (MAX_SEND_ITEMS + 1))
    with dk.expect(InvalidArgument, code, f"items 0 and 2 both send request {a[0]!r}"):
        hp.p.c.send_many([(a[0], a[3].ticket, 0, 8, False), (b[0], b[3].ticket), (a[0], a[3].ticket, 8)])
    # Nothing was sent: both receivers still wait, nothing written, no SEND lease.
    assert hp.d.c.wait_ready(a[0], 0).state is WAITING and hp.d.c.wait_ready(b[0], 0).state is WAITING
    assert torch.equal(hp.d.arena, before_d) and hp.p.c.stats().leases_live == 0
    for r in (a, b):
        hp.d.c.release_lease(r[3].lease_id)
    hp.check()


def test_the_asyncio_client_sends_many_too(hp):
    async def send(kv, rid, ticket):
        return await kv.send_many([SendSpec(rid, ticket)])

    out = hp.async_handoff("async", send)
    assert len(out) == 1 and isinstance(out[0], SendResult) and out.seconds > 0, out
    hp.check()
