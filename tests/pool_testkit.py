"""Helpers shared by the pure-core pool tests: small arenas per layout, pool snapshots, and
page-byte patterns that prove bytes survive compaction and offload/restore.

Not a test module (no ``test_`` prefix); test files import it as ``pool_testkit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvd.memory.arena import ShmArena
from kvd.pool.layout import GroupKind, GroupSpec, Layout
from kvd.records import IndexVectors
from kvd.pool.pool import Pool
from kvd.pool.presets import preset

FULL, SWA, STATE, DRAFT = GroupKind.FULL, GroupKind.SWA, GroupKind.STATE, GroupKind.DRAFT

# ---- layouts --------------------------------------------------------------------------------


def two_group_layout(*, swa_ratio: int = 2, window: int = 8, page_size: int = 4, name: str = "two-group") -> Layout:
    """A small full + swa layout (float32). Full: 64 B/token; swa: ``swa_ratio`` x that.

    With page_size 4 a full page is 256 B, so a few hundred pages fit in a few hundred KiB."""
    return Layout(
        name=name,
        page_size=page_size,
        dtype="float32",
        groups=(
            GroupSpec(kind=GroupKind.FULL, num_layers=1, num_kv_heads=1, head_dim=8),
            GroupSpec(kind=GroupKind.SWA, num_layers=swa_ratio, num_kv_heads=1, head_dim=8, window=window),
        ),
        source="synthetic: inline test layout",
    )


def tri_pool_layout() -> Layout:
    """SGLang's tri-pool shape, small: [state up | swa float | full down] (float32, page 4)."""
    return Layout(
        name="tri-pool",
        page_size=4,
        dtype="float32",
        groups=(
            GroupSpec(kind=GroupKind.FULL, num_layers=1, num_kv_heads=1, head_dim=8),
            GroupSpec(kind=GroupKind.SWA, num_layers=2, num_kv_heads=1, head_dim=8, window=8),
            GroupSpec(kind=GroupKind.STATE, num_layers=2, state_elems=128),
        ),
        source="synthetic: inline test layout",
    )


def full_only_layout(page_size: int = 4) -> Layout:
    return Layout(
        name="full-only",
        page_size=page_size,
        dtype="float32",
        groups=(GroupSpec(kind=GroupKind.FULL, num_layers=1, num_kv_heads=1, head_dim=8),),
        source="synthetic: inline test layout",
    )


@dataclass(frozen=True)
class Sizing:
    """A layout with a small arena: ``backed`` bytes out of ``reserved``, and token ranges that
    make capacity errors frequent."""

    layout: Layout
    reserved: int
    backed: int
    max_tokens: int


def _sizing(layout: Layout, full_pages: int, extra_bytes: int, max_tokens: int) -> Sizing:
    """Back the sink, ``extra_bytes`` and ``full_pages`` full pages; reserve twice that."""
    pb = layout.page_bytes(layout.group(FULL))
    backed = layout.max_page_bytes + extra_bytes + full_pages * pb
    return Sizing(layout, reserved=2 * backed, backed=backed, max_tokens=max_tokens)


def sizings() -> dict[str, Sizing]:
    """Small arenas for every layout the property tests run on."""
    gemma, gpt, qwen, tiny = (preset(n) for n in ("gemma-4-31b-it-tp2", "gpt-oss-20b", "qwen3.5-0.8b", "tiny-hybrid"))
    two = two_group_layout(swa_ratio=2, window=8)
    return {
        # 120 full pages' worth of bytes shared by all four groups (state/swa/draft/full).
        "tiny-hybrid": _sizing(tiny, 120, 0, 80),
        # swa pages are 10x full pages: ~12 swa pages, or ~120 full ones.
        "gemma-4-31b-it-tp2": _sizing(gemma, 120, 0, 160),
        # equal pages; window 128 tokens = 8 pages, so long requests release swa pages.
        "gpt-oss-20b": _sizing(gpt, 200, 0, 400),
        # a state slot is ~100 full pages: three or four requests fill it.
        "qwen3.5-0.8b": _sizing(qwen, 200, 2 * qwen.page_bytes(qwen.group(STATE)), 320),
        "two-group": _sizing(two, 300, 0, 48),
        # one float between the ends; state slots are 1 KiB, full pages 256 B.
        "tri-pool": _sizing(tri_pool_layout(), 300, 0, 48),
    }


def arena_for(s: Sizing) -> ShmArena:
    return ShmArena(s.reserved, s.backed)


# ---- snapshots ------------------------------------------------------------------------------


def vec_key(v: IndexVectors) -> tuple:
    """An IndexVectors as plain, comparable Python values."""
    return (v.rid, v.boot_id, v.epoch, v.tokens, v.full.tolist(), v.swa_first_page, v.swa.tolist(), v.state, v.draft.tolist())


def phys_key(v: IndexVectors) -> tuple:
    """Only the physical placement of an IndexVectors (not the epoch it was made at)."""
    return (v.tokens, v.full.tolist(), v.swa_first_page, v.swa.tolist(), v.state, v.draft.tolist())


def snapshot(pool: Pool) -> tuple:
    """Everything observable about a pool: stats, each live request's vectors and virtual ids,
    the offloaded ids. Equal snapshots mean nothing changed."""
    live = {}
    for rid in sorted(pool.request_ids):
        vids = pool.virtual_ids(rid)
        live[rid] = (vec_key(pool.vectors(rid)), {k: t.tolist() for k, t in sorted(vids.items())})
    return (pool.stats(), live, sorted(pool.offloaded_ids))


def assert_unchanged(pool: Pool, before: tuple, *, refused_compaction: bool = False) -> None:
    """The pool equals ``before``, and its invariants hold. A refused compaction may only bump
    the ``compactions_refused`` counter (by one)."""
    after = snapshot(pool)
    stats_b, live_b, off_b = before
    stats_a, live_a, off_a = after
    if refused_compaction:
        assert stats_a.compactions_refused == stats_b.compactions_refused + 1
        stats_a.compactions_refused = stats_b.compactions_refused
    assert stats_a == stats_b
    assert live_a == live_b
    assert off_a == off_b
    pool.check()


# ---- page patterns --------------------------------------------------------------------------

_GCODE = {FULL: 1, SWA: 2, STATE: 3, DRAFT: 4}


def _pages_of(v: IndexVectors) -> dict[GroupKind, tuple[list[int], torch.Tensor]]:
    """Per group: logical page indices and the physical pages behind them."""
    n = v.full.numel()
    out = {FULL: (list(range(n)), v.full), SWA: (list(range(v.swa_first_page, n)), v.swa),
           DRAFT: (list(range(v.draft.numel())), v.draft)}
    if v.state is not None:
        out[STATE] = ([0], torch.tensor([v.state], dtype=torch.int64))
    return out


#: Pages up to this many int64 words are patterned whole; bigger ones every _STRIDE words.
_WHOLE_WORDS = 8192  # 64 KiB
_STRIDE = 4096  # one word per 32 KiB


@dataclass
class Patterns:
    """Distinct int64 keys per (request, group, logical page), written into the page's words;
    the last word holds the key's complement so a shifted or partial copy shows.

    Pages up to 64 KiB carry the key in every word. Bigger pages (megabytes in the real-model
    layouts) carry it in one word per 32 KiB plus the last word, which still catches a page
    moved to the wrong place, a run cut short or a page left behind, at a fraction of the cost.
    ``uid`` numbers requests so a recycled rid gets new keys."""

    pool: Pool
    uids: dict[str, int] = field(default_factory=dict)
    _next: int = 1

    def key(self, rid: str, kind: GroupKind, idx: int) -> int:
        return (self.uids[rid] << 28) | (_GCODE[kind] << 24) | idx

    def _view64(self, kind: GroupKind) -> torch.Tensor:
        return self.pool.page_view(kind).view(torch.int64)

    @staticmethod
    def _words(view: torch.Tensor) -> torch.Tensor | None:
        """Word offsets carrying the key (None: all), the last one excluded."""
        n = view.shape[1]
        return None if n <= _WHOLE_WORDS else torch.arange(0, n - 1, _STRIDE)

    def write_new(self, v: IndexVectors, old: IndexVectors | None = None) -> None:
        """Write keys into the pages of ``v`` that ``old`` (the same request before a step) did
        not have. A new request (``old`` None) gets a fresh uid."""
        if old is None:
            self.uids[v.rid] = self._next
            self._next += 1
        old_pages = _pages_of(old) if old is not None else {}
        for kind, (idxs, phys) in _pages_of(v).items():
            if kind not in self.pool.groups or not idxs:
                continue
            seen = set(old_pages.get(kind, ([], None))[0])
            sel = [i for i, x in enumerate(idxs) if x not in seen]
            if not sel:
                continue
            keys = torch.tensor([self.key(v.rid, kind, idxs[i]) for i in sel], dtype=torch.int64)
            pages = phys.to(torch.int64)[torch.tensor(sel, dtype=torch.int64)]
            view = self._view64(kind)
            words = self._words(view)
            if words is None:
                view[pages] = keys[:, None]
            else:
                view[pages[:, None], words[None, :]] = keys[:, None]
            view[pages, -1] = ~keys

    def verify(self, v: IndexVectors, *, whole: bool = True) -> None:
        """Read the keyed words of every page of ``v`` through its (current) physical ids.

        ``whole=False`` reads only each page's first and last word: enough to catch a page
        handed to the wrong request, cheap enough for every step."""
        for kind, (idxs, phys) in _pages_of(v).items():
            if kind not in self.pool.groups or not idxs:
                continue
            keys = torch.tensor([self.key(v.rid, kind, i) for i in idxs], dtype=torch.int64)
            view, p = self._view64(kind), phys.to(torch.int64)
            words = self._words(view) if whole else torch.tensor([0])
            got = view[p][:, :-1] if words is None else view[p[:, None], words[None, :]]
            bad = (got != keys[:, None]).any(dim=1) | (view[p, -1] != ~keys)
            assert not bool(bad.any()), (
                f"{v.rid}: {kind.value} pages {phys[bad].tolist()} (logical "
                f"{[idxs[i] for i in bad.nonzero().flatten().tolist()]}) lost their bytes"
            )

    def forget(self, rid: str) -> None:
        self.uids.pop(rid, None)


def expected_used(pool: Pool, model: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Pages each group must have bound for live requests ``rid -> (tokens, base_tokens)``."""
    layout = pool.layout
    ps = layout.page_size
    used = {k.value: 0 for k in pool.groups}
    for tokens, base in model.values():
        n = -(-tokens // ps)
        used["full"] += n
        if SWA in pool.groups:
            swa_first = max(0, base - layout.group(SWA).window) // ps
            used["swa"] += n - swa_first
        if STATE in pool.groups:
            used["state"] += 1
        if DRAFT in pool.groups:
            used["draft"] += -(-tokens // layout.page_size_of(layout.group(DRAFT)))
    return used


def request_bytes(pool: Pool, v: IndexVectors) -> int:
    """Bytes of every page a request holds (what offload copies to the host)."""
    g = pool.groups
    total = v.full.numel() * g[FULL].pb + v.swa.numel() * (g[SWA].pb if SWA in g else 0)
    total += v.draft.numel() * (g[DRAFT].pb if DRAFT in g else 0)
    total += g[STATE].pb if v.state is not None else 0
    return total
