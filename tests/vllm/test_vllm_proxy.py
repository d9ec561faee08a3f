"""``kvd proxy`` in front of two real vLLM OpenAI servers (prefill, decode; tiny Llama), each beside
its own kvd daemon: completions and chat, whole and streamed, answer what the decode server alone
answers, with the KV handed off (the decode daemon's page ids asked for: a load); a request the
handoff cannot serve (a prompt too short, a prefill instance down) is served by the decode instance
alone and its ticket given back at once; a caller gone mid-stream aborts the decode request."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Not "vllm": with tests/ on sys.path (rootdir conftest), tests/vllm imports as a namespace package.
pytest.importorskip("vllm.config", reason="the vLLM tier runs in .venv-vllm (make venv-vllm)")

import pd_kit as pk  # noqa: E402
import tiny_models  # noqa: E402
from daemon_kit import samples  # noqa: E402

from kvd.client import Client  # noqa: E402

WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
CHAT = [{"role": "system", "content": " ".join(WORDS * 3)}, {"role": "user", "content": " ".join(reversed(WORDS * 2))}]


@dataclass
class Stack:
    tmp: Path
    model: str
    prefill_d: pk.Daemon
    decode_d: pk.Daemon
    prefill: str  # base URLs
    decode: str
    tickets: str
    proxy: str
    procs: list[subprocess.Popen]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("proxy")
    model = tiny_models.build("llama", str(tmp_path_factory.getbasetemp() / "models"))
    procs: list[subprocess.Popen] = []
    pd_ = dd = None
    try:
        pd_, dd = pk.Daemon.start(tmp, "p"), pk.Daemon.start(tmp, "d")
        pport, dport, tport = pk.free_port(), pk.free_port(), pk.free_port()
        urls = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{tport}"
        # one at a time: two vLLM start-ups at once crawl on 2 cores
        procs.append(pk.start_server(tmp, "decode", model, dport, pk.kv_config("kv_consumer", dd.address, kvd_ticket_listen=f"127.0.0.1:{tport}")))
        pk.wait_up(urls[1], procs[-1], tmp / "decode.server.log")
        procs.append(pk.start_server(tmp, "prefill", model, pport, pk.kv_config("kv_producer", pd_.address)))
        pk.wait_up(urls[0], procs[-1], tmp / "prefill.server.log")
        proxy, proc = pk.start_proxy(tmp, "proxy", [urls[0]], [(urls[1], urls[2])])
        procs.append(proc)
        yield Stack(tmp, model, pd_, dd, *urls, proxy, procs)
    finally:
        pk.stop_all(procs)
        for d in (pd_, dd):
            if d is not None:
                d.stop()


def _post(url: str, path: str, body: dict) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}


def _stream(url: str, path: str, body: dict) -> tuple[str, dict[str, str], bool]:
    """The text of a streamed answer (completion text or chat deltas), its headers, and whether it
    ended with ``data: [DONE]``."""
    req = urllib.request.Request(url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    parts, done = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        assert headers["content-type"].startswith("text/event-stream"), headers
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ch = json.loads(line[6:])["choices"]
            if ch:
                parts.append(ch[0].get("text") or (ch[0].get("delta") or {}).get("content") or "")
    return "".join(parts), headers, done


def _text(doc: dict) -> str:
    c = doc["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def _live(address: str) -> int:
    with Client.connect(address, name="probe") as c:
        return c.stats().pool.requests_live


def _wait_live_zero(address: str, timeout: float = 10) -> int:
    end = time.monotonic() + timeout
    while (n := _live(address)) and time.monotonic() < end:
        time.sleep(0.05)
    return n


def _loads(s: Stack) -> int:
    """Page-id lookups on the decode daemon: the connector asks one per load it copies."""
    return s.decode_d.rpc_counts()["GetVectors"]


def test_completions_whole_and_streamed_match_the_decode_server_alone(stack: Stack) -> None:
    s = stack
    prompt = pk.prompts([100])[0]
    body = {"model": s.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    alone, _ = _post(s.decode, "/v1/completions", body)
    loads = _loads(s)
    doc, hdr = _post(s.proxy, "/v1/completions", body)
    assert hdr["x-kvd-path"] == "pd" and float(hdr["x-kvd-prefill-ms"]) > 0, hdr
    assert set(doc["kvd"]) == {"ticket_s", "prefill_s"}, doc.get("kvd")
    assert _text(doc) == _text(alone) and doc["usage"]["completion_tokens"] == 16
    text, hdr, done = _stream(s.proxy, "/v1/completions", body)
    assert hdr["x-kvd-path"] == "pd" and done and text == _text(alone)
    # a string prompt: tokenized on the prefill instance, the decode instance given those ids
    words = {"model": s.model, "prompt": " ".join(WORDS * 4), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    doc, hdr = _post(s.proxy, "/v1/completions", words)
    assert hdr["x-kvd-path"] == "pd" and _text(doc) == _text(_post(s.decode, "/v1/completions", words)[0])
    assert _loads(s) >= loads + 3, "the decode vLLM computed the prompts itself instead of loading the KV sent"
    assert _wait_live_zero(s.decode_d.address) == 0 and _wait_live_zero(s.prefill_d.address) == 0
    # The connectors' counts in vLLM's own /metrics (vllm:kvd_*), each side its own.
    dec = _wait_vllm(s.decode, "vllm:kvd_loads_total", 3)
    assert dec["vllm:kvd_tickets_minted_total"] >= 3 and dec["vllm:kvd_admitted_total"] >= 3
    assert dec["vllm:kvd_load_bytes_total"] > 0 and dec.get("vllm:kvd_sends_total", 0) == 0
    # A Send ends after its request's last step, and vLLM collects a worker's counts at its steps:
    # the last Send is counted at the prefill server's next step (any request).
    _post(s.prefill, "/v1/completions", {"model": s.model, "prompt": pk.prompts([8])[0], "max_tokens": 1})
    pre = _wait_vllm(s.prefill, "vllm:kvd_sends_total", 3)
    assert pre["vllm:kvd_send_bytes_total"] > 0 and pre["vllm:kvd_save_bytes_total"] > 0 and pre.get("vllm:kvd_loads_total", 0) == 0


def _deploy_kit():
    """tests/deploy/deploy_kit.py (the deployment files' PromQL helpers), by its path."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "deploy" / "deploy_kit.py"
    spec = importlib.util.spec_from_file_location("deploy_kit_for_vllm", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_dashboard_and_rules_select_what_the_vllm_servers_export(stack: Stack) -> None:
    """Every vllm:kvd_* series the Grafana dashboard and the Prometheus rules select (KvdConnector's
    counters, scraped from the engines) is in a real vLLM server's /metrics, with every label they
    match or group by (beyond the labels Prometheus adds at scrape time)."""
    K = _deploy_kit()
    scrape = K.Scrape([_scrape_proxy(url) for url in (stack.prefill, stack.decode)])
    checked = 0
    for source, name, expr in K.exprs():
        used = list(K.vllm_selectors(expr))
        if used:
            K.check_selected(scrape, f"{source} {name}", expr, used, "vLLM's /metrics: kvd/connectors/vllm_stats.py COUNTERS")
            checked += len(used)
    assert checked >= 20, "the dashboard's vLLM connector row and the KvdVllm* rules select vllm:kvd_* series"


def test_several_samples_of_one_prompt(stack: Stack) -> None:
    """``n=2``: vLLM runs two requests of one prompt on the decode server; one loads the KV sent,
    the other finds the ticket taken and computes the prompt itself (the connector's rule): both
    samples (seeded: vLLM refuses n > 1 greedy) are the decode server's alone, and no kvd page is
    left behind."""
    s = stack
    body = {"model": s.model, "prompt": pk.prompts([96], salt=11)[0], "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True, "n": 2}
    alone, _ = _post(s.decode, "/v1/completions", body)
    doc, hdr = _post(s.proxy, "/v1/completions", body)
    assert hdr["x-kvd-path"] == "pd"
    assert sorted(c["text"] for c in doc["choices"]) == sorted(c["text"] for c in alone["choices"])
    assert _wait_live_zero(s.decode_d.address) == 0 and _wait_live_zero(s.prefill_d.address) == 0


def test_chat_whole_and_streamed_matches_the_decode_server_alone(stack: Stack) -> None:
    s = stack
    body = {"model": s.model, "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone, _ = _post(s.decode, "/v1/chat/completions", body)
    loads = _loads(s)
    doc, hdr = _post(s.proxy, "/v1/chat/completions", body)
    assert hdr["x-kvd-path"] == "pd" and doc["object"] == "chat.completion" and _text(doc) == _text(alone)
    text, hdr, done = _stream(s.proxy, "/v1/chat/completions", body)
    assert hdr["x-kvd-path"] == "pd" and done and text == _text(alone)
    # The decode instance templated the chat to the very tokens the ticket was minted for: it loaded.
    assert _loads(s) >= loads + 2
    assert _wait_live_zero(s.decode_d.address) == 0


def test_what_the_handoff_cannot_serve_the_decode_instance_serves_alone(stack: Stack) -> None:
    s = stack
    short = {"model": s.model, "prompt": pk.prompts([20])[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    doc, hdr = _post(s.proxy, "/v1/completions", short)
    assert hdr["x-kvd-path"] == "decode-only:short_prompt" and "kvd" not in doc
    assert _text(doc) == _text(_post(s.decode, "/v1/completions", short)[0])
    # Logprobs of the prompt: only an instance that computes the prompt has them.
    lp = {"model": s.model, "prompt": pk.prompts([70], salt=4)[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    doc, hdr = _post(s.proxy, "/v1/completions", lp)
    assert hdr["x-kvd-path"] == "decode-only:prompt_logprobs"
    assert doc["choices"][0]["prompt_logprobs"][1:] == _post(s.decode, "/v1/completions", lp)[0]["choices"][0]["prompt_logprobs"][1:]
    # A prefill instance that does not answer: the ticket minted for it is given back at once (not
    # after the connector's 30 s admission window) and the decode instance computes the prompt.
    dead = f"http://127.0.0.1:{pk.free_port()}"
    url, proc = pk.start_proxy(s.tmp, "proxy-dead-prefill", [dead], [(s.decode, s.tickets)])
    try:
        body = {"model": s.model, "prompt": pk.prompts([90], salt=3)[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        doc, hdr = _post(url, "/v1/completions", body)
        assert hdr["x-kvd-path"] == "decode-only:prefill_failed", hdr
        assert _text(doc) == _text(_post(s.decode, "/v1/completions", body)[0])
        assert _wait_live_zero(s.decode_d.address, 5) == 0 and time.monotonic() - t0 < 20
        m = samples(_scrape_proxy(url))
        assert m[("kvd_proxy_fallbacks_total", (("reason", "prefill_failed"),))] == 1
        assert m[("kvd_proxy_requests_total", (("path", "decode-only"), ("route", "completions")))] == 1
        _wait_vllm(s.decode, "vllm:kvd_tickets_released_total", 1)
    finally:
        pk.stop_all([proc])
    # bad input: a clear 400, nothing minted
    req = urllib.request.Request(s.proxy + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"not JSON" in e.value.read()


def test_instances_that_refuse_connections_are_passed_over(stack: Stack) -> None:
    """A proxy given a dead instance of each role beside the live one (listed first): every
    request still goes through the handoff, on the live instances."""
    s = stack
    dead = [f"http://127.0.0.1:{pk.free_port()}" for _ in range(3)]
    url, proc = pk.start_proxy(s.tmp, "proxy-dead-first", [dead[0], s.prefill], [(dead[1], dead[2]), (s.decode, s.tickets)])
    try:
        for i in range(3):
            body = {"model": s.model, "prompt": " ".join(WORDS[i:] * 4), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            doc, hdr = _post(url, "/v1/completions", body)
            assert hdr["x-kvd-path"] == "pd", hdr
            assert _text(doc) == _text(_post(s.decode, "/v1/completions", body)[0])
        assert _wait_live_zero(s.decode_d.address) == 0
    finally:
        pk.stop_all([proc])


def test_a_decode_server_gone_answers_502_and_gives_its_ticket_back(stack: Stack) -> None:
    """A decode instance whose vLLM server is gone but whose connector's ticket server answers: the
    handoff is made, the decode call fails, the caller gets a 502 (counted), and the ticket whose
    KV landed is given back at once -- not after the connector's 30 s admission window."""
    s = stack
    dead = f"http://127.0.0.1:{pk.free_port()}"
    url, proc = pk.start_proxy(s.tmp, "proxy-dead-decode", [s.prefill], [(dead, s.tickets)])
    try:
        released = _vllm(s.decode, "vllm:kvd_tickets_released_total")
        body = {"model": s.model, "prompt": pk.prompts([90], salt=5)[0], "max_tokens": 4, "temperature": 0}
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(url, "/v1/completions", body)
        assert e.value.code == 502 and e.value.headers["x-kvd-path"] == "pd"
        assert dead.encode() in e.value.read()
        assert _wait_live_zero(s.decode_d.address, 5) == 0 and time.monotonic() - t0 < 20
        # vLLM publishes the connector's counts with a step's stats: one request makes a step
        _post(s.decode, "/v1/completions", dict(body, max_tokens=1))
        _wait_vllm(s.decode, "vllm:kvd_tickets_released_total", released + 1)
        m = samples(_scrape_proxy(url))
        assert m[("kvd_proxy_decode_errors_total", (("route", "completions"),))] == 1
        assert m[("kvd_proxy_decode_errors_total", (("route", "chat"),))] == 0
        assert m[("kvd_proxy_requests_total", (("path", "pd"), ("route", "completions")))] == 1
    finally:
        pk.stop_all([proc])


def _scrape_proxy(url: str) -> str:
    """A server's /metrics (the proxy's, or a vLLM server's) as text."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _summed(url: str) -> dict[str, float]:
    """A server's series by sample name, summed over their labels."""
    out: dict[str, float] = {}
    for (n, _), v in samples(_scrape_proxy(url)).items():
        out[n] = out.get(n, 0) + v
    return out


def _wait_vllm(url: str, name: str, at_least: float, timeout: float = 15) -> dict[str, float]:
    end = time.monotonic() + timeout
    while (got := _summed(url)).get(name, 0) < at_least and time.monotonic() < end:
        time.sleep(0.2)
    assert got.get(name, 0) >= at_least, (name, {k: v for k, v in got.items() if k.startswith("vllm:kvd_")})
    return got


def _vllm(url: str, name: str) -> float:
    return _summed(url).get(name, 0)


def test_a_caller_gone_mid_stream_aborts_the_decode_request(stack: Stack) -> None:
    """The caller reads one event and leaves: the proxy stops the stream and closes the decode
    connection, so the decode vLLM drops the request with its 900 tokens far from done (no finished
    request counted, fewer than 900 tokens generated) and its kvd pages are freed."""
    s = stack
    done0, gen0 = _vllm(s.decode, "vllm:request_success_total"), _vllm(s.decode, "vllm:generation_tokens_total")
    host, port = s.proxy.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": s.model, "prompt": pk.prompts([100], salt=5)[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("x-kvd-path") == "pd"
    assert r.readline().startswith(b"data: ")  # the first token is out
    conn.sock.close()  # the caller goes away, 899 tokens early
    conn.close()
    end = time.monotonic() + 60
    while (_vllm(s.decode, "vllm:num_requests_running") or _vllm(s.decode, "vllm:num_requests_waiting")) and time.monotonic() < end:
        time.sleep(0.1)
    assert _vllm(s.decode, "vllm:num_requests_running") == 0
    assert _vllm(s.decode, "vllm:request_success_total") == done0, "the decode vLLM finished the request for a caller that left"
    assert _vllm(s.decode, "vllm:generation_tokens_total") - gen0 < 900
    assert samples(_scrape_proxy(s.proxy))[("kvd_proxy_streams_cut_total", ())] == 1
    assert _wait_live_zero(s.decode_d.address) == 0
