"""The connector's hooks piece by piece, against real daemons in this process (the tier's
test_vllm_pd.py runs them end to end through vLLM engines). Decode side, sync loads: what a worker
reports of one that failed (its blocks, for vLLM to fail the request) and of one it copied
(KVConnectorWorkerMetadata, summed over workers), and the scheduler freeing the kvd request only
once every worker reported it. Prefill side, the open: a step's Allocate whose reply was lost
carried on, a second vLLM request with the same ticket refused without touching the first's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

# Not "vllm": with tests/ on sys.path (rootdir conftest), tests/vllm imports as a namespace package.
pytest.importorskip("vllm.config", reason="the vLLM tier runs in .venv-vllm (make venv-vllm)")

from daemon_kit import start_inproc, stop_inproc  # noqa: E402

from kvd.connectors.vllm import CopyStats, KvdConnector  # noqa: E402
from kvd.connectors.vllm_loader import Loader  # noqa: E402
from kvd.connectors.vllm_saver import Saver  # noqa: E402
from kvd.connectors.vllm_worker import Worker  # noqa: E402
from kvd.connectors.vllm_meta import KvdWorkerMetadata, Load  # noqa: E402
from kvd.connectors.vllm_ticket_book import CALL_WAIT_S, TicketBook  # noqa: E402


def _loader(block: int = 32) -> Loader:
    """A worker's loads, over what they read of the worker (its block size, its counts): no vLLM
    config, no daemon."""
    return Loader(SimpleNamespace(bs=block, copy_stats=CopyStats()))  # type: ignore[arg-type]


def _saver(kv: Any) -> Saver:
    """A producer worker's saves over client ``kv`` (no KV caches registered: the opens only)."""
    return Saver(Worker(kv, "unix:test", "prefill-worker", None, kv.info().layout, {}), producer=True)


@contextmanager
def _ticket_book(tmp_path: Any, **kw: Any) -> Iterator[tuple[Any, Any, TicketBook, list[int]]]:
    """A daemon in this process, a scheduler's client of it and a ticket book on that client (``kw``:
    the book's options), closed and stopped after; and a prompt two pages and a token long."""
    t = start_inproc(tmp_path)
    try:
        kv = t.connect(name="scheduler")
        layout = kv.info().layout
        book = TicketBook(kv, 30.0, layout.page_size, layout, **kw)
        try:
            yield t, kv, book, list(range(1, 2 * layout.page_size + 2))
        finally:
            book.close()
    finally:
        stop_inproc(t)


def _req(req_id: str, tk: dict, prompt: list[int], **more: Any) -> SimpleNamespace:
    """What the ticket book reads of a vLLM request that names ticket ``tk``."""
    return SimpleNamespace(request_id=req_id, kv_transfer_params={"kvd_rid": tk["kvd_rid"]}, prompt_token_ids=prompt, **more)


def test_a_failed_sync_load_reports_its_blocks_and_is_reported_done():
    """Tokens [32, 100) of a request in blocks [5, 6, 7, 8] (32 a block): blocks 6-8 hold them
    (5 is vLLM's own prefix-cache hit), reported once; the load is reported done (its kvd request
    freed) and never in failed_recving, which vLLM 0.32 asserts only of a request it holds back."""
    c = _loader()
    c.load_failed(Load("req-0", ([5, 6, 7, 8],), 32, 100, sync=True))
    assert c.failed == set() and c.w.copy_stats.sync_failed == 1
    assert c.get_block_ids_with_load_errors() == {6, 7, 8}
    assert c.get_block_ids_with_load_errors() == set()
    meta = c.build_connector_worker_meta()
    assert isinstance(meta, KvdWorkerMetadata) and meta.loaded == {"req-0": 1}
    assert c.build_connector_worker_meta() is None  # reported once


def test_a_failed_async_load_goes_to_failed_recving():
    c = _loader()
    c.load_failed(Load("req-1", ([5, 6],), 0, 64))
    assert c.failed == {"req-1"} and c.get_block_ids_with_load_errors() == set() and c.build_connector_worker_meta() is None


def test_workers_reports_add_up():
    a, b = KvdWorkerMetadata({"r1": 1, "r2": 1}), KvdWorkerMetadata({"r1": 1})
    assert a.aggregate(b).loaded == {"r1": 2, "r2": 1}
    with pytest.raises(TypeError):
        a.aggregate(object())  # type: ignore[arg-type]


def test_a_sync_loads_kvd_request_is_freed_once_every_worker_reported_it(tmp_path):
    """Two workers (tensor parallel): the first one's report keeps the kvd request, the second one
    frees it (its RECV lease aborted first: no KV came in this test)."""
    with _ticket_book(tmp_path, sync_tokens=8192, workers=2) as (t, kv, book, prompt):
        tk = book.mint(prompt)
        req = _req("req-0", tk, prompt)
        assert book.matched(req, 0) == (tk["kvd_tokens"], True)  # not landed: a load of its own
        assert kv.stats().pool.requests_live == 1
        book.loaded({"req-0": 1})
        assert kv.stats().pool.requests_live == 1 and book.status(tk["kvd_rid"]) is not None
        book.loaded({"req-0": 1, "someone-else": 1})
        assert kv.stats().pool.requests_live == 0 and book.status(tk["kvd_rid"]) is None
        t.check()


def test_a_request_asked_again_is_admitted_once_and_one_preempted_after_its_load_is_computed_again(tmp_path):
    """vLLM asks the connector again each step a request waits for blocks: one admission, the same
    answer. A request preempted after its load (its kvd request freed, its vLLM blocks gone) is
    computed again, counted ``recomputed`` once a preemption, never loaded a second time nor
    reported unknown."""
    with _ticket_book(tmp_path, workers=1) as (t, kv, book, prompt):
        tk = book.mint(prompt)
        req = _req("req-0", tk, prompt, num_preemptions=0)
        for _ in range(3):  # no blocks for it yet: asked again
            assert book.matched(req, 0) == (tk["kvd_tokens"], True)
        assert book.stats.admitted == 1 and book.stats.not_matched == 0
        book.finished({"req-0"})  # loaded (or failed): the kvd request is freed
        assert kv.stats().pool.requests_live == 0
        req.num_preemptions = 1  # vLLM preempted it while it decoded
        for _ in range(3):  # asked again while it waits for blocks: one recomputation
            assert book.matched(req, 0) == (0, False)
        assert book.stats.recomputed == 1 and book.stats.not_matched == 0 and book.stats.admitted == 1
        req.num_preemptions = 2  # and preempted once more
        assert book.matched(req, 0) == (0, False) and book.stats.recomputed == 2
        t.check()


def test_a_request_ended_while_it_waits_for_its_kv_is_reported_aborted_then_freed(tmp_path):
    """vLLM frees the blocks of a request ended in WAITING_FOR_REMOTE_KVS only once the worker
    reports its load finished: the book hands the worker that load as aborted (never copied), and
    frees the kvd request with the report; a request ended before it had blocks is freed at once."""
    with _ticket_book(tmp_path) as (t, kv, book, prompt):
        tk, tk2 = book.mint(prompt), book.mint(prompt)
        req = _req("req-0", tk, prompt)
        req2 = _req("req-1", tk2, prompt)
        assert book.matched(req, 0) == (tk["kvd_tokens"], True) and book.matched(req2, 0) == (tk2["kvd_tokens"], True)
        book.allocated(req, SimpleNamespace(get_block_ids=lambda: ([4, 5],)), tk["kvd_tokens"])  # req-1: no blocks yet
        book.ended("req-1")  # vLLM holds no blocks for it: freed now
        book.ended("req-0")  # vLLM holds its blocks until told: not freed yet
        assert kv.stats().pool.requests_live == 1 and book.status(tk2["kvd_rid"]) is None
        assert book.status(tk["kvd_rid"])["state"] == "ABORTED"
        (load,) = book.ready_loads()
        assert load.req_id == "req-0" and load.aborted and load.error and load.block_ids == ([4, 5],)
        assert book.ready_loads() == []  # dispatched once
        c = _loader()
        c.load_failed(load)
        assert c.failed == {"req-0"}  # reported in finished_recving (and failed_recving)
        book.finished({"req-0"}, failed={"req-0"})  # the scheduler hears it (in both sets): the kvd request goes
        assert kv.stats().pool.requests_live == 0
        assert book.by_req == {} and book.pending == {}, "an ended request is still known by its ticket"
        assert book.stats.aborted == 1 and book.stats.transfers_failed == 0
        t.check()


def test_tickets_asked_for_together_are_minted_in_one_call_and_a_refusal_is_only_its_own(tmp_path):
    """Tickets asked for while a mint's call is out wait and go together, in one Allocate; where the
    daemon refuses that call (one request too large), each is minted alone: the others get their
    tickets, the refused one its error, and nothing else is held."""
    import threading

    from kvd.errors import KvdError
    from kvd.records import LeaseKind

    with _ticket_book(tmp_path) as (t, kv, book, _):
        def together(items: list[tuple[str, int]]) -> dict[str, Any]:
            out: dict[str, Any] = {}

            def one(rid: str, n: int) -> None:
                try:
                    out[rid] = book._allocate_recv(rid, n)
                except KvdError as exc:
                    out[rid] = exc

            threads = [threading.Thread(target=one, args=it) for it in items]
            with book._minting:  # another mint's call is out: these queue behind it
                for th in threads:
                    th.start()
                while len(book._mints) < len(items):
                    time.sleep(0.001)
            for th in threads:
                th.join(10)
            return out

        calls = book.stats.mint_calls
        got = together([(f"co-{i}", 8 * (i + 1)) for i in range(5)])
        assert book.stats.mint_calls == calls + 1, "five tickets asked for together took more than one call"
        assert all(le.rid == r and le.kind is LeaseKind.RECV for r, le in got.items()) and len(got) == 5
        assert kv.stats().pool.requests_live == 5 and kv.stats().leases_live == 5
        got2 = together([("co-a", 8), ("co-huge", 1 << 30), ("co-b", 8)])
        assert book.stats.mint_calls == calls + 1 + 1 + 3  # the refused call, then each alone
        assert isinstance(got2["co-huge"], KvdError) and got2["co-a"].rid == "co-a" and got2["co-b"].rid == "co-b"
        assert kv.stats().pool.requests_live == 7 and kv.stats().leases_live == 7
        t.check()
        for le in [*got.values(), got2["co-a"], got2["co-b"]]:
            kv.release_lease(le.lease_id)
            kv.free(le.rid)
        t.check()


def test_ticket_prompts_are_checked_before_anything_is_allocated_and_matched_by_their_tokens(tmp_path):
    """A ticket request's prompt must be ints (no bools, no floats) that fit 64 bits, more than a
    block long: otherwise InvalidArgument and nothing allocated. A vLLM request matches its ticket
    only if its prompt is longer than the ticket's tokens and begins with them."""
    from kvd.errors import InvalidArgument

    with _ticket_book(tmp_path) as (t, kv, book, prompt):
        bs = kv.info().layout.page_size
        for bad in (None, "1 2 3", [1], [1, True, *prompt], [1.0, *prompt], [*prompt, 1 << 64], [*prompt, -(1 << 63) - 1], list(range(bs))):
            with pytest.raises(InvalidArgument):
                book.mint(bad)
        assert kv.stats().pool.requests_live == 0 and book.stats.tickets_minted == 0
        tk = book.mint(prompt)
        n = tk["kvd_tokens"]
        other = list(prompt)
        other[n - 1] += 1  # the last ticketed token differs
        for ids in (other, prompt[:n], None):
            assert book.matched(_req("req-x", tk, ids), 0) == (0, False)
        assert book.stats.not_matched == 3 and book.stats.admitted == 0
        assert book.matched(_req("req-0", tk, [*prompt[:n], 99, 98]), 0) == (n, True)  # its own tail past the ticket
        t.check()


def test_a_ticket_vllms_own_prefix_cache_holds_is_given_back_at_admission(tmp_path):
    """Every ticketed token already in vLLM's own prefix cache: nothing to load, and the kvd request
    goes back at admission (not when the request ends); asked again (waiting for blocks), the same
    answer without a warning; the request's end frees nothing twice."""
    with _ticket_book(tmp_path) as (t, kv, book, prompt):
        tk = book.mint(prompt)
        req = _req("req-0", tk, prompt, num_preemptions=0)
        assert book.matched(req, tk["kvd_tokens"] + 4) == (0, False)
        assert kv.stats().pool.requests_live == 0 and book.status(tk["kvd_rid"]) is None
        assert book.matched(req, tk["kvd_tokens"] + 4) == (0, False)
        req.num_preemptions = 1
        assert book.matched(req, 0) == (0, False)
        assert (book.stats.admitted, book.stats.cached, book.stats.not_matched) == (1, 1, 0)
        book.ended("req-0")
        assert book.by_req == {} and book.pending == {}
        t.check()


def test_a_request_whose_load_failed_is_asked_again_without_a_warning(tmp_path):
    """vLLM with kv_load_failure_policy "recompute": a failed async load sends the request back to
    waiting with nothing computed, and vLLM asks the connector again. Its kvd request is freed with
    the report; the second ask answers "nothing to load" as for a ticket given back, not "unknown
    ticket"; the request's end forgets it."""
    with _ticket_book(tmp_path) as (t, kv, book, prompt):
        tk = book.mint(prompt)
        req = _req("req-0", tk, prompt, num_preemptions=0)
        assert book.matched(req, 0) == (tk["kvd_tokens"], True)
        book.finished({"req-0"}, failed={"req-0"})
        assert kv.stats().pool.requests_live == 0
        assert book.matched(req, 0) == (0, False) and book.stats.not_matched == 0
        book.ended("req-0")
        assert book.by_req == {} and book.pending == {}
        t.check()


# ---- the producer's open: a lost reply adopted, a duplicate ticket refused without harm ------------

def test_an_open_whose_reply_was_lost_is_carried_on_and_a_duplicate_refused_without_freeing(tmp_path):
    """A step's Allocate applied by the prefill daemon but its reply lost (the worker falls back to
    one open each): the open finds the request already there, in its own session and held by no
    other vLLM request, and carries on with it (its page ids asked) instead of failing it. A second
    vLLM request with the same ticket is refused, sends nothing, and frees nothing: the first one's
    kvd request stays open, pages and all."""
    import handoff_kit as hk

    from kvd.connectors.vllm_meta import Save

    pair = hk.make_pair(tmp_path)
    try:
        dec, pre = pair.decode.t.connect(name="decode"), pair.prefill.t.connect(name="prefill-worker")
        _, lease = dec.allocate_recv("kvd-x", 40)
        pre.allocate_many([("kvd-x", 40)], tickets=[lease.ticket])  # applied; its reply "lost"
        want = pre.vectors("kvd-x")
        c = _saver(pre)
        first = Save("req-a", "kvd-x", lease.ticket, 40, ([1, 2],), 0, 40, True)
        v = c._open(first)
        assert v is not None and v["full"] == want.full.tolist() and c.w.copy_stats.adopted == 1
        dup = Save("req-b", "kvd-x", lease.ticket, 40, ([3, 4],), 0, 40, True)
        assert c._open(dup) is None and "req-b" in c.bad_saves and c.w.copy_stats.adopted == 1
        assert pre.vectors("kvd-x").full.tolist() == want.full.tolist()  # still open, the same pages
        assert c.vecs == {"req-a": v}
        for side in pair.sides:
            side.t.check()
    finally:
        for side in pair.sides:
            side.stop()


def test_a_steps_new_requests_are_opened_ahead_of_its_forward_on_the_opener_thread(tmp_path):
    """vLLM's first call of a step (handle_preemptions, with the step's metadata) opens the step's
    new requests on the opener thread, the new ones together in one Allocate; the forward thread
    joins that work (_opened) and finds them open, with no call of its own. A step with nothing
    new starts no work; a request whose open is refused is only its own failure (a bad save), as
    at the first save. Nothing is left open on either daemon once each is freed."""
    import threading

    import handoff_kit as hk

    from kvd.connectors.vllm_meta import Save

    pair = hk.make_pair(tmp_path)
    try:
        dec, pre = pair.decode.t.connect(name="decode"), pair.prefill.t.connect(name="prefill-worker")
        (_, la), (_, lb) = dec.allocate_recv("kvd-a", 40), dec.allocate_recv("kvd-b", 40)
        c = _saver(pre)
        calls: list[tuple[str, str]] = []
        for name in ("allocate", "allocate_many"):
            real = getattr(pre, name)

            def spy(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                calls.append((_name, threading.current_thread().name))
                return _real(*a, **k)

            setattr(pre, name, spy)
        step = [Save("req-a", "kvd-a", la.ticket, 40, ([1, 2],), 0, 32, False), Save("req-b", "kvd-b", lb.ticket, 40, ([3, 4],), 0, 32, False)]
        c.handle_preemptions(SimpleNamespace(saves=step))
        c.opened()
        assert [n for n, _ in calls] == ["allocate_many"] and calls[0][1].startswith("kvd-opener"), calls
        assert {r: v["full"] for r, v in c.vecs.items()} == {"req-a": pre.vectors("kvd-a").full.tolist(),
                                                               "req-b": pre.vectors("kvd-b").full.tolist()}
        assert c.w.copy_stats.opens == 1 and c.w.copy_stats.opened == 2
        c.handle_preemptions(SimpleNamespace(saves=[replace(sv, start=32, end=40, last=True) for sv in step]))
        assert c.opening is None and len(calls) == 1  # their next chunks: nothing new to open
        bad = Save("req-c", "kvd-c", b"not a ticket", 40, ([5, 6],), 0, 40, True)
        c.handle_preemptions(SimpleNamespace(saves=[bad]))
        c.opened()
        assert "req-c" in c.bad_saves and "req-c" not in c.vecs and calls[-1][0] == "allocate"
        for rid in ("kvd-a", "kvd-b"):  # as the worker does with a request vLLM ended before its last chunk
            pre.abort(rid, "the test is done")
            pre.free(rid)
            assert dec.wait_ready(rid, 5).state.value == "failed"
            dec.free(rid)
        assert pre.stats().pool.requests_live == 0 == dec.stats().pool.requests_live
        for side in pair.sides:
            side.t.check()
    finally:
        if c.opener is not None:
            c.opener.shutdown()
        for side in pair.sides:
            side.stop()


def test_an_overdue_session_is_probed_once_a_second_not_once_a_layer(tmp_path):
    """A worker whose daemon stopped answering (no call answered for half its TTL) asks once
    before writing; the next layers of the step do not ask again (each could wait a call's
    timeout), and writing stays refused once the daemon says the session is gone."""
    import time

    from kvd.client import Client

    t = start_inproc(tmp_path)
    kv = Client.connect(t.unix, name="worker", ttl=1.0)
    kv.attach()
    layout = kv.info().layout
    stop_inproc(t)  # its heartbeat fails from here on
    time.sleep(0.6)
    w = Worker(kv, t.unix, "worker", 1.0, layout, {})
    try:
        assert kv.overdue
        for _ in range(8):  # a step's layers
            w.gone()
        assert w.copy_stats.session_probes == 1
    finally:
        kv.close()


def test_a_ticket_whose_request_will_not_come_is_given_back_at_once(tmp_path):
    """``DELETE /v1/kvd/tickets/{rid}`` (the proxy, when its prefill instance failed): a ticket not
    admitted is freed now (its RECV lease aborted first), an unknown one is 404, one the decode
    vLLM admitted is 409 and stays (the request frees it when it ends)."""
    with _ticket_book(tmp_path) as (t, kv, book, prompt):
        tk = book.mint(prompt)
        assert kv.stats().pool.requests_live == 1
        assert book.cancel(tk["kvd_rid"]) == (200, "freed")
        assert kv.stats().pool.requests_live == 0 and book.status(tk["kvd_rid"]) is None
        code, why = book.cancel(tk["kvd_rid"])
        assert code == 404 and "no such ticket" in why
        # the decode vLLM may still come with it: it computes the prompt itself
        req = _req("req-0", tk, prompt)
        assert book.matched(req, 0) == (0, False)
        tk2 = book.mint(prompt)
        req2 = _req("req-1", tk2, prompt)
        assert book.matched(req2, 0) == (tk2["kvd_tokens"], True)
        code, why = book.cancel(tk2["kvd_rid"])
        assert code == 409 and "req-1" in why and kv.stats().pool.requests_live == 1
        t.check()


def test_the_ticket_server_keeps_a_proxys_connection_and_drops_one_it_cannot_reuse(tmp_path):
    """HTTP/1.1 keep-alive: mint, look up and give back tickets on one connection (a pooled proxy
    connection costs no connect and no thread per ticket); a request whose body it does not read
    (a wrong path) is answered with ``Connection: close`` and the connection closed, so that body is
    never taken for the next request."""
    import http.client
    import json

    from kvd.connectors.vllm_ticket_server import serve_tickets
    from pd_kit import free_port

    t = start_inproc(tmp_path)
    try:
        kv = t.connect(name="scheduler")
        layout = kv.info().layout
        book = TicketBook(kv, 30.0, layout.page_size, layout)
        port = free_port()
        srv = serve_tickets(book, f"127.0.0.1:{port}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            prompt = list(range(1, 2 * layout.page_size + 2))
            rids = []
            for _ in range(3):
                conn.request("POST", "/v1/kvd/tickets", json.dumps({"prompt_token_ids": prompt}), {"Content-Type": "application/json"})
                r = conn.getresponse()
                assert r.status == 200 and r.getheader("Connection") != "close"
                rids.append(json.loads(r.read())["kvd_rid"])
            sock = conn.sock
            conn.request("GET", f"/v1/kvd/transfers/{rids[0]}")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["state"] == "WAITING"
            for rid in rids:
                conn.request("DELETE", f"/v1/kvd/tickets/{rid}")
                r = conn.getresponse()
                assert r.status == 200 and json.loads(r.read())["released"] is True
            assert conn.sock is sock, "the connection was not kept"
            assert kv.stats().pool.requests_live == 0
            conn.request("POST", "/v1/kvd/nope", json.dumps({"prompt_token_ids": prompt}), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 404 and r.getheader("Connection") == "close"
            r.read()
            conn.request("POST", "/v1/kvd/tickets", json.dumps({"prompt_token_ids": prompt}), {"Content-Type": "application/json"})
            r = conn.getresponse()  # http.client reconnected: the unread body never reached a handler
            assert r.status == 200 and conn.sock is not sock
            assert book.cancel(json.loads(r.read())["kvd_rid"]) == (200, "freed")
            conn.close()
            t.check()
        finally:
            srv.close()
            book.close()
    finally:
        stop_inproc(t)


def test_the_counts_vllm_logs_and_exports_are_what_grew_summed_over_workers():
    """get_kv_connector_stats hands vLLM only what grew since its last call; vLLM sums workers'
    (and the scheduler's) and logs the sum."""
    from kvd.connectors.vllm_stats import KvdConnectorStats, grown

    stats = CopyStats()
    seen: dict = {}
    stats.loads, stats.load_bytes, stats.load_s = 2, 4096, 0.0015
    assert grown(stats, seen) == {"loads": 2, "load_bytes": 4096, "load_s": 0.0015}
    assert grown(stats, seen) == {}
    stats.loads += 1
    a = KvdConnectorStats(data=grown(stats, seen))
    b = KvdConnector.build_kv_connector_stats({"loads": 2, "load_bytes": 100, "load_s": 0.25})
    total = a.aggregate(b)
    assert total.data == {"loads": 3, "load_bytes": 100, "load_s": 0.25} and not total.is_empty()
    assert total.reduce() == {"load_bytes": 100, "load_s": 0.25, "loads": 3}
    assert KvdConnectorStats(data={"loads": 0}).is_empty()
    total.reset()
    assert total.is_empty()


def test_over_grpc_one_thread_watches_every_pending_transfer_with_a_few_calls(tmp_path):
    """A decode scheduler whose client has no doorbells (gRPC) watched each pending transfer with a
    WaitReady of its own (a thread each here; at most 8 waited in the daemon, the rest were refused
    and sent again every 0.2 s). Now one thread's WaitEnded calls answer them all: 24 tickets, more
    than the daemon's gRPC waits, 16 sent and 8 aborted, each READY or FAILED as it happened, with
    at most a call per transfer that ended and one per CALL_WAIT_S while nothing did."""
    import threading

    import daemon_kit as dk
    import handoff_kit as hk

    from kvd.server.service import GRPC_WAIT_SLOTS

    pair = hk.make_pair(tmp_path, "local", "inproc")
    try:
        kv = pair.decode.connect("scheduler", transport="grpc")
        seen = dk.counted(kv)
        layout = kv.info().layout
        t0 = time.monotonic()
        book = TicketBook(kv, 30.0, layout.page_size, layout)
        prefill = pair.prefill.connect("prefill")
        try:
            prompt = list(range(1, 2 * layout.page_size + 2))
            tks = [book.mint(prompt) for _ in range(3 * GRPC_WAIT_SLOTS)]
            sent, aborted = tks[: 2 * GRPC_WAIT_SLOTS], tks[2 * GRPC_WAIT_SLOTS :]
            time.sleep(0.2)
            assert all(book.status(tk["kvd_rid"])["state"] == "WAITING" for tk in tks)
            assert not [t.name for t in threading.enumerate() if t.name.startswith("kvd-watch-")]
            for tk in sent:
                ticket = __import__("base64").b64decode(tk["kvd_ticket"])
                prefill.allocate(tk["kvd_rid"], tk["kvd_tokens"], ticket=ticket)
                prefill.send(tk["kvd_rid"], ticket, last=True, free=True)
            for tk in aborted:
                kv.abort(tk["kvd_rid"], "the test gave up")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(book.status(tk["kvd_rid"])["state"] == "WAITING" for tk in tks):
                time.sleep(0.02)
            assert [book.status(tk["kvd_rid"])["state"] for tk in sent] == ["READY"] * len(sent)
            states = [book.status(tk["kvd_rid"]) for tk in aborted]
            assert all(s["state"] == "FAILED" and "gave up" in s["reason"] for s in states), states
            assert "WaitReady" not in seen
            assert [t.name for t in threading.enumerate()].count("kvd-ticket-waits") == 1
            # A call per end at most (one answers all that ended while it waited), one a second idle.
            idle = (time.monotonic() - t0) / CALL_WAIT_S
            assert 1 <= seen.count("WaitEnded") <= len(tks) + idle + 1, (seen.count("WaitEnded"), idle)
            for tk in tks:
                assert book.cancel(tk["kvd_rid"])[0] == 200
            assert kv.stats().pool.requests_live == 0
        finally:
            book.close()
            prefill.close()
            kv.close()
    finally:
        for s in pair.sides:
            s.stop()
