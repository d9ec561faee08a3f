"""The planner's two ways with ids (pure core): a few pages per group in plain Python, many in
numpy. Both must plan the same blocks and refuse alike; here they are compared on random
requests, ranges and envelopes with each way forced in turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvd.copy.runs as runs
import kvd.handoff.plan as plan_mod
from kvd.errors import KvdError
from kvd.handoff.plan import plan_chunk
from kvd.pool.presets import preset
from kvd.records import Envelope, IndexVectors

LAYOUTS = {name: preset(name) for name in ("tiny-hybrid", "gemma-4-31b-it-tp2")}
FEW, MANY = 10**9, -1  # SMALL values that force each way


def _ids(draw, n: int, lo: int, hi: int) -> torch.Tensor:
    """``n`` ids in ``[lo, hi]``: runs of consecutive ids (what pools hand out) with jumps."""
    out: list[int] = []
    while len(out) < n:
        start = draw(st.integers(lo, hi))
        out += range(start, min(hi, start + draw(st.integers(0, 6))) + 1)
    return torch.tensor(out[:n], dtype=torch.int32)


@st.composite
def cases(draw):
    layout = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))]
    ps = layout.page_size
    tokens = draw(st.integers(1, 60 * ps))
    pages = -(-tokens // ps)
    vecs = []
    for side in ("src", "dst"):
        lo, hi = 5, 470
        swa_first = draw(st.integers(0, pages))
        draft_pages = -(-tokens // layout.page_size_of(layout.group("draft"))) if layout.has("draft") else 0
        vecs.append(IndexVectors(
            "r", side, 1, tokens, _ids(draw, pages, lo, hi), swa_first,
            _ids(draw, pages - swa_first, lo, hi) if layout.has("swa") else torch.empty(0, dtype=torch.int32),
            draw(st.integers(lo, hi)) if layout.has("state") else None,
            _ids(draw, draft_pages, lo, hi),
        ))
    src, dst = vecs
    if draw(st.booleans()):
        dst = dst._replace(swa_first_page=src.swa_first_page, swa=_ids(draw, pages - src.swa_first_page, 5, 470))
    s_env, d_env = (_envelopes(draw, layout, side, v) for side, v in (("src", src), ("dst", dst)))
    t0 = draw(st.integers(0, tokens - 1))
    t1 = draw(st.integers(t0 + 1, tokens))
    return layout, src, dst, s_env, d_env, t0, t1, draw(st.booleans())


def _envelopes(draw, layout, side: str, v: IndexVectors) -> list[Envelope]:
    """Envelopes around ``v``'s ids: mostly wide; now and then random, or right at the edges of a
    group's ids (one page in or out: refused the same either way)."""
    how = draw(st.sampled_from(["wide", "wide", "random", "edges"]))
    env = []
    for i, g in enumerate(layout.arena_order()):
        ids = {"state": [] if v.state is None else [v.state], "swa": v.swa.tolist(), "draft": v.draft.tolist(), "full": v.full.tolist()}[g.name]
        first, last = 0, 480
        if how == "random":
            first = draw(st.integers(0, 5))
            last = draw(st.integers(first, 480))
        elif how == "edges" and ids:
            first, last = max(0, min(ids) + draw(st.integers(0, 1))), max(ids) - draw(st.integers(0, 1))
        env.append(Envelope(g.name, side, (i + 1) << 40, 1 << 40, layout.page_bytes(g), first, last))
    return env


def _outcome(case, small: int, monkeypatch) -> object:
    monkeypatch.setattr(plan_mod, "SMALL", small)
    monkeypatch.setattr(runs, "SMALL", small)
    try:
        p = plan_chunk(*case)
    except KvdError as exc:
        return type(exc), str(exc)
    return p.src, p.dst, p.length, p.pages


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_few_and_many_pages_plan_the_same_blocks(case):
    with pytest.MonkeyPatch.context() as mp:
        few, many = _outcome(case, FEW, mp), _outcome(case, MANY, mp)
    assert few == many


@st.composite
def id_pairs(draw) -> list[tuple[int, int]]:
    """Paired ids: stretches consecutive on both sides (one run, as fresh pools hand pages out),
    on one side only, or neither."""
    out: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(1, 4))):
        x, y, k = draw(st.integers(-5, 40)), draw(st.integers(-5, 40)), draw(st.integers(1, 12))
        how = draw(st.sampled_from(["both", "src", "none"]))
        out += [(x + i, y + (i if how == "both" else 2 * i if how == "src" else draw(st.integers(0, 40)))) for i in range(k)]
    return out[:40]


@settings(max_examples=400, deadline=None)
@given(pairs=id_pairs())
def test_coalesce_lists_is_coalesce_np(pairs):
    s, d = (np.array(v, dtype=np.int32) for v in zip(*pairs))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs, "SMALL", MANY)
        want = [a.tolist() for a in runs.coalesce_np(s, d)]
    assert list(runs.coalesce_lists(s.tolist(), d.tolist())) == want
