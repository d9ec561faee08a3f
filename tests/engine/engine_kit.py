"""Helpers for the accuracy tests: a prefill-decode pair of in-process daemons, the engines on
top of them driven in one thread, and the workloads the tests share.

Not a test module; the tests import it as ``engine_kit``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvd.client import Attachment, Client
from kvd.config import load_settings
from kvd.engine.decode import DecodeEngine, DecodeStats
from kvd.engine.prefill import PrefillEngine
from kvd.engine.records import Completion, EngineConfig, Request, TicketRewrite
from kvd.engine.model import Models
from kvd.engine.paged import PagedKV
from kvd.server.app import Daemon

WINDOW = 32
#: prompt lengths around the SWA window (32) and page (4) boundaries, and several windows long
CROSSING = (5, 31, 32, 33, 35, 36, 63, 64, 65, 100, 150, 230)


def requests(lengths: tuple[int, ...] = CROSSING, max_new: int = 34, seed: int = 7, prefix: str = "r") -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"{prefix}{i}-{n}", tuple(torch.randint(0, 256, (n,), generator=g).tolist()), max_new)
            for i, n in enumerate(lengths)]


@dataclass
class Node:
    daemon: Daemon
    client: Client
    att: Attachment


@dataclass
class Pair:
    prefill: Node
    decode: Node


def _node(workdir: str, name: str, models: Models, arena_bytes: int, post_capture: bool, backend: str) -> Node:
    settings = dict(listen_unix=f"{workdir}/{name}.sock", listen_tcp="127.0.0.1:0", backend=backend, speculative=True,
                    arena_bytes=arena_bytes, grace_s=0.5, session_ttl_s=30, lease_ttl_s=30)
    if post_capture:
        settings.update(post_capture=True, reserve_bytes=16 * arena_bytes)
    d = Daemon.start(load_settings(**settings))
    try:
        c = Client.connect(d.address, name=f"{name}-engine")
        if post_capture:
            c.finalize(arena_bytes)
        return Node(d, c, c.attach())
    except BaseException:
        d.stop(0)
        raise


@contextlib.contextmanager
def pd_pair(models: Models, *, prefill_bytes: int = 8 << 20, decode_bytes: int = 8 << 20, post_capture: bool = False,
            backend: str = "local") -> Iterator[Pair]:
    """Two in-process daemons (prefill node, decode node) on loopback with the models' layout.
    On exit both pools must pass ``check()`` with no request and no lease left."""
    workdir = tempfile.mkdtemp(prefix="kvd-eng-")
    nodes: list[Node] = []
    try:
        for name, nbytes in (("prefill", prefill_bytes), ("decode", decode_bytes)):
            nodes.append(_node(workdir, name, models, nbytes, post_capture, backend))
        yield Pair(*nodes)
        for role, n in zip(("prefill", "decode"), nodes):
            n.daemon.node.check()
            st = n.daemon.node.stats()
            assert st.pool.requests_live == 0 and st.pool.requests_offloaded == 0, f"requests left on the {role} node: {st.pool}"
            assert st.leases_live == 0, f"{st.leases_live} leases left on the {role} node"
    finally:
        for n in nodes:
            n.att.close()
            n.client.close()
            n.daemon.stop(0)
        shutil.rmtree(workdir, ignore_errors=True)


def engines(pair: Pair, models: Models, cfg: EngineConfig, *,
            ticket_rewrite: TicketRewrite | None = None) -> tuple[PrefillEngine, DecodeEngine]:
    pre = PrefillEngine(pair.prefill.client, PagedKV(models.layout, pair.prefill.att.views), models, cfg,
                        ticket_rewrite=ticket_rewrite)
    dec = DecodeEngine(pair.decode.client, PagedKV(models.layout, pair.decode.att.views), models, cfg)
    return pre, dec


def run_pd(pair: Pair, models: Models, reqs: list[Request], cfg: EngineConfig, *, inflight: int = 4,
           ticket_rewrite: TicketRewrite | None = None) -> tuple[dict[str, Completion], DecodeStats]:
    """Every request through the pair: admit on decode, prefill + send, decode to the end.
    ``inflight`` requests are admitted at a time (more than one: memory pressure can bite)."""
    pre, dec = engines(pair, models, cfg, ticket_rewrite=ticket_rewrite)
    queue = deque(reqs)
    out: dict[str, Completion] = {}
    for _ in range(100_000):
        if not queue and not dec.busy:
            break
        while queue and len(dec.awaiting) + len(dec.running) + len(dec.retracted) < inflight:
            ticket = dec.admit(queue[0])
            if ticket is None:
                break
            req = queue.popleft()
            first = pre.prefill(req, ticket)
            if first.error:
                out[req.rid] = dec.cancel(req.rid, first.error)
            else:
                dec.start(first)
        for c in dec.poll_ready(timeout=1.0):
            out[c.rid] = c
        dec.maintain()
        for c in dec.step():
            out[c.rid] = c
    else:
        raise AssertionError("run_pd made no progress")
    return out, dec.stats
