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
from kvd.copy.runs import coalesce_np

__all__ = ["Block", "Plan", "check_range", "pair_envelopes", "plan_chunk"]


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


def _ids(vec: torch.Tensor) -> np.ndarray:
    # A numpy view of an id vector (no copy): the planner's few array steps cost ~1 us each in
    # numpy against ~10 us on small torch tensors, and a Send plans on its critical path.
    return vec.numpy(force=True)


def _page_range(t0: int, t1: int, page_size: int) -> tuple[int, int]:
    return t0 // page_size, -(-t1 // page_size)


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
    pairs = pair_envelopes(layout, src_env, dst_env)
    plan = Plan([], [], [], {})
    for g in layout.arena_order():
        name = g.name
        s_env, d_env = pairs[name]
        pb = s_env.page_bytes
        if g.kind is GroupKind.STATE:
            if not last:
                continue
            if src.state is None or dst.state is None:
                raise InvalidArgument(f"request {quote(src.rid)}: a state slot is missing on one side")
            s_ids = np.array([src.state], dtype=np.int64)
            d_ids = np.array([dst.state], dtype=np.int64)
        elif g.kind is GroupKind.SWA:
            p0, p1 = _page_range(t0, t1, layout.page_size)
            p0 = max(p0, dst.swa_first_page)
            if p0 >= p1:
                continue
            if p0 < src.swa_first_page:
                raise InvalidArgument(
                    f"request {quote(src.rid)}: the receiver needs SWA page {p0} but the sender released pages before "
                    f"{src.swa_first_page}; send each chunk before extending past it"
                )
            s_ids = _ids(src.swa)[p0 - src.swa_first_page : p1 - src.swa_first_page]
            d_ids = _ids(dst.swa)[p0 - dst.swa_first_page : p1 - dst.swa_first_page]
        else:
            vec_s, vec_d = (src.full, dst.full) if g.kind is GroupKind.FULL else (src.draft, dst.draft)
            p0, p1 = _page_range(t0, t1, layout.page_size_of(g))
            s_ids = _ids(vec_s)[p0:p1]
            d_ids = _ids(vec_d)[p0:p1]
        if s_ids.size != d_ids.size:
            raise InvalidArgument(f"group {name}: {s_ids.size} source pages vs {d_ids.size} destination pages")
        if s_ids.size == 0:
            continue
        for ids, env, side in ((s_ids, s_env, "source"), (d_ids, d_env, "destination")):
            if int(ids.min()) < env.first_page or int(ids.max()) > env.last_page:
                raise InvalidArgument(f"group {name}: a {side} page lies outside its envelope [{env.first_page}, {env.last_page}]")
        r_src, r_dst, r_len = coalesce_np(s_ids, d_ids)
        plan.src.extend((r_src * pb + s_env.base).tolist())
        plan.dst.extend((r_dst * pb + d_env.base).tolist())
        plan.length.extend((r_len * pb).tolist())
        plan.pages[name] = s_ids.size
    return plan
