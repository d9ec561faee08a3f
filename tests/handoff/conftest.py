"""Fixtures of the handoff tests (issue 4): a prefill and a decode daemon, and the test process
playing both engines.

* ``pair`` -- one long-lived pair per variant, shared by every test of the variant:
  ``local``, ``mooncake`` and ``nixl`` run both daemons as ``python -m kvd.cli serve``
  subprocesses on loopback (Mooncake over TCP, NIXL over UCX: cma with tcp for wire-up); ``inproc`` runs both in this process (backend ``local``) so
  that ``node.check()`` can run after every scenario. Tests that kill a daemon restart it on
  the same socket and port; a test that left one dead gets it restarted before the next test.
* ``hp`` -- per test: one engine session on each daemon. At the end the sessions are closed
  (their requests freed) and both pools must come back to nothing: no page used in any group,
  no lease, no request, no session but the probe's; in-process also ``node.check()`` and no
  outbound transfer left open.
* ``bare`` / ``hg`` -- a second decode daemon like the pair's that serves no peer socket (its
  tickets take gRPC), and per test an engine session on it, settled like ``hp``'s.
* ``narrow`` -- a decode daemon of another layout (full head_dim 8 instead of 16), started on
  first use, for the layout-mismatch test.
"""

from __future__ import annotations

import asyncio
import random
import sys
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

import daemon_kit as dk  # noqa: E402
import handoff_kit as hk  # noqa: E402

from kvd.client import AsyncClient, TransferState

T = TypeVar("T")

from kvd.errors import Unavailable  # noqa: E402
from kvd.pool.layout import GroupKind, Layout

VARIANTS = {
    "local": ("subproc", "local"),
    "mooncake": ("subproc", "mooncake"),
    "nixl": ("subproc", "nixl"),
    "inproc": ("inproc", "local"),
}


@pytest.fixture(scope="session", autouse=True)
def _handoff_session_clean():
    yield
    left = hk.leftovers()
    assert not left, f"the handoff tests left daemons or arena files behind: {left}"


@pytest.fixture(scope="session", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> hk.Pair:
    mode, backend = VARIANTS[request.param]
    if backend == "mooncake":
        try:
            from kvd.backends.mooncake import check_installed

            check_installed()
        except Unavailable as exc:
            pytest.skip(f"mooncake backend not usable here: {exc}")
    if backend == "nixl":
        from kvd.backends.nixl import missing

        if missing():
            pytest.skip(f"nixl backend not usable here: {missing()}")
    p = hk.make_pair(tmp_path_factory.mktemp(f"handoff-{request.param}"), backend, mode)
    yield p
    rcs = {s.role: s.stop() for s in p.sides}
    assert all(rc == 0 for rc in rcs.values()), f"daemons exited with {rcs}"


@pytest.fixture(scope="session")
def narrow(pair, tmp_path_factory) -> hk.Side:
    """A decode daemon whose layout differs from tiny-hybrid only in the full group's head_dim."""
    base = hk.LAYOUT
    groups = tuple(g.model_copy(update={"head_dim": 8}) if g.kind is GroupKind.FULL else g for g in base.groups)
    layout = Layout(name="tiny-hybrid-narrow", page_size=base.page_size, dtype=base.dtype, groups=groups)
    root = tmp_path_factory.mktemp(f"narrow-{pair.backend}-{pair.mode}")
    path = root / "narrow.json"
    path.write_text(layout.model_dump_json())
    opts = {**hk.DAEMON_OPTS, "backend": pair.backend, "layout": str(path), "listen_tcp": f"127.0.0.1:{hk.free_port()}"}
    side = hk.Side("decode-narrow", pair.mode, root / "d", opts)
    side.start()
    yield side
    assert side.stop() == 0


@pytest.fixture(scope="session")
def bare(pair, tmp_path_factory) -> hk.Side:
    """A second decode daemon like the pair's but serving no peer socket (``peer_socket: ""``): its
    tickets name none, so a sender calls it over gRPC. Started on first use."""
    root = tmp_path_factory.mktemp(f"bare-{pair.backend}-{pair.mode}")
    side = hk.sibling(pair.decode, root, "decode-bare", peer_socket="")
    yield side
    assert side.stop() == 0


@pytest.fixture
def hg(bare) -> Iterator[hk.Engine]:
    """A decode engine's session on ``bare``; at the end it is closed and ``bare`` must come back
    to nothing, as the pair does after ``hp``."""
    if not bare.alive():
        bare.restart()
    e = hk.Engine(bare, "decode-engine-grpc")
    yield e
    e.close_attachment()
    bare.t.close_clients()
    _settle(bare)


@dataclass
class HP:
    """One test's view of the pair: an engine session on each daemon and a seeded RNG."""

    pair: hk.Pair
    p: hk.Engine  # the prefill engine
    d: hk.Engine  # the decode engine
    rnd: random.Random
    seed: int

    def check(self) -> None:
        """Page accounting on both daemons; in-process also every node invariant."""
        for e in (self.p, self.d):
            e.assert_accounted()
            if e.side.node is not None:
                e.side.node.check()

    def setup_request(self, tokens: int, *, scatter: bool = True, prefix: str = "req"):
        """Churn both pools, allocate ``rid`` on both (receive=True on decode), fill both arenas
        with random bytes, take the RECV lease. Returns ``(rid, src vectors, dst vectors, lease)``."""
        rid = dk.rid(prefix)
        if scatter:
            self.p.scatter(self.rnd, dk.rid("pf"))
            self.d.scatter(self.rnd, dk.rid("df"))
        src = self.p.alloc(rid, tokens)
        dst = self.d.alloc(rid, tokens, receive=True)
        hk.randomize(self.p.arena, self.seed)
        hk.randomize(self.d.arena, self.seed + 1)
        lease = self.d.c.acquire_lease(rid, "recv")
        return rid, src, dst, lease

    def assert_landed(self, src, dst, before_d, before_p, upto: int, *, state: bool) -> dict:
        """The decode arena is ``before_d`` with exactly the pages tokens [0, upto) move replaced
        by the prefill's bytes; the prefill arena is unchanged. Returns the moved pages."""
        pages = hk.moved(src, dst, upto, state=state)
        exp = hk.expected_arena(before_d, self.p.arena, pages)
        got = self.d.arena
        assert torch.equal(got, exp), f"decode arena after tokens [0, {upto}): {hk.diff_summary(got, exp)}"
        assert torch.equal(self.p.arena, before_p), "the sender's arena changed: a send only reads it"
        return pages

    def async_handoff(self, prefix: str, send: Callable[[AsyncClient, str, bytes], Awaitable[T]]) -> T:
        """A 24-token request handed off by an asyncio client of the prefill daemon: it
        allocates the request, the decode engine takes the RECV lease, ``send(kv, rid, ticket)``
        moves it and its result is returned; the request must end READY on the decode side, and
        is freed on both."""
        rid = dk.rid(prefix)

        async def go() -> T:
            async with await AsyncClient.connect(self.pair.prefill.t.unix, name="async-prefill") as kv:
                await kv.allocate(rid, 24)
                self.d.alloc(rid, 24, receive=True)
                out = await send(kv, rid, self.d.c.acquire_lease(rid, "recv").ticket)
                await kv.free(rid)
                return out

        out = asyncio.run(go())
        assert self.d.c.wait_ready(rid, 5).state is TransferState.READY
        assert self.d.free(rid) == 1
        return out


def _settle(side: hk.Side) -> None:
    """Everything of the test is gone from ``side``: pages, leases, requests, sessions."""
    c = side.connect("settle-probe")
    try:

        def clean() -> bool:
            s = c.stats()
            return (
                all(g.used_pages == 0 for g in s.pool.groups)
                and s.leases_live == 0
                and s.pool.requests_live == 0
                and s.pool.requests_offloaded == 0
                and s.sessions_live == 1  # the probe
            )

        try:
            dk.wait_for(clean, hk.FENCE_S + 3.0, f"{side.role}: every page, lease, request and session of the test gone")
        except BaseException:
            print(f"{side.role} stats when it failed to settle: {c.stats()}")
            raise
        if side.node is not None:
            side.node.check()
            d = side.t.daemon
            assert d.outbox is None or d.outbox.open_count() == 0, f"{side.role}: outbound transfers left open"
    finally:
        c.close()
        side.t.clients.remove(c)


@pytest.fixture
def hp(pair, request) -> HP:
    for s in pair.sides:
        if not s.alive():
            s.restart()
    seed = zlib.crc32(request.node.nodeid.encode())
    h = HP(pair, hk.Engine(pair.prefill, "prefill-engine"), hk.Engine(pair.decode, "decode-engine"), random.Random(seed), seed)
    yield h
    for e in (h.p, h.d):
        e.close_attachment()
    errors = []
    for s in pair.sides:
        if s.alive():
            s.t.close_clients()
            try:
                _settle(s)
            except BaseException as exc:  # settle the other side too, then report
                errors.append(exc)
    if errors:
        raise errors[0]
