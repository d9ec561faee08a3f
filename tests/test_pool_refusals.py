"""Every refusal of the pool: the right exception class, a message that names the problem, and
a pool left exactly as it was (stats, every live request's vectors and ids, ``check()``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvd.errors import (
    AlreadyExists,
    CapacityError,
    FailedPrecondition,
    InvalidArgument,
    KvdError,
    NotFinalized,
    NotFound,
    Pinned,
    StaleEpoch,
)
from kvd.pool.layout import GroupKind
from kvd.records import AllocSpec
from kvd.pool.pool import Pool
from kvd.pool.presets import preset
from pool_testkit import FULL, SWA, Patterns, assert_unchanged, snapshot, two_group_layout

TINY = preset("tiny-hybrid")
PB = TINY.page_bytes(TINY.group("full"))  # 2,048 B
RESERVED, BACKED = 400 * PB, 200 * PB


@pytest.fixture
def loaded(kvd_pool_factory) -> Pool:
    """A tiny-hybrid pool with live requests of every shape (fresh, received, extended past the
    window so SWA pages were released) and one offloaded request."""
    pool = kvd_pool_factory(TINY, RESERVED, BACKED)
    pool.allocate("a", 10)
    pool.allocate("b", 40, receive=True)
    pool.allocate("c", 20)
    pool.extend("c", 30)
    pool.extend("c", 9)  # base 50 > window 32: the oldest SWA pages were given back
    assert pool.vectors("c").swa_first_page > 0
    pool.allocate("d", 12)
    pool.offload("d")
    pool.check()
    return pool


def _refused(pool: Pool, call: Callable[[], object], exc: type[KvdError], match: str, **kw) -> KvdError:
    before = snapshot(pool)
    with pytest.raises(exc, match=match) as info:
        call()
    assert_unchanged(pool, before, **kw)
    return info.value


# ---- allocate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, match",
    [(0, "token count must be positive, got 0"), (-3, "token count must be positive, got -3"),
     (1.5, "token count must be an int, got 1.5"), ("4", "token count must be an int"),
     (True, "token count must be an int, got True"), (None, "token count must be an int, got None")],
)
def test_allocate_bad_token_count(loaded: Pool, tokens, match: str) -> None:
    _refused(loaded, lambda: loaded.allocate("new", tokens), InvalidArgument, match)
    # The same bad spec inside a batch refuses the whole batch.
    _refused(loaded, lambda: loaded.allocate_many([AllocSpec("ok", 4), AllocSpec("new", tokens)]), InvalidArgument, match)


@pytest.mark.parametrize("rid", ["", None, 7])
def test_allocate_bad_request_id(loaded: Pool, rid) -> None:
    _refused(loaded, lambda: loaded.allocate(rid, 4), InvalidArgument, "request id must be a non-empty string")


def test_allocate_empty_batch(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.allocate_many([]), InvalidArgument, "no requests given")
    _refused(loaded, lambda: loaded.shortfall_bytes([]), InvalidArgument, "no requests given")


@pytest.mark.parametrize("rid", ["a", "b", "c", "d"])  # d is offloaded: its id is still taken
def test_allocate_existing_rid(loaded: Pool, rid: str) -> None:
    err = _refused(loaded, lambda: loaded.allocate(rid, 4), AlreadyExists, f"request '{rid}' already exists")
    assert "free it first or pick a new id" in str(err)
    _refused(loaded, lambda: loaded.allocate_many([AllocSpec("fresh", 4), AllocSpec(rid, 4)]), AlreadyExists, "already exists")


def test_allocate_duplicate_rid_within_batch(loaded: Pool) -> None:
    _refused(
        loaded, lambda: loaded.allocate_many([AllocSpec("x", 4), AllocSpec("y", 4), AllocSpec("x", 8)]),
        AlreadyExists, "request 'x' already exists",
    )
    assert "x" not in loaded.request_ids and "y" not in loaded.request_ids


def test_allocate_too_large(loaded: Pool) -> None:
    tokens = 10_000
    short = loaded.shortfall_bytes(AllocSpec("big", tokens))
    assert short > 0 and not loaded.can_allocate(AllocSpec("big", tokens))
    err = _refused(loaded, lambda: loaded.allocate("big", tokens), CapacityError, "does not fit: .* bytes short")
    assert err.shortfall_bytes == short > 0
    assert "free or offload requests" in str(err)


def test_allocate_many_is_atomic(kvd_pool_factory) -> None:
    """A batch whose last request does not fit binds none of them, though the others would."""
    pool = kvd_pool_factory(TINY, RESERVED, BACKED)
    pool.allocate("keep", 8)
    pats = Patterns(pool)
    pats.write_new(pool.vectors("keep"))
    batch = [AllocSpec("s1", 8), AllocSpec("s2", 12, receive=True), AllocSpec("huge", 100_000)]
    assert pool.can_allocate(batch[:2])
    err = _refused(pool, lambda: pool.allocate_many(batch), CapacityError, r"allocation of 3 request\(s\) does not fit")
    assert err.shortfall_bytes > 0
    assert pool.request_ids == ["keep"]
    pats.verify(pool.vectors("keep"))
    # The first two alone still fit afterwards: nothing leaked.
    assert [v.rid for v in pool.allocate_many(batch[:2])] == ["s1", "s2"]
    pool.check()


def test_allocate_before_finalize(kvd_pool_factory) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    err = _refused(pool, lambda: pool.allocate("a", 4), NotFinalized, "allocate before finalize")
    assert "finalize(bytes)" in str(err)
    _refused(pool, lambda: pool.can_allocate(AllocSpec("a", 4)), NotFinalized, "allocate before finalize")


# ---- extend / free ----------------------------------------------------------------------------


def test_extend_unknown_rid(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.extend("nope", 4), NotFound, "request 'nope' is not allocated")
    _refused(loaded, lambda: loaded.extend_many([("a", 4), ("nope", 4)]), NotFound, "'nope' is not allocated")


def test_extend_offloaded_rid(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.extend("d", 4), FailedPrecondition, "'d' is offloaded to host memory; restore it first")


@pytest.mark.parametrize("add, match", [(0, "must be positive, got 0"), (-1, "must be positive, got -1"), (2.0, "must be an int")])
def test_extend_bad_count(loaded: Pool, add, match: str) -> None:
    _refused(loaded, lambda: loaded.extend("a", add), InvalidArgument, f"extend: token count {match}")


def test_extend_same_rid_twice_in_batch(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.extend_many([("a", 4), ("a", 4)]), InvalidArgument, "'a' appears twice in one batch")


def test_extend_too_large(loaded: Pool) -> None:
    err = _refused(loaded, lambda: loaded.extend_many([("a", 4), ("c", 50_000)]), CapacityError, "extension of 2 request")
    assert err.shortfall_bytes > 0


def test_free_unknown_and_double_free(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.free("nope"), NotFound, "request 'nope' is not allocated")
    loaded.free("a")
    loaded.check()
    _refused(loaded, lambda: loaded.free("a"), NotFound, "request 'a' is not allocated in this pool \\(freed")
    # An offloaded request frees once, too.
    loaded.free("d")
    _refused(loaded, lambda: loaded.free("d"), NotFound, "'d' is not allocated")


def test_free_many_checks_every_id_first(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.free_many(["b", "nope"]), NotFound, "'nope'")
    _refused(loaded, lambda: loaded.free_many(["b", "b"]), InvalidArgument, "appears twice in one batch")
    assert "b" in loaded.request_ids


# ---- compaction ----------------------------------------------------------------------------


def _fragmented(kvd_pool_factory) -> Pool:
    """Two-group pool whose full region has holes below a live request, so compaction moves it."""
    layout = two_group_layout()
    pool = kvd_pool_factory(layout, 256 * 600, 256 * 300)
    for i in range(6):
        pool.allocate(f"r{i}", 8)
    for i in range(5):
        pool.free(f"r{i}")
    return pool


def test_compaction_refused_names_lease_labels(kvd_pool_factory) -> None:
    pool = _fragmented(kvd_pool_factory)
    labels = {"r5": "lease-7"}
    err = _refused(pool, lambda: pool.compact(labels), Pinned, "compaction refused: it would move pages pinned by lease-7",
                   refused_compaction=True)
    assert err.holders == ("lease-7",)
    assert "release them or retry later" in str(err)
    # Plain ids name themselves.
    err = _refused(pool, lambda: pool.compact(["r5"]), Pinned, "pinned by r5", refused_compaction=True)
    assert err.holders == ("r5",)
    # Around the pin, nothing of r5 moves; unpinned, it does.
    v = pool.vectors("r5")
    res = pool.compact(labels, around_pinned=True)
    assert res.pages_moved == 0 and torch.equal(pool.vectors("r5").full, v.full)
    assert pool.compact().pages_moved > 0
    pool.check()


def test_compaction_pinning_unknown_rid(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.compact({"ghost": "lease-1"}), NotFound, "pinned request 'ghost' is not allocated")


# ---- sizing order ----------------------------------------------------------------------------


def test_finalize_eager_pool(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.finalize(BACKED), FailedPrecondition, "built eagerly")


def test_finalize_twice(kvd_pool_factory) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    pool.finalize(BACKED)
    _refused(pool, lambda: pool.finalize(BACKED), FailedPrecondition, "already finalized; use resize")


@pytest.mark.parametrize(
    "nbytes, match",
    [(None, "finalize: no byte count given"), (0, "must be a positive int, got 0"), (-PB, "must be a positive int"),
     (1.5e6, "must be a positive int, got 1500000.0"), (True, "must be a positive int, got True"),
     (RESERVED + 1, "more than the 819,200 reserved")],
)
def test_finalize_bad_byte_count(kvd_pool_factory, nbytes, match: str) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    _refused(pool, lambda: pool.finalize(nbytes), InvalidArgument, match)
    assert not pool.finalized and pool.arena.backed == TINY.max_page_bytes


def test_finalize_below_floor(kvd_pool_factory) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    floor = pool.floor_bytes()
    _refused(pool, lambda: pool.finalize(floor - 1), InvalidArgument, f"below the one-request floor of {floor:,d} bytes")
    pool.finalize(floor)  # the floor itself is accepted, and admits one floor-sized request
    pool.allocate("one", pool.floor_tokens)
    pool.check()


def test_eager_pool_below_floor(kvd_arena_factory) -> None:
    probe = Pool(TINY, kvd_arena_factory(RESERVED, BACKED))
    floor = probe.floor_bytes()
    with pytest.raises(InvalidArgument, match="below the one-request floor"):
        Pool(TINY, kvd_arena_factory(RESERVED, floor - 1))


def test_resize_before_finalize(kvd_pool_factory) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    _refused(pool, lambda: pool.resize(BACKED), NotFinalized, "resize before finalize")


def test_resize_with_live_allocations(kvd_pool_factory) -> None:
    pool = kvd_pool_factory(TINY, RESERVED, BACKED, post_capture=True)
    pool.finalize(BACKED)
    pool.allocate("a", 8)
    _refused(pool, lambda: pool.resize(BACKED // 2), FailedPrecondition, "resize with 1 live allocations")
    _refused(pool, lambda: pool.resize(None), FailedPrecondition, "live allocations")
    pool.free("a")
    for bad, match in [(None, "no byte count"), (RESERVED + 1, "more than"), (pool.floor_bytes() - 1, "floor")]:
        _refused(pool, lambda: pool.resize(bad), InvalidArgument, f"resize: .*{match}")
    base = pool.arena.base
    pool.resize(BACKED // 2)
    assert pool.arena.backed == BACKED // 2 and pool.arena.base == base
    pool.allocate("b", 8)
    pool.check()


def test_resize_eager_pool(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.resize(BACKED), FailedPrecondition, "built eagerly")


# ---- offload / restore / lookup ------------------------------------------------------------


def test_restore_not_offloaded(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.restore("a"), FailedPrecondition, "'a' is not offloaded \\(it is live\\)")
    _refused(loaded, lambda: loaded.restore("nope"), NotFound, "'nope' is not offloaded in this pool")


def test_restore_that_does_not_fit(kvd_pool_factory) -> None:
    layout = two_group_layout()
    pool = kvd_pool_factory(layout, 256 * 200, 256 * 40)
    pool.allocate("big", 40)
    pats = Patterns(pool)
    pats.write_new(pool.vectors("big"))
    pool.offload("big")
    while pool.can_allocate(AllocSpec(f"f{len(pool.request_ids)}", 4)):
        pool.allocate(f"f{len(pool.request_ids)}", 4)
    err = _refused(pool, lambda: pool.restore("big"), CapacityError, "restore of 'big' does not fit")
    assert err.shortfall_bytes > 0
    assert pool.offloaded_ids == ["big"]
    pool.free_many([r for r in pool.request_ids])
    pats.verify(pool.restore("big"))  # the host copy survived the refusal
    pool.check()


def test_offload_unknown(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.offload("nope"), NotFound, "'nope' is not allocated")
    _refused(loaded, lambda: loaded.offload("d"), FailedPrecondition, "'d' is offloaded")


def test_vectors_of_offloaded_or_unknown(loaded: Pool) -> None:
    _refused(loaded, lambda: loaded.vectors("d"), FailedPrecondition, "request 'd' is offloaded to host memory")
    _refused(loaded, lambda: loaded.virtual_ids("d"), FailedPrecondition, "offloaded")
    _refused(loaded, lambda: loaded.vectors("nope"), NotFound, "'nope' is not allocated")


@pytest.mark.parametrize("kind", ["full", "swa", "state", "draft"])
def test_translate_out_of_range(loaded: Pool, kind: str) -> None:
    size = loaded.groups[GroupKind(kind)].v2p.numel()
    if kind == "swa":  # swa binds the full group's ids, so it spans the owner's id space
        assert size == loaded.groups[FULL].v2p.numel()
    for bad in ([-1], [0, size], [size + 5]):
        ids = torch.tensor(bad, dtype=torch.int32)
        _refused(loaded, lambda: loaded.translate(kind, ids), InvalidArgument, rf"translate: virtual ids must lie in \[0, {size}\)")
    # In range is fine: bound ids translate to their pages, the rest to -1.
    v = loaded.vectors("a")
    ids = loaded.virtual_ids("a")["full"]
    if kind == "full":
        assert torch.equal(loaded.translate("full", ids), v.full)
    if kind == "swa":
        assert torch.equal(loaded.translate("swa", ids[v.swa_first_page :]), v.swa)


def test_require_fresh_wrong_boot(loaded: Pool) -> None:
    v = loaded.vectors("a")
    _refused(loaded, lambda: loaded.require_fresh("a", v.epoch, "0123456789abcdef"), StaleEpoch,
             "boot id '0123456789abcdef' is not this pool's .* the daemon restarted")
    loaded.require_fresh("a", v.epoch, v.boot_id)  # the right boot is accepted


def test_require_fresh_stale_after_compaction(kvd_pool_factory) -> None:
    pool = _fragmented(kvd_pool_factory)
    old = pool.vectors("r5")
    pool.require_fresh("r5", old.epoch, old.boot_id)
    res = pool.compact()
    assert res.pages_moved > 0
    new = pool.vectors("r5")
    assert not torch.equal(new.full, old.full) and new.epoch == res.epoch > old.epoch
    _refused(pool, lambda: pool.require_fresh("r5", old.epoch, old.boot_id), StaleEpoch,
             f"request 'r5': epoch {old.epoch} is stale \\(its pages moved at epoch {new.epoch}")
    _refused(pool, lambda: pool.require_fresh("r5", new.epoch + 1, old.boot_id), StaleEpoch, "is stale")
    pool.require_fresh("r5", new.epoch, new.boot_id)
    _refused(pool, lambda: pool.require_fresh("gone", new.epoch, new.boot_id), NotFound, "'gone' is not allocated")


def test_require_fresh_unmoved_request_survives_compaction(kvd_pool_factory) -> None:
    """Only requests whose pages moved go stale; one that compaction left alone stays fresh."""
    layout = two_group_layout()
    pool = kvd_pool_factory(layout, 256 * 600, 256 * 300)
    pool.allocate("stay", 8)
    pool.allocate("hole", 8)
    pool.allocate("move", 8)
    pool.free("hole")
    stay, move = pool.vectors("stay"), pool.vectors("move")
    assert pool.compact().pages_moved > 0
    assert torch.equal(pool.vectors("stay").full, stay.full)
    pool.require_fresh("stay", stay.epoch, stay.boot_id)
    with pytest.raises(StaleEpoch):
        pool.require_fresh("move", move.epoch, move.boot_id)
    assert pool.groups[SWA].used == 4


def test_vectors_of_a_freed_request_are_stale_for_a_reused_id(kvd_pool_factory) -> None:
    """A request freed and allocated again under the same id gets new pages; vectors quoted for
    the old one must not pass require_fresh (they would point at someone else's pages)."""
    pool = kvd_pool_factory(preset("tiny-hybrid"), 1 << 20, 1 << 20)
    old = pool.allocate("r", 20)
    pool.free("r")
    pool.allocate("other", 20)  # may take r's old pages
    pool.allocate("r", 20)
    with pytest.raises(StaleEpoch, match="stale"):
        pool.require_fresh("r", old.epoch, old.boot_id)
    pool.require_fresh("r", pool.vectors("r").epoch, pool.boot_id)
    pool.check()
