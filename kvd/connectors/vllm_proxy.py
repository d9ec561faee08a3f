"""``kvd proxy``: an OpenAI-compatible front for vLLM prefill/decode instances over kvd (aiohttp).

``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed (``stream: true``, server-sent
events passed through as the decode instance writes them) or not:

1. the prompt's token ids: given (completions), or from a prefill instance's ``POST /tokenize``
   (a string prompt; a chat's ``messages`` with its template options);
2. a ticket from a decode instance's KvdConnector (``POST {tickets}/v1/kvd/tickets``): that
   decode daemon allocates and leases the request's pages now (push mode);
3. prefill: ``POST /v1/completions`` with ``prompt[:kvd_tokens]``, ``max_tokens=1`` and the ticket as
   ``kv_transfer_params`` (the connector sends the KV, then frees it);
4. decode, on the instance that minted the ticket: the caller's request with
   ``kv_transfer_params={"kvd_rid": ...}`` (a completion's prompt as the token ids of step 1, so
   the decode instance loads exactly the KV it was sent); its answer goes back to the caller.

A request is never lost to the handoff: when no ticket can be had (a prompt shorter than a block
plus one, a decode daemon out of pages, a ticket server down), or the prefill instance fails, the
decode instance serves the whole request itself; a ticket already minted is released at once
(``DELETE {tickets}/v1/kvd/tickets/{rid}``), not left to its admission window. Each answer says
which way it went: headers ``x-kvd-path`` (``pd``, or ``decode-only:<reason>``), ``x-kvd-ticket-ms``,
``x-kvd-prefill-ms``; a whole (not streamed) answer also carries them in a ``kvd`` field.
``/metrics`` counts requests by route and path, fallbacks by reason, and times each stage.

Several instances of each role (``--prefill`` / ``--decode`` + ``--tickets``, repeated): each
request goes to the instance of the role with the fewest requests in flight (ties in turn). One
that refuses a connection (nothing was started there) is passed over for :data:`DOWN_S` and the
request tries the next: a prefill instance for its tokens or its prompt, a decode instance whose
ticket server is down for its ticket.

A caller that goes away mid-stream closes the decode connection, which makes vLLM abort the
request (its kvd pages are freed by the connector as for any finished request).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientConnectorError, ClientError, ClientSession, ClientTimeout, TCPConnector, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["Instance", "ProxyConfig", "Upstreams", "build_app", "serve"]

log = logging.getLogger("kvd.proxy")

#: Keys of a chat request that shape its prompt: passed to ``/tokenize`` with its ``messages``.
CHAT_PROMPT_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                    "tools", "documents", "add_special_tokens")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: The label values of the proxy's series, every one exported from the start (at 0), so that a
#: rate or a ratio over them is 0, not absent, before the first request of its kind.
ROUTE_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ROUTES = tuple(ROUTE_PATHS)
PATHS = ("pd", "decode-only")
#: Why a request went to a decode instance alone. The first three are the request's own (by design);
#: the others mean the handoff is broken somewhere (deploy/prometheus/kvd-rules.yaml alerts on them).
REASONS = ("short_prompt", "prompt_logprobs", "prompt_kind", "no_ticket", "prefill_failed", "tokenize_failed", "decode_down")
STAGES = ("ticket", "prefill", "first_byte")

#: Seconds an instance that refused a connection is passed over (unless every one of its role is).
DOWN_S = 5.0


@dataclass
class Instance:
    """One vLLM instance behind the proxy (a decode one with its connector's ticket URL)."""

    url: str
    tickets: str = ""
    in_flight: int = 0
    down_until: float = 0.0  # time.monotonic(): refused a connection, passed over until then


@dataclass
class Upstreams:
    """The instances of one role. :meth:`take` picks, among those not marked down, the one with
    the fewest requests in flight (ties in turn), and counts the request in flight until its
    ``with`` block ends; :meth:`down` passes an instance over for :data:`DOWN_S` (all of them
    down: every one is a candidate again). Not thread-safe: the proxy's one event loop is its
    only user."""

    members: list[Instance]
    _turn: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("give at least one instance")
        self._turn = itertools.cycle(range(len(self.members)))

    def pick(self, now: float | None = None, *, besides: Sequence[Instance] = ()) -> Instance:
        """``besides``: instances this request tried already (chosen only when nothing else is left)."""
        now = time.monotonic() if now is None else now
        up = [m for m in self.members if m.down_until <= now and m not in besides]
        pool = up or [m for m in self.members if m not in besides] or self.members
        low = min(m.in_flight for m in pool)
        for _ in range(len(self.members)):
            m = self.members[next(self._turn)]
            if m in pool and m.in_flight == low:
                return m
        raise AssertionError("unreachable: one member has the lowest count")

    def down(self, m: Instance, now: float | None = None) -> None:
        m.down_until = (time.monotonic() if now is None else now) + DOWN_S
        log.warning("%s refused a connection: passed over for %.0f s", m.url, DOWN_S)

    @contextmanager
    def take(self, *, besides: Sequence[Instance] = ()) -> Iterator[Instance]:
        m = self.pick(besides=besides)
        m.in_flight += 1
        try:
            yield m
        finally:
            m.in_flight -= 1


@dataclass(frozen=True)
class ProxyConfig:
    prefill: Sequence[str]
    decode: Sequence[str]
    tickets: Sequence[str]
    prefill_timeout_s: float = 600.0  # a whole prompt on the prefill instance
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("give at least one --prefill and one --decode instance")
        if len(self.decode) != len(self.tickets):
            raise ValueError(
                f"{len(self.decode)} --decode instance(s) but {len(self.tickets)} --tickets URL(s): give each decode "
                "instance its connector's ticket URL (kvd_ticket_listen), in the same order"
            )


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvd_proxy_requests_total", "Requests answered, by route and by the way they went",
                                ["route", "path"], registry=self.registry)
        self.fallbacks = Counter("kvd_proxy_fallbacks_total", "Requests served by a decode instance alone, by reason",
                                 ["reason"], registry=self.registry)
        self.cut = Counter("kvd_proxy_streams_cut_total", "Streams that ended before the decode answer did (caller gone)",
                           registry=self.registry)
        self.stage = Histogram("kvd_proxy_stage_seconds", "Time of each stage of a PD request (first_byte: of the decode answer)",
                               ["stage"], buckets=_BUCKETS, registry=self.registry)
        self.decode_errors = Counter("kvd_proxy_decode_errors_total",
                                     "Requests answered 502: the decode instance could not be reached or did not answer",
                                     ["route"], registry=self.registry)
        for route in ROUTES:
            self.decode_errors.labels(route)
            for way in PATHS:
                self.requests.labels(route, way)
        for reason in REASONS:
            self.fallbacks.labels(reason)
        for stage in STAGES:
            self.stage.labels(stage)


class _Upstream(Exception):
    """An upstream answered with another status than 200."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


class _DecodeDown(Exception):
    """A decode instance's ticket server refused the connection: try another decode instance."""


class _Fallback(Exception):
    """The handoff could not be set up: serve the request on a decode instance alone."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason = reason


class _Proxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.prefill = Upstreams([Instance(u.rstrip("/")) for u in cfg.prefill])
        self.decode = Upstreams([Instance(u.rstrip("/"), t.rstrip("/")) for u, t in zip(cfg.decode, cfg.tickets)])
        self.metrics = _Metrics()
        self.http: ClientSession | None = None

    async def session(self, app: web.Application) -> Any:  # aiohttp's cleanup context
        # One pool of keep-alive connections to every upstream; no total timeout (a stream
        # lasts as long as the decode instance writes), the prefill call bounded on its own.
        self.http = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s))
        yield
        await self.http.close()

    # -- upstream calls ----------------------------------------------------------------------
    async def _post(self, url: str, body: dict, timeout: float | None = None) -> Any:
        """POST ``body`` as JSON; the JSON answer, or _Upstream naming the status and its text."""
        assert self.http is not None
        to = ClientTimeout(total=timeout, sock_connect=self.cfg.connect_timeout_s) if timeout else None
        async with self.http.post(url, json=body, **({"timeout": to} if to else {})) as r:
            if r.status != 200:
                raise _Upstream(r.status, (await r.text())[:500])
            return await r.json()

    async def _on_prefill(self, path: str, body: dict, timeout: float) -> Any:
        """POST to a prefill instance; one that refuses the connection (nothing started there) is
        marked down and the next one tried. Raises what the last try raised."""
        tried: list[Instance] = []
        while True:
            with self.prefill.take(besides=tried) as p:
                try:
                    return await self._post(f"{p.url}{path}", body, timeout)
                except ClientConnectorError:
                    self.prefill.down(p)
                    tried.append(p)
                    if len(tried) >= len(self.prefill.members):
                        raise

    async def _tokens(self, route: str, body: dict) -> list[int]:
        if route == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                raise _Fallback("prompt_kind", "a batch of prompts, or no prompt: the decode instance answers it whole")
            req: dict = {"prompt": prompt}
            if "add_special_tokens" in body:  # the ids the decode instance is given must be the caller's
                req["add_special_tokens"] = body["add_special_tokens"]
        else:
            if not isinstance(body.get("messages"), list):
                raise web.HTTPBadRequest(text='{"error": "messages: give the chat as a list"}', content_type="application/json")
            req = {"messages": body["messages"], **{k: body[k] for k in CHAT_PROMPT_KEYS if k in body}}
        if "model" in body:
            req["model"] = body["model"]
        try:
            got = await self._on_prefill("/tokenize", req, self.cfg.connect_timeout_s + 20)
        except (_Upstream, ClientError, asyncio.TimeoutError) as exc:
            raise _Fallback("tokenize_failed", f"/tokenize: {exc}") from exc
        toks = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(toks, list):
            raise _Fallback("tokenize_failed", "/tokenize answered no token list")
        return toks

    async def _release(self, dec: Instance, rid: str) -> None:
        """Give a minted ticket's pages back now (best effort: its admission window frees them anyway)."""
        assert self.http is not None
        try:
            async with self.http.delete(f"{dec.tickets}/v1/kvd/tickets/{rid}") as r:
                if r.status not in (200, 404, 409):
                    log.warning("releasing ticket %s at %s: HTTP %d", rid, dec.tickets, r.status)
        except (ClientError, asyncio.TimeoutError) as exc:
            log.warning("releasing ticket %s at %s: %s (its admission window frees it)", rid, dec.tickets, exc)

    async def _handoff(self, route: str, body: dict, dec: Instance, timings: dict[str, float]) -> tuple[dict, list[int] | None]:
        """Steps 1-3: the decode request's ``kv_transfer_params`` (and the completion's token ids)
        once the prefill instance sent the KV; _Fallback when the handoff cannot be made,
        _DecodeDown when ``dec``'s ticket server refuses the connection."""
        if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
            # Logprobs of the prompt need its logits, which only an instance that computes the
            # prompt has: with the KV handed over, the decode instance never computes them.
            raise _Fallback("prompt_logprobs", "the prompt's logprobs asked for: computed where the prompt is")
        tokens = await self._tokens(route, body)
        t0 = time.perf_counter()
        try:
            tk = await self._post(f"{dec.tickets}/v1/kvd/tickets", {"prompt_token_ids": tokens}, self.cfg.connect_timeout_s + 20)
        except _Upstream as exc:
            raise _Fallback("short_prompt" if exc.status == 400 else "no_ticket", f"{dec.tickets}: {exc}") from exc
        except ClientConnectorError as exc:
            raise _DecodeDown(str(exc)) from exc
        except (ClientError, asyncio.TimeoutError) as exc:
            raise _Fallback("no_ticket", f"{dec.tickets}: {exc}") from exc
        t1 = time.perf_counter()
        timings["ticket"] = t1 - t0
        pre = {"prompt": tokens[: tk["kvd_tokens"]], "max_tokens": 1, "stream": False, "kv_transfer_params": tk}
        if "model" in body:
            pre["model"] = body["model"]
        try:
            await self._on_prefill("/v1/completions", pre, self.cfg.prefill_timeout_s)
        except (_Upstream, ClientError, asyncio.TimeoutError) as exc:
            await self._release(dec, tk["kvd_rid"])
            raise _Fallback("prefill_failed", f"prefill: {type(exc).__name__}: {exc}") from exc
        timings["prefill"] = time.perf_counter() - t1
        for stage in ("ticket", "prefill"):
            self.metrics.stage.labels(stage).observe(timings[stage])
        return {"kvd_rid": tk["kvd_rid"]}, (tokens if route == "completions" else None)

    # -- the routes --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("completions", request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("chat", request)

    async def _serve(self, route: str, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON: send the OpenAI request object"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object (the OpenAI request)"}, status=400)
        path = ROUTE_PATHS[route]
        tried: list[Instance] = []
        while True:
            timings: dict[str, float] = {}
            with self.decode.take(besides=tried) as dec:
                try:
                    params, tokens = await self._handoff(route, body, dec, timings)
                    way = "pd"
                    out = dict(body, kv_transfer_params=params)
                    if tokens is not None:
                        out["prompt"] = tokens
                except _DecodeDown as exc:
                    self.decode.down(dec)
                    tried.append(dec)
                    if len(tried) < len(self.decode.members):
                        continue  # another decode instance (nothing was started on this one)
                    way, out = "decode-only:decode_down", body
                    self.metrics.fallbacks.labels("decode_down").inc()
                    log.warning("%s: every decode instance's ticket server refused (%s)", path, exc)
                except _Fallback as fb:
                    log.info("%s: served by %s alone (%s): %s", path, dec.url, fb.reason, fb)
                    self.metrics.fallbacks.labels(fb.reason).inc()
                    way, out = f"decode-only:{fb.reason}", body
                self.metrics.requests.labels(route, way.split(":")[0]).inc()
                headers = {"x-kvd-path": way, **{f"x-kvd-{k}-ms": f"{v * 1e3:.3f}" for k, v in timings.items()}}
                return await self._decode(request, dec, route, out, headers, timings)

    async def _decode(self, request: web.Request, dec: Instance, route: str, body: dict, headers: dict[str, str],
                      timings: dict[str, float]) -> web.StreamResponse:
        """Step 4: the decode instance's answer, streamed through as it comes (or whole)."""
        assert self.http is not None
        path = ROUTE_PATHS[route]
        t0 = time.perf_counter()
        try:
            async with self.http.post(f"{dec.url}{path}", json=body) as r:
                ctype = r.headers.get("Content-Type", "application/json")
                if r.status != 200 or not ctype.startswith("text/event-stream"):
                    data = await r.read()
                    self.metrics.stage.labels("first_byte").observe(time.perf_counter() - t0)
                    if r.status == 200 and ctype.startswith("application/json") and timings:
                        try:
                            doc = json.loads(data)
                            doc["kvd"] = {f"{k}_s": v for k, v in timings.items()}
                            return web.json_response(doc, headers=headers)
                        except (ValueError, TypeError):
                            pass  # not the JSON object vLLM answers with: passed on as it came
                    return web.Response(body=data, status=r.status, content_type=ctype.split(";")[0], headers=headers)
                out = web.StreamResponse(status=200, headers={**headers, "Content-Type": ctype, "Cache-Control": "no-cache"})
                await out.prepare(request)
                first = True
                try:
                    async for chunk in r.content.iter_any():
                        if first:
                            self.metrics.stage.labels("first_byte").observe(time.perf_counter() - t0)
                            first = False
                        await out.write(chunk)
                    await out.write_eof()
                except (ConnectionError, ClientError, asyncio.TimeoutError) as exc:
                    # The caller went away (or the decode instance did, mid-stream: the caller's
                    # stream just ends). Leaving the block closes the decode connection unread,
                    # and vLLM aborts the request.
                    log.info("%s%s: stream cut: %s: %s", dec.url, path, type(exc).__name__, exc)
                    self.metrics.cut.inc()
                return out
        except (ClientError, asyncio.TimeoutError) as exc:
            if isinstance(exc, ClientConnectorError):
                self.decode.down(dec)
            self.metrics.decode_errors.labels(route).inc()
            rid = (body.get("kv_transfer_params") or {}).get("kvd_rid")
            if rid:  # the KV landed for a request the decode instance never got
                await self._release(dec, rid)
            return web.json_response({"error": f"decode instance {dec.url}: {type(exc).__name__}: {exc}"}, status=502, headers=headers)

    async def passthrough(self, request: web.Request) -> web.Response:
        """Other GETs (``/v1/models``, ``/version``...) answered by a decode instance."""
        assert self.http is not None
        dec = self.decode.pick()
        try:
            async with self.http.get(f"{dec.url}{request.rel_url}") as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
        except (ClientError, asyncio.TimeoutError) as exc:
            return web.json_response({"error": f"decode instance {dec.url}: {exc}"}, status=502)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": [m.url for m in self.prefill.members],
                                  "decode": [m.url for m in self.decode.members]})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(cfg: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (run it with :func:`serve`, or an ``AppRunner``)."""
    proxy = _Proxy(cfg)
    app = web.Application(client_max_size=64 * 1024 * 1024)  # long prompts as token ids
    app.cleanup_ctx.append(proxy.session)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_page)
    app.router.add_get("/{tail:.*}", proxy.passthrough)
    return app


def serve(listen: str, cfg: ProxyConfig) -> None:
    """Serve on ``listen`` (host:port) until interrupted."""
    host, _, port = listen.rpartition(":")
    web.run_app(build_app(cfg), host=host or "127.0.0.1", port=int(port), print=lambda *_: None, access_log=None)
