"""kvd.connectors.vllm_blocks on the CPU (no vLLM): vLLM 0.32's KV layouts, allocated as its model
runner does (tests/kits/vllm_alloc_kit.py), told from their strides, saved into kvd page views and
loaded back into fresh vLLM tensors byte for byte; SWA null blocks, a partial last block, kernel
blocks; a wrong layout assumption gives other bytes, and unknown strides are refused."""

from __future__ import annotations

import pytest
import torch
import vllm_alloc_kit as va

from kvd.client.views import all_views
from kvd.connectors import vllm_blocks as vb
from kvd.errors import InvalidArgument
from kvd.pool.layout import GroupKind, GroupSpec, Layout

H, D, BS, NB = 2, 8, 4, 16
FULL = va.Group(("l0", "l2", "l4"), H, D)
SWA = va.Group(("l1", "l3"), H, D)
TOKENS = 18  # 4 blocks and 2 tokens: a partial last block
FULL_IDS = [7, 3, 9, 12, 5]
SWA_IDS = [0, 0, 11, 2, 14]  # the window dropped the first two blocks: vLLM's null block 0
# kvd's groups share the arena from byte 0: full pages (3 layers) below byte 33 x, swa (2 layers) above
FULL_PAGES, SWA_FIRST, SWA_PAGES = [10, 4, 6, 1, 8], 2, [20, 18, 22]
LAYOUT = Layout(name="gemma-like", page_size=BS, dtype="bfloat16", groups=(
    GroupSpec(kind=GroupKind.FULL, num_layers=3, num_kv_heads=H, head_dim=D),
    GroupSpec(kind=GroupKind.SWA, num_layers=2, num_kv_heads=H, head_dim=D, window=8),
))
UNIFIED = sorted(va.STRIDE_ORDERS)
LEGACY = ["FLASH_ATTN_LEGACY", "FLASHINFER_NHD_LEGACY", "FLASHINFER_HND_LEGACY"]


def _alloc(layout: str, fill: int | None = None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    make = va.allocate_legacy if layout in LEGACY else va.allocate
    raw, views = make([FULL, SWA], NB, BS, layout, fill=fill)
    return (None if layout in LEGACY else raw), views


def _kept() -> dict[str, list[tuple[int, int]]]:
    """(vLLM block, offset) of every token the request keeps, per layer."""
    out = {}
    for g, ids in ((FULL, FULL_IDS), (SWA, SWA_IDS)):
        for ln in g.layers:
            out[ln] = [(ids[t // BS], t % BS) for t in range(TOKENS) if ids[t // BS] != 0]
    return out


def _slots(group: str) -> vb.Slots:
    if group == "full":
        return vb.token_slots(FULL_IDS, 0, TOKENS, BS, FULL_PAGES)
    return vb.token_slots(SWA_IDS, 0, TOKENS, BS, SWA_PAGES, SWA_FIRST)


def _round_trip(layout: str, detect=vb.detect_layout) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    _, src = _alloc(layout, fill=3)
    _, dst = _alloc(layout)
    arena = torch.zeros(LAYOUT.page_bytes(LAYOUT.group("swa")) * 24, dtype=torch.uint8)
    views = all_views(LAYOUT, arena)
    cs = vb.CopyStream("cpu")
    for phase, tensors in (("save", src), ("load", dst)):
        for g, name in ((FULL, "full"), (SWA, "swa")):
            for i, ln in enumerate(g.layers):
                lb = detect(tensors[ln], num_kv_heads=H, block_size=BS, head_size=D)
                with cs.after_current():
                    at = cs.slots(_slots(name), lb)
                    (vb.save_layer if phase == "save" else vb.load_layer)(lb, at, views[name][i])
        assert cs.record() is None
    return src, dst, arena


@pytest.mark.parametrize("layout", UNIFIED + LEGACY)
def test_vllm_layouts_round_trip_byte_identical(layout):
    src, dst, arena = _round_trip(layout)
    _, exp = _alloc(layout)
    for ln, kept in _kept().items():
        lb = vb.detect_layout(src[ln], num_kv_heads=H, block_size=BS, head_size=D)
        assert lb.layout.name == layout
        eb = vb.detect_layout(exp[ln], num_kv_heads=H, block_size=BS, head_size=D)
        for b, o in kept:
            eb.k[b, o] = lb.k[b, o]
            eb.v[b, o] = lb.v[b, o]
    for ln in exp:  # kept tokens identical, everything else still zero (null block included)
        assert torch.equal(dst[ln].view(torch.int16), exp[ln].view(torch.int16)), f"{layout} {ln}"
    assert arena.any()


def test_vllm_strides_are_what_vllm_computes():
    """Element strides of a layer's view, worked out by hand from compute_layout_strides."""
    c = 2 * D  # K|V elements per (head, token)
    _, v = va.allocate([FULL], NB, BS, "LBNHC")
    assert v["l0"].shape == (NB, H, BS, c) and v["l0"].stride() == (BS * H * c, c, H * c, 1)
    _, v = va.allocate([FULL], NB, BS, "LBHNC")
    assert v["l2"].stride() == (H * BS * c, BS * c, c, 1)
    _, v = va.allocate([FULL], NB, BS, "BLHNC")  # a block holds the three layers' pages
    assert v["l0"].stride() == (3 * H * BS * c, BS * c, c, 1)
    assert v["l2"].storage_offset() - v["l0"].storage_offset() == H * BS * c  # l2: the group's second layer
    _, v = va.allocate([FULL], NB, BS, "LHBNC")
    assert v["l0"].stride() == (BS * c, NB * BS * c, c, 1)
    _, v = va.allocate([FULL], NB, BS, "BHLNC")
    assert v["l0"].stride() == (H * 3 * BS * c, 3 * BS * c, c, 1)
    _, v = va.allocate_legacy([FULL], NB, BS, "FLASHINFER_HND_LEGACY")
    assert v["l0"].shape == (NB, 2, BS, H, D) and v["l0"].stride() == (2 * H * BS * D, H * BS * D, D, BS * D, 1)
    for name in UNIFIED:
        _, v = va.allocate([FULL, SWA], NB, BS, name)
        assert {vb.detect_layout(t, num_kv_heads=H, block_size=BS, head_size=D).layout.name for t in v.values()} == {name}


def test_a_wrong_layout_assumption_gives_other_bytes():
    """Negative control: take vLLM's NHD (LBNHC) memory for the CPU's HND (LBHNC), as a connector
    that assumed one layout for every backend would."""

    def as_hnd(t, **kw):
        c = 2 * D
        return vb.detect_layout(torch.as_strided(t, t.shape, (H * BS * c, BS * c, c, 1), t.storage_offset()), **kw)

    src, dst, _ = _round_trip("LBNHC", detect=as_hnd)
    src2, dst2, _ = _round_trip("LBNHC")
    assert not all(torch.equal(dst[ln].view(torch.int16), dst2[ln].view(torch.int16)) for ln in dst)
    # and the right assumption is what vLLM would see: its K rows land in kvd's K pages
    lb = vb.detect_layout(src2["l0"], num_kv_heads=H, block_size=BS, head_size=D)
    assert torch.equal(lb.k[FULL_IDS[0], 1].view(torch.int16), src2["l0"][FULL_IDS[0], :, 1, :D].view(torch.int16))


def test_unknown_layouts_are_refused_naming_what_was_seen():
    _, v = va.allocate([FULL], NB, BS, "LBNHC")
    t = v["l0"]
    with pytest.raises(InvalidArgument, match=r"vLLM resolved LBHNC, these strides are LBNHC"):
        vb.detect_layout(t, num_kv_heads=H, block_size=BS, head_size=D, expect="HND")
    assert vb.detect_layout(t, num_kv_heads=H, block_size=BS, head_size=D, expect="NHD").layout.name == "LBNHC"
    odd = torch.zeros(BS, NB, H, 2 * D, dtype=torch.bfloat16).permute(1, 2, 0, 3)  # tokens outermost
    with pytest.raises(InvalidArgument, match=r"strides \(32, 16, 512, 1\).*no KVCacheLayout order.*known: LBHNC"):
        vb.detect_layout(odd, num_kv_heads=H, block_size=BS, head_size=D)
    with pytest.raises(InvalidArgument, match=r"shape \(16, 2, 4, 16\).*\[blocks, 4, 4"):
        vb.detect_layout(t, num_kv_heads=4, block_size=BS, head_size=D)
    with pytest.raises(InvalidArgument, match="known:"):
        vb.layout_named("LNBHC")


def test_kernel_blocks_split_a_vllm_block():
    """A backend that splits 4-token blocks into 2-token kernel blocks: B x 2 blocks of N = 2."""
    _, src = va.allocate([FULL], NB * 2, 2, "LBNHC", fill=5)
    _, dst = va.allocate([FULL], NB * 2, 2, "LBNHC")
    arena = torch.zeros(LAYOUT.page_bytes(LAYOUT.group("full")) * 12 * 2, dtype=torch.uint8)
    view = all_views(LAYOUT, arena)["full"][0]
    cs = vb.CopyStream("cpu")
    s = vb.token_slots(FULL_IDS, 0, TOKENS, BS, FULL_PAGES)
    a, b = (vb.detect_layout(t["l0"], num_kv_heads=H, block_size=BS, head_size=D) for t in (src, dst))
    assert a.ratio == 2
    vb.save_layer(a, cs.slots(s, a), view)
    vb.load_layer(b, cs.slots(s, b), view)
    for t in range(TOKENS):  # block FULL_IDS[j], token o = kernel block 2 * id + o // 2, offset o % 2
        kb, ko = 2 * FULL_IDS[t // BS] + (t % BS) // 2, t % 2
        assert torch.equal(dst["l0"][kb, :, ko].view(torch.int16), src["l0"][kb, :, ko].view(torch.int16))
        assert torch.equal(view.k[FULL_PAGES[t // BS], t % BS].view(torch.int16), src["l0"][kb, :, ko, :D].view(torch.int16))
    assert int((dst["l0"].view(torch.int16) != 0).sum()) == TOKENS * H * 2 * D - int((src["l0"].view(torch.int16)[
        [2 * FULL_IDS[t // BS] + (t % BS) // 2 for t in range(TOKENS)], :, [t % 2 for t in range(TOKENS)]] == 0).sum())


def test_token_slots_skip_null_blocks_and_refuse_short_lists():
    s = vb.token_slots(SWA_IDS, 0, TOKENS, BS, SWA_PAGES, SWA_FIRST)
    assert s.block.tolist() == [11] * 4 + [2] * 4 + [14] * 2 and s.page.tolist() == [20] * 4 + [18] * 4 + [22] * 2
    assert len(vb.token_slots([0, 0], 0, 8, BS, [], 2).page) == 0  # all in the null block: nothing to copy
    with pytest.raises(RuntimeError, match="vLLM gave 2 blocks"):
        vb.token_slots([3, 4], 0, 9, BS, [1, 2, 3])
    with pytest.raises(RuntimeError, match=r"kvd holds pages for \[2, 4\)"):
        vb.token_slots(SWA_IDS, 0, TOKENS, BS, SWA_PAGES[:2], SWA_FIRST)


def test_state_bytes_is_a_whole_slot():
    t = torch.arange(4 * 12, dtype=torch.int8).view(4, 1, 1, 12)
    assert vb.state_bytes(t, 2).tolist() == list(range(24, 36))
    with pytest.raises(InvalidArgument, match="not contiguous"):
        vb.state_bytes(torch.zeros(4, 12, 2, dtype=torch.int8).transpose(1, 2), 0)


def test_rows_cut_at_block_page_and_kernel_block_edges():
    """The Triton copy's rows (vLLM block, offset, kvd page, offset, tokens): a run ends where the
    block, the page or a kernel block ends."""
    s = vb.token_slots([4, 9], 3, 13, BS * 2, [2, 2], 0)  # both blocks on page 2: still two rows
    assert vb.token_rows(s.block, s.offset, s.page, s.offset).tolist() == [[4, 3, 2, 3, 5], [9, 0, 2, 0, 5]]
    _, t = va.allocate([FULL], NB, BS, "LBNHC")  # 8-token vLLM blocks split into kernel blocks of 4
    lb = vb.detect_layout(t["l0"], num_kv_heads=H, block_size=BS * 2, head_size=D)
    at = vb.CopyStream("cpu").slots(s, lb)  # block b, token o -> kernel block 2b + o // 4, offset o % 4
    assert at.rows is not None and at.rows.tolist() == [[8, 3, 2, 3, 1], [9, 0, 2, 4, 4], [18, 0, 2, 0, 4], [19, 0, 2, 4, 1]]
    assert [len(vb.token_rows(*(torch.empty(0, dtype=torch.long),) * 4))] == [0]


@pytest.mark.skipif(vb.vk.available(torch.device("cpu")), reason="Triton's interpreter runs the kernel on the CPU")
def test_the_torch_path_is_the_cpu_path_and_counts_its_ops():
    """Without Triton (or on the CPU) the copies take the torch path, say why, and refuse a forced kernel."""
    _, src = _alloc("LBNHC", fill=3)
    arena = torch.zeros(LAYOUT.page_bytes(LAYOUT.group("swa")) * 24, dtype=torch.uint8)
    views = all_views(LAYOUT, arena)["full"]
    lbs = [vb.detect_layout(src[ln], num_kv_heads=H, block_size=BS, head_size=D) for ln in FULL.layers]
    assert "no Triton kernel on cpu" in (vb.kernel_refusal(lbs[0], views[0]) or "")
    at = vb.CopyStream("cpu").slots(_slots("full"), lbs[0])
    # pages as long as blocks: the 4 whole blocks block for page, a slice copy a tensor each (no
    # two of them consecutive on both sides), the partial last block's 2 tokens token by token
    assert at.whole is not None and at.whole.blocks.tolist() == FULL_IDS[:4] and at.whole.pages.tolist() == FULL_PAGES[:4]
    assert at.whole.spans == tuple(zip(FULL_IDS[:4], FULL_PAGES[:4], [1] * 4))
    assert list(zip(at.whole.rest.block.tolist(), at.whole.rest.boff.tolist())) == [(FULL_IDS[4], 0), (FULL_IDS[4], 1)]
    before = vb.LAUNCHES.copy()
    vb.save_layers(lbs, at, views)
    assert vb.LAUNCHES - before == {"torch": (2 * 4 + 2 * 2) * 3, "layers": 3}
    # consecutive blocks on consecutive pages: one slice a tensor for all of them
    run = vb.CopyStream("cpu").slots(vb.token_slots([2, 3, 4, 5], 0, 16, BS, [6, 7, 8, 9]), lbs[0])
    assert run.whole is not None and run.whole.spans == ((2, 6, 4),) and run.whole.rest.tokens == 0
    before = vb.LAUNCHES.copy()
    vb.save_layers(lbs, run, views)
    assert vb.LAUNCHES - before == {"torch": 2 * 3, "layers": 3}
    # scattered past _SPANS spans: a gather and a scatter a tensor, however many blocks
    ids, pages = [1, 3, 5, 7, 9, 11, 13, 15, 2, 4], [10, 8, 6, 4, 2, 0, 9, 7, 5, 3]
    assert len(ids) > vb._SPANS
    scattered = vb.CopyStream("cpu").slots(vb.token_slots(ids, 0, len(ids) * BS, BS, pages), lbs[0])
    assert scattered.whole is not None and scattered.whole.spans is None and scattered.whole.blocks.tolist() == ids
    before = vb.LAUNCHES.copy()
    vb.save_layers(lbs, scattered, views)
    assert vb.LAUNCHES - before == {"torch": 4 * 3, "layers": 3}
    mid = vb.CopyStream("cpu").slots(vb.token_slots(FULL_IDS, 1, 3, BS, FULL_PAGES), lbs[0])
    assert mid.whole is None  # no whole run: token by token only
    before = vb.LAUNCHES.copy()
    vb.save_layers(lbs, mid, views)
    assert vb.LAUNCHES - before == {"torch": 4 * 3, "layers": 3}
    with pytest.raises(InvalidArgument, match="Triton copy does not apply here: no Triton kernel on cpu"):
        vb.save_layer(lbs[0], at, views[0], path="triton")
    with pytest.raises(InvalidArgument, match="one view per layer"):
        vb.load_layers(lbs, at, views[:2])
    # layers one stride apart on both sides (vLLM 0.32's view_5d[l]; kvd's page-major layers)
    assert vb.layer_stride([lb.k for lb in lbs]) == NB * H * BS * 2 * D
    assert vb.layer_stride([v.k for v in views]) == BS * H * 2 * D
    assert vb.layer_stride([lbs[0].k, lbs[2].k, lbs[1].k]) is None


def test_token_slots_and_rows_match_a_per_token_reference():
    """The numpy builders against the plain per-token definition: random blocks (null blocks among
    them), a request starting and ending inside a block, kernel blocks (ratio 2)."""
    import random

    rnd = random.Random(15)
    bs, start, end = 16, 5, 16 * 40 + 3
    ids = [rnd.choice([0, rnd.randrange(1, 500)]) for _ in range(41)]
    pages = [rnd.randrange(0, 500) for _ in range(41)]
    s = vb.token_slots(ids, start, end, bs, pages)
    want = [(ids[t // bs], t % bs, pages[t // bs]) for t in range(start, end) if ids[t // bs] != 0]
    assert list(zip(s.block.tolist(), s.offset.tolist(), s.page.tolist())) == want
    lb = vb.detect_layout(va.allocate([FULL], 2 * 600, bs // 2, "LBNHC")[1]["l0"], num_kv_heads=H, block_size=bs, head_size=D)
    at = vb.CopyStream("cpu").slots(s, lb)
    assert at.rows is not None
    assert list(zip(at.block.tolist(), at.boff.tolist(), at.page.tolist(), at.poff.tolist())) == \
        [(b * 2 + o // 8, o % 8, p, o) for b, o, p in want]
    toks = [(b + 0, bo + i, p, po + i) for b, bo, p, po, n in at.rows.tolist() for i in range(n)]
    assert toks == list(zip(at.block.tolist(), at.boff.tolist(), at.page.tolist(), at.poff.tolist()))
    assert all(bo + n <= 8 and po + n <= bs for _, bo, _, po, n in at.rows.tolist())  # a row stays in its block and page


def test_a_copy_plan_is_made_once_per_layer_set_and_holds_no_tensor(monkeypatch):
    """The per-layer work (kernel verdict, strides) is done on a layer set's first copy only, redone
    for other tensors, and the plan keeps none of vLLM's or kvd's tensors alive."""
    import gc
    import weakref

    calls = []
    real = vb.kernel_refusal
    monkeypatch.setattr(vb, "kernel_refusal", lambda b, v: calls.append(1) or real(b, v))
    _, src = _alloc("LBNHC", fill=3)
    arena = torch.zeros(LAYOUT.page_bytes(LAYOUT.group("swa")) * 24, dtype=torch.uint8)
    views = all_views(LAYOUT, arena)["full"]
    lb = vb.detect_layout(src["l0"], num_kv_heads=H, block_size=BS, head_size=D)
    at = vb.CopyStream("cpu").slots(_slots("full"), lb)
    for _ in range(3):
        vb.save_layer(lb, at, views[0])
    assert len(calls) == 1
    vb.save_layer(lb, at, views[1])  # another layer's pages: its own plan
    assert len(calls) == 2
    gone = weakref.ref(lb.k)
    del lb, src, at
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("ids,pages,start,end", [
    ([2, 3, 4, 5, 9], [6, 7, 8, 9, 1], 0, 18),  # one span of 4 blocks, a partial last block
    ([1, 3, 5, 7, 9, 11, 13, 15, 2, 4], [10, 8, 6, 4, 2, 0, 9, 7, 5, 3], 2, 40),  # scattered: index ops; a partial first block
    ([0, 0, 6, 7, 12], [5, 6, 7], 0, 20),  # SWA null blocks skipped, then a span of 2 and one more block
], ids=["span", "scattered", "null-blocks"])
def test_whole_runs_copy_the_bytes_token_by_token_copies(ids, pages, start, end):
    """The torch path's block-for-page shortcut (slices, or a gather and a scatter) writes what the
    token-by-token copy writes, both ways: kvd pages after a save, vLLM blocks after a load."""
    _, src = _alloc("LBNHC", fill=3)
    lb = vb.detect_layout(src["l0"], num_kv_heads=H, block_size=BS, head_size=D)
    first = sum(1 for b in ids if b == 0)
    at = vb.CopyStream("cpu").slots(vb.token_slots(ids, start, end, BS, pages, first), lb)
    assert at.whole is not None
    plain = at._replace(whole=None)  # a NamedTuple's own copy-with: DeviceSlots keeps len() its fields' count
    assert plain.tokens == at.tokens == end - start - BS * first and plain.whole is None
    arenas = []
    for slots in (at, plain):
        arena = torch.zeros(LAYOUT.page_bytes(LAYOUT.group("swa")) * 24, dtype=torch.uint8)
        vb.save_layer(lb, slots, all_views(LAYOUT, arena)["full"][0])
        arenas.append(arena)
    assert torch.equal(arenas[0], arenas[1]) and arenas[0].any()
    loaded = []
    for slots in (at, plain):
        _, dst = _alloc("LBNHC")
        back = vb.detect_layout(dst["l0"], num_kv_heads=H, block_size=BS, head_size=D)
        vb.load_layer(back, slots, all_views(LAYOUT, arenas[0])["full"][0])
        loaded.append(dst["l0"])
    assert torch.equal(loaded[0].view(torch.int16), loaded[1].view(torch.int16)) and loaded[0].view(torch.int16).any()
