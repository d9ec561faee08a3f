"""Transfer planning: which bytes of a request move from a prefill pool to a decode pool.

Pure and vectorised: given the source and destination index vectors of one request, the
envelopes of both arenas and the token range of a chunk, produce byte blocks
``(src_addr, dst_addr, length)`` for a backend. Pages are page-major, so one run of pages that
is consecutive on both sides becomes one block carrying every layer of its group.

What a chunk ``[t0, t1)`` carries, per group:

* ``full``: request pages overlapping the chunk. A page the chunk fills only partly is sent
  again by the next chunk (its later tokens land on the same page);
* ``swa``: only pages in the destination's window tail ``[dst.swa_first_page, n)`` — physical
  SWA ids on both sides, never kernel-facing or full-group ids. The source must still hold
  them (a sender that already released an SWA page the receiver needs is refused);
* ``state``: the slot, with the last chunk only (state is final after the last token);
* ``draft``: draft pages overlapping the chunk at the draft page size — its own vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvd.errors import InvalidArgument, LayoutMismatch
from kvd.pool.layout import GroupKind, Layout
from kvd.limits import quote
from kvd.records import Envelope, IndexVectors
from kvd.copy.runs import SMALL, coalesce_lists, coalesce_np

__all__ = ["Block", "Plan", "check_range", "check_envelopes", "pair_envelopes", "plan_chunk"]


@dataclass(frozen=True, slots=True)
class Block:
    src: int  # address in the source arena
    dst: int  # address in the destination arena
    length: int  # bytes


@dataclass(slots=True)
class Plan:
    """Blocks to write, as three parallel lists (what a backend takes), plus per-group page counts
    (for metrics and tests). Block ``i`` is ``(src[i], dst[i], length[i])``."""

    src: list[int]  # addresses in the source arena
    dst: list[int]  # addresses in the destination arena
    length: list[int]  # bytes
    pages: dict[str, int]

    @property
    def blocks(self) -> list[Block]:
        return [Block(s, d, n) for s, d, n in zip(self.src, self.dst, self.length)]

    @property
    def nbytes(self) -> int:
        return sum(self.length)

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        return self.src, self.dst, self.length


def check_range(t0: int, t1: int, tokens: int) -> None:
    """Refuses (InvalidArgument) a send range that is empty or not inside ``tokens``."""
    if not (0 <= t0 < t1 <= tokens):
        raise InvalidArgument(f"send range [{t0}, {t1}) is not inside the request's {tokens} tokens")


def pair_envelopes(layout: Layout, src_env: list[Envelope], dst_env: list[Envelope]) -> dict[str, tuple[Envelope, Envelope]]:
    """Each group's (source, destination) envelope. Refuses (LayoutMismatch) a group missing on
    a side or whose page bytes differ: what a ticket of another layout (or a tampered one)
    shows before any request is looked at."""
    se = {e.group: e for e in src_env}
    de = {e.group: e for e in dst_env}
    out = {}
    for g in layout.arena_order():
        name = g.name
        if name not in se or name not in de:
            raise LayoutMismatch(f"group {name} missing from an envelope list (sender {sorted(se)}, receiver {sorted(de)})")
        if se[name].page_bytes != de[name].page_bytes:
            raise LayoutMismatch(f"group {name}: page bytes {se[name].page_bytes} here vs {de[name].page_bytes} at the receiver")
        _check_addresses(de[name])
        out[name] = (se[name], de[name])
    return out


#: Addresses are planned as int64 (numpy): an envelope must end below this.
_ADDRESS_END = 1 << 63


def _check_addresses(env: Envelope) -> None:
    """InvalidArgument unless every page ``[first_page, last_page]`` of the receiver's ``env``
    ends below :data:`_ADDRESS_END`: what a real arena's envelope always does, so a ticket whose
    envelope says otherwise was corrupted (or forged) before its seal is checked."""
    if env.last_page < env.first_page:
        return  # no valid page: any id is refused against it (plan_chunk)
    end = env.base + (env.last_page + 1) * env.page_bytes
    if env.base < 0 or env.first_page < 0 or end > _ADDRESS_END:
        raise InvalidArgument(
            f"the receiver's envelope of group {env.group} spans [{env.base:#x}, {end:#x}) past the address space: the ticket "
            "is corrupt; pass the decode daemon's ticket unchanged"
        )


def _ids(vec: torch.Tensor, p0: int, p1: int, few: bool) -> list[int] | np.ndarray:
    """Ids ``[p0, p1)`` of an id vector of a request of ``few`` pages (:data:`~kvd.copy.runs.SMALL`
    or fewer in the group): a list (one call); else a numpy view (no copy): numpy's few array
    steps cost ~1 us each against ~10 us on small torch tensors. Either serves :func:`_add`."""
    return vec.tolist()[p0:p1] if few else vec.numpy(force=True)[p0:p1]


#: What planning reads of a layout and both sides' envelopes, per group in arena order: its
#: name, kind, tokens per page and (source, destination) envelopes.
_Row = tuple[str, GroupKind, int, Envelope, Envelope]
_last_rows: tuple[Layout, list[Envelope], list[Envelope], tuple[_Row, ...]] | None = None


def _rows(layout: Layout, src_env: list[Envelope], dst_env: list[Envelope]) -> tuple[_Row, ...]:
    """The groups of ``layout`` paired by :func:`pair_envelopes` (its refusals), kept for the
    last layout and envelopes that passed: a daemon plans against the same envelopes Send after
    Send (they change with a backing), and the pairing and the layout's own caches cost more
    than comparing two short lists."""
    global _last_rows
    last = _last_rows
    if last is not None and last[0] is layout and last[1] == src_env and last[2] == dst_env:
        return last[3]
    pairs = pair_envelopes(layout, src_env, dst_env)
    rows = tuple(
        (g.name, g.kind, layout.page_size if g.kind is GroupKind.SWA else layout.page_size_of(g), *pairs[g.name])
        for g in layout.arena_order()
    )
    _last_rows = (layout, list(src_env), list(dst_env), rows)
    return rows


def check_envelopes(layout: Layout, src_env: list[Envelope], dst_env: list[Envelope]) -> None:
    """:func:`pair_envelopes`'s refusals alone (what a sender checks before the receiver hears of
    a ticket); changes nothing."""
    _rows(layout, src_env, dst_env)


def plan_chunk(
    layout: Layout,
    src: IndexVectors,
    dst: IndexVectors,
    src_env: list[Envelope],
    dst_env: list[Envelope],
    t0: int,
    t1: int,
    last: bool,
) -> Plan:
    """Blocks that move tokens ``[t0, t1)`` of one request (see the module docstring).

    Blocks are maximal runs: a backend splits what its transport needs split (Mooncake's
    ``max_block``), and the local copies move a run of any length in one memcpy -- splitting a
    1.7 GB request into 64 MiB blocks cost the copy engines ~4% against one copy.

    Refuses (InvalidArgument) a range outside the request, vectors of different lengths, or
    envelopes whose page bytes differ (LayoutMismatch) -- before anything is written."""
    check_range(t0, t1, src.tokens)
    if src.tokens != dst.tokens:
        raise InvalidArgument(
            f"request {quote(src.rid)} has {src.tokens} tokens here but the receiver allocated {dst.tokens}; allocate the same length"
        )
    plan = Plan([], [], [], {})
    for name, kind, page_size, s_env, d_env in _rows(layout, src_env, dst_env):
        s_ids: list[int] | np.ndarray
        d_ids: list[int] | np.ndarray
        if kind is GroupKind.STATE:
            if not last:
                continue
            if src.state is None or dst.state is None:
                raise InvalidArgument(f"request {quote(src.rid)}: a state slot is missing on one side")
            s_ids, d_ids = [src.state], [dst.state]
        else:
            p0, p1 = t0 // page_size, -(-t1 // page_size)
            few = -(-src.tokens // page_size) <= SMALL  # the group's pages in the request
            if kind is GroupKind.SWA:
                p0 = max(p0, dst.swa_first_page)
                if p0 >= p1:
                    continue
                if p0 < src.swa_first_page:
                    raise InvalidArgument(
                        f"request {quote(src.rid)}: the receiver needs SWA page {p0} but the sender released pages before "
                        f"{src.swa_first_page}; send each chunk before extending past it"
                    )
                s_ids = _ids(src.swa, p0 - src.swa_first_page, p1 - src.swa_first_page, few)
                d_ids = _ids(dst.swa, p0 - dst.swa_first_page, p1 - dst.swa_first_page, few)
            elif kind is GroupKind.FULL:
                s_ids, d_ids = _ids(src.full, p0, p1, few), _ids(dst.full, p0, p1, few)
            else:
                s_ids, d_ids = _ids(src.draft, p0, p1, few), _ids(dst.draft, p0, p1, few)
        n = len(s_ids)
        if n != len(d_ids):
            raise InvalidArgument(f"group {name}: {n} source pages vs {len(d_ids)} destination pages")
        if n:
            _add(plan, name, s_ids, d_ids, s_env, d_env)
    return plan


def _add(plan: Plan, name: str, s: list[int] | np.ndarray, d: list[int] | np.ndarray, s_env: Envelope, d_env: Envelope) -> None:
    """Append to ``plan`` the blocks that move pages ``s[i] -> d[i]`` of group ``name`` (equal,
    nonzero lengths); InvalidArgument for a page outside its side's envelope. A few pages
    (:data:`~kvd.copy.runs.SMALL`) are planned in plain Python: a numpy step per array costs
    more than the loop."""
    pb = s_env.page_bytes
    n = len(s)
    if n <= SMALL:
        s = s if isinstance(s, list) else s.tolist()
        d = d if isinstance(d, list) else d.tolist()
        s0, d0 = s[0], d[0]
        if s == list(range(s0, s0 + n)) and d == list(range(d0, d0 + n)):
            # One run on both sides (pages a pool handed out in a row): its ends are the bounds.
            runs = ([s0], [d0], [n])
            s_lo, s_hi, d_lo, d_hi = s0, s0 + n - 1, d0, d0 + n - 1
        else:
            runs = coalesce_lists(s, d)
            s_lo, s_hi, d_lo, d_hi = min(s), max(s), min(d), max(d)
        if s_lo < s_env.first_page or s_hi > s_env.last_page:
            raise _outside(name, s_env, "source")
        if d_lo < d_env.first_page or d_hi > d_env.last_page:
            raise _outside(name, d_env, "destination")
        srcs, dsts, lens, sb, db = plan.src, plan.dst, plan.length, s_env.base, d_env.base
        for x, y, k in zip(*runs):
            srcs.append(x * pb + sb)
            dsts.append(y * pb + db)
            lens.append(k * pb)
    else:
        a, b = np.asarray(s), np.asarray(d)
        if int(a.min()) < s_env.first_page or int(a.max()) > s_env.last_page:
            raise _outside(name, s_env, "source")
        if int(b.min()) < d_env.first_page or int(b.max()) > d_env.last_page:
            raise _outside(name, d_env, "destination")
        r_src, r_dst, r_len = coalesce_np(a, b)
        plan.src.extend((r_src * pb + s_env.base).tolist())
        plan.dst.extend((r_dst * pb + d_env.base).tolist())
        plan.length.extend((r_len * pb).tolist())
    plan.pages[name] = n


def _outside(name: str, env: Envelope, side: str) -> InvalidArgument:
    return InvalidArgument(f"group {name}: a {side} page lies outside its envelope [{env.first_page}, {env.last_page}]")
