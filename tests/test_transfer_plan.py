"""Transfer planning (pure core): which pages of a request a chunk moves, as coalesced blocks."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvd.memory.arena import ShmArena
from kvd.errors import InvalidArgument
from kvd.pool.pool import Pool
from kvd.pool.presets import preset
from kvd.handoff.plan import plan_chunk


@pytest.fixture
def pair():
    layout = preset("tiny-hybrid")
    a, b = ShmArena(1 << 22, 1 << 21), ShmArena(1 << 22, 1 << 21)
    src, dst = Pool(layout, a), Pool(layout, b)
    yield layout, src, dst
    a.close()
    b.close()


def _run(plan):
    """Execute a plan with memmove: both arenas are mapped in this process."""
    for b in plan.blocks:
        ctypes.memmove(b.dst, b.src, b.length)


def _fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    t = pool.arena.tensor()
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def test_whole_request_moves_full_swa_tail_state_and_draft(pair):
    layout, src, dst = pair
    n = 150  # window 32, page 4: decode needs only the tail
    s = src.allocate("r", n)
    d = dst.allocate("r", n, receive=True)
    plan = plan_chunk(layout, s, d, src.envelopes(), dst.envelopes(), 0, n, last=True)
    assert plan.pages == {"state": 1, "swa": d.swa.numel(), "draft": d.draft.numel(), "full": d.full.numel()}
    assert d.swa.numel() < s.swa.numel()  # only the window tail travels
    # Every block stays inside its page envelope and carries whole pages.
    assert sum(b.length for b in plan.blocks) == sum(
        plan.pages[g.name] * layout.page_bytes(g) for g in layout.groups
    )
    # Blocks are runs: fewer blocks than pages (fresh pools hand out consecutive pages).
    assert len(plan.blocks) < sum(plan.pages.values())


def test_chunks_cover_the_request_and_state_goes_last(pair):
    layout, src, dst = pair
    s = src.allocate("r", 100)
    d = dst.allocate("r", 100, receive=True)
    plans = [
        plan_chunk(layout, s, d, src.envelopes(), dst.envelopes(), t0, min(t0 + 30, 100), last=t0 + 30 >= 100)
        for t0 in range(0, 100, 30)
    ]
    assert all("state" not in p.pages for p in plans[:-1]) and plans[-1].pages["state"] == 1
    before = dst.arena.tensor().clone()
    _fill(src, 1)
    for p in plans:
        _run(p)
    after = dst.arena.tensor()
    touched = torch.zeros_like(after, dtype=torch.bool)
    for g, ids_s, ids_d in (
        ("full", s.full, d.full),
        ("swa", s.swa[d.swa_first_page - s.swa_first_page :], d.swa),
        ("state", torch.tensor([s.state]), torch.tensor([d.state])),
        ("draft", s.draft, d.draft),
    ):
        sv, dv = src.page_view(g), dst.page_view(g)
        assert torch.equal(dv[ids_d.long()], sv[ids_s.long()]), g
        pb = dv.shape[1]
        for q in ids_d.tolist():
            touched[q * pb : (q + 1) * pb] = True
    # Nothing outside the request's destination pages changed.
    assert torch.equal(after[~touched], before[~touched])


def test_refusals_before_any_block(pair):
    layout, src, dst = pair
    s = src.allocate("r", 40)
    d = dst.allocate("r", 48, receive=True)
    with pytest.raises(InvalidArgument, match="allocate the same length"):
        plan_chunk(layout, s, d, src.envelopes(), dst.envelopes(), 0, 40, last=True)
    with pytest.raises(InvalidArgument, match="not inside"):
        plan_chunk(layout, s, s, src.envelopes(), src.envelopes(), 0, 41, last=True)


def test_sender_that_released_the_tail_is_refused(pair):
    layout, src, dst = pair
    s = src.allocate("r", 40)
    s = src.extend("r", 100)  # releases SWA pages before (40 - 32) // 4
    d = dst.allocate("r", 140, receive=True)
    # The tail the receiver needs starts at (140 - 32) // 4 = 27 >= the sender's first bound SWA page (2).
    plan_chunk(layout, s, d, src.envelopes(), dst.envelopes(), 0, 140, last=True)
    fake = d._replace(swa_first_page=0, swa=torch.cat([torch.zeros(27, dtype=torch.int32), d.swa]))
    with pytest.raises(InvalidArgument, match="released"):
        plan_chunk(layout, s, fake, src.envelopes(), dst.envelopes(), 0, 140, last=True)
