"""Direct unit tests of the small pieces under the pool: page runs, the virtual-id ring, and the
shared-memory arena (in place growth, and a second process mapping it)."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.pool.allocator import IDX, IdRing
from kvd.memory.arena import ArenaHandle, ShmArena, map_shared
from kvd.errors import FailedPrecondition, InternalError, InvalidArgument
from kvd.copy.pages import copy_runs
from kvd.copy.runs import Runs, coalesce, expand


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _runs(r: Runs) -> list[tuple[int, int, int]]:
    return list(zip(r.src.tolist(), r.dst.tolist(), r.length.tolist()))


# ---- runs -------------------------------------------------------------------------------------


def test_coalesce_breaks_where_either_side_jumps() -> None:
    src = _t([0, 1, 2, 5, 6, 7, 8, 3])
    dst = _t([10, 11, 12, 20, 22, 23, 24, 25])
    # 0-2 -> 10-12 together; 5->20 alone (dst jumps after it); 6-8 -> 22-24; 3 -> 25 (src jumps).
    assert _runs(coalesce(src, dst)) == [(0, 10, 3), (5, 20, 1), (6, 22, 3), (3, 25, 1)]


def test_coalesce_empty_and_mismatched() -> None:
    r = coalesce(_t([]), _t([]))
    assert len(r) == 0 and r.src.dtype == torch.int64
    assert expand(r)[0].numel() == 0
    with pytest.raises(ValueError, match="3 sources but 2 destinations"):
        coalesce(_t([1, 2, 3]), _t([1, 2]))


def test_coalesce_accepts_int32_and_returns_int64() -> None:
    r = coalesce(torch.tensor([4, 5], dtype=IDX), torch.tensor([8, 9], dtype=IDX))
    assert _runs(r) == [(4, 8, 2)] and r.src.dtype == r.dst.dtype == r.length.dtype == torch.int64


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_coalesce_expand_round_trip(pairs: list[tuple[int, int]]) -> None:
    src, dst = _t([p[0] for p in pairs]), _t([p[1] for p in pairs])
    r = coalesce(src, dst)
    s, d = expand(r)
    assert torch.equal(s, src) and torch.equal(d, dst)
    assert bool((r.length >= 1).all())
    # Maximal: two neighbouring runs could not have been one.
    for (s0, d0, n0), (s1, d1, _) in zip(_runs(r), _runs(r)[1:]):
        assert not (s1 == s0 + n0 and d1 == d0 + n0)


@pytest.mark.parametrize("page_bytes", [16, 64 * 1024], ids=["gather-path", "loop-path"])
def test_copy_runs_moves_whole_pages(page_bytes: int) -> None:
    pages = 12
    # Every byte differs from its neighbours and from the same offset on other pages.
    view = ((torch.arange(pages)[:, None] * 7 + torch.arange(page_bytes)[None, :]) % 251).to(torch.uint8)
    orig = view.clone()
    src, dst = _t([7, 8, 9, 11, 2]), _t([0, 1, 3, 4, 10])  # live pages into holes, same view
    copy_runs(view, view, coalesce(src, dst))
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(view[d], orig[s]), (s, d)
    untouched = [p for p in range(pages) if p not in dst.tolist()]
    assert torch.equal(view[untouched], orig[untouched])


def test_copy_runs_between_views_and_noop() -> None:
    a = torch.randint(0, 255, (6, 32), dtype=torch.uint8)
    b = torch.zeros_like(a)
    copy_runs(a, b, coalesce(_t([0, 1, 2, 5]), _t([3, 4, 5, 0])))
    assert torch.equal(b[3:6], a[0:3]) and torch.equal(b[0], a[5]) and bool((b[1:3] == 0).all())
    before = b.clone()
    copy_runs(a, b, coalesce(_t([]), _t([])))
    assert torch.equal(b, before)


# ---- IdRing ---------------------------------------------------------------------------------


def test_id_ring_is_fifo_and_wraps() -> None:
    ring = IdRing(5)
    assert ring.take(3).tolist() == [0, 1, 2] and ring.count == 2
    ring.give(torch.tensor([1], dtype=IDX))
    ring.give(torch.tensor([0, 2], dtype=IDX))
    assert ring.free_ids().tolist() == [3, 4, 1, 0, 2] and ring.count == 5
    # Freed ids come back only after every id that was free before them (reused as late as possible).
    assert ring.take(2).tolist() == [3, 4]
    assert ring.take(3).tolist() == [1, 0, 2]  # the ring's end wrapped around to its start
    assert ring.count == 0 and ring.free_ids().numel() == 0
    ring.give(torch.tensor([4, 2], dtype=IDX))
    assert ring.take(2).tolist() == [4, 2]


def test_id_ring_refuses_overdraw_and_overfill() -> None:
    ring = IdRing(3)
    with pytest.raises(InternalError, match="asked for 4 ids with 3 free"):
        ring.take(4)
    assert ring.count == 3
    with pytest.raises(InternalError, match="returned to a ring with 0 taken"):
        ring.give(torch.tensor([0], dtype=IDX))
    ring.take(2)
    ring.reset()
    assert ring.count == 3 and ring.take(3).tolist() == [0, 1, 2]


def test_id_ring_long_churn_walks_every_id() -> None:
    ring = IdRing(7)
    seen = []
    for _ in range(30):
        ids = ring.take(3)
        seen.extend(ids.tolist())
        ring.give(ids)
    assert set(seen) == set(range(7))
    assert sorted(ring.free_ids().tolist()) == list(range(7))


# ---- ShmArena ----------------------------------------------------------------------------------


def test_shm_arena_set_backed_keeps_base(kvd_arena_factory) -> None:
    arena = kvd_arena_factory(1 << 20, 4096)
    base = arena.base
    t = arena.tensor()
    assert t.numel() == 4096 and t.data_ptr() == base and arena.reserved == 1 << 20
    t[:16] = torch.arange(16, dtype=torch.uint8)
    t[4000:4010] = 7
    arena.set_backed(1 << 19)  # grow
    assert arena.base == base and arena.backed == 1 << 19
    g = arena.tensor()
    assert g.numel() == 1 << 19 and g.data_ptr() == base
    assert g[:16].tolist() == list(range(16))  # bytes survive growth
    g[(1 << 19) - 1] = 9
    arena.set_backed(2048)  # shrink below byte 4000: the tail is given back
    assert arena.base == base and arena.tensor().numel() == 2048
    arena.set_backed(8192)  # grow again: the kept prefix is intact, the released tail reads zero
    t2 = arena.tensor()
    assert t2[:16].tolist() == list(range(16)) and bool((t2[4000:4010] == 0).all())
    assert arena.base == base and arena.handle().backed == 8192


def test_shm_arena_refuses_bad_sizes(kvd_arena_factory) -> None:
    arena = kvd_arena_factory(4096, 0)
    for bad in (-1, 4097, 1.5, True):
        with pytest.raises(InvalidArgument, match="arena"):
            arena.set_backed(bad)
    assert arena.backed == 0
    with pytest.raises(InvalidArgument, match="positive byte count"):
        ShmArena(0)
    with pytest.raises(InvalidArgument, match="does not exist"):
        ShmArena(4096, directory="/nonexistent-kvd-dir")


def test_shm_arena_close_unlinks(tmp_path) -> None:
    arena = ShmArena(4096, 1024, directory=str(tmp_path))
    path = arena.path
    assert (tmp_path / arena.region_id).exists()
    arena.close()
    arena.close()  # idempotent
    assert not (tmp_path / path.rsplit("/", 1)[-1]).exists()


def test_an_allocating_shm_arena_takes_its_backed_pages_from_the_tmpfs_at_once(tmp_path) -> None:
    # On /dev/shm (a tmpfs): the file's blocks are there before anything is written; a sparse
    # arena's are not.
    allocating = ShmArena(1 << 22, 1 << 20, allocate=True)
    sparse = ShmArena(1 << 22, 1 << 20)
    try:
        assert os.fstat(allocating._fd).st_blocks * 512 >= 1 << 20
        assert os.fstat(sparse._fd).st_blocks == 0
        allocating.set_backed(1 << 21)  # grown: the new pages too
        assert os.fstat(allocating._fd).st_blocks * 512 >= 1 << 21
        allocating.set_backed(1 << 19)  # shrunk: given back
        assert os.fstat(allocating._fd).st_blocks * 512 < 1 << 20
    finally:
        allocating.close()
        sparse.close()


def _free_shm() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def test_a_tmpfs_without_room_refuses_the_backing_with_what_to_change_and_keeps_nothing(kvd_shm_dir) -> None:
    # More than /dev/shm holds: refused before a byte is taken (statvfs), no file left behind, and
    # the message names the setting, the directory and the ways to give it room.
    too_much = 2 * _free_shm() + (1 << 30)
    where = re.escape(kvd_shm_dir)
    with pytest.raises(FailedPrecondition, match=rf"arena_dir '{where}' cannot hold .*--shm-size.*shm.sizeLimit.*arena_bytes"):
        ShmArena(too_much, too_much, directory=kvd_shm_dir, allocate=True)
    assert os.listdir(kvd_shm_dir) == []
    # Growing an arena that lives: refused, its backing and its bytes as they were.
    arena = ShmArena(too_much, 1 << 20, allocate=True)
    try:
        arena.tensor()[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        with pytest.raises(FailedPrecondition, match="cannot hold"):
            arena.set_backed(too_much)
        assert arena.backed == 1 << 20 and os.fstat(arena._fd).st_size == 1 << 20
        assert arena.tensor()[:4].tolist() == [1, 2, 3, 4]
    finally:
        arena.close()


def test_a_failed_allocation_leaves_the_arena_as_it_was(monkeypatch) -> None:
    # The tmpfs filled up between the room check and the allocation (another user of it): ENOSPC,
    # the file cut back to what it was, and the same error.
    arena = ShmArena(1 << 22, 1 << 20, allocate=True)
    try:
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(FailedPrecondition, match="No space left on device"):
            arena.set_backed(1 << 21)
        assert arena.backed == 1 << 20 and os.fstat(arena._fd).st_size == 1 << 20
    finally:
        arena.close()


_CHILD = textwrap.dedent(
    """
    import json, sys
    from kvd.memory.arena import ArenaHandle, map_shared
    h = ArenaHandle(**json.loads(sys.argv[1]))
    mm, view = map_shared(h)
    got = view[:8].tolist()
    view[100:108] = 200          # write back for the parent to see
    print(json.dumps({"got": got, "len": view.numel()}))
    del view
    mm.close()
    """
)


def test_map_shared_in_a_second_process(kvd_arena_factory) -> None:
    arena = kvd_arena_factory(1 << 16, 4096)
    arena.tensor()[:8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8)
    h = arena.handle()
    assert h.kind == "shm" and h.backed == 4096 and h.region_id == arena.region_id
    payload = json.dumps({"kind": h.kind, "path": h.path, "backed": h.backed, "region_id": h.region_id})
    out = subprocess.run([sys.executable, "-c", _CHILD, payload], capture_output=True, text=True, timeout=120, check=True)
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply == {"got": [1, 2, 3, 4, 5, 6, 7, 8], "len": 4096}
    assert arena.tensor()[100:108].tolist() == [200] * 8  # the child's writes landed here


def test_map_shared_refusals(kvd_arena_factory) -> None:
    arena = kvd_arena_factory(1 << 16, 4096)
    h = arena.handle()
    with pytest.raises(InvalidArgument, match="shm arenas only"):
        map_shared(ArenaHandle("cuda-vmm", "", 4096, "x"))
    with pytest.raises(InvalidArgument, match="less than the 8,192 announced"):
        map_shared(ArenaHandle(h.kind, h.path, 8192, h.region_id))
    mm, view = map_shared(h)
    try:
        assert view.numel() == 4096
    finally:
        del view
        mm.close()


def test_reap_stale_removes_only_dead_owners_files(tmp_path) -> None:
    """A SIGKILLed daemon leaves its arena file on tmpfs; the next daemon removes it, but never a
    live arena's file."""
    import os
    import signal
    import subprocess
    import sys

    from kvd.memory.arena import ShmArena, is_live, reap_stale

    live = ShmArena(1 << 20, 1 << 16, directory=str(tmp_path))
    code = (
        "import sys, time; from kvd.memory.arena import ShmArena; "
        f"a = ShmArena(1 << 20, 1 << 16, directory={str(tmp_path)!r}); print(a.path, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        dead = p.stdout.readline().strip()
        assert is_live(dead) and is_live(live.path)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert not is_live(dead)
        assert reap_stale(str(tmp_path)) == [dead]
        assert os.path.exists(live.path) and not os.path.exists(dead)
    finally:
        p.kill()
        live.close()


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], list[int], list[int]]:
    """A source range, a peer range and blocks mostly inside both (a few past an edge)."""
    lo, size, p_lo, backed = (draw(st.integers(0, 1 << 20)), draw(st.integers(1, 1 << 20)),
                              draw(st.integers(0, 1 << 20)), draw(st.integers(1, 1 << 20)))
    srcs, dsts, lens = [], [], []
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.integers(-1, 64)) if draw(st.integers(0, 9)) else draw(st.integers(-1, 1 << 16))
        srcs.append(lo + draw(st.integers(-8, size)))
        dsts.append(p_lo + draw(st.integers(-8, backed)))
        lens.append(n)
    return lo, size, p_lo, backed, srcs, dsts, lens


@settings(max_examples=400, deadline=None)
@given(case=_blocks())
def test_a_few_blocks_are_checked_as_the_vectorised_check_does(case: tuple[int, int, int, int, list[int], list[int], list[int]]) -> None:
    """The loop that checks a few blocks (and lets blocks that pass every condition through at
    once) refuses exactly what the numpy check refuses, naming the same block."""
    import kvd.backends.base as base

    lo, size, p_lo, backed, srcs, dsts, lens = case
    peer = base.PeerRegion("peer", p_lo, backed, "r")
    outcomes = []
    for small in (10**9, -1):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base, "SMALL_CHECK", small)
            try:
                base.Backend._check_blocks(None, peer, lo, size, srcs, dsts, lens)  # type: ignore[arg-type]
                outcomes.append(None)
            except InvalidArgument as exc:
                outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


def test_an_arena_being_made_is_never_reaped_by_a_daemon_starting_beside_it() -> None:
    """Two daemons sharing an arena directory (the demo's pair; pods on one node's /dev/shm/kvd)
    start together: each reaps the directory's unlocked kvd-* files as it starts. An arena file
    must hold its liveness lock from the moment it has its name, or the other daemon takes it
    for a dead daemon's and unlinks it, and no engine can map that arena (seen under a loaded
    test run: 'decode engine did not start: ... No such file or directory'). A reaper process
    loops over the directory while this one makes arenas there: every file stays."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    from kvd.memory.arena import ShmArena, is_live

    d = tempfile.mkdtemp(prefix="kvd-reap-race-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    code = ("import sys; from kvd.memory.arena import reap_stale; print('up', flush=True)\n"
            "while True: reap_stale(sys.argv[1])")
    p = subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE, text=True)
    made: list[ShmArena] = []
    try:
        assert p.stdout.readline().strip() == "up"  # type: ignore[union-attr]
        end = time.monotonic() + 3.0
        while time.monotonic() < end and len(made) < 400:
            a = ShmArena(1 << 30, 1 << 12, directory=d)  # a reservation to size and map: a window to hit
            made.append(a)
            assert os.path.exists(a.path) and is_live(a.path)
        assert p.poll() is None, "the reaper died"
        gone = [a.path for a in made if not os.path.exists(a.path)]
        assert not gone, f"{len(gone)} of {len(made)} live arenas reaped as a dead daemon's: {gone[:3]}"
    finally:
        p.kill()
        p.wait(10)
        for a in made:
            a.close()
        shutil.rmtree(d, ignore_errors=True)
