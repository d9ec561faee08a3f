"""Triton page moves and translation against the CPU implementation, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from gpu_kit import GPU, NEEDS_TRITON

from kvd.copy import kernels, runs
from kvd.errors import InvalidArgument
from kvd.copy.runs import Runs, coalesce, copy_runs

pytestmark = [*GPU, NEEDS_TRITON]


def _scattered(pages: int, slot: int, n_runs: int, gen: torch.Generator) -> Runs:
    """``n_runs`` runs of 1..slot pages; sources and destinations in distinct slots (no overlap)."""
    slots = pages // slot
    assert 2 * n_runs <= slots
    perm = torch.randperm(slots, generator=gen)
    src, dst = perm[:n_runs] * slot, perm[n_runs : 2 * n_runs] * slot
    length = torch.randint(1, slot + 1, (n_runs,), generator=gen)
    return Runs(src.to(torch.int64), dst.to(torch.int64), length.to(torch.int64))


def _rand_pages(pages: int, page_bytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=gen)


# 16 B (uint8..int64 tiles, masked), 100 B (odd: 4-byte words), 4 KiB, 16 KiB and 256 KiB (even
# tiles), 64 KiB + 8 (8-byte words, masked tail), 2 MiB.
PAGE_BYTES = [16, 100, 4096, 16384, 65536 + 8, 262144, 2 << 20]


STRATEGIES = ["tile", "balanced", "flat"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("page_bytes", PAGE_BYTES)
def test_move_pages_same_view_matches_cpu(page_bytes: int, strategy: str) -> None:
    gen = torch.Generator().manual_seed(page_bytes + len(strategy))
    pages = max(64, min(4096, (96 << 20) // page_bytes))
    slot = 8 if pages >= 256 else 4
    r = _scattered(pages, slot, (pages // slot) // 3, gen)
    cpu = _rand_pages(pages, page_bytes, gen)
    gpu = cpu.cuda()
    copy_runs(cpu, cpu, r)
    kernels.move_pages(gpu, gpu, r, strategy=strategy)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("page_bytes", [16, 4096, 65536 + 8, 1 << 20])
def test_move_pages_between_views_writes_exactly_the_runs(page_bytes: int, strategy: str) -> None:
    gen = torch.Generator().manual_seed(7 + page_bytes)
    pages = max(64, min(2048, (64 << 20) // page_bytes))
    r = _scattered(pages, 4, (pages // 4) // 2, gen)
    src = _rand_pages(pages, page_bytes, gen)
    poison = _rand_pages(pages, page_bytes, gen)
    ref = poison.clone()
    copy_runs(src, ref, r)
    g_src, g_dst = src.cuda(), poison.cuda()
    kernels.move_pages(g_src, g_dst, r, strategy=strategy)
    assert torch.equal(g_dst.cpu(), ref)
    assert torch.equal(g_src.cpu(), src)  # the source is only read


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tile_bytes", [2048, 4096, 16384, 65536])
def test_move_pages_variants(tile_bytes: int, strategy: str) -> None:
    gen = torch.Generator().manual_seed(tile_bytes)
    for page_bytes in (4096, 24576, 65536):
        for stream in (True, False):
            pages = 512
            r = _scattered(pages, 8, 20, gen)
            cpu = _rand_pages(pages, page_bytes, gen)
            gpu = cpu.cuda()
            copy_runs(cpu, cpu, r)
            kernels.move_pages(gpu, gpu, r, tile_bytes=tile_bytes, strategy=strategy, stream=stream)
            assert torch.equal(gpu.cpu(), cpu), (tile_bytes, page_bytes, strategy, stream)
    with pytest.raises(InvalidArgument, match="unknown strategy"):
        kernels.move_pages(gpu, gpu, r, strategy="nope")


def test_move_pages_long_run_is_split_and_correct() -> None:
    gen = torch.Generator().manual_seed(11)
    pages, pb = 8192, 4096
    src = torch.cat([torch.arange(0, 3000), torch.arange(3000, 3400, 4)])
    dst = torch.cat([torch.arange(4096, 7096), torch.arange(7200, 7300)])
    r = coalesce(src, dst)
    assert int(r.length.max()) == 3000 and len(r) == 101
    cpu = _rand_pages(pages, pb, gen)
    gpu = cpu.cuda()
    copy_runs(cpu, cpu, r)
    kernels.move_pages(gpu, gpu, r)
    assert torch.equal(gpu.cpu(), cpu)
    split = kernels._split(r, 64)
    assert int(split.length.max()) == 64 and int(split.length.sum()) == int(r.length.sum())
    assert torch.equal(torch.cat(runs.expand(split)), torch.cat(runs.expand(r)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_move_pages_with_runs_on_the_device(strategy: str) -> None:
    gen = torch.Generator().manual_seed(5)
    cpu = _rand_pages(1024, 8192, gen)
    gpu = cpu.cuda()
    r = _scattered(1024, 8, 40, gen)
    copy_runs(cpu, cpu, r)
    kernels.move_pages(gpu, gpu, Runs(*(t.cuda() for t in r)), strategy=strategy)
    assert torch.equal(gpu.cpu(), cpu)


def test_prepared_tables_are_reusable_and_checked() -> None:
    gen = torch.Generator().manual_seed(6)
    cpu = _rand_pages(1024, 16384, gen)
    gpu = cpu.cuda()
    r = _scattered(1024, 8, 40, gen)
    tiles = kernels.prepare_tiles(gpu, gpu, r)
    assert len(tiles) == int(r.length.sum()) * 16384 // kernels._FLAT_TILE_BYTES
    prepared = kernels.prepare_runs(r, 16384, gpu.device, strategy="tile")
    for table in (tiles, prepared, tiles):
        cpu2 = _rand_pages(1024, 16384, gen)
        gpu.copy_(cpu2)
        copy_runs(cpu2, cpu2, r)
        kernels.move_pages(gpu, gpu, table)
        assert torch.equal(gpu.cpu(), cpu2)
    other = torch.zeros(1024, 8192, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidArgument, match="tile table was built for 16384-byte pages"):
        kernels.move_pages(other, other, tiles)
    with pytest.raises(InvalidArgument, match="flat strategy needs the views"):
        kernels.prepare_runs(r, 16384, gpu.device, strategy="flat")
    with pytest.raises(InvalidArgument, match="TileTable runs only"):
        kernels.move_pages(gpu.cpu(), gpu.cpu(), tiles)


def test_move_pages_fallbacks_on_cuda() -> None:
    """Views the kernel does not cover (strided rows, CPU <-> CUDA) still move the right bytes."""
    gen = torch.Generator().manual_seed(9)
    wide = _rand_pages(256, 3 * 1024, gen)
    r = _scattered(256, 4, 20, gen)
    ref = wide.clone()
    copy_runs(ref[:, :1024], ref[:, :1024], r)
    g = wide.cuda()
    kernels.move_pages(g[:, :1024], g[:, :1024], r)  # stride(0) != page bytes
    assert torch.equal(g.cpu(), ref)
    src = _rand_pages(256, 1024, gen)
    dst = torch.zeros(256, 1024, dtype=torch.uint8, device="cuda")
    ref = torch.zeros(256, 1024, dtype=torch.uint8)
    copy_runs(src, ref, r)
    copy_runs(src, dst, r)  # CPU -> CUDA goes through copy_runs' CUDA dispatch
    assert torch.equal(dst.cpu(), ref)
    back, back_ref = torch.zeros(256, 1024, dtype=torch.uint8), torch.zeros(256, 1024, dtype=torch.uint8)
    copy_runs(ref, back_ref, r)
    copy_runs(dst, back, r)  # CUDA -> CPU
    assert torch.equal(back, back_ref)


def test_move_pages_refuses_mismatched_pages() -> None:
    a = torch.zeros(4, 64, dtype=torch.uint8, device="cuda")
    b = torch.zeros(4, 32, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidArgument, match="page sizes differ"):
        kernels.move_pages(a, b, coalesce(torch.tensor([0]), torch.tensor([1])))


def test_copy_runs_dispatches_cuda_views_to_the_kernel(monkeypatch) -> None:
    calls = []
    real = kernels.move_pages

    def spy(src, dst, r, **kw):
        calls.append(len(r))
        return real(src, dst, r, **kw)

    monkeypatch.setattr(kernels, "move_pages", spy)
    view = torch.arange(32 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(32, 64)
    g = view.cuda()
    r = coalesce(torch.tensor([0, 1, 2, 9]), torch.tensor([20, 21, 22, 30]))
    copy_runs(g, g, r)
    copy_runs(view, view, r)  # the CPU path stays in runs.py
    assert calls == [2]
    assert torch.equal(g.cpu(), view)


# ---- the staged path: run table on the CPU -> pinned buffer -> one copy, one table launch ------


@pytest.fixture
def small_staging(monkeypatch):
    """Staging buffers made anew for the test, starting at 64 elements (16 runs), so tables of a
    few hundred runs grow them while earlier copies may still be pending."""
    from kvd.copy import staging

    monkeypatch.setattr(staging, "_STAGING", {})
    monkeypatch.setattr(staging, "_MIN_ELEMS", 64)
    return staging


def _random_runs(n: int, gen: torch.Generator, *, zeros: bool = True) -> Runs:
    """Run tables whose page ids need not be valid (table-only tests): lengths 0..8, one long run."""
    length = torch.randint(0 if zeros else 1, 9, (n,), generator=gen)
    length[int(torch.randint(0, n, (1,), generator=gen))] = 300
    return Runs(torch.randint(0, 1 << 20, (n,), generator=gen), torch.randint(0, 1 << 20, (n,), generator=gen), length)


@pytest.mark.parametrize("page_bytes", [8, 16, 100, 4096, 65536 + 8, 1 << 20])
def test_staged_tile_table_equals_the_torch_build(page_bytes: int, small_staging) -> None:
    gen = torch.Generator().manual_seed(page_bytes)
    view = torch.empty(1, page_bytes, dtype=torch.uint8, device="cuda")
    for n in (1, 2, 3, 5, 17, 500):
        r = _random_runs(n, gen)
        for tile in (2048, 8192, 32768):
            _, w, block, _, _ = kernels._flat_geometry(view, view, tile)
            got = kernels._tile_table_staged(r, page_bytes, w, block, view.device)
            ref = kernels._tile_table_torch(r, page_bytes, w, block, view.device)
            assert (got.page_bytes, got.word_bytes, got.block) == (ref.page_bytes, ref.word_bytes, ref.block)
            assert torch.equal(got.table.cpu(), ref.table.cpu()), (n, tile)


@pytest.mark.parametrize("page_bytes", [16, 4096, 16384, 65536 + 8, 1 << 20])
def test_staged_moves_of_random_tables_match_cpu(page_bytes: int, small_staging) -> None:
    gen = torch.Generator().manual_seed(31 + page_bytes)
    pages = max(256, min(8192, (64 << 20) // page_bytes))
    for n_runs, slot in ((1, 8), (7, 8), (pages // 32, 8), (pages // 4, 2)):
        r = _scattered(pages, slot, n_runs, gen)
        if n_runs > 1:  # int32 ids and a zero-length run are moved like any other table
            r = Runs(r.src.to(torch.int32), r.dst.to(torch.int32), torch.cat([r.length[:-1], r.length.new_zeros(1)]))
        cpu = _rand_pages(pages, page_bytes, gen)
        gpu = cpu.cuda()
        copy_runs(cpu, cpu, Runs(*(t.to(torch.int64) for t in r)))
        kernels.move_pages(gpu, gpu, r)
        assert torch.equal(gpu.cpu(), cpu), (n_runs, slot)


def _sleep_stream(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (so the host runs ahead of the copies)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz clocks


def test_staged_moves_back_to_back_without_a_sync(small_staging) -> None:
    """Many calls in a row while the stream sleeps: every table is written into a reused pinned
    buffer before the copies of earlier calls have run (and the buffers grow meanwhile); each
    call must still move its own table."""
    gen = torch.Generator().manual_seed(41)
    pages, pb, calls = 4096, 1024, 12
    cpu_src = [_rand_pages(pages, pb, gen) for _ in range(calls)]
    tables = [_scattered(pages, 2, n, gen) for n in (3, 700, 1, 40, 1000, 5, 300, 1024, 2, 64, 900, 11)]
    g_src = [c.cuda() for c in cpu_src]
    g_dst = [torch.zeros(pages, pb, dtype=torch.uint8, device="cuda") for _ in range(calls)]
    torch.cuda.synchronize()
    _sleep_stream(50)
    for i in range(calls):
        kernels.move_pages(g_src[i], g_dst[i], tables[i])
    kernels.move_pages(g_dst[0], g_dst[0], Runs(*(torch.empty(0, dtype=torch.int64) for _ in range(3))))  # empty: no-op
    torch.cuda.synchronize()
    for i in range(calls):
        ref = torch.zeros(pages, pb, dtype=torch.uint8)
        copy_runs(cpu_src[i], ref, tables[i])
        assert torch.equal(g_dst[i].cpu(), ref), i
    caps = small_staging.staging_for(g_src[0].device).capacity()
    assert max(caps) >= 4 * 1024 and min(caps) > 64  # both buffers grew from 64 elements


def test_staged_moves_on_a_side_stream(small_staging) -> None:
    gen = torch.Generator().manual_seed(43)
    cpu = _rand_pages(2048, 4096, gen)
    gpu = cpu.cuda()
    r = [_scattered(2048, 4, 200, gen) for _ in range(4)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _sleep_stream(20)
        for t in r:
            kernels.move_pages(gpu, gpu, t)
    for t in r:
        copy_runs(cpu, cpu, t)
    side.synchronize()
    assert torch.equal(gpu.cpu(), cpu)


def test_staged_empty_and_zero_length_tables(small_staging) -> None:
    gen = torch.Generator().manual_seed(45)
    g = _rand_pages(64, 4096, gen).cuda()
    before = g.clone()
    e = torch.empty(0, dtype=torch.int64)
    zero = Runs(torch.tensor([0, 5]), torch.tensor([10, 20]), torch.tensor([0, 0]))
    for r in (Runs(e, e, e), zero):
        kernels.move_pages(g, g, r)
        tiles = kernels.prepare_tiles(g, g, r)
        assert len(tiles) == 0 and tiles.table.shape == (0, 4) and tiles.table.is_cuda
        kernels.move_pages(g, g, tiles)
    torch.cuda.synchronize()
    assert torch.equal(g, before)


def test_staged_huge_table_grows_the_buffer(monkeypatch) -> None:
    """A table far larger than the initial staging buffer (default size): 200k runs of 16-byte pages."""
    from kvd.copy import staging

    monkeypatch.setattr(staging, "_STAGING", {})
    gen = torch.Generator().manual_seed(47)
    pages = 1 << 20
    r = _scattered(pages, 2, 200_000, gen)
    cpu = _rand_pages(pages, 16, gen)
    gpu = cpu.cuda()
    copy_runs(cpu, cpu, r)
    kernels.move_pages(gpu, gpu, r)
    assert torch.equal(gpu.cpu(), cpu)
    assert 4 * 200_000 > staging._MIN_ELEMS
    assert max(staging.staging_for(gpu.device).capacity()) >= 4 * 200_000


def test_unstaged_torch_table_build_still_moves(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_STAGED_TABLE", False)
    gen = torch.Generator().manual_seed(49)
    cpu = _rand_pages(1024, 16384, gen)
    gpu = cpu.cuda()
    r = _scattered(1024, 8, 60, gen)
    copy_runs(cpu, cpu, r)
    kernels.move_pages(gpu, gpu, r)
    assert torch.equal(gpu.cpu(), cpu)


# ---- translate -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 20) + 3])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_translate_matches_cpu(n: int, id_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n + (id_dtype == torch.int64))
    table = 3 << 20
    v2p = torch.randint(-1, 1 << 24, (table,), dtype=torch.int32, generator=gen)
    vids = torch.randint(0, table, (n,), dtype=id_dtype, generator=gen)
    ref = v2p.index_select(0, vids.to(torch.int64))
    out = kernels.translate(v2p.cuda(), vids.cuda())
    assert out.is_cuda and out.dtype == torch.int32 and out.shape == vids.shape
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(kernels.translate(v2p, vids), ref)  # the CPU fallback
    # 2-D ids keep their shape
    if n >= 1000:
        assert torch.equal(kernels.translate(v2p.cuda(), vids[:1000].cuda().view(10, 100)).cpu(), ref[:1000].view(10, 100))


def test_translate_out_of_range() -> None:
    v2p = torch.arange(100, dtype=torch.int32) * 3
    vids = torch.tensor([0, 99, 100, -1, 5])
    want = torch.tensor([0, 297, -1, -1, 15], dtype=torch.int32)
    assert torch.equal(kernels.translate(v2p.cuda(), vids.cuda()).cpu(), want)
    assert torch.equal(kernels.translate(v2p, vids), want)
    for table in (v2p, v2p.cuda()):
        with pytest.raises(InvalidArgument, match=r"virtual ids must lie in \[0, 100\)"):
            kernels.translate(table, vids.to(table.device), check=True)
    with pytest.raises(InvalidArgument, match="ids must be integers"):
        kernels.translate(v2p.cuda(), torch.zeros(3, device="cuda"))


@pytest.mark.parametrize("label", list(kernels.TRANSLATE_VARIANTS))
def test_translate_variants_match_cpu(label: str) -> None:
    """Every tuning gives index_select's result, -1 for ids outside the table, on even and ragged sizes."""
    tu = kernels.TRANSLATE_VARIANTS[label]
    gen = torch.Generator().manual_seed(len(label))
    table = 1 << 20
    v2p = torch.randint(-1, 1 << 24, (table,), dtype=torch.int32, generator=gen)
    g_v2p = v2p.cuda()
    for n in (tu.block * 64, tu.block * 64 + 37, 5):
        vids = torch.randint(0, table, (n,), dtype=torch.int64, generator=gen)
        vids[::97] = -1
        vids[1::89] = table + 5
        vids[2::101] = table
        vids[3::103] = -(1 << 40)
        inside = (vids >= 0) & (vids < table)
        ref = torch.where(inside, v2p[vids.clamp(0, table - 1)], torch.full_like(v2p[:1], -1))
        for dt in (torch.int32, torch.int64):
            v = vids.to(dt) if dt == torch.int64 else vids.clamp(-(1 << 31), (1 << 31) - 1).to(dt)
            out = kernels.translate(g_v2p, v.cuda(), tuning=tu)
            assert out.dtype == torch.int32 and torch.equal(out.cpu(), ref), (n, dt)
    with pytest.raises(InvalidArgument, match="power of two"):
        kernels.translate(g_v2p, vids.cuda(), tuning=tu, block=1000)
