"""A pool over a CUDA virtual-memory arena behaves exactly like one over a shm arena.

Each test drives two pools of the same layout and size, one on the CPU (ShmArena) and one on the
GPU (CudaVmmArena), through the same operations: every outcome (vectors, compaction results, the
exception class and message of every refusal) and every stat must match, and after every
compaction the two arenas must hold the same bytes."""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
from collections.abc import Callable

import pytest
import torch
from gpu_kit import GPU, NEEDS_TRITON, NEEDS_VMM
from pool_testkit import phys_key, sizings

from kvd.copy import kernels
from kvd.memory.arena import ShmArena
from kvd.errors import KvdError
from kvd.pool.layout import GroupKind
from kvd.records import CompactionResult, IndexVectors
from kvd.pool.pool import Pool
from kvd.pool.presets import preset

pytestmark = [*GPU, NEEDS_VMM, NEEDS_TRITON]

SIZINGS = sizings()


def _norm(x: object) -> object:
    if isinstance(x, IndexVectors):
        return (x.rid, x.epoch, phys_key(x))
    if isinstance(x, CompactionResult):
        return tuple(x)
    if isinstance(x, torch.Tensor):
        return x.cpu().tolist()
    if isinstance(x, (list, tuple)):
        return [_norm(i) for i in x]
    return x


def _stats(pool: Pool) -> object:
    return dataclasses.replace(pool.stats(), boot_id="")


def _shm_dir() -> str:
    """/dev/shm where it has room (containers often cap it at 64 MiB), else the temp directory."""
    try:
        if shutil.disk_usage("/dev/shm").free >= 1 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


class Mirror:
    """A CPU pool and a GPU pool driven in lockstep."""

    def __init__(self, layout, reserved: int, backed: int, vmm_arena_factory, *, post_capture: bool = False, seed: int = 0):
        self.shm = ShmArena(reserved, 0 if post_capture else backed, directory=_shm_dir())
        self.cpu = Pool(layout, self.shm, post_capture=post_capture)
        self.gpu = Pool(layout, vmm_arena_factory(reserved, 0 if post_capture else backed), post_capture=post_capture)
        self.seed = seed
        if not post_capture:
            self.fill()

    def close(self) -> None:
        self.shm.close()

    def fill(self) -> None:
        """The same random bytes in both arenas, so every page is distinguishable."""
        g = torch.Generator().manual_seed(self.seed)
        data = torch.randint(0, 256, (self.cpu.arena.backed,), dtype=torch.uint8, generator=g)
        self.cpu.arena.tensor().copy_(data)
        self.gpu.arena.tensor().copy_(data.cuda())

    def do(self, what: str, op: Callable[[Pool], object]) -> tuple:
        outs = []
        for pool in (self.cpu, self.gpu):
            try:
                outs.append(("ok", _norm(op(pool))))
            except KvdError as e:
                outs.append((type(e).__name__, str(e).replace(pool.boot_id, "<boot id>")))
        assert outs[0] == outs[1], f"{what}: CPU {outs[0]!r} != GPU {outs[1]!r}"
        assert _stats(self.cpu) == _stats(self.gpu), f"{what}: stats differ"
        return outs[0]

    def same_bytes(self, what: str) -> None:
        torch.cuda.synchronize()
        a, b = self.cpu.arena.tensor(), self.gpu.arena.tensor().cpu()
        assert a.numel() == b.numel()
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()
            raise AssertionError(f"{what}: arenas differ in {bad.numel()} bytes, first at {int(bad[0])}")
        self.gpu.check()


@pytest.fixture
def mirror_factory(vmm_arena_factory):
    made: list[Mirror] = []

    def make(*args, **kw) -> Mirror:
        m = Mirror(*args, vmm_arena_factory, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("strategy", ["tile", "flat"])
@pytest.mark.parametrize("name", list(SIZINGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_compaction_is_byte_identical_to_cpu(mirror_factory, monkeypatch, name: str, seed: int, strategy: str) -> None:
    monkeypatch.setattr(kernels, "_STRATEGY", strategy)  # what copy_runs uses on CUDA views
    s = SIZINGS[name]
    m = mirror_factory(s.layout, s.reserved, s.backed, seed=seed)
    rng = random.Random(seed)
    live: list[str] = []
    nxt = 0
    compactions = 0
    for step in range(160):
        roll = rng.random()
        if roll < 0.45 or not live:
            rid = f"r{nxt}"
            nxt += 1
            tokens, receive = rng.randint(1, s.max_tokens), rng.random() < 0.3
            out = m.do(f"step {step} allocate {rid}", lambda p: p.allocate(rid, tokens, receive=receive))
            if out[0] == "ok":
                live.append(rid)
        elif roll < 0.65:
            rid = rng.choice(live)
            add = rng.randint(1, max(1, s.max_tokens // 4))
            m.do(f"step {step} extend {rid}", lambda p: p.extend(rid, add))
        elif roll < 0.85:
            rid = live.pop(rng.randrange(len(live)))
            m.do(f"step {step} free {rid}", lambda p: p.free(rid))
        else:
            pinned = {rng.choice(live): "lease-1"} if live and rng.random() < 0.4 else {}
            around = bool(pinned) and rng.random() < 0.5
            out = m.do(f"step {step} compact", lambda p: p.compact(pinned, around_pinned=around))
            if out[0] == "ok":
                compactions += 1
            m.same_bytes(f"step {step} compact")
        if step % 40 == 39:
            m.do(f"step {step} vectors", lambda p: [p.vectors(r) for r in sorted(live)])
    m.do("final compact", lambda p: p.compact())
    m.same_bytes("final compact")
    st = m.gpu.stats()
    assert st.compactions_done >= 2 and st.pages_moved > 0, st


def test_offload_and_restore_bytes_match_cpu(mirror_factory) -> None:
    s = SIZINGS["gpt-oss-20b"]
    m = mirror_factory(s.layout, s.reserved, s.backed, seed=3)
    for i in range(6):
        m.do(f"allocate r{i}", lambda p, i=i: p.allocate(f"r{i}", 100 + 37 * i))
    m.do("offload r2", lambda p: p.offload("r2"))
    m.do("free r1", lambda p: p.free("r1"))
    m.do("restore r2", lambda p: p.restore("r2"))
    m.same_bytes("restore")


def test_translation_matches_cpu(mirror_factory) -> None:
    """The pool's tables through the Triton gather equal the CPU pool's translate, on random ids."""
    s = SIZINGS["tiny-hybrid"]
    m = mirror_factory(s.layout, s.reserved, s.backed, seed=4)
    for i in range(20):
        m.do(f"allocate r{i}", lambda p, i=i: p.allocate(f"r{i}", 1 + (i * 13) % s.max_tokens))
    gen = torch.Generator().manual_seed(4)
    for kind, a in m.cpu.groups.items():
        vids = torch.randint(0, a.v2p.numel(), (50_000,), generator=gen)
        ref = m.cpu.translate(kind, vids)
        got = kernels.translate(m.gpu.groups[kind].v2p.cuda(), vids.cuda())
        assert torch.equal(got.cpu(), ref), kind
        assert torch.equal(kernels.translate(a.v2p, vids), ref)


TINY = preset("tiny-hybrid")
PB = TINY.page_bytes(TINY.group("full"))
RESERVED, BACKED = 400 * PB, 200 * PB


def test_refusals_match_cpu_eager(mirror_factory) -> None:
    m = mirror_factory(TINY, RESERVED, BACKED, seed=5)
    ok = [
        ("allocate a", lambda p: p.allocate("a", 10)),
        ("allocate b", lambda p: p.allocate("b", 40, receive=True)),
        ("allocate c", lambda p: p.allocate("c", 20)),
        ("extend c", lambda p: p.extend("c", 30)),
        ("extend c", lambda p: p.extend("c", 9)),
    ]
    for what, op in ok:
        assert m.do(what, op)[0] == "ok"
    refusals = [
        ("allocate 0 tokens", lambda p: p.allocate("x", 0), "InvalidArgument"),
        ("allocate 1.5 tokens", lambda p: p.allocate("x", 1.5), "InvalidArgument"),
        ("allocate empty rid", lambda p: p.allocate("", 4), "InvalidArgument"),
        ("allocate existing", lambda p: p.allocate("a", 4), "AlreadyExists"),
        ("allocate empty batch", lambda p: p.allocate_many([]), "InvalidArgument"),
        ("allocate too large", lambda p: p.allocate("x", 10**6), "CapacityError"),
        ("extend unknown", lambda p: p.extend("ghost", 4), "NotFound"),
        ("extend bad count", lambda p: p.extend("a", -1), "InvalidArgument"),
        ("extend twice in batch", lambda p: p.extend_many([("a", 1), ("a", 1)]), "InvalidArgument"),
        ("extend too large", lambda p: p.extend("a", 10**6), "CapacityError"),
        ("free unknown", lambda p: p.free("ghost"), "NotFound"),
        ("free twice in batch", lambda p: p.free_many(["a", "a"]), "InvalidArgument"),
        ("compact pinned", lambda p: p.compact({"ghost": "lease-1"}), "NotFound"),
        ("finalize eager", lambda p: p.finalize(BACKED), "FailedPrecondition"),
        ("resize eager", lambda p: p.resize(BACKED), "FailedPrecondition"),
        ("restore not offloaded", lambda p: p.restore("a"), "FailedPrecondition"),
        ("restore unknown", lambda p: p.restore("ghost"), "NotFound"),
        ("offload unknown", lambda p: p.offload("ghost"), "NotFound"),
        ("vectors unknown", lambda p: p.vectors("ghost"), "NotFound"),
        ("translate out of range", lambda p: p.translate("full", torch.tensor([10**7])), "InvalidArgument"),
        ("require_fresh wrong boot", lambda p: p.require_fresh("a", p.epoch, "nope") and None, "StaleEpoch"),
    ]
    for what, op, cls in refusals:
        out = m.do(what, op)
        assert out[0] == cls, (what, out)
    # Free half so compaction has work; a compaction that would move a pinned page is refused.
    for i in range(10):
        m.do(f"allocate s{i}", lambda p, i=i: p.allocate(f"s{i}", 8))
    for i in range(0, 10, 2):
        m.do(f"free s{i}", lambda p, i=i: p.free(f"s{i}"))
    m.do("compact pinned s9", lambda p: p.compact({"s9": "lease-7"}))
    m.do("compact around s9", lambda p: p.compact({"s9": "lease-7"}, around_pinned=True))
    m.same_bytes("compact around pinned")
    m.do("compact", lambda p: p.compact())
    m.same_bytes("compact")


def test_refusals_match_cpu_post_capture(mirror_factory) -> None:
    m = mirror_factory(TINY, RESERVED, BACKED, post_capture=True, seed=6)
    assert m.gpu.arena.backed == m.cpu.arena.backed == TINY.max_page_bytes
    base = m.gpu.arena.base
    steps = [
        ("allocate before finalize", lambda p: p.allocate("a", 4), "NotFinalized"),
        ("resize before finalize", lambda p: p.resize(BACKED), "NotFinalized"),
        ("restore before finalize", lambda p: p.restore("a"), "NotFound"),
        ("finalize None", lambda p: p.finalize(None), "InvalidArgument"),
        ("finalize 0", lambda p: p.finalize(0), "InvalidArgument"),
        ("finalize float", lambda p: p.finalize(1.5e6), "InvalidArgument"),
        ("finalize above reserved", lambda p: p.finalize(RESERVED + 1), "InvalidArgument"),
        ("finalize below floor", lambda p: p.finalize(p.floor_bytes() - 1), "InvalidArgument"),
        ("finalize", lambda p: p.finalize(BACKED), "ok"),
        ("finalize twice", lambda p: p.finalize(BACKED), "FailedPrecondition"),
        ("allocate a", lambda p: p.allocate("a", 8), "ok"),
        ("resize with live", lambda p: p.resize(BACKED // 2), "FailedPrecondition"),
        ("free a", lambda p: p.free("a"), "ok"),
        ("resize below floor", lambda p: p.resize(p.floor_bytes() - 1), "InvalidArgument"),
        ("resize down", lambda p: p.resize(BACKED // 2), "ok"),
        ("resize up", lambda p: p.resize(RESERVED), "ok"),
        ("allocate big", lambda p: p.allocate("big", 500), "ok"),
    ]
    for what, op, cls in steps:
        out = m.do(what, op)
        assert out[0] == cls, (what, out)
        assert m.gpu.arena.base == base
    assert m.gpu.arena.backed == RESERVED and m.gpu.page_view(GroupKind.FULL).data_ptr() == base
