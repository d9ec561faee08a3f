"""Helpers for the handoff tests: a prefill/decode pair of daemons, churn that scatters pages,
arena bytes in and out, and the "no leaked pages" proofs.

Not a test module; ``tests/handoff/conftest.py`` builds the fixtures from it. Daemons start
through ``tests/kits/daemon_kit.py`` (``start_subproc`` / ``start_inproc``).

The test process plays both engines: one :class:`~kvd.client.Client` per daemon, and the arenas
attached into this process to write the prefill's KV and read what landed on the decode side.
Page ``p`` of group ``g`` is bytes ``[p * pb_g, (p + 1) * pb_g)`` of the arena (``kvd.pool.pool``'s
``page_view``), so the whole-arena tensor of an attachment is all a test needs.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import daemon_kit as dk
import numpy as np
import torch

from kvd.client import Attachment, Client
from kvd.errors import CapacityError
from kvd.pool.layout import GroupKind, Layout
from kvd.records import IndexVectors
from kvd.pool.presets import preset
from kvd.v1 import kvd_pb2 as pb

LAYOUT: Layout = preset("tiny-hybrid")
#: page bytes per group name: full/swa 2 KiB, state 256 B, draft 1 KiB.
PB: dict[str, int] = {g.name: LAYOUT.page_bytes(g) for g in LAYOUT.groups}
PS_FULL = LAYOUT.page_size  # 4 tokens
PS_DRAFT = LAYOUT.page_size_of(LAYOUT.group(GroupKind.DRAFT))  # 8 tokens
WINDOW = LAYOUT.group(GroupKind.SWA).window  # 32 tokens

#: Settings of every daemon here: small arenas, short timers so failure paths finish fast.
PEER_TIMEOUT_S = 1.0
FENCE_S = 0.5
DAEMON_OPTS: dict[str, Any] = dict(
    arena_bytes=2 << 20,
    peer_timeout_s=PEER_TIMEOUT_S,
    fence_s=FENCE_S,
    lease_ttl_s=5.0,
    session_ttl_s=5.0,
    sweep_interval_s=0.05,
    grace_s=1.0,
)


def free_port() -> int:
    """A loopback port nobody listens on now (the daemon binds it, and binds it again on restart)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows(t: torch.Tensor, pb: int) -> torch.Tensor:
    """The arena tensor as ``[pages, pb]``: row ``p`` is page ``p`` of a group with page bytes ``pb``."""
    return t[: t.numel() // pb * pb].view(-1, pb)


def one_run(ids: torch.Tensor) -> bool:
    """Whether ``ids`` are consecutive ascending (one block on the wire)."""
    return ids.numel() < 2 or bool((ids[1:] - ids[:-1] == 1).all())


# ---- daemons --------------------------------------------------------------------------------

#: Every daemon a Side started (checked at the end of the session: none running, no arena file left).
STARTED: list[dk.Target] = []


@dataclass
class Side:
    """One daemon of the pair, restartable on the same Unix socket and TCP port (a restart is a
    new boot: new boot id, new arena)."""

    role: str  # "prefill" | "decode"
    mode: str  # "subproc" | "inproc"
    workdir: Path
    opts: dict[str, Any]
    target: dk.Target | None = None
    dead_arenas: list[str] = field(default_factory=list)  # arena files of killed subprocess daemons
    killed: bool = False  # the running target was killed on purpose

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        start = dk.start_subproc if self.mode == "subproc" else dk.start_inproc
        self.target = start(self.workdir, **self.opts)
        self.killed = False
        STARTED.append(self.target)

    @property
    def t(self) -> dk.Target:
        assert self.target is not None, f"{self.role} daemon is not running"
        return self.target

    @property
    def node(self):
        """The in-process daemon's node (None for a subprocess)."""
        return self.t.node

    def connect(self, name: str, **kw: Any) -> Client:
        return self.t.connect(name=name, **kw)

    @property
    def peer_socket(self) -> str:
        """The daemon's peer socket path (the default: beside its Unix listener)."""
        return self.t.unix.removeprefix("unix:") + ".peer"

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The daemon's Prometheus samples (``daemon_kit.samples`` keys): scraped from a
        subprocess, read from the registry in-process (whose HTTP exporter is off)."""
        if self.mode == "subproc":
            return dk.samples(dk.scrape(self.t.metrics_port))
        assert self.t.daemon is not None and self.t.daemon.metrics is not None
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in self.t.daemon.metrics.registry.collect()
            for s in fam.samples
        }

    def counter(self, name: str, **labels: str) -> float:
        """One sample of :meth:`samples` (0 when the daemon has not reported it)."""
        return self.samples().get((name, tuple(sorted(labels.items()))), 0.0)

    def alive(self) -> bool:
        if self.target is None:
            return False
        if self.mode == "subproc":
            return self.t.proc.poll() is None
        return not self.t.daemon._stop.is_set()

    def kill(self) -> None:
        """Take the daemon away abruptly: SIGKILL for a subprocess (no cleanup at all; its arena
        file stays in /dev/shm until :meth:`restart`), ``stop(0)`` for an in-process one (its
        server, heartbeats and backend stop at once; this process cannot kill itself)."""
        t = self.t
        if self.mode == "subproc":
            t.proc.send_signal(signal.SIGKILL)
            t.proc.wait(10)
            if t.proc.stdout:
                t.proc.stdout.close()
            self.dead_arenas.append(f"/dev/shm/{t.region_id}")
        else:
            t.daemon.stop(0)
        self.killed = True
        t.close_clients()  # their sessions died with the daemon (this only stops their heartbeats)

    def restart(self) -> None:
        if self.alive():
            self.kill()
        self.reap()
        self.start()

    def reap(self) -> None:
        """Remove arena files that killed daemons left behind (what an operator's cleanup does)."""
        while self.dead_arenas:
            p = self.dead_arenas.pop()
            if os.path.exists(p):
                os.unlink(p)

    def stop(self) -> int:
        """Stop gracefully; returns the exit status (0 for one this kit killed on purpose; a
        daemon that died by itself reports its status and its arena file is removed)."""
        if self.target is None:
            return 0
        t, self.target = self.target, None
        if self.mode == "subproc":
            if t.proc.poll() is None:
                rc = dk.stop_subproc(t)
            else:
                rc = 0 if self.killed else t.proc.returncode
                self.dead_arenas.append(f"/dev/shm/{t.region_id}")
                t.close_clients()
        else:
            t.close_clients()
            t.daemon.stop(0)
            rc = 0
        self.reap()
        return rc


@dataclass
class Pair:
    backend: str
    mode: str
    prefill: Side
    decode: Side

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.prefill, self.decode


def make_pair(
    root: Path,
    backend: str = "local",
    mode: str = "inproc",
    *,
    arena: str = "shm",
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    **overrides: Any,
) -> Pair:
    """A prefill and a decode daemon, both started (``mode``: "subproc" or "inproc"; workdirs
    ``root/prefill`` and ``root/decode``). Each runs :data:`DAEMON_OPTS` with ``backend``,
    ``arena`` ("shm", or "cuda" on a GPU host), layout tiny-hybrid and a TCP port of its own (kept
    across restarts), then ``overrides`` (settings of both) and ``prefill`` / ``decode`` (settings
    of that side alone: a peer token, a cuda_device, peer_socket ''). If one cannot start, the
    other is stopped before the error propagates."""
    sides = []
    for role, own in (("prefill", prefill), ("decode", decode)):
        opts = {
            **DAEMON_OPTS, "backend": backend, "arena": arena, "layout": "tiny-hybrid",
            "listen_tcp": f"127.0.0.1:{free_port()}", **overrides, **(own or {}),
        }
        sides.append(Side(role, mode, root / role, opts))
    pair = Pair(backend, mode, *sides)
    try:
        for s in pair.sides:
            s.start()
    except BaseException:
        for s in pair.sides:
            s.stop()
        raise
    return pair


def sibling(side: Side, root: Path, role: str, **opts: Any) -> Side:
    """Another daemon like ``side`` (its backend, mode, layout and settings) in ``root / role``, on
    a TCP port of its own, with ``opts`` on top (``peer_socket=""``: a decode daemon that serves no
    peer socket, whose tickets take gRPC), started. The caller stops it (:meth:`Side.stop`)."""
    s = Side(role, side.mode, root / role, {**side.opts, "listen_tcp": f"127.0.0.1:{free_port()}", **opts})
    s.start()
    return s


# ---- the engines' view ----------------------------------------------------------------------


class Engine:
    """One engine's session on one daemon: tracks the requests it holds so page accounting can
    be compared with the daemon's stats."""

    def __init__(self, side: Side, name: str) -> None:
        self.side = side
        self.name = name
        self.c: Client = side.connect(name)
        self.live: set[str] = set()
        self._att: Attachment | None = None

    def reconnect(self) -> None:
        """A new session, after the daemon restarted or the old session was closed: the old
        session's requests are gone (with the old boot, or freed by the close)."""
        self.close_attachment()
        self.c.close()  # idempotent; against a dead daemon it only stops the heartbeat
        if self.c in self.side.t.clients:
            self.side.t.clients.remove(self.c)
        self.c = self.side.connect(self.name)
        self.live.clear()

    @property
    def arena(self) -> torch.Tensor:
        """The daemon's whole backed arena, mapped here (uint8)."""
        if self._att is None:
            self._att = self.c.attach()
        return self._att.tensor

    def close_attachment(self) -> None:
        if self._att is not None:
            self._att.close()
            self._att = None

    def alloc(self, rid: str, tokens: int, *, receive: bool = False) -> IndexVectors:
        """Allocate; when the groups box each other in, compact once and retry (what an engine does)."""
        try:
            v = self.c.allocate(rid, tokens, receive=receive)
        except CapacityError:
            self.c.compact()
            v = self.c.allocate(rid, tokens, receive=receive)
        self.live.add(rid)
        return v

    def free(self, *rids: str) -> int:
        n = self.c.free(*rids)
        self.live.difference_update(rids)
        return n

    def scatter(self, rnd: random.Random, prefix: str) -> None:
        """Churn: allocate fillers of random lengths, free every other one, compact, repeat; end
        with holes that compaction did not close, so the next request lands in scattered pages."""
        mine: list[str] = []
        for r in range(2):
            for i in range(10):
                rid = f"{prefix}-{r}-{i}"
                self.alloc(rid, rnd.randint(4, 40))
                mine.append(rid)
            self.free(*mine[::2])
            mine = mine[1::2]
            self.c.compact()
        late = [f"{prefix}-late-{i}" for i in range(6)]
        for rid in late:
            self.alloc(rid, rnd.randint(4, 24))
        self.free(*late[::2])

    def used(self) -> dict[str, int]:
        return {g.name: g.used_pages for g in self.c.stats().pool.groups}

    def expected_used(self) -> dict[str, int]:
        """Pages per group the live requests hold, from their own index vectors."""
        vecs = self.c.vectors_many(sorted(self.live)) if self.live else []
        return {
            "full": sum(v.full.numel() for v in vecs),
            "swa": sum(v.swa.numel() for v in vecs),
            "state": sum(v.state is not None for v in vecs),
            "draft": sum(v.draft.numel() for v in vecs),
        }

    def assert_accounted(self, extra: dict[str, int] | None = None) -> None:
        """The daemon's used pages per group are exactly what this engine's live requests hold
        (plus ``extra``: pages of a freed request still fenced)."""
        exp = self.expected_used()
        for k, n in (extra or {}).items():
            exp[k] += n
        assert self.used() == exp, f"{self.side.role}: pages used {self.used()} != held by live requests {exp}"

    def wait_reclaimed(self, timeout: float, extra_ok: bool = False) -> float:
        """Poll until the used pages drop to what the live requests hold and no lease is live;
        returns the seconds it took."""
        t0 = time.monotonic()
        dk.wait_for(
            lambda: self.used() == self.expected_used() and self.c.stats().leases_live == 0,
            timeout,
            f"{self.side.role}: pages and leases reclaimed",
        )
        return time.monotonic() - t0


def randomize(t: torch.Tensor, seed: int) -> None:
    """Fill an arena with random bytes (every page differs from every other, w.h.p.)."""
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def moved(src: IndexVectors, dst: IndexVectors, upto: int, *, state: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{group: (source page ids, destination page ids)}`` that tokens ``[0, upto)`` move (the
    contract in :mod:`kvd.handoff.plan`): every full and draft page touched, SWA only the receiver's
    window tail, the state slot with the last chunk only."""
    out = {}
    n = ceil_div(upto, PS_FULL)
    out["full"] = (src.full[:n], dst.full[:n])
    p0 = dst.swa_first_page
    if n > p0:
        out["swa"] = (src.swa[p0 - src.swa_first_page : n - src.swa_first_page], dst.swa[: n - p0])
    nd = ceil_div(upto, PS_DRAFT)
    out["draft"] = (src.draft[:nd], dst.draft[:nd])
    if state:
        out["state"] = (torch.tensor([src.state]), torch.tensor([dst.state]))
    return out


def expected_arena(before: torch.Tensor, src_arena: torch.Tensor, pages: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``before`` with the destination pages replaced by the source pages, every other byte as it was."""
    exp = before.clone()
    for g, (s, d) in pages.items():
        assert s.numel() == d.numel() > 0 or s.numel() == d.numel() == 0
        rows(exp, PB[g])[d.long()] = rows(src_arena, PB[g])[s.long()]
    return exp


def diff_summary(got: torch.Tensor, exp: torch.Tensor) -> str:
    bad = (got != exp).nonzero().flatten()
    if bad.numel() == 0:
        return "identical"
    pages = sorted({int(b) // PB["full"] for b in bad[:10000]})
    return f"{bad.numel()} bytes differ, first at byte {int(bad[0])} (2 KiB pages {pages[:20]})"


def leftovers() -> list[str]:
    """Daemons this kit started that still run, and arena files they left in /dev/shm."""
    out = []
    for t in STARTED:
        if t.proc is not None and t.proc.poll() is None:
            out.append(f"daemon pid {t.proc.pid} still running")
        if t.daemon is not None and not t.daemon._stop.is_set():
            out.append(f"in-process daemon on {t.unix} still serving")
        if os.path.exists(f"/dev/shm/{t.region_id}"):
            out.append(f"arena file /dev/shm/{t.region_id} left behind")
    return out


# ---- tickets ---------------------------------------------------------------------------------


def ticket_body(ticket: bytes) -> pb.Ticket:
    """The body of sealed ticket bytes: what anyone carrying the ticket can read."""
    return pb.Ticket.FromString(pb.SealedTicket.FromString(ticket).body)


def ids(m: pb.IndexVectors, group: str) -> list[int]:
    """The ids of vector ``group`` ("full", "swa", "draft") of a ticket's vectors, which carry them packed."""
    return np.frombuffer(getattr(m, f"{group}_le"), "<i4").tolist()


def set_ids(m: pb.IndexVectors, group: str, values: list[int]) -> None:
    """Vector ``group`` of ``m`` rewritten, packed as tickets carry it (as int32: a value past it raises)."""
    setattr(m, f"{group}_le", np.asarray(values, dtype="<i4").tobytes())


def set_id(m: pb.IndexVectors, group: str, i: int, value: int) -> None:
    """One id of vector ``group`` of ``m`` rewritten (:func:`set_ids`)."""
    xs = ids(m, group)
    xs[i] = value
    set_ids(m, group, xs)


def tampered(ticket: bytes, edit: Callable[[pb.Ticket], object]) -> bytes:
    """``ticket`` with its body edited by ``edit`` and serialised again under the old seal: what a
    router or prefill engine that rewrote a field would pass on."""
    sealed = pb.SealedTicket.FromString(ticket)
    t = pb.Ticket.FromString(sealed.body)
    edit(t)
    return pb.SealedTicket(body=t.SerializeToString(), seal=sealed.seal).SerializeToString()


def resealed(side: Side, ticket: bytes, edit: Callable[[pb.Ticket], object]) -> bytes:
    """``ticket`` edited and sealed again with the in-process daemon's own key: a ticket only the
    daemon itself could have minted (for tests that need a field changed with the seal intact)."""
    assert side.t.daemon is not None and side.t.daemon.tickets is not None, "resealing needs an in-process daemon"
    t = ticket_body(ticket)
    edit(t)
    return side.t.daemon.tickets.seal(t)
