"""vLLM prefill -> kvd -> kvd -> vLLM decode against one vLLM alone, on tiny float32 models.

Runs in the vLLM venv (``make venv-vllm``; .ci/run runs this tier there and fails if it skips);
skips where vLLM is not installed. Per model (Llama; Gemma3: sliding window 16, null blocks;
GraniteMoeHybrid: Mamba2 state slots): the baseline, then a decode engine, a prefill engine and
two daemons, each its own process, and:

* identical greedy token ids (32) for 4 prompts: not block multiples, one to several blocks
  handed over, several windows long;
* a negative control: the decode daemon's arena corrupted once the KV arrived -> outputs differ;
* a prefill engine killed mid-transfer -> the waiting decode request fails through vLLM's
  load-error path, and neither daemon keeps a page;
* (Llama) 300 pending transfers at once, more than the daemon's engine-socket connections: the
  decode connector watches them on their doorbells, none fails, a handoff beside them is exact.

The prefill engine runs chunked prefill (64 tokens a step): a prompt's KV is saved over several
steps. The daemons start with ``layout_from_engine`` (each takes its engine's layout). Once, on Llama: a
vLLM whose daemon is missing, or serves another layout, refuses to start, saying so.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Not "vllm": with tests/ on sys.path (rootdir conftest), tests/vllm imports as a namespace package.
pytest.importorskip("vllm.config", reason="the vLLM tier runs in .venv-vllm (make venv-vllm)")

from kvd.client import Client
from kvd.pool.layout import Layout
from pd_kit import Daemon, Engine, free_port, kv_config, prompts, ticket, transfer, wait_state  # noqa: E402
from tiny_models import build  # noqa: E402

MODELS = ["llama", "gemma3", "granitemoehybrid"]
# Not block multiples; 200 = 12 windows of 16. Each at least one block plus one: Llama's and Gemma3's
# blocks are 32 tokens, GraniteMoeHybrid's 64 (vLLM sizes the attention block to the Mamba state's page).
LENGTHS = [70, 100, 77, 200]
ADMIT_TTL = 12.0
CHUNK = 64  # the prefill engine's tokens per step (chunked prefill); one Granite block
# KV cache blocks (32 tokens) of a decode vLLM small enough that LENGTHS' prompts, decoding 96 tokens,
# preempt each other; the longest (296 tokens) fits alone. Gemma3's four groups (one full, three
# sliding) share the pool, and vLLM sizes it as if each held the whole max_model_len
PREEMPT_BLOCKS = {"llama": 12, "gemma3": 44, "granitemoehybrid": 12}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass
class PD:
    model: str
    tmp: Path
    baseline: dict
    prefill_d: Daemon
    decode_d: Daemon
    prefill: Engine
    decode: Engine
    port: int
    hold: Path
    model_dir: str


@pytest.fixture(scope="module", params=MODELS)
def pd(request, tmp_path_factory):
    model = request.param
    tmp = tmp_path_factory.mktemp(model)
    model_dir = build(model, str(tmp_path_factory.getbasetemp() / "models"))
    layout = tmp / "layout.json"
    base = Engine(tmp, "baseline", model_dir, layout_out=layout).ready()
    try:
        baseline = base.run(prompts(LENGTHS))
    finally:
        base.stop()
    started: list = []
    live = None
    try:
        pd_ = Daemon.start(tmp, "prefill")  # layout_from_engine: each takes its engine's layout
        started.append(pd_)
        dd = Daemon.start(tmp, "decode")
        started.append(dd)
        port, hold = free_port(), tmp / "hold-sends"
        decode = Engine(tmp, "decode", model_dir, kv_config("kv_consumer", dd.address, kvd_ticket_listen=f"127.0.0.1:{port}",
                                                         kvd_admit_ttl_s=ADMIT_TTL))
        started.append(decode)
        decode.ready()  # one engine starting at a time: two at once hung here (2 cores)
        # chunked prefill on the producer: 64 tokens a step, so the longer prompts are saved over several steps
        # A short session TTL makes a killed prefill's requests fail fast (the kill test); 1 s, not
        # less: a loaded 2-core runner once held the starting vLLM's heartbeat past 0.5 s, its
        # session expired and every later Send of that engine was refused.
        prefill = Engine(tmp, "prefill", model_dir, kv_config("kv_producer", pd_.address, kvd_session_ttl_s=1.0),
                         env={"KVDCONN_TEST_HOLD_FILE": str(hold)}, extra=["--max-num-batched-tokens", str(CHUNK), "--prefix-caching"])
        started.append(prefill)
        prefill.ready()
        want = Layout.model_validate_json(layout.read_text())  # what the baseline engine derived
        for d in (pd_, dd):
            with Client.connect(d.address, name="probe") as c:
                assert c.info().layout == want, f"{model}: the daemon took another layout than the engine's"
        live = PD(model, tmp, baseline, pd_, dd, prefill, decode, port, hold, model_dir)
        yield live
    finally:
        if live is not None:  # the restart tests replace the daemons: stop the ones running now, after the engines
            started[:0] = [live.prefill_d, live.decode_d]
        for p in reversed(started):
            p.stop()


def handoff(pd: PD, ps: list[list[int]]) -> tuple[list[dict], dict]:
    """Tickets from the decode side, the prompts' KV through the prefill engine; returns the tickets
    and the prefill engine's result (its kv_transfer_params)."""
    tickets = [ticket(pd.port, p) for p in ps]
    res = pd.prefill.run([p[: t["kvd_tokens"]] for p, t in zip(ps, tickets)], tickets, max_tokens=1)
    return tickets, res


def decode(pd: PD, ps: list[list[int]], tickets: list[dict]) -> dict:
    return pd.decode.run(ps, [{"kvd_rid": t["kvd_rid"]} for t in tickets])


def sent(pd: PD, calls, n: int, timeout: float = 10.0):
    """The prefill daemon's calls since ``calls``, once ``n`` Sends are among them (the worker's
    sender thread sends after vLLM returned the requests) or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while (d := pd.prefill_d.rpc_counts() - calls)["Send"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return d


def live_requests(address: str) -> int:
    with Client.connect(address, name="probe") as c:
        return c.stats().pool.requests_live


def test_pd_matches_vllm_alone(pd: PD) -> None:
    ps = prompts(LENGTHS)
    calls_d, calls_p = pd.decode_d.rpc_counts(), pd.prefill_d.rpc_counts()
    t0 = time.perf_counter()
    tickets, pre = handoff(pd, ps)
    assert [p["kvd_rid"] for p in pre["kv_params"]] == [t["kvd_rid"] for t in tickets]
    out = decode(pd, ps, tickets)
    elapsed = time.perf_counter() - t0
    print(f"\n{pd.model}: PD {elapsed:.2f} s (prefill {pre['seconds']:.2f} s, decode {out['seconds']:.2f} s, "
          f"baseline {pd.baseline['seconds']:.2f} s)")
    same = [got == want for got, want in zip(out["tokens"], pd.baseline["tokens"])]
    first = [next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), None) for got, want in zip(out["tokens"], pd.baseline["tokens"])]
    assert all(len(w) == 32 for w in pd.baseline["tokens"])
    assert all(same), f"{pd.model}: PD output differs from vLLM alone for prompts {LENGTHS}: {same}, first diff at {first}"
    deadline = time.monotonic() + 5
    while live_requests(pd.decode_d.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(pd.decode_d.address) == 0, "the decode connector kept kvd pages after loading them"
    assert live_requests(pd.prefill_d.address) == 0, "the prefill connector kept kvd pages after sending them"
    # The handoff in the fused calls: a ticket is one Allocate (allocate + RECV lease), a prefill
    # request one Allocate (with its ticket) and one Send that frees it -- no AcquireLease, no Free.
    dd = pd.decode_d.rpc_counts() - calls_d
    dp = pd.prefill_d.rpc_counts() - calls_p
    n = len(ps)
    assert dd["Allocate"] == n and dd["AcquireLease"] == 0, dict(dd)
    # ... and on the decode side, the landed requests' page ids asked once per step (not per
    # request), and freed once per step (READY released their leases: no Abort first).
    assert 1 <= dd["Free"] <= n and dd["Abort"] == 0 and 1 <= dd["GetVectors"] <= n, dict(dd)
    # (a prefill step's new requests share one Allocate: at most one per request; the next test)
    assert 1 <= dp["Allocate"] <= n and dp["Send"] == n and dp["Free"] == 0 and dp["BeginSend"] == 0, dict(dp)


def test_a_prefill_step_opens_its_new_requests_in_one_allocate(pd: PD) -> None:
    """Four 40-token prompts through the 64-token prefill steps: each step starts two of them
    (40 + 24, then 16 + 40 + 8), and opens both in one Allocate on vLLM's forward thread, not one
    call each. Then a step whose batch the daemon refuses (one ticket is another request's): each
    request is opened alone, so only that one fails, and the others' handoffs stay exact. The
    reference is the decode engine itself computing the prompts (no kvd params; no prefix cache)."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the batching does not depend on the layout")
    ps = prompts([40, 40, 40, 40])
    alone = pd.decode.run(ps)
    calls, st0 = pd.prefill_d.rpc_counts(), pd.prefill.copy_stats()
    tickets, _ = handoff(pd, ps)
    dp, st = sent(pd, calls, len(ps)), pd.prefill.copy_stats()
    assert dp["Allocate"] == st["opens"] - st0["opens"] < len(ps) == st["opened"] - st0["opened"], (dict(dp), st)
    assert dp["Send"] == len(ps) and st["batches_refused"] == st0["batches_refused"], (dict(dp), st)
    out = decode(pd, ps, tickets)
    assert out["tokens"] == alone["tokens"], f"{pd.model}: PD with batched Allocates differs from the engine alone"

    ps2 = prompts([41, 42, 43, 44])
    tickets = [ticket(pd.port, p) for p in ps2]
    bad = dict(tickets[1], kvd_ticket=tickets[2]["kvd_ticket"])  # request 2's ticket on request 1: refused
    calls, st0 = pd.prefill_d.rpc_counts(), pd.prefill.copy_stats()
    pd.prefill.run([p[: t["kvd_tokens"]] for p, t in zip(ps2, tickets)], [tickets[0], bad, *tickets[2:]], max_tokens=1)
    dp, st = sent(pd, calls, 3), pd.prefill.copy_stats()
    assert st["batches_refused"] == st0["batches_refused"] + 1, st  # request 1's step: refused together ...
    assert st["opened"] - st0["opened"] == 3 and dp["Send"] == 3, (dict(dp), st)  # ... then all but request 1 opened, and sent
    good = [0, 2, 3]
    out = decode(pd, [ps2[i] for i in good], [tickets[i] for i in good])
    want = pd.decode.run([ps2[i] for i in good])
    assert out["tokens"] == want["tokens"], f"{pd.model}: a refused batch spoilt the handoffs of its other requests"
    assert live_requests(pd.prefill_d.address) == 0, "the prefill connector kept kvd pages of a refused batch"


def test_a_prefill_prefix_cache_hit_still_sends_every_token(pd: PD) -> None:
    """The prefill vLLM runs with prefix caching (vLLM's default): a prompt it has seen starts
    its first step past the cached blocks. Its KV for the cached tokens is in vLLM's blocks all
    the same, and must reach the decode side: the same prompts handed off twice (the second time
    mostly from the prefill's cache) both decode as vLLM alone."""
    ps = prompts(LENGTHS)
    for round_ in ("first", "cached"):
        st0 = pd.prefill.copy_stats()
        tickets, _ = handoff(pd, ps)
        out = decode(pd, ps, tickets)
        assert out["tokens"] == pd.baseline["tokens"], f"{pd.model}: PD with the prefill's prefix cache ({round_} run) differs from vLLM alone"
    cached = pd.prefill.copy_stats()["cached_tokens"] - st0["cached_tokens"]
    print(f"\n{pd.model}: {cached} of {sum(LENGTHS)} prompt tokens sent from the prefill's prefix cache")
    assert cached > 0, f"{pd.model}: the second run hit no prefix cache: this test proves nothing"


def test_a_decode_prefix_cache_hit_loads_only_past_it(pd: PD) -> None:
    """A second decode vLLM on the same daemon, with prefix caching (vLLM's default). Fresh
    prompts load every ticketed token; the same prompts again find every ticketed token in its
    own cache and load nothing (their kvd requests freed at admission); longer prompts that start
    with them load only past the hit. Each run decodes as the engine without a cache computing
    the prompts alone."""
    port = free_port()
    dec = Engine(pd.tmp, "decode-cached", pd.model_dir, kv_config("kv_consumer", pd.decode_d.address, kvd_ticket_listen=f"127.0.0.1:{port}",
                                                                  kvd_admit_ttl_s=ADMIT_TTL), extra=["--prefix-caching"])
    try:
        dec.ready()
        ps = prompts([70, 100, 77], salt=1)
        longer = prompts([150, 180, 120], salt=1)  # prompt i starts with ps[i]
        runs = []  # (ticketed tokens, loads, bytes loaded)
        ticketed: list[list[int]] = []  # per run, each request's
        for run in (ps, ps, longer):
            st0 = dec.copy_stats()
            tickets = [ticket(port, p) for p in run]
            pd.prefill.run([p[: t["kvd_tokens"]] for p, t in zip(run, tickets)], tickets, max_tokens=1)
            out = dec.run(run, [{"kvd_rid": t["kvd_rid"]} for t in tickets])
            assert out["tokens"] == pd.decode.run(run)["tokens"], f"{pd.model}: PD into a prefix-caching decode vLLM differs"
            st = dec.copy_stats()
            runs.append((sum(t["kvd_tokens"] for t in tickets), st["loads"] - st0["loads"], st["load_bytes"] - st0["load_bytes"]))
            ticketed.append([t["kvd_tokens"] for t in tickets])
            deadline = time.monotonic() + 5
            while any(transfer(port, t["kvd_rid"]) for t in tickets) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(transfer(port, t["kvd_rid"]) for t in tickets), "a finished request's kvd request was kept"
        print(f"\n{pd.model}, decode with prefix caching: (ticketed tokens, loads, bytes loaded) per run: {runs}")
        per_token = runs[0][2] / runs[0][0]
        assert runs[0][1] == 3 and per_token > 0, runs
        assert runs[1][1:] == (0, 0), runs  # every ticketed token in the decode's own cache
        # ... whose tickets were given back at admission, not when the requests ended
        full_hits = 3 + sum(a <= b for a, b in zip(ticketed[2], ticketed[0]))
        assert dec.scheduler()["ticket_stats"]["cached"] == full_hits, (ticketed, dec.scheduler())
        # only past ps's blocks (a longer prompt ticketed no further than its prefix -- granite's
        # 64-token blocks: 120 tokens -- loads nothing) ...
        assert runs[2][1] == sum(a > b for a, b in zip(ticketed[2], ticketed[0])), (runs, ticketed)
        assert 0 < runs[2][2] < runs[2][0] * per_token, runs
        if pd.model == "llama":  # ... exactly (its KV is per token; a window's or a state's is not)
            assert runs[2][2] == (runs[2][0] - runs[0][0]) * per_token, runs
    finally:
        dec.stop()


def test_a_decode_vllm_that_preempts_handed_over_requests_computes_them_again(pd: PD) -> None:
    """A second decode vLLM on the same daemon, with room for a few blocks only: requests whose KV
    was handed over are preempted while they decode (vLLM frees their blocks, and computes prompt
    and output again once room comes back). Each decodes as vLLM alone; the connector counts the
    recomputed ones (never a load again: their kvd requests were freed once loaded, and nothing
    waits for one), and no kvd page is left."""
    port = free_port()
    blocks = PREEMPT_BLOCKS[pd.model]
    dec = Engine(pd.tmp, "decode-small", pd.model_dir, kv_config("kv_consumer", pd.decode_d.address, kvd_ticket_listen=f"127.0.0.1:{port}",
                                                                kvd_admit_ttl_s=ADMIT_TTL), extra=["--num-blocks", str(blocks), "--max-model-len", "320"])
    try:
        dec.ready()
        ps = prompts(LENGTHS, salt=6)
        want = pd.decode.run(ps, max_tokens=96)["tokens"]  # the big decode engine computing the prompts alone
        tickets = [ticket(port, p) for p in ps]
        pd.prefill.run([p[: t["kvd_tokens"]] for p, t in zip(ps, tickets)], tickets, max_tokens=1)
        st = wait_state(port, [t["kvd_rid"] for t in tickets], {"READY"})
        assert all(s and s["state"] == "READY" for s in st), st
        out = dec.run(ps, [{"kvd_rid": t["kvd_rid"]} for t in tickets], max_tokens=96)
        sched = dec.scheduler()
        print(f"\n{pd.model}, decode vLLM of {blocks} blocks: {sched}")
        assert sched["preemptions"] > 0, f"{pd.model}: {blocks} blocks were enough for every request: nothing was preempted"
        assert out["tokens"] == want, f"{pd.model}: a preempted PD request decoded otherwise than vLLM alone"
        ts = sched["ticket_stats"]
        assert ts["admitted"] == len(ps) and ts["not_matched"] == 0 and 0 < ts["recomputed"] <= sched["preemptions"], ts
        deadline = time.monotonic() + 5
        while live_requests(pd.decode_d.address) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_requests(pd.decode_d.address) == 0, "pages leaked"
    finally:
        dec.stop()


def test_a_decode_request_aborted_while_its_kv_is_on_the_way_gives_back_blocks_and_pages(pd: PD) -> None:
    """A decode request admitted with a ticket whose KV has not come (vLLM holds its blocks and waits
    for the load: WAITING_FOR_REMOTE_KVS), then aborted (its client gone). vLLM frees such a
    request's blocks only once the connector reports its load finished: the connector must, though
    nothing will be copied, or vLLM holds the request and its blocks for good. Its kvd request is
    freed, its RECV lease aborted; the engine serves the next handoff as before."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the abort does not depend on the layout")
    ps = prompts([100], salt=7)
    tickets = [ticket(pd.port, p) for p in ps]  # minted; no prefill will send them
    before = pd.decode.scheduler()
    res = pd.decode.abort_after(ps, [{"kvd_rid": t["kvd_rid"]} for t in tickets], steps=2)
    assert res["finished_before_abort"] == [], res
    deadline = time.monotonic() + 5
    while (live_requests(pd.decode_d.address) or pd.decode.scheduler()["requests"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = pd.decode.scheduler()
    assert after["requests"] == 0, f"vLLM still holds the aborted request: {after}"
    assert after["free_blocks"] == before["free_blocks"], f"the aborted request's vLLM blocks were kept: {before} -> {after}"
    assert live_requests(pd.decode_d.address) == 0, "the aborted request's kvd pages were kept"
    assert transfer(pd.port, tickets[0]["kvd_rid"]) is None
    again = prompts(LENGTHS[:1])
    t2, _ = handoff(pd, again)
    assert decode(pd, again, t2)["tokens"] == pd.baseline["tokens"][:1]


def test_kv_landed_at_admission_is_loaded_in_the_step_that_computes_the_tail(pd: PD) -> None:
    """Prompts whose KV has landed when the decode vLLM admits them. Llama (one KV cache group):
    each is copied before the forward of the step that computes its tail (vLLM's sync load), so
    its first token comes from the first step; the hybrid models load asynchronously as before, a
    step of their own first (vLLM fails a sync load's request by block ids, which name a block
    only with one group). vLLM alone's output either way, and every kvd request freed once loaded
    (a sync load's on the worker's report, KVConnectorWorkerMetadata)."""
    ps = prompts(LENGTHS, salt=3)
    want = pd.decode.run(ps)["tokens"]  # the decode engine computing the prompts alone
    tickets, _ = handoff(pd, ps)
    st = wait_state(pd.port, [t["kvd_rid"] for t in tickets], {"READY"})
    assert all(s and s["state"] == "READY" for s in st), st
    st0 = pd.decode.copy_stats()
    out = decode(pd, ps, tickets)
    st1 = pd.decode.copy_stats()
    got = {k: st1[k] - st0[k] for k in ("loads", "sync_loads", "sync_failed", "steps")}
    print(f"\n{pd.model}: 4 requests landed at admission, 32 tokens each: {got}")
    assert out["tokens"] == want, f"{pd.model}: PD with the KV landed at admission differs from vLLM alone"
    sync = pd.model == "llama"
    assert got["loads"] == len(ps) and got["sync_loads"] == (len(ps) if sync else 0) and got["sync_failed"] == 0, got
    assert got["steps"] == (32 if sync else 33), got  # the load's own step, or none
    deadline = time.monotonic() + 5
    while any(transfer(pd.port, t["kvd_rid"]) for t in tickets) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(transfer(pd.port, t["kvd_rid"]) for t in tickets), "a loaded request's ticket was kept"
    while live_requests(pd.decode_d.address) and time.monotonic() < deadline + 5:  # the Free follows the ticket's end
        time.sleep(0.05)
    assert live_requests(pd.decode_d.address) == 0, "the decode connector kept kvd pages after loading them"


def test_kv_landed_then_its_decode_daemon_restarted_fails_the_request(pd: PD) -> None:
    """The KV landed, then the decode daemon restarted before the decode vLLM admitted the request:
    its pages went with the old arena. The request fails (Llama: a sync load that reports its
    blocks, and vLLM drops what the step computed; the hybrid models: failed_recving), never
    decodes from the old arena, and the next handoff is exact."""
    ps = prompts(LENGTHS[:1], salt=4)
    tickets, _ = handoff(pd, ps)
    st = wait_state(pd.port, [t["kvd_rid"] for t in tickets], {"READY"})
    assert st[0] and st[0]["state"] == "READY", st
    st0 = pd.decode.copy_stats()
    pd.decode_d = pd.decode_d.restarted(layout=pd.tmp / "layout.json")
    out = decode(pd, ps, tickets)
    st1 = pd.decode.copy_stats()
    assert len(out["tokens"][0]) < 32 and out["finish"][0] in ("error", "abort"), out
    assert st1["sync_failed"] - st0["sync_failed"] == (1 if pd.model == "llama" else 0), (st0, st1)
    assert st1["loads"] == st0["loads"], "nothing was copied"
    ps = prompts(LENGTHS[:2])
    tickets, _ = handoff(pd, ps)
    assert decode(pd, ps, tickets)["tokens"] == pd.baseline["tokens"][:2], f"{pd.model}: PD after the restart differs"
    deadline = time.monotonic() + 5
    while live_requests(pd.decode_d.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(pd.decode_d.address) == 0, "pages leaked"


def test_a_ticket_sent_twice_to_the_prefill_engine_leaves_the_first_request_alone(pd: PD) -> None:
    """Two prefill requests with one ticket in one step (a client's retry while the first still
    computes): the second is refused its kvd request and sends nothing; the first's stays open,
    is written and sent, and decodes exactly. Before, the refused open freed the kvd request the
    first one was still writing into (its page ids kept in the worker: writes into pages the
    daemon could hand to another request) and the handoff failed."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the open does not depend on the layout")
    ps = prompts([100], salt=5)
    t = ticket(pd.port, ps[0])
    st0 = pd.prefill.copy_stats()
    pd.prefill.run([ps[0][: t["kvd_tokens"]]] * 2, [t, t], max_tokens=1)
    st = wait_state(pd.port, [t["kvd_rid"]], {"READY", "FAILED"})
    assert st[0] and st[0]["state"] == "READY", st
    deadline = time.monotonic() + 5  # the sender thread counts its Send once the reply is back
    while (st1 := pd.prefill.copy_stats())["sends"] == st0["sends"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st1["sends"] - st0["sends"] == 1 and st1["adopted"] == st0["adopted"], (st0, st1)
    assert decode(pd, ps, [t])["tokens"] == pd.decode.run(ps)["tokens"], f"{pd.model}: the first request's handoff is not exact"
    assert live_requests(pd.prefill_d.address) == 0


def test_a_prefill_aborted_mid_prompt_frees_its_kvd_request_and_fails_the_transfer(pd: PD) -> None:
    """A prefill request aborted after two of its 64-token steps (its client gone): its kvd request
    was opened and half saved, and no Send will come. The producer frees it once vLLM says the
    request ended (at the worker's next step: vLLM steps no worker while idle), which fails the
    transfer on the decode side at once, instead of holding the prefill daemon's pages for the
    worker's lifetime and the decode side's until its admission window closes."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the abort does not depend on the layout")
    ps = prompts([300], salt=2)
    tickets = [ticket(pd.port, p) for p in ps]
    st0 = pd.prefill.copy_stats()
    res = pd.prefill.abort_after([p[: t["kvd_tokens"]] for p, t in zip(ps, tickets)], tickets, steps=2)
    assert res["finished_before_abort"] == [], res
    t0 = time.monotonic()
    after = prompts(LENGTHS[:1])
    t2, _ = handoff(pd, after)  # the worker's next step, where vLLM names the aborted request
    st = wait_state(pd.port, [tickets[0]["kvd_rid"]], {"FAILED"}, timeout=5)
    assert st[0] is None or st[0]["state"] == "FAILED", st  # failed (or, failed and reclaimed already)
    assert st[0] is None or "ended the request before its prompt was computed" in st[0]["reason"], st  # and why
    assert time.monotonic() - t0 < ADMIT_TTL, "the transfer failed no sooner than the admission window"
    assert decode(pd, after, t2)["tokens"] == pd.baseline["tokens"][:1]
    assert live_requests(pd.prefill_d.address) == 0, "the aborted request's kvd pages were kept on the prefill daemon"
    assert pd.prefill.copy_stats()["abandoned"] == st0["abandoned"] + 1


def test_prompt_shorter_than_a_block_gets_no_ticket(pd: PD) -> None:
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as ei:
        ticket(pd.port, prompts([12])[0])
    assert ei.value.code == 400


def test_corrupted_kv_changes_the_output(pd: PD) -> None:
    """Negative control: the same handoff with the decode daemon's arena overwritten by noise (state
    bytes xor-ed) after the KV arrived and before decode admits: every output must differ."""
    ps = prompts(LENGTHS)
    tickets, _ = handoff(pd, ps)
    st = wait_state(pd.port, [t["kvd_rid"] for t in tickets], {"READY"})
    assert all(s and s["state"] == "READY" for s in st), st
    with Client.connect(pd.decode_d.address, name="corrupter") as c:
        att = c.attach()
        for name, layers in att.views.items():
            for lkv in layers:
                if name == "state":
                    lkv.k.bitwise_xor_(0x55)
                else:  # noise: a sign flip alone left one Gemma3 prompt's 32 tokens unchanged
                    lkv.k.normal_(0.0, 1.0)
                    lkv.v.normal_(0.0, 1.0)
        del att
    out = decode(pd, ps, tickets)
    for i, (got, want) in enumerate(zip(out["tokens"], pd.baseline["tokens"])):
        assert got != want, f"{pd.model} prompt {i}: corrupted KV gave vLLM-alone's output: the KV was not used"


def test_more_pending_transfers_than_engine_socket_connections(pd: PD) -> None:
    """300 tickets pending at once -- more than the daemon's 256 engine-socket connections, which a
    blocking WaitReady per pending transfer would each hold (the 257th refused, its request
    FAILED): the decode connector reads them all on their doorbells from one thread. All stay
    WAITING, a handoff beside them decodes as vLLM alone, and the unclaimed ones are reclaimed."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the watcher does not depend on the layout")
    idle = [ticket(pd.port, p)["kvd_rid"] for p in prompts([40] * 300)]
    time.sleep(0.5)  # a watcher that failed them would have by now
    st = [transfer(pd.port, rid) for rid in idle]
    assert all(s is not None and s["state"] == "WAITING" for s in st), [s for s in st if not s or s["state"] != "WAITING"][:3]
    ps = prompts(LENGTHS[:1])
    tickets, _ = handoff(pd, ps)
    out = decode(pd, ps, tickets)
    assert out["tokens"][0] == pd.baseline["tokens"][0], f"{pd.model}: PD beside 300 pending transfers differs from vLLM alone"
    deadline = time.monotonic() + ADMIT_TTL + 10
    while live_requests(pd.decode_d.address) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert live_requests(pd.decode_d.address) == 0, "unclaimed tickets kept their kvd pages past the admission window"


def test_never_admitted_is_reclaimed(pd: PD) -> None:
    if pd.model != "llama":
        pytest.skip("one model is enough: the reclaim does not depend on the layout")
    ps = prompts([40])
    tickets, _ = handoff(pd, ps)
    wait_state(pd.port, [tickets[0]["kvd_rid"]], {"READY"})
    assert live_requests(pd.decode_d.address) == 1
    t0 = time.monotonic()
    while transfer(pd.port, tickets[0]["kvd_rid"]) is not None and time.monotonic() - t0 < ADMIT_TTL + 5:
        time.sleep(0.1)
    assert live_requests(pd.decode_d.address) == 0, "a request decode never admitted kept its kvd pages"
    out = decode(pd, ps, tickets)  # too late: computed locally (with a warning), still the right tokens
    assert out["tokens"][0] == pd.baseline["tokens"][0][:32] or len(out["tokens"][0]) == 32


def test_engines_carry_on_across_daemon_restarts(pd: PD) -> None:
    """Both daemons restarted under running engines (new boots, new arenas; the prefill daemon with
    no layout until an engine proposes it, the decode daemon given the layout, as an operator may
    start it): the next handoff is exact, and no engine was restarted. The prefill worker connects
    again at its next Allocate (SessionGone), the decode worker at its next load (page ids of a
    boot it has not attached: never copied from the old arena, whose views it still holds)."""
    before = {e.name: e.copy_stats()["reconnects"] for e in (pd.prefill, pd.decode)}
    pd.prefill_d = pd.prefill_d.restarted()
    pd.decode_d = pd.decode_d.restarted(layout=pd.tmp / "layout.json")
    ps = prompts(LENGTHS[:2])
    tickets, pre = handoff(pd, ps)
    assert [p["kvd_rid"] for p in pre["kv_params"]] == [t["kvd_rid"] for t in tickets]
    out = decode(pd, ps, tickets)
    assert out["tokens"] == pd.baseline["tokens"][:2], f"{pd.model}: PD output after the daemons' restart differs from vLLM alone"
    after = {e.name: e.copy_stats()["reconnects"] for e in (pd.prefill, pd.decode)}
    assert after == {k: v + 1 for k, v in before.items()}, f"each worker connects again once: {before} -> {after}"
    deadline = time.monotonic() + 5
    while (live_requests(pd.decode_d.address) or live_requests(pd.prefill_d.address)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(pd.decode_d.address) == 0 and live_requests(pd.prefill_d.address) == 0, "pages leaked"


def held_open(pd: PD) -> str:
    """One request's transfer open (the prefill engine wrote its KV; its Send held: ``pd.hold``
    exists) and the decode vLLM admitted the request and waits for it; returns its kvd rid."""
    ps = prompts([100])
    tickets, _ = handoff(pd, ps)
    rid = tickets[0]["kvd_rid"]
    pd.decode.submit(ps, [{"kvd_rid": rid}])
    end = time.monotonic() + 30
    while not (transfer(pd.port, rid) or {}).get("admitted") and time.monotonic() < end:
        time.sleep(0.05)
    assert transfer(pd.port, rid)["state"] == "WAITING", "the transfer must still be open"
    return rid


def test_a_decode_daemon_restart_fails_the_transfer_in_flight_only(pd: PD) -> None:
    """The decode daemon restarted while a transfer is open (the prefill engine's Send held) and
    the decode vLLM waits for it: that request fails at once through vLLM's load-error path (its
    doorbell board went with the daemon), the prefill side's Send is refused (a ticket of the old
    boot) and its pages freed, and the next handoff is exact."""
    if pd.model != "llama":
        pytest.skip("one model is enough: the restart does not depend on the layout")
    pd.hold.touch()
    try:
        held_open(pd)
        t0 = time.perf_counter()
        pd.decode_d = pd.decode_d.restarted(layout=pd.tmp / "layout.json")
        out = pd.decode.result(timeout=60)
        failed_s = time.perf_counter() - t0
    finally:
        pd.hold.unlink()  # the held Send goes on, to a daemon that no longer knows its ticket
    print(f"\n{pd.model}: decode request failed {failed_s:.2f} s after its daemon was stopped (and started again)")
    assert len(out["tokens"][0]) < 32 and out["finish"][0] in ("error", "abort"), out
    assert failed_s < ADMIT_TTL / 2, "the request waited out its deadline instead of failing with its daemon"
    deadline = time.monotonic() + 10
    while live_requests(pd.prefill_d.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(pd.prefill_d.address) == 0, "the prefill side kept the refused request's pages"
    ps = prompts(LENGTHS[:1])
    tickets, _ = handoff(pd, ps)
    out = decode(pd, ps, tickets)
    assert out["tokens"][0] == pd.baseline["tokens"][0], f"{pd.model}: PD after the decode daemon's restart differs from vLLM alone"


def test_killed_prefill_fails_the_decode_request(pd: PD) -> None:
    """Last test of the module: it kills the prefill engine."""
    pd.hold.touch()
    held_open(pd)
    os.kill(pd.prefill.proc.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    out = pd.decode.result(timeout=60)
    failed_s = time.perf_counter() - t0
    print(f"\n{pd.model}: decode request failed {failed_s:.2f} s after the prefill engine was killed "
          f"(finish_reason {out['finish'][0]!r})")
    assert len(out["tokens"][0]) < 32, "a failed load must never decode"
    assert out["finish"][0] in ("error", "abort"), out
    assert failed_s < 3.0
    deadline = time.monotonic() + 5
    while (live_requests(pd.decode_d.address) or live_requests(pd.prefill_d.address)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(pd.decode_d.address) == 0 and live_requests(pd.prefill_d.address) == 0, "pages leaked"
    pd.hold.unlink()


# ---- refusals at start-up (Llama only: they do not depend on the model) ---------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build("llama", str(tmp_path_factory.getbasetemp() / "models"))


def refused_start(tmp: Path, name: str, model: str, kv: str) -> tuple[str, float]:
    """Start an engine that must not start; its log and how long it took to give up."""
    e = Engine(tmp, name, model, kv)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            e.ready()
        took = time.perf_counter() - t0
        e.proc.wait(30)
    finally:
        e.stop()
    assert e.proc.returncode != 0
    return e.log.read_text(), took


def test_vllm_refuses_to_start_without_its_daemon(tmp_path, llama) -> None:
    address = f"unix:{tmp_path}/no-daemon.sock"
    log, took = refused_start(tmp_path, "orphan", llama, kv_config("kv_producer", address))
    print(f"\nvLLM without its daemon gave up after {took:.1f} s")
    assert f"no kvd daemon answers at {address!r}" in log, log[-3000:]


def test_vllm_refuses_a_daemon_of_another_layout_naming_both(tmp_path, llama) -> None:
    d = Daemon.start(tmp_path, "tiny", "tiny-hybrid")
    try:
        log, _ = refused_start(tmp_path, "mismatch", llama, kv_config("kv_producer", d.address))
        with Client.connect(d.address, name="probe") as c:
            assert c.info().layout.name == "tiny-hybrid" and c.stats().pool.requests_live == 0
    finally:
        d.stop()
    assert f"the kvd daemon at {d.address} refused this vLLM's layout" in log, log[-3000:]
    assert "layout tiny-hybrid page_size=4" in log and "layout llama page_size=32" in log, log[-3000:]
