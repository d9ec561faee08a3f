"""The GPU pool behind a daemon (issue 6): ``arena: cuda``, attach by fd passing, and the local
backend between two CUDA arenas on one GPU.

* An engine in another process attaches an in-process cuda daemon: its views are CUDA tensors
  over exactly the backed bytes (before and after finalize), and bytes written on either side
  are the other side's bytes. The handle socket hands out only the chunks of the backed prefix.
* Two cuda daemons (subprocesses: a prefill and a decode arena on the same GPU, backend local)
  hand a request off; the decode arena then equals what the CPU shm path computes for the same
  plan (``plan_chunk`` blocks applied with the shm backend's numpy copy to CPU copies of both
  arenas), byte for byte.

CUDA memory is only ever imported by another process than the one that exported it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_kit import GPU, NEEDS_TRITON, NEEDS_VMM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handoff"))

import daemon_kit as dk
import handoff_kit as hk

import kvd
from kvd import errors as E
from kvd.client import TransferState
from kvd.ipc.fdpass import fetch, ping
from kvd.handoff.plan import plan_chunk
from kvd.client.views import all_views
from kvd.handoff.ticket import read as read_ticket

pytestmark = [*GPU, NEEDS_VMM, NEEDS_TRITON]

MiB = 1 << 20
#: Not a multiple of the 2 MiB granularity: the last chunk reaches past it, views must not.
FINAL = 6 * MiB + 12288
CHILD = Path(__file__).with_name("attach_child.py")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


class Child:
    """An engine process speaking attach_child.py's line protocol."""

    def __init__(self, address: str) -> None:
        root = str(Path(kvd.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.p = subprocess.Popen(
            [sys.executable, str(CHILD), address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )

    def __call__(self, **cmd: object) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        line = self.p.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.p.wait(30)
            pytest.fail(f"attach child died on {cmd}: {self.p.stderr.read()}")  # type: ignore[union-attr]
        return json.loads(line)

    def finish(self) -> None:
        self(op="quit")
        assert self.p.wait(60) == 0, self.p.stderr.read()  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def test_an_engine_process_attaches_the_gpu_arena_before_and_after_finalize(tmp_path):
    t = dk.start_inproc(tmp_path, arena="cuda", post_capture=True, arena_bytes=FINAL, reserve_bytes=64 * MiB)
    d = t.daemon
    arena = d.node.pool.arena
    handles_path = d.handles.path
    assert handles_path == str(tmp_path / "kvd.sock") + ".handles" and os.path.exists(handles_path)
    c = t.connect(name="parent")
    info = c.info()
    assert "cuda-arena" in info.capabilities and info.envelopes[0].base == arena.base
    child = Child(t.unix)
    try:
        # Before finalize only the sink is backed, and that is all the engine gets.
        got = child(op="attach")
        assert got["nbytes"] == arena.backed == info.layout.max_page_bytes
        assert got["region"] == arena.region_id and got["device"] == f"cuda:{arena.device.index}" and got["views_on_gpu"]

        c.finalize(FINAL)
        assert arena.backed == FINAL
        g = torch.Generator(device=arena.device).manual_seed(7)
        arena.tensor().copy_(torch.randint(0, 256, (FINAL,), dtype=torch.uint8, device=arena.device, generator=g))
        torch.cuda.synchronize()

        # The handle socket exports exactly the chunks of the backed prefix, to sessions only
        # (or peers: no peer token is configured here).
        h, fds = fetch(handles_path, session=c.session_id)
        for fd in fds:
            os.close(fd)
        assert h.backed == FINAL and h.region_id == arena.region_id and h.boot_id == info.boot_id
        assert list(h.sizes) == [size for _, size in arena.chunks]
        assert sum(h.sizes) == arena.mapped_bytes == -(-FINAL // arena.granularity) * arena.granularity
        assert h.generation == 1 and h.device == arena.device.index
        with pytest.raises(E.NotFound, match="unknown or expired"):
            fetch(handles_path, session="no-such-session")
        assert ping(handles_path).region_id == arena.region_id

        # After finalize a new attach sees the new size and the same bytes.
        got = child(op="attach")
        assert got["nbytes"] == FINAL and got["digest"] == _sha(arena.tensor())

        # Engine -> daemon: written through the child's views, read through the daemon's arena.
        child(op="fill", group="full", layer=1, page=5, value=1.5)
        mine = all_views(info.layout, arena.tensor())["full"][1].k[5]
        assert bool((mine == 1.5).all())
        # Daemon -> engine: the last bytes of the backed prefix, in the chunk that reaches past it.
        pattern = torch.arange(8192, device=arena.device, dtype=torch.int64).remainder(251).to(torch.uint8)
        arena.tensor()[FINAL - 8192 :].copy_(pattern)
        torch.cuda.synchronize()
        assert child(op="digest", lo=FINAL - 8192, hi=FINAL)["digest"] == _sha(pattern)
        child.finish()
    finally:
        child.kill()
        dk.stop_inproc(t)
    assert not os.path.exists(handles_path), "the handle socket was left behind"


TOKENS = 103


def cuda_pair(root: Path, devices: tuple[int, int] = (0, 0), backend: str = "local", **extra):
    """A prefill and a decode daemon (subprocesses, arena=cuda on ``devices``, ``backend``: local
    or mooncake); a generator for module fixtures: both must exit 0 and leave no handle socket
    behind."""
    pair = hk.make_pair(
        root, backend, "subproc", arena="cuda", prefill={"cuda_device": devices[0]}, decode={"cuda_device": devices[1]},
        **{"arena_bytes": "4MiB", **extra},
    )
    try:
        yield pair
    finally:
        rcs = {s.role: s.stop() for s in pair.sides}
        assert all(rc == 0 for rc in rcs.values()), f"daemons exited with {rcs}"
        for s in pair.sides:
            assert not os.path.exists(s.workdir / "kvd.sock.handles"), f"{s.role}: handle socket left behind"


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    yield from cuda_pair(tmp_path_factory.mktemp("gpu-pair"))


def _shm_path_result(src_arena: torch.Tensor, dst_arena: torch.Tensor, plan, src_base: int, dst_base: int) -> torch.Tensor:
    """What the shm local backend writes for ``plan``: its numpy block copy on CPU copies."""
    from kvd.backends.local import _copy_blocks

    src, dst = src_arena.cpu().numpy().copy(), dst_arena.cpu().numpy().copy()
    srcs, dsts, lens = plan.as_lists()
    _copy_blocks(src, dst, [a - src_base for a in srcs], [a - dst_base for a in dsts], lens)
    return torch.from_numpy(dst)


def hand_off_like_the_cpu_path(decode_workdir: Path, p: hk.Engine, d: hk.Engine, seed: int, wait_s: float) -> None:
    """Scatter both pools (compaction runs on the GPU arenas too), hand a hybrid request off and
    check the decode arena against the CPU shm path byte for byte (the sender's arena unchanged),
    then a second request through what the prefill daemon keeps (the local backend's mapping, or
    Mooncake's session). Shared by the one-GPU and two-GPU tests of both backends: the daemons'
    backend (``d.side.opts["backend"]``) decides what the ticket's transfer endpoint must be."""
    rnd = random.Random(seed)
    p.scatter(rnd, "pf")
    d.scatter(rnd, "df")
    src = p.alloc("r1", TOKENS)
    dst = d.alloc("r1", TOKENS, receive=True)
    hk.randomize(p.arena, seed + 10)
    hk.randomize(d.arena, seed + 11)
    for t in (p.arena, d.arena):
        torch.cuda.synchronize(t.device)
    lease = d.c.acquire_lease("r1", "recv")
    ticket = read_ticket(lease.ticket)
    if d.side.opts["backend"] == "local":  # the decode daemon's handle socket
        assert ticket.transfer_endpoint == str(decode_workdir / "kvd.sock") + ".handles"
    else:  # Mooncake's "host:rpc port" (transfer_host is loopback here)
        assert re.fullmatch(r"127\.0\.0\.1:\d+", ticket.transfer_endpoint), ticket.transfer_endpoint
    assert torch.equal(ticket.vectors.full, dst.full)
    pi, di = p.c.info(), d.c.info()  # envelopes after the churn
    plan = plan_chunk(pi.layout, src, ticket.vectors, pi.envelopes, ticket.envelopes, 0, TOKENS, True)
    assert set(plan.pages) >= {"full", "swa", "state", "draft"}
    expected = _shm_path_result(p.arena, d.arena, plan, pi.envelopes[0].base, di.envelopes[0].base)
    before_p = p.arena.cpu()

    r = p.c.send("r1", lease.ticket)
    st = d.c.wait_ready("r1", wait_s)

    assert st.state is TransferState.READY, st
    assert r.nbytes == st.nbytes == plan.nbytes and r.blocks == len(plan.blocks)
    got = d.arena.cpu()
    assert torch.equal(got, expected), f"decode arena vs the CPU path: {hk.diff_summary(got, expected)}"
    assert torch.equal(p.arena.cpu(), before_p), "the sender's arena changed"
    assert r.pages["full"] == hk.ceil_div(TOKENS, hk.PS_FULL)

    src2, dst2 = p.alloc("r2", 40), d.alloc("r2", 40, receive=True)
    lease2 = d.c.acquire_lease("r2", "recv", vectors=dst2)
    before_d = d.arena.cpu()
    p.c.send("r2", lease2.ticket)
    assert d.c.wait_ready("r2", wait_s).state is TransferState.READY
    exp2 = hk.expected_arena(before_d, p.arena.cpu(), hk.moved(src2, dst2, 40, state=True))
    assert torch.equal(d.arena.cpu(), exp2), hk.diff_summary(d.arena.cpu(), exp2)
    for e in (p, d):
        e.free(*sorted(e.live))


def send_many_like_the_cpu_path(p: hk.Engine, d: hk.Engine, seed: int, wait_s: float) -> None:
    """Four requests in one SendMany (the local cuda backend queues each request's copies before
    it waits for the previous request's): every one READY, the decode arena byte for byte what
    the CPU shm path writes for the four plans, the sender's arena unchanged."""
    lengths = {f"m{i}": n for i, n in enumerate((103, 40, 7, 64))}
    srcs = {rid: p.alloc(rid, n) for rid, n in lengths.items()}
    for rid, n in lengths.items():
        d.alloc(rid, n, receive=True)
    hk.randomize(p.arena, seed + 20)
    hk.randomize(d.arena, seed + 21)
    for t in (p.arena, d.arena):
        torch.cuda.synchronize(t.device)
    tickets = {rid: d.c.acquire_lease(rid, "recv").ticket for rid in lengths}
    pi, di = p.c.info(), d.c.info()
    expected = d.arena.cpu()
    for rid, n in lengths.items():
        t = read_ticket(tickets[rid])
        plan = plan_chunk(pi.layout, srcs[rid], t.vectors, pi.envelopes, t.envelopes, 0, n, True)
        expected = _shm_path_result(p.arena, expected, plan, pi.envelopes[0].base, di.envelopes[0].base)
    before_p = p.arena.cpu()

    out = p.c.send_many([(rid, tickets[rid]) for rid in lengths])

    assert [type(r).__name__ for r in out] == ["SendResult"] * len(lengths), out
    for rid, r in zip(lengths, out):
        st = d.c.wait_ready(rid, wait_s)
        assert st.state is TransferState.READY and st.nbytes == r.nbytes, st
    got = d.arena.cpu()
    assert torch.equal(got, expected), f"decode arena vs the CPU path: {hk.diff_summary(got, expected)}"
    assert torch.equal(p.arena.cpu(), before_p), "the sender's arena changed"
    for e in (p, d):
        e.free(*lengths)


@contextlib.contextmanager
def engines(pair: hk.Pair) -> Iterator[tuple[hk.Engine, hk.Engine]]:
    """A prefill and a decode engine session on ``pair``, detached and closed afterwards."""
    p, d = hk.Engine(pair.prefill, "prefill-engine"), hk.Engine(pair.decode, "decode-engine")
    try:
        yield p, d
    finally:
        for e in (p, d):
            e.close_attachment()
            e.c.close()


def test_two_cuda_daemons_hand_off_byte_identical_to_the_cpu_path(gpu_pair):
    with engines(gpu_pair) as (p, d):
        pi, di = p.c.info(), d.c.info()
        assert "cuda-arena" in pi.capabilities and "handoff" in pi.capabilities and di.backend == "local"
        assert p.arena.is_cuda and d.arena.is_cuda
        hand_off_like_the_cpu_path(gpu_pair.decode.workdir, p, d, seed=11, wait_s=10)


def test_two_cuda_daemons_send_many_byte_identical_to_the_cpu_path(gpu_pair):
    with engines(gpu_pair) as (p, d):
        send_many_like_the_cpu_path(p, d, seed=17, wait_s=10)
