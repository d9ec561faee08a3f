"""``kvd proxy``: a minimal OpenAI-compatible front for vLLM prefill/decode over kvd (stdlib only).

``POST /v1/completions`` (non-streaming; ``prompt`` a string or token ids):

1. tokenize the prompt on the prefill instance (``POST /tokenize``) unless it is token ids;
2. ask the decode instance's KvdConnector for a ticket (``POST {tickets}/v1/kvd/tickets``): the
   decode daemon allocates and leases the request's pages now (push mode);
3. prefill: ``prompt[:kvd_tokens]``, ``max_tokens=1``, ``kv_transfer_params`` = the ticket;
4. decode: the whole prompt and the caller's parameters, ``kv_transfer_params={"kvd_rid": ...}``;
   its reply goes back to the caller with ``kvd`` timings (ticket, prefill, decode seconds).

Other paths are passed to the decode instance unchanged (``/v1/models``, ``/health``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["make_server", "post_json", "reply_json"]


def reply_json(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
    """Answer ``handler``'s request with ``code`` and ``body`` as JSON (the proxy's and the
    connector's ticket server's one reply)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def make_server(listen: str, prefill: str, decode: str, tickets: str) -> ThreadingHTTPServer:
    """A proxy on ``listen`` (host:port) over the prefill and decode vLLM base URLs and the decode
    connector's ticket URL (``kvd_ticket_listen``). Call ``serve_forever()``."""
    prefill, decode, tickets = (u.rstrip("/") for u in (prefill, decode, tickets))

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            reply_json(self, code, body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                with urllib.request.urlopen(decode + self.path, timeout=30) as r:
                    self._reply(r.status, json.loads(r.read() or b"{}"))
            except urllib.error.HTTPError as e:
                self._reply(e.code, {"error": e.reason})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                return self._reply(404, {"error": "kvd proxy serves POST /v1/completions"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self._reply(200, complete(body))
            except urllib.error.HTTPError as e:
                self._reply(e.code, {"error": f"upstream: {e.read()[:500].decode(errors='replace')}"})
            except (ValueError, KeyError, TypeError) as e:
                self._reply(400, {"error": str(e)})

        def log_message(self, *args: object) -> None:
            pass

    def complete(body: dict) -> dict:
        if body.get("stream"):
            raise ValueError("kvd proxy: streaming is not supported; drop stream")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = post_json(f"{prefill}/tokenize", {"model": body.get("model"), "prompt": prompt})["tokens"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("prompt: one string or one list of token ids")
        t0 = time.perf_counter()
        try:
            tk = post_json(f"{tickets}/v1/kvd/tickets", {"prompt_token_ids": prompt})
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise
            return post_json(f"{decode}/v1/completions", dict(body, prompt=prompt))  # too short to hand off
        t1 = time.perf_counter()
        pre = dict(body, prompt=prompt[: tk["kvd_tokens"]], max_tokens=1, kv_transfer_params=tk)
        pre.pop("min_tokens", None)
        post_json(f"{prefill}/v1/completions", pre)
        t2 = time.perf_counter()
        out = post_json(f"{decode}/v1/completions", dict(body, prompt=prompt, kv_transfer_params={"kvd_rid": tk["kvd_rid"]}))
        t3 = time.perf_counter()
        out["kvd"] = {"ticket_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "prompt_tokens": len(prompt)}
        return out

    host, _, port = listen.rpartition(":")
    srv = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    srv.daemon_threads = True
    return srv
