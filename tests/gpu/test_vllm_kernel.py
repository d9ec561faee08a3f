"""The vLLM connector's Triton copy (kvd.connectors.vllm_kernels) against its torch path
(kvd.connectors.vllm_blocks), byte for byte: every vLLM 0.32 layout and the legacy ones (tensors
made as vLLM allocates them: tests/kits/vllm_alloc_kit.py), kernel blocks (a vLLM block split in
two), K and V of different head sizes, a request that starts and ends inside a block, null blocks;
saves layer by layer, loads in one launch per group where the layers lie one stride apart. Nothing
outside the request's tokens is written; a row one token too long is caught by that check (the
negative control).

Runs on CUDA with Triton; on a CPU host with Triton installed, ``TRITON_INTERPRET=1`` runs it
through Triton's interpreter (how it was written without a GPU); skipped otherwise."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from gpu_kit import HAS_CUDA

import vllm_alloc_kit as va
from kvd.client.views import all_views
from kvd.connectors import vllm_blocks as vb
from kvd.pool.layout import GroupKind, GroupSpec, Layout

_TRITON = importlib.util.find_spec("triton") is not None
_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _TRITON, reason="needs Triton"),
    pytest.mark.skipif(not (HAS_CUDA or _INTERP), reason="needs a CUDA device (or TRITON_INTERPRET=1 on a CPU host)"),
]
DEV = "cuda" if HAS_CUDA else "cpu"

H, D, BS, NB, L = 2, 16, 8, 24, 3
START, END = 5, 45  # starts inside block 0, ends inside block 5
UNIFIED = sorted(va.STRIDE_ORDERS)
LEGACY = ["FLASH_ATTN_LEGACY", "FLASHINFER_NHD_LEGACY", "FLASHINFER_HND_LEGACY"]


def _case(layout: str, kernel_bs: int = BS, dv: int = D):
    """(vLLM source, vLLM zeroed, kvd layout, slots): random source bytes, a request's blocks and
    pages shuffled, its first vLLM block the null block (a sliding window dropped it)."""
    grp = va.Group(tuple(f"l{i}" for i in range(L)), H, D)
    if dv != D:  # K|V of different widths: vLLM 0.32's LBNHC view over one [L, B, N, H, D + Dv] buffer
        raw = torch.randint(-2**15, 2**15, (L, NB, BS, H, D + dv), dtype=torch.int16).view(torch.bfloat16).to(DEV)
        zero = torch.zeros_like(raw)
        src = {n: raw[i].transpose(1, 2) for i, n in enumerate(grp.layers)}
        dst = {n: zero[i].transpose(1, 2) for i, n in enumerate(grp.layers)}
    else:
        make = va.allocate_legacy if layout in LEGACY else va.allocate
        nb = NB * BS // kernel_bs
        _, src = make([grp], nb, kernel_bs, layout, device=DEV, fill=7)
        _, dst = make([grp], nb, kernel_bs, layout, device=DEV)
    kl = Layout(name="k", page_size=BS, dtype="bfloat16", groups=(
        GroupSpec(kind=GroupKind.FULL, num_layers=L, num_kv_heads=H, head_dim=D, v_head_dim=dv),))
    rnd = random.Random(layout)
    n_blocks = -(-END // BS)
    ids = [0] + rnd.sample(range(1, NB), n_blocks - 1)
    pages = rnd.sample(range(NB), n_blocks - 1)
    slots = vb.token_slots(ids, START, END, BS, pages, 1)
    return src, dst, kl, slots


def _blocks(tensors, dv: int = D):
    return [vb.detect_layout(t, num_kv_heads=H, block_size=BS, head_size=D, head_size_v=dv) for t in tensors.values()]


def _arena(kl: Layout):
    arena = torch.zeros(kl.page_bytes(kl.group("full")) * NB, dtype=torch.uint8, device=DEV)
    return arena, all_views(kl, arena)["full"]


def _untouched_outside(views, s: vb.Slots) -> bool:
    """Every byte of kvd's pages outside the request's (page, offset) slots is still zero."""
    written = torch.zeros(NB, BS, dtype=torch.bool, device=DEV)
    written[s.page.to(DEV), s.offset.to(DEV)] = True
    return all(not x[~written].view(torch.int16).any() for v in views for x in (v.k, v.v))


def _bytes(tensors) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.int16).cpu() for t in tensors.values()]


CASES = [(lay, BS, D) for lay in UNIFIED + LEGACY] + [("LBNHC", BS // 2, D), ("LBHNC", BS // 2, D), ("LBNHC", BS, 2 * D)]


@pytest.mark.parametrize("layout,kernel_bs,dv", CASES, ids=[f"{a}-n{b}-dv{c}" for a, b, c in CASES])
def test_kernel_and_torch_paths_give_identical_bytes(layout, kernel_bs, dv):
    src, dst, kl, s = _case(layout, kernel_bs, dv)
    sb, db = _blocks(src, dv), _blocks(dst, dv)
    assert sb[0].ratio == BS // kernel_bs
    assert vb.kernel_refusal(sb[0], _arena(kl)[1][0]) is None
    cs = vb.CopyStream(DEV)
    at = cs.slots(s, sb[0])
    arenas = {}
    for path in ("torch", "triton"):
        arena, views = _arena(kl)
        before = vb.LAUNCHES.copy()
        for b, v in zip(sb, views):  # save_kv_layer: layer by layer
            vb.save_layer(b, at, v, path=path)
        ran = vb.LAUNCHES - before
        assert ran == ({"torch": 4 * L, "layers": L} if path == "torch" else {"triton": L, "layers": L}), f"{path}: {ran}"
        assert _untouched_outside(views, s), f"{layout} {path}: kvd bytes outside the request's tokens"
        arenas[path] = arena.cpu()
    assert arenas["torch"].any() and torch.equal(arenas["torch"], arenas["triton"]), f"{layout}: saves differ"

    arena, views = _arena(kl)
    arena.copy_(arenas["torch"].to(DEV))
    loaded = {}
    for path in ("torch", "triton"):
        _, fresh = _case(layout, kernel_bs, dv)[:2]
        fb = _blocks(fresh, dv)
        before = vb.LAUNCHES.copy()
        vb.load_layers(fb, cs.slots(s, fb[0]), views, path=path)  # start_load_kv: all layers
        ran = vb.LAUNCHES - before
        if path == "triton":
            strided = all(vb.layer_stride(ts) is not None for ts in ([b.k for b in fb], [b.v for b in fb]))
            # vLLM 0.32 allocates a group's layers as view_5d[l] of one buffer: one launch for all of them
            assert strided or layout in LEGACY, f"{layout}: layers not one stride apart"
            assert ran["triton"] == (1 if strided else L) and not ran["torch"], f"{layout}: {ran}"
        loaded[path] = _bytes(fresh)
    assert any(x.any() for x in loaded["torch"])
    assert all(torch.equal(x, y) for x, y in zip(loaded["torch"], loaded["triton"])), f"{layout}: loads differ"


def test_a_row_one_token_too_long_writes_outside_the_request():
    """Negative control: the out-of-range check above fails when the kernel's token mask is wrong
    (the last row, a partial block, told one token more: the kernel copies vLLM's next token)."""
    src, _, kl, s = _case("LBNHC")
    sb = _blocks(src)
    at = vb.CopyStream(DEV).slots(s, sb[0])
    assert at.rows is not None and int(at.rows[-1, 3]) + int(at.rows[-1, 4]) < BS  # the last row ends inside its page
    long = vb.DeviceSlots(at.block, at.boff, at.page, at.poff, at.rows.clone())
    long.rows[-1, 4] += 1
    for at_, clean in ((at, True), (long, False)):
        _, views = _arena(kl)
        vb.save_layers(sb, at_, views, path="triton")
        assert _untouched_outside(views, s) is clean



@pytest.mark.skipif(not HAS_CUDA, reason="the pinned staging buffers are CUDA's")
@pytest.mark.parametrize("pool", [16, 2])
def test_a_staging_buffer_is_not_rewritten_while_its_copy_waits(monkeypatch, pool):
    """CopyStream.slots reuses pinned buffers once their copy out is done: five calls queued behind a
    0.1 s sleep on the copy stream each arrive with their own slots, with buffers to spare (five
    buffers) and with two (the third call waits for the first's copy). Without the event checks a
    call overwrites an earlier one's bytes before they are copied: the negative control."""
    monkeypatch.setattr(vb, "_STAGE_MAX", pool)
    cs = vb.CopyStream(DEV)
    got = []
    with cs.after_current():
        torch.cuda._sleep(int(2e8))  # ~0.1 s at ~2 GHz: the copies below queue behind it
        for i in range(5):
            s = vb.token_slots([i + 1, i + 2], 0, 2 * BS, BS, [10 * i, 10 * i + 1])
            got.append((s, cs.slots(s)))
    torch.cuda.synchronize()
    assert len(cs._stage) == min(pool, 5)
    for s, at in got:
        assert at.block.tolist() == s.block.tolist() and at.page.tolist() == s.page.tolist()
        assert at.rows is not None and at.rows.tolist() == vb.token_rows(s.block, s.offset, s.page, s.offset).tolist()


@pytest.mark.parametrize("layout", ["LBNHC", "FLASH_ATTN_LEGACY"])
def test_repeated_copies_of_the_same_layers_stay_exact(layout):
    """A layer set's later copies reuse its plan (and, on CUDA with Triton 3.6, the compiled kernel
    directly: vllm_kernels.FAST_LAUNCH): three rounds of save then load on the same tensors, each
    with fresh slots and the kvd side cleared, give the torch path's bytes every time."""
    src, dst, kl, s = _case(layout)
    sb, db = _blocks(src), _blocks(dst)
    arena, views = _arena(kl)
    ref_arena, ref_views = _arena(kl)
    for b, v in zip(sb, ref_views):
        vb.save_layer(b, vb.CopyStream(DEV).slots(s, b), v, path="torch")
    cs = vb.CopyStream(DEV)
    for _ in range(3):
        arena.zero_()
        for t in db:
            t.k.zero_()
            t.v.zero_()
        with cs.after_current():
            at = cs.slots(s, sb[0])
            for b, v in zip(sb, views):
                vb.save_layer(b, at, v, path="triton")
            vb.load_layers(db, cs.slots(s, db[0]), views, path="triton")
        if cs.stream is not None:
            torch.cuda.current_stream().wait_stream(cs.stream)
        assert torch.equal(arena.cpu(), ref_arena.cpu()), f"{layout}: a repeated save differs"
        assert _untouched_outside(views, s)
        for a, b in zip(sb, db):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                got = y[s.block.to(DEV), s.offset.to(DEV)].view(torch.int16)
                assert torch.equal(got, x[s.block.to(DEV), s.offset.to(DEV)].view(torch.int16)), f"{layout}: a repeated load differs"
