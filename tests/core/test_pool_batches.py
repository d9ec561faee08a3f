"""The pool's batch paths (issue 16): ``allocate_many`` / ``extend_many`` / ``free_many`` bind and
release a whole batch in one allocator call per group. They must leave the pool exactly as binding
or releasing the same requests one by one (under the same plan) does -- every page, id, hole stack,
ring and version -- keep every invariant, and refuse a batch with one bad item having changed
nothing. The specialisations of the per-request path (one request not split, one id bound with
scalar writes, a few ids reduced as a list) must leave every table as the general path does.
Also: the small-run fast path of ``coalesce_np`` and the lease table's per-request index."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

import kvd.copy.runs as runs
import kvd.pool.allocator as allocator
from kvd.daemon.leases import LeaseTable
from kvd.errors import AlreadyExists, CapacityError, InvalidArgument, KvdError, NotFound
from kvd.pool.planner import Step
from kvd.pool.pool import Pool
from kvd.records import AllocSpec, LeaseKind
from pool_testkit import arena_for, assert_unchanged, sizings, snapshot, vec_key

SIZINGS = sizings()


def _one_by_one(pool: Pool) -> Pool:
    """Make ``pool`` bind and release batches request by request (the path before issue 16):
    the reference the batch paths must match."""
    b = pool._bindings
    bind, release = b.bind_steps, b.release_many

    def bind_each(reqs, steps, plan):
        for r, s in zip(reqs, steps):
            bind([r], [s], plan)

    b.bind_steps = bind_each  # type: ignore[method-assign]
    b.release_many = lambda reqs: sum(release([r]) for r in reqs)  # type: ignore[method-assign]
    return pool


def _split_only(pool: Pool) -> Pool:
    """Make ``pool`` bind and release a single request through the batch paths too (the ids
    split among one request): the reference the one-request paths must match."""
    b = pool._bindings
    b._bind_one = lambda r, need, plan: b._bind_split([r], [Step(need)], plan)  # type: ignore[method-assign]
    b._release_one = lambda r: b._release_split([r])  # type: ignore[method-assign]
    return pool


def _internals(pool: Pool) -> tuple:
    """Every table behind the pool, as plain values."""
    groups = {
        k.value: (a.p2v.tolist(), a.v2p.tolist(), a.holes().tolist(), a.lo, a.hi, a.used)
        for k, a in pool.groups.items()
    }
    b = pool._bindings
    rings = {k.value: (r._ring.tolist(), r._head, r.count) for k, r in b.rings.items()}
    owners = {k.value: t.tolist() for k, t in b.vid_req.items()}
    reqs = {rid: (r.handle, r.full.tolist(), r.swa_first, r.state, r.draft.tolist(), r.version)
            for rid, r in pool._requests.items()}
    return groups, rings, owners, reqs


def _step(pool: Pool, op: str, arg) -> object:
    try:
        if op == "alloc":
            return [vec_key(v)[3:] for v in pool.allocate_many(arg)]
        if op == "extend":
            return [vec_key(v)[3:] for v in pool.extend_many(arg)]
        pool.free_many(arg)
        return None
    except KvdError as exc:
        return type(exc).__name__


@pytest.mark.parametrize("name", sorted(SIZINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_batches_match_one_by_one(name: str, seed: int) -> None:
    s = SIZINGS[name]
    batch, ref = Pool(s.layout, arena_for(s)), _one_by_one(Pool(s.layout, arena_for(s)))
    rng = random.Random(seed)
    live: list[str] = []
    seq = 0
    capacity_refusals = batches = 0
    for _ in range(120):
        roll = rng.random()
        if roll < 0.45 or not live:
            n = rng.randint(1, 6)
            specs = [AllocSpec(f"r{seq + i}", rng.randint(1, s.max_tokens // 2), rng.random() < 0.4) for i in range(n)]
            seq += n
            op, arg = "alloc", specs
        elif roll < 0.65:
            pick = rng.sample(live, min(len(live), rng.randint(1, 4)))
            op, arg = "extend", [(rid, rng.randint(1, s.max_tokens // 4)) for rid in pick]
        else:
            op, arg = "free", rng.sample(live, min(len(live), rng.randint(1, 5)))
        got, want = _step(batch, op, arg), _step(ref, op, arg)
        assert got == want, (op, arg)
        if got == "CapacityError":
            capacity_refusals += 1
        elif op == "alloc":
            live += [x.rid for x in arg]
            batches += len(arg) > 1
        elif op == "free" and not isinstance(got, str):
            live = [rid for rid in live if rid not in arg]
        assert _internals(batch) == _internals(ref), (op, arg)
        batch.check()
        ref.check()
    assert batches > 10  # the batch paths ran, several requests at once
    assert capacity_refusals < 120


@pytest.mark.parametrize("name", sorted(SIZINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_one_request_paths_match_the_split_paths(name: str, seed: int) -> None:
    """Binding and releasing one request (``_bind_one``, ``_release_one``) leaves every table as
    the batch paths given that one request do, over random single and batched operations."""
    s = SIZINGS[name]
    fast, ref = Pool(s.layout, arena_for(s)), _split_only(Pool(s.layout, arena_for(s)))
    rng = random.Random(seed)
    live: list[str] = []
    seq = singles = 0
    for _ in range(150):
        roll, n = rng.random(), 1 if rng.random() < 0.7 else rng.randint(2, 4)
        if roll < 0.45 or not live:
            op, arg = "alloc", [AllocSpec(f"r{seq + i}", rng.randint(1, s.max_tokens // 2), rng.random() < 0.4) for i in range(n)]
            seq += n
        elif roll < 0.65:
            op, arg = "extend", [(rid, rng.randint(1, s.max_tokens // 4)) for rid in rng.sample(live, min(len(live), n))]
        else:
            op, arg = "free", rng.sample(live, min(len(live), n))
        got, want = _step(fast, op, arg), _step(ref, op, arg)
        assert got == want, (op, arg)
        if not isinstance(got, str):
            singles += len(arg) == 1
            if op == "alloc":
                live += [x.rid for x in arg]
            elif op == "free":
                live = [rid for rid in live if rid not in arg]
        assert _internals(fast) == _internals(ref), (op, arg)
        fast.check()
        ref.check()
    assert singles > 40


class _ArraysOnly:
    """Binds and unbinds one id, and a few (up to ``allocator._FEW``), through the array path,
    and reduces a few ids in numpy, while the block runs (the allocator's module switches)."""

    def __enter__(self) -> None:
        self.saved = allocator._SCALAR, allocator._SMALL
        allocator._SCALAR, allocator._SMALL = False, 0

    def __exit__(self, *exc: object) -> None:
        allocator._SCALAR, allocator._SMALL = self.saved


@pytest.mark.parametrize("name", sorted(SIZINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_one_id_paths_match_the_array_paths(name: str, seed: int) -> None:
    """Random allocations, one-page extensions (a decode step), frees and offload/restore on two
    pools, one of them binding every id through the array path (the other binds one id, and a
    short request's few, through scalar writes): every table stays equal."""
    s = SIZINGS[name]
    fast, ref = Pool(s.layout, arena_for(s)), Pool(s.layout, arena_for(s))
    rng = random.Random(seed)
    live: list[str] = []
    seq = 0
    for _ in range(150):
        roll = rng.random()
        if roll < 0.35 or not live:
            op, arg = "alloc", [AllocSpec(f"r{seq}", rng.randint(1, s.max_tokens // 2), rng.random() < 0.4)]
            seq += 1
        elif roll < 0.7:
            op, arg = "extend", [(rng.choice(live), rng.randint(1, s.layout.page_size))]
        elif roll < 0.9:
            op, arg = "free", [rng.choice(live)]
        else:
            rid = rng.choice(live)
            for p, arrays in ((fast, False), (ref, True)):
                with _ArraysOnly() if arrays else contextlib.nullcontext():
                    p.offload(rid)
                    try:
                        p.restore(rid)
                    except CapacityError:
                        p.free(rid)
            if rid not in fast.request_ids:
                live.remove(rid)
            assert _internals(fast) == _internals(ref)
            continue
        got = _step(fast, op, arg)
        with _ArraysOnly():
            want = _step(ref, op, arg)
        assert got == want, (op, arg)
        if not isinstance(got, str):
            if op == "alloc":
                live += [x.rid for x in arg]
            elif op == "free":
                live.remove(arg[0])
        assert _internals(fast) == _internals(ref), (op, arg)
        fast.check()
        ref.check()


def test_a_fresh_batch_gets_the_pages_one_by_one_binds_give() -> None:
    """The down-growing group's growth split among a batch: the first request highest, each
    request's pages ascending (+1 runs) -- what the batch bind must reproduce."""
    s = SIZINGS["tiny-hybrid"]
    batch, ref = Pool(s.layout, arena_for(s)), _one_by_one(Pool(s.layout, arena_for(s)))
    specs = [AllocSpec(f"r{i}", 9 + 4 * i) for i in range(4)]
    got = [vec_key(v) for v in batch.allocate_many(specs)]
    want = [vec_key(v) for v in ref.allocate_many(specs)]
    assert [g[3:] for g in got] == [w[3:] for w in want]
    fulls = [g[4] for g in got]
    assert all(f == list(range(f[0], f[0] + len(f))) for f in fulls)
    assert fulls[0][0] > fulls[1][0] > fulls[2][0]
    batch.free_many(["r1", "r3"])  # two requests' pages pushed back, the first one's first
    ref.free_many(["r1", "r3"])
    assert _internals(batch) == _internals(ref)
    again = [AllocSpec("a", 13), AllocSpec("b", 21)]
    assert [vec_key(v)[3:] for v in batch.allocate_many(again)] == [vec_key(v)[3:] for v in ref.allocate_many(again)]
    batch.check()


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma-4-31b-it-tp2", "qwen3.5-0.8b"])
def test_a_bad_item_leaves_the_pool_as_it_was(name: str) -> None:
    s = SIZINGS[name]
    pool = Pool(s.layout, arena_for(s))
    pool.allocate_many([AllocSpec("a", 8), AllocSpec("b", 5, True), AllocSpec("c", 3)])
    pool.free("b")
    before = snapshot(pool)
    bad = [
        (lambda: pool.allocate_many([AllocSpec("x", 4), AllocSpec("a", 4)]), AlreadyExists),
        (lambda: pool.allocate_many([AllocSpec("x", 4), AllocSpec("x", 4)]), AlreadyExists),
        (lambda: pool.allocate_many([AllocSpec("x", 4), AllocSpec("y", 0)]), InvalidArgument),
        (lambda: pool.allocate_many([AllocSpec("x", 4), AllocSpec("y", 10**9)]), CapacityError),
        (lambda: pool.free_many(["a", "nope"]), NotFound),
        (lambda: pool.free_many(["a", "c", "a"]), InvalidArgument),
        (lambda: pool.extend_many([("a", 4), ("nope", 4)]), NotFound),
        (lambda: pool.extend_many([("a", 4), ("c", -1)]), InvalidArgument),
        (lambda: pool.extend_many([("a", 4), ("c", 10**9)]), CapacityError),
    ]
    for call, err in bad:
        with pytest.raises(err):
            call()
        assert_unchanged(pool, before)


def test_coalesce_small_path_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    for trial in range(600):
        n = int(rng.integers(1, 2 * runs.SMALL))
        s = np.cumsum(rng.integers(1, 3, n)).astype(np.int32)
        d = np.cumsum(rng.integers(1, 3, n)).astype(np.int32)
        if trial % 3 == 0:
            s = rng.permutation(s)
        small = runs.coalesce_np(s, d)
        saved, runs.SMALL = runs.SMALL, 0
        try:
            vec = runs.coalesce_np(s, d)
        finally:
            runs.SMALL = saved
        for a, b in zip(small, vec):
            assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
    src, dst, length = runs.coalesce_np(np.array([4, 5, 6, 9]), np.array([10, 11, 12, 13]))
    assert (src.tolist(), dst.tolist(), length.tolist()) == ([4, 9], [10, 13], [3, 1])


def test_lease_table_index_follows_every_change() -> None:
    now = [0.0]
    t = LeaseTable(default_ttl=5.0, clock=lambda: now[0])
    a = t.acquire("r1", LeaseKind.SEND, session="s", boot_id="b", epoch=1)
    b = t.acquire("r1", LeaseKind.RECV, session="s", boot_id="b", epoch=1, ttl=1.0)
    c = t.acquire("r2", LeaseKind.SEND, session="s", boot_id="b", epoch=1)
    assert [x.lease_id for x in t.for_rid("r1")] == [a.lease_id, b.lease_id]
    t.check()
    t.release(a.lease_id)
    assert [x.lease_id for x in t.for_rid("r1")] == [b.lease_id]
    now[0] = 2.0  # b ran out: not listed, then expired
    assert t.for_rid("r1") == []
    assert [x.lease_id for x in t.expire()] == [b.lease_id]
    t.drop(c.lease_id)
    t.drop(c.lease_id)  # twice: nothing
    assert t.for_rid("r2") == [] and len(t) == 0
    t.check()
    assert t._by_rid == {}
