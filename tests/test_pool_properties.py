"""Property tests of the pool: random operation sequences on small arenas of several layouts.

A hypothesis state machine drives allocate / allocate_many (incl. receive) / extend /
extend_many / free / compact (unpinned, strict and around pinned requests) / offload / restore /
resize (post-capture pools, when empty) against a plain model of the live requests. Request ids
are never reused within one run: require_fresh keys on (rid, epoch) only. After every step: ``pool.check()``, the model's
page counts, the bytes of every live request's pages (written with a distinct pattern when bound,
read back through the current physical ids), and epoch fencing (a vector that
``require_fresh`` still accepts must name the same physical pages). A ``CapacityError`` or
``Pinned`` must leave the pool exactly as it was.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvd.errors import AlreadyExists, CapacityError, FailedPrecondition, Pinned, StaleEpoch
from kvd.records import AllocSpec, IndexVectors
from kvd.pool.pool import Pool
from pool_testkit import (
    DRAFT,
    FULL,
    STATE,
    SWA,
    Patterns,
    Sizing,
    arena_for,
    assert_unchanged,
    expected_used,
    phys_key,
    request_bytes,
    sizings,
    snapshot,
)

SIZINGS = sizings()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tensors here are tiny: torch's intra-op threads only add wake-up latency, and on a
    busy 2-core runner that latency dominates (10x). Restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pages_by_index(v: IndexVectors) -> dict[tuple[str, int], int]:
    """Physical page of every (group, logical page) of a vector."""
    n = v.full.numel()
    out = {("full", i): p for i, p in enumerate(v.full.tolist())}
    out.update({("swa", i): p for i, p in zip(range(v.swa_first_page, n), v.swa.tolist())})
    out.update({("draft", i): p for i, p in enumerate(v.draft.tolist())})
    if v.state is not None:
        out[("state", 0)] = v.state
    return out


class PoolMachine(RuleBasedStateMachine):
    SIZING: Sizing

    def __init__(self) -> None:
        super().__init__()
        self.arena = None
        self.pool: Pool | None = None
        self.model: dict[str, tuple[int, int]] = {}  # live rid -> (tokens, base_tokens)
        self.off: dict[str, tuple[int, int]] = {}  # offloaded rid -> (tokens, base_tokens)
        self.seen: dict[str, IndexVectors] = {}  # vectors a client fetched last, per rid
        self.n = 0
        self.last_epoch = 0
        self.post_capture = False

    # ---- setup --------------------------------------------------------------------------
    @initialize(post_capture=st.booleans())
    def build(self, post_capture: bool) -> None:
        s = self.SIZING
        if post_capture:
            self.arena = arena_for(Sizing(s.layout, s.reserved, 0, s.max_tokens))
            self.pool = Pool(s.layout, self.arena, post_capture=True)
            assert self.arena.backed == s.layout.max_page_bytes
            self.pool.finalize(s.backed)
            self.post_capture = True
        else:
            self.arena = arena_for(s)
            self.pool = Pool(s.layout, self.arena)
        assert self.arena.backed == s.backed
        self.pat = Patterns(self.pool)
        self.pool.check()

    def teardown(self) -> None:
        self.pool = None
        self.pat = None
        if self.arena is not None:
            self.arena.close()

    # ---- helpers ------------------------------------------------------------------------
    def _rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _expect_swa_first(self, base: int) -> int:
        layout = self.pool.layout
        if SWA not in self.pool.groups:
            return 0
        return max(0, base - layout.group("swa").window) // layout.page_size

    def _check_vec(self, v: IndexVectors, tokens: int, base: int) -> None:
        layout, g = self.pool.layout, self.pool.groups
        assert v.tokens == tokens
        assert v.boot_id == self.pool.boot_id and v.epoch == self.pool.epoch
        n = -(-tokens // layout.page_size)
        assert v.full.numel() == n
        first = self._expect_swa_first(base)
        assert v.swa_first_page == first
        assert v.swa.numel() == (n - first if SWA in g else 0)
        assert (v.state is not None) == (STATE in g)
        if DRAFT in g:
            assert v.draft.numel() == -(-tokens // layout.page_size_of(layout.group("draft")))
        else:
            assert v.draft.numel() == 0

    def _tokens(self) -> st.SearchStrategy[int]:
        return st.integers(1, self.SIZING.max_tokens)

    # ---- rules --------------------------------------------------------------------------
    @rule(data=st.data(), receive=st.booleans())
    def allocate(self, data, receive: bool) -> None:
        tokens = data.draw(self._tokens(), label="tokens")
        self._allocate([AllocSpec(self._rid(), tokens, receive)], single=True)

    @rule(data=st.data())
    def allocate_many(self, data) -> None:
        shapes = data.draw(st.lists(st.tuples(self._tokens(), st.booleans()), min_size=1, max_size=3), label="batch")
        self._allocate([AllocSpec(self._rid(), t, r) for t, r in shapes], single=False)

    def _allocate(self, specs: list[AllocSpec], single: bool) -> None:
        pool = self.pool
        short = pool.shortfall_bytes(specs)
        can = pool.can_allocate(specs)
        assert can == (short == 0)
        before = snapshot(pool)
        try:
            if single:
                out = [pool.allocate(specs[0].rid, specs[0].tokens, receive=specs[0].receive)]
            else:
                out = pool.allocate_many(specs)
        except CapacityError as e:
            event("allocate: CapacityError")
            assert not can, "can_allocate said it fits"
            assert e.shortfall_bytes == short > 0
            assert "does not fit" in str(e)
            assert_unchanged(pool, before)
            return
        assert can, "can_allocate said it does not fit"
        for s, v in zip(specs, out, strict=True):
            base = s.tokens if s.receive else 0
            self._check_vec(v, s.tokens, base)
            self.model[s.rid] = (s.tokens, base)
            self.pat.write_new(v)
            self.seen[s.rid] = v

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def duplicate_rid_refused(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model) + sorted(self.off)), label="rid")
        before = snapshot(self.pool)
        with pytest.raises(AlreadyExists, match="already exists"):
            self.pool.allocate_many([AllocSpec(self._rid(), 1), AllocSpec(rid, 1)])
        assert_unchanged(self.pool, before)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)), label="rid")
        add = data.draw(st.integers(1, max(1, self.SIZING.max_tokens // 2)), label="add")
        self._extend([(rid, add)], single=True)

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def extend_many(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=2, max_size=3, unique=True), label="rids")
        adds = [data.draw(st.integers(1, max(1, self.SIZING.max_tokens // 2)), label="add") for _ in rids]
        self._extend(list(zip(rids, adds)), single=False)

    def _extend(self, items: list[tuple[str, int]], single: bool) -> None:
        pool = self.pool
        old = {rid: pool.vectors(rid) for rid, _ in items}
        before = snapshot(pool)
        try:
            out = [pool.extend(*items[0])] if single else pool.extend_many(items)
        except CapacityError as e:
            event("extend: CapacityError")
            assert e.shortfall_bytes > 0
            assert "does not fit" in str(e)
            assert_unchanged(pool, before)
            return
        for (rid, add), v in zip(items, out, strict=True):
            tokens, _ = self.model[rid]
            self._check_vec(v, tokens + add, tokens)
            self.model[rid] = (tokens + add, tokens)
            if v.swa_first_page > old[rid].swa_first_page:
                event("extend: released swa pages")
            # Extending never moves a page the request keeps.
            o, n = _pages_by_index(old[rid]), _pages_by_index(v)
            assert {k: n[k] for k in o if k in n} == {k: o[k] for k in o if k in n}
            self.pat.write_new(v, old[rid])
            self.seen[rid] = v

    @precondition(lambda self: self.model or self.off)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model) + sorted(self.off)), label="rid")
        self.pool.free(rid)
        self.model.pop(rid, None)
        self.off.pop(rid, None)
        self.seen.pop(rid, None)
        self.pat.forget(rid)
        assert rid not in self.pool.request_ids and rid not in self.pool.offloaded_ids

    @rule(data=st.data(), mode=st.sampled_from(["none", "strict", "around"]), as_mapping=st.booleans())
    def compact(self, data, mode: str, as_mapping: bool) -> None:
        self._compact(data, mode, as_mapping)

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data(), mode=st.sampled_from(["none", "strict", "around"]), as_mapping=st.booleans())
    def free_some_then_compact(self, data, mode: str, as_mapping: bool) -> None:
        """Punch holes into the regions first, so that compaction has pages to move."""
        live = sorted(self.model)
        victims = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live) - 1, unique=True), label="free")
        self.pool.free_many(victims)
        for rid in victims:
            self.model.pop(rid)
            self.seen.pop(rid, None)
            self.pat.forget(rid)
        self._compact(data, mode, as_mapping)

    def _compact(self, data, mode: str, as_mapping: bool) -> None:
        pool = self.pool
        candidates = sorted(self.model) + sorted(self.off)
        pinned: list[str] = []
        if mode != "none" and candidates:
            pinned = data.draw(st.lists(st.sampled_from(candidates), max_size=len(candidates), unique=True), label="pinned")
        labels = {rid: f"lease-{i}" for i, rid in enumerate(pinned)}
        arg = labels if as_mapping else list(pinned)
        shown = set(labels.values()) if as_mapping else set(pinned)
        old = {rid: pool.vectors(rid) for rid in self.model}
        before = snapshot(pool)
        st_before = before[0]
        try:
            res = pool.compact(arg, around_pinned=(mode == "around"))
        except Pinned as e:
            event("compact: Pinned")
            assert mode == "strict"
            assert e.holders and set(e.holders) <= shown
            for h in e.holders:
                assert h in str(e)
            assert "compaction refused" in str(e)
            assert_unchanged(pool, before, refused_compaction=True)
            return
        st_after = pool.stats()
        assert st_after.compactions_done == st_before.compactions_done + 1
        assert st_after.pages_moved == st_before.pages_moved + res.pages_moved
        assert st_after.bytes_moved == st_before.bytes_moved + res.bytes_moved
        assert res.gap_gained_bytes == st_after.gap_bytes - st_before.gap_bytes >= 0
        assert res.epoch == pool.epoch
        assert pool.epoch == st_before.epoch + (1 if res.pages_moved else 0)
        for rid in pinned:
            if rid in self.model:
                assert phys_key(pool.vectors(rid)) == phys_key(old[rid]), f"pinned {rid} moved"
        if mode != "around":
            # Nothing pinned stood in the way: every group is packed, with no holes left.
            assert all(g.hole_pages == 0 for g in st_after.groups), st_after.groups
        moved = 0
        for rid, o in old.items():
            v = pool.vectors(rid)
            self.pat.verify(v)
            a, b = _pages_by_index(o), _pages_by_index(v)
            assert a.keys() == b.keys()
            moved += sum(a[k] != b[k] for k in a)
        assert moved == res.pages_moved
        event(f"compact {mode}: " + ("moved pages" if moved else "nothing moved"))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def offload(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)), label="rid")
        v = self.pool.vectors(rid)
        nbytes = self.pool.offload(rid)
        assert nbytes == request_bytes(self.pool, v)
        self.off[rid] = self.model.pop(rid)
        with pytest.raises(FailedPrecondition, match="offloaded"):
            self.pool.vectors(rid)

    @precondition(lambda self: self.off)
    @rule(data=st.data())
    def restore(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.off)), label="rid")
        pool = self.pool
        before = snapshot(pool)
        try:
            v = pool.restore(rid)
        except CapacityError as e:
            event("restore: CapacityError")
            assert e.shortfall_bytes > 0
            assert_unchanged(pool, before)
            return
        event("restore: ok")
        tokens, base = self.off.pop(rid)
        self._check_vec(v, tokens, base)
        assert v.epoch == before[0].epoch + 1
        assert phys_key(pool.vectors(rid)) == phys_key(v)
        self.model[rid] = (tokens, base)
        self.pat.verify(v)

    @precondition(lambda self: self.post_capture and not self.model)
    @rule(data=st.data())
    def resize(self, data) -> None:
        """Resize the empty pool (offloaded requests may wait on the host) in place."""
        pool, s = self.pool, self.SIZING
        nbytes = data.draw(st.integers(pool.floor_bytes(), s.reserved), label="nbytes")
        base, tables = pool.arena.base, {k: (a.v2p.data_ptr(), a.p2v.data_ptr()) for k, a in pool.groups.items()}
        epoch = pool.epoch
        pool.resize(nbytes)
        assert pool.arena.backed == nbytes and pool.epoch == epoch + 1
        assert pool.arena.base == base
        assert {k: (a.v2p.data_ptr(), a.p2v.data_ptr()) for k, a in pool.groups.items()} == tables
        assert all(g.used_pages == 0 and g.free_pages == g.capacity_pages for g in pool.stats().groups)

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        if pool is None:
            return
        pool.check()
        assert sorted(pool.request_ids) == sorted(self.model)
        assert sorted(pool.offloaded_ids) == sorted(self.off)
        stats = pool.stats()
        assert {g.name: g.used_pages for g in stats.groups} == expected_used(pool, self.model)
        assert all(g.free_pages == g.capacity_pages - g.used_pages >= 0 for g in stats.groups)
        assert stats.epoch >= self.last_epoch
        self.last_epoch = stats.epoch
        for rid, (tokens, _) in self.model.items():
            v = pool.vectors(rid)
            assert v.tokens == tokens
            self.pat.verify(v, whole=False)  # whole pages after every compaction and restore

    @invariant()
    def fenced(self) -> None:
        """A vector that require_fresh still accepts names exactly the pages the request holds
        at those positions now; one whose pages moved is refused."""
        pool = self.pool
        if pool is None:
            return
        for rid, old in self.seen.items():
            if rid not in self.model:
                continue
            now = _pages_by_index(pool.vectors(rid))
            then = _pages_by_index(old)
            same = all(now[k] == then[k] for k in then if k in now)
            try:
                pool.require_fresh(rid, old.epoch, old.boot_id)
            except StaleEpoch:
                continue
            assert same, f"{rid}: epoch {old.epoch} still accepted but its pages moved"

    @invariant()
    def vouched(self) -> None:
        """``Pool.unchanged`` (a Send planned at BeginSend reuses its plan on it) vouches only
        for vectors that are exactly the request's vectors now; off the wire (version 0) never."""
        pool = self.pool
        if pool is None:
            return
        for rid, old in self.seen.items():
            if pool.unchanged(old):
                assert rid in self.model, f"{rid}: not live, yet its old vectors are vouched for"
                assert phys_key(pool.vectors(rid)) == phys_key(old), f"{rid}: vouched for, but its pages changed"
            assert not pool.unchanged(old._replace(version=0))


_SETTINGS = dict(
    deadline=None,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Big-page layouts copy megabytes per page; give them fewer examples.
_EXAMPLES = {"tiny-hybrid": 60, "two-group": 50, "tri-pool": 50, "gpt-oss-20b": 30, "gemma-4-31b-it-tp2": 30, "qwen3.5-0.8b": 30}


def _case(name: str):
    machine = type(f"PoolMachine_{name}", (PoolMachine,), {"SIZING": SIZINGS[name]})
    case = machine.TestCase
    case.settings = settings(max_examples=_EXAMPLES[name], **_SETTINGS)
    return case


TestTinyHybrid = _case("tiny-hybrid")
TestTwoGroup = _case("two-group")
TestTriPool = _case("tri-pool")
TestGptOss20b = _case("gpt-oss-20b")
TestGemma4_31bTp2 = _case("gemma-4-31b-it-tp2")
TestQwen35 = _case("qwen3.5-0.8b")


# ---- directed regressions found by the machine above ----------------------------------------


def test_extend_many_binds_swa_pages_a_later_request_releases(kvd_arena_factory) -> None:
    """The plan counts SWA pages that any request of an extend_many batch releases as holes for
    the whole batch; an earlier request of the batch may need them. (Binding before every
    release left request A with an unbound swa id: InternalError, pool broken.)"""
    from pool_testkit import two_group_layout

    layout = two_group_layout(swa_ratio=1, window=4)  # full and swa pages of 256 B
    pool = Pool(layout, kvd_arena_factory(256 * 100, 256 * 21))
    pool.allocate("A", 4)
    pool.allocate("B", 13)
    pool.allocate("C", 12, receive=True)  # 3 full pages, 1 swa page
    for i in range(3):
        pool.allocate(f"f{i}", 4)
    assert pool.stats().gap_bytes == 0  # the arena is exactly full
    pool.free("C")
    pool.allocate("D", 4, receive=True)  # takes C's swa hole: full has 2 holes, swa none
    assert {g.name: g.hole_pages for g in pool.stats().groups} == {"swa": 0, "full": 2}
    pats = Patterns(pool)
    for rid in pool.request_ids:
        pats.write_new(pool.vectors(rid))
    old_a, old_b = pool.vectors("A"), pool.vectors("B")
    # A needs one full and one swa page; B's extension needs none but releases two swa pages.
    a, b = pool.extend_many([("A", 4), ("B", 1)])
    pool.check()
    assert a.swa.numel() == 2 and b.swa_first_page == 2 and b.swa.numel() == 2
    assert set(a.swa.tolist()).isdisjoint(b.swa.tolist())
    pats.write_new(a, old_a)
    pats.write_new(b, old_b)
    for rid in pool.request_ids:
        pats.verify(pool.vectors(rid))
