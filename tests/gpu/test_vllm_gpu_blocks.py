"""The vLLM connector's GPU copies (issue 15, GPU) through two ``--arena cuda`` daemons, without
vLLM: KV tensors shaped and strided as vLLM 0.32's CUDA backends allocate them
(tests/kits/vllm_alloc_kit.py: LBNHC = FLASH_ATTN / TRITON_ATTN / FlashInfer's default NHD, LBHNC
= FlashInfer HND on Blackwell, a block-outer order, and the legacy 5-D FlashAttention / FlashInfer
NHD / HND layouts). Prefill saves its vLLM blocks of a full + sliding-window request into kvd's
CUDA pages (kvd.connectors.vllm_blocks, on its own stream, under
``torch.cuda.set_sync_debug_mode("error")``: a host sync inside a copy fails the test); the
prefill daemon sends; decode loads into zeroed vLLM tensors: every token either side keeps is
byte-identical, and nothing else was written.

The copies take the Triton path (kvd.connectors.vllm_kernels, ``path="triton"``: refused, and the
test fails, where the kernel does not apply) when Triton is installed, the torch path otherwise;
the path that ran and its launches are checked from ``vb.LAUNCHES`` and named in the test's
report line (``-rP`` or a failure). Saves go layer by layer (save_kv_layer), loads all layers of
a group at once (start_load_kv: one launch where vLLM's layers lie one stride apart)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from gpu_kit import GPU, NEEDS_VMM

import handoff_kit as hk
import vllm_alloc_kit as va

pytestmark = [*GPU, NEEDS_VMM]

TOKENS = 103  # not a multiple of the block size
PATH = "triton" if importlib.util.find_spec("triton") is not None else "torch"
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "FLASH_ATTN_LEGACY", "FLASHINFER_NHD_LEGACY", "FLASHINFER_HND_LEGACY"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = hk.make_pair(tmp_path_factory.mktemp("vllm-gpu"), "local", "subproc", arena="cuda", arena_bytes="16MiB")
    try:
        yield p
    finally:
        rcs = {s.role: s.stop() for s in p.sides}
        assert all(rc == 0 for rc in rcs.values()), f"daemons exited with {rcs}"


def _vllm_ids(rnd: random.Random, n_blocks: int, first: int, pool: int, taken: set[int]) -> list[int]:
    """A request's vLLM block ids: 0 (the null block) before ``first``, distinct free blocks after."""
    free = [b for b in range(1, pool) if b not in taken]
    ids = rnd.sample(free, n_blocks - first)
    taken.update(ids)
    return [0] * first + ids


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_layout_round_trip_through_two_cuda_daemons(pair, layout):
    from kvd.connectors import vllm_blocks as vb

    rnd = random.Random(layout)
    p, d = hk.Engine(pair.prefill, "vllm-prefill"), hk.Engine(pair.decode, "vllm-decode")
    rid = f"v-{layout}"
    try:
        kl = p.c.info().layout
        bs = kl.page_size
        groups = [g for g in kl.groups if g.kind.value in ("full", "swa")]
        assert {kl.page_size_of(g) for g in groups} == {bs}, "vLLM needs one block size"
        dvec, lease = d.c.allocate_recv(rid, TOKENS)
        pvec = p.c.allocate(rid, TOKENS)
        patt, datt = p.c.attach(), d.c.attach()
        dev = patt.tensor.device
        n_blocks = hk.ceil_div(TOKENS, bs)
        pool = 2 * n_blocks + 4
        make = va.allocate_legacy if layout.endswith("_LEGACY") else va.allocate
        src, dst, ids = {}, {}, {}
        for gi, g in enumerate(groups):
            vg = va.Group(tuple(f"{g.name}{i}" for i in range(g.num_layers)), g.num_kv_heads, g.head_dim, kl.torch_dtype(g))
            _, src[g.name] = make([vg], pool, bs, layout, device=str(dev), fill=gi + 1)
            _, dst[g.name] = make([vg], pool, bs, layout, device=str(dev))
            for side, vec in (("p", pvec), ("d", dvec)):
                first = vec.swa_first_page if g.kind.value == "swa" else 0
                ids[side, g.name] = _vllm_ids(rnd, n_blocks, first, pool, set())
        torch.cuda.synchronize(dev)

        launched = {}

        def copy(side: str, vec, views, tensors, whole: bool) -> None:
            cs = vb.CopyStream(dev)
            before = vb.LAUNCHES.copy()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with cs.after_current():
                    for g in groups:
                        pages = vec.full.tolist() if g.kind.value == "full" else vec.swa.tolist()
                        first = vec.swa_first_page if g.kind.value == "swa" else 0
                        lbs = [vb.detect_layout(t, num_kv_heads=g.num_kv_heads, block_size=bs, head_size=g.head_dim)
                               for t in tensors[g.name].values()]
                        assert {lb.layout.name for lb in lbs} == {layout}
                        at = cs.slots(vb.token_slots(ids[side, g.name], 0, TOKENS, bs, pages, first, what=g.name), lbs[0])
                        if whole:  # start_load_kv: every layer of the group in one call
                            vb.load_layers(lbs, at, views[g.name], path=PATH)
                        else:  # save_kv_layer: layer by layer
                            for lb, view in zip(lbs, views[g.name]):
                                vb.save_layer(lb, at, view, path=PATH)
                ev = cs.record()
                launched[side] = dict(vb.LAUNCHES - before)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert cs.stream is not None and cs.stream != torch.cuda.current_stream(dev)
            ev.synchronize()

        copy("p", pvec, patt.views, src, False)
        p.c.send(rid, lease.ticket, last=True)
        assert d.c.wait_ready(rid, 10).state.name == "READY"
        copy("d", dvec, datt.views, dst, True)
        torch.cuda.synchronize(dev)
        layers = sum(g.num_layers for g in groups)
        print(f"{layout}: path {PATH}; launches save {launched['p']}, load {launched['d']}")
        if PATH == "triton":
            assert launched["p"] == {"triton": layers, "layers": layers}, launched
            assert not launched["d"].get("torch") and launched["d"]["triton"] <= layers, launched
            if not layout.endswith("_LEGACY"):  # vLLM 0.32: a group's layers are view_5d[l] of one buffer
                assert launched["d"]["triton"] == len(groups), launched
        else:
            assert launched["p"] == {"torch": 4 * layers, "layers": layers}, launched

        for g in groups:
            for ln, s in src[g.name].items():
                a = vb.detect_layout(s, num_kv_heads=g.num_kv_heads, block_size=bs, head_size=g.head_dim)
                b = vb.detect_layout(dst[g.name][ln], num_kv_heads=g.num_kv_heads, block_size=bs, head_size=g.head_dim)
                written = torch.zeros_like(b.k, dtype=torch.bool)
                for t in range(TOKENS):
                    j, o = divmod(t, bs)
                    sb, db = ids["p", g.name][j], ids["d", g.name][j]
                    if sb == 0 or db == 0:
                        continue  # outside one side's window
                    for x, y in ((a.k, b.k), (a.v, b.v)):
                        assert torch.equal(x[sb, o].view(torch.int16), y[db, o].view(torch.int16)), f"{layout} {ln} token {t}"
                    written[db, o] = True
                assert not b.k[~written].view(torch.int16).any(), f"{layout} {ln}: bytes outside the request's tokens"
    finally:
        for e in (p, d):
            try:
                e.c.free(rid)
            except Exception:  # noqa: BLE001 - freed already
                pass
            e.close_attachment()
            e.c.close()
