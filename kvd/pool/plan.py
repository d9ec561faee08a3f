"""``kvd plan``: size a model's layout for a memory budget, before anything starts.

For a layout (a preset, a layout file, or derived from a ``config.json`` by :mod:`kvd.pool.models`)
and a byte budget per rank, :func:`plan` computes what a daemon built on that budget would hold,
with the pool's own arithmetic (:class:`kvd.pool.pool.Pool` and :class:`kvd.pool.allocator.GroupAllocator`
size their tables exactly so; ``tests/test_plan.py`` checks the two agree):

* per group: entry bytes per token, page bytes, pages (a group's capacity if it had the whole
  backed arena, as ``GroupStats.capacity_pages`` reports it) and the tokens they hold;
* the largest request that fits: a prefill allocation (every group covers every token at once)
  and a received one (the swa group only holds the window tail);
* the full:swa page ratio (seed 004: the swa side binds the full side's ids);
* the bytes of every mapping table (int32): ``v2p`` / ``p2v`` / holes per group, the id rings
  and their id -> request tables per id owner; sized by the *reservation*, so a post-capture
  daemon (which reserves more than it backs) pays for the reservation;
* the post-capture reservation (``reserve_bytes``, default 4x the budget, as ``kvd serve``).

The budget is given in bytes, or as a GPU's memory times a fraction (SGLang's
``--mem-fraction-static``) less the weights and anything else the engine keeps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvd.errors import InvalidArgument
from kvd.pool.layout import GroupKind, Layout

if TYPE_CHECKING:
    from rich.console import Group

__all__ = ["GPUS", "Plan", "GroupPlan", "TablePlan", "plan", "gpu_budget", "format_plan"]

#: Total memory of some GPUs, bytes, as ``nvidia-smi --query-gpu=memory.total`` reports it (MiB).
GPUS: dict[str, int] = {
    "a100-40gb": 40_960 << 20,
    "a100-80gb": 81_920 << 20,
    "h100": 81_559 << 20,
    "h200": 143_771 << 20,
    "l40s": 46_068 << 20,
}

_IDX_BYTES = 4  # kvd.pool.allocator.IDX is int32
_SEED_IDX_BYTES = 8  # SGLang's tables are int64 (seed 004's 16.5 MB)


def gpu_budget(gpu: str | None = None, *, memory: int | None = None, fraction: float = 0.8, other: int = 0) -> int:
    """Bytes for the KV pool on one GPU: ``fraction`` of its memory less ``other`` (the weights,
    activations, graphs). ``gpu`` names one of :data:`GPUS`; ``memory`` gives the total instead."""
    if memory is None:
        if gpu is None:
            raise InvalidArgument("give a budget (--budget BYTES) or a GPU (--gpu NAME or --gpu-memory BYTES)")
        try:
            memory = GPUS[gpu.lower()]
        except KeyError:
            raise InvalidArgument(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPUS))} (or give --gpu-memory BYTES)") from None
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"memory fraction must be in (0, 1], got {fraction}")
    budget = int(memory * fraction) - other
    if budget <= 0:
        raise InvalidArgument(
            f"{fraction} of {memory:,d} bytes less {other:,d} other bytes leaves nothing for the KV pool; "
            "raise the fraction or lower --other"
        )
    return budget


@dataclass(slots=True)
class GroupPlan:
    name: str
    layers: int
    entry_bytes: int  # per token (state: per slot)
    page_size: int  # tokens per page (state: 1 slot)
    page_bytes: int
    pages: int  # the group's capacity with the whole backed arena
    tokens: int  # pages x page_size (state: requests, one slot each)
    v2p_len: int  # kvd's v2p entries (swa: the full group's id space)
    sglang_v2p_len: int  # SGLang's unified pool: budget // page bytes pages, its v2p one longer (seed 004's table)
    window: int | None = None


@dataclass(slots=True)
class TablePlan:
    group: str
    table: str  # v2p | p2v | holes | id ring | id -> request
    entries: int
    bytes: int


@dataclass(slots=True)
class Plan:
    layout: str
    fingerprint: str
    page_size: int
    dtype: str
    budget_bytes: int
    reserve_bytes: int  # post-capture reservation
    sink_bytes: int
    groups: list[GroupPlan]
    largest_request_tokens: int  # prefill: every group covers every token at once
    largest_received_tokens: int  # received: the swa group holds the window tail only
    full_to_swa_pages: float | None
    tables: list[TablePlan]  # sized by the budget (an eager daemon: reserved = budget)
    tables_bytes: int
    post_capture_tables_bytes: int  # sized by reserve_bytes
    swa_v2p_seed_bytes: dict[str, int] = field(default_factory=dict)  # seed 004's row cost, int64

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _tables(layout: Layout, reserved: int) -> list[TablePlan]:
    """The tables :class:`kvd.pool.pool.Pool` allocates for an arena reserving ``reserved`` bytes."""
    out: list[TablePlan] = []
    full_ids = reserved // layout.page_bytes(layout.group(GroupKind.FULL))
    for g in layout.arena_order():
        own = reserved // layout.page_bytes(g)
        ids = full_ids if g.kind is GroupKind.SWA else own
        rows = [("v2p", ids), ("p2v", own), ("holes", own)]
        if g.kind is not GroupKind.SWA:  # an id owner: its ring of free ids and id -> request
            rows += [("id ring", ids), ("id -> request", ids)]
        out += [TablePlan(g.name, t, n, n * _IDX_BYTES) for t, n in rows]
    return out


def _request_bytes(layout: Layout, tokens: int, *, receive: bool) -> int:
    """Smallest backing that admits one request of ``tokens``: :meth:`kvd.pool.pool.Pool.floor_bytes`
    (``receive=False``); received, the swa group holds only the pages of the window tail."""
    ps = layout.page_size
    n = -(-tokens // ps)
    cursor = layout.max_page_bytes  # the sink
    for g in layout.arena_order():
        if g.kind is GroupKind.FULL:
            need = n
        elif g.kind is GroupKind.SWA:
            need = n - (max(0, tokens - (g.window or 0)) // ps if receive else 0)
        elif g.kind is GroupKind.STATE:
            need = 1
        else:
            need = -(-tokens // layout.page_size_of(g))
        pb = layout.page_bytes(g)
        cursor = (-(-cursor // pb) + need) * pb
    return cursor


def _largest(layout: Layout, budget: int, *, receive: bool) -> int:
    """The most tokens one request can have in ``budget`` bytes (0: not even one page)."""
    lo, hi = 0, budget // layout.entry_bytes(layout.group(GroupKind.FULL)) + layout.page_size
    if _request_bytes(layout, 1, receive=receive) > budget:
        return 0
    while lo < hi:  # invariant: lo fits, hi + 1 does not (or is the bound)
        mid = (lo + hi + 1) // 2
        if _request_bytes(layout, mid, receive=receive) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(layout: Layout, budget: int, *, reserve: int | None = None) -> Plan:
    """What a daemon with ``layout`` and ``budget`` backed bytes holds; ``reserve``: the
    post-capture reservation (default 4x ``budget``, as ``kvd serve --post-capture``)."""
    if budget <= 0:
        raise InvalidArgument(f"budget must be a positive byte count, got {budget}")
    reserve = 4 * budget if reserve is None else reserve
    if reserve < budget:
        raise InvalidArgument(f"reserve ({reserve:,d}) is below the budget ({budget:,d}); reserve at least the budget")
    sink = layout.max_page_bytes
    if budget < _request_bytes(layout, layout.page_size, receive=False):
        raise InvalidArgument(
            f"budget {budget:,d} bytes is below the one-request floor of {_request_bytes(layout, layout.page_size, receive=False):,d} "
            f"bytes for layout {layout.name!r}; give the pool more memory"
        )
    groups = []
    for g in layout.arena_order():
        pb = layout.page_bytes(g)
        pages = max(0, budget // pb - -(-sink // pb))  # GroupAllocator: p_max - p_min
        ps = layout.page_size_of(g)
        v2p = budget // layout.page_bytes(layout.group(GroupKind.FULL)) if g.kind is GroupKind.SWA else budget // pb
        groups.append(GroupPlan(g.name, g.num_layers, layout.entry_bytes(g), ps, pb, pages, pages * ps, v2p, budget // pb + 1, g.window))
    by = {g.name: g for g in groups}
    ratio = by["full"].pages / by["swa"].pages if "swa" in by and by["swa"].pages else None
    tables = _tables(layout, budget)
    seed: dict[str, int] = {}
    if "swa" in by:
        full_ids = budget // layout.page_bytes(layout.group(GroupKind.FULL))
        swa_own = budget // layout.page_bytes(layout.group(GroupKind.SWA))
        # One row per id of the owner's space (kvd and the seed's fix) vs per own page (the bug).
        seed = {"owner_ids_int64": (full_ids + 1) * _SEED_IDX_BYTES, "own_pages_int64": (swa_own + 1) * _SEED_IDX_BYTES,
                "owner_ids_int32": full_ids * _IDX_BYTES}
    return Plan(
        layout=layout.name, fingerprint=layout.fingerprint, page_size=layout.page_size, dtype=layout.dtype,
        budget_bytes=budget, reserve_bytes=reserve, sink_bytes=sink, groups=groups,
        largest_request_tokens=_largest(layout, budget, receive=False),
        largest_received_tokens=_largest(layout, budget, receive=True),
        full_to_swa_pages=ratio, tables=tables, tables_bytes=sum(t.bytes for t in tables),
        post_capture_tables_bytes=sum(t.bytes for t in _tables(layout, reserve)), swa_v2p_seed_bytes=seed,
    )


def format_plan(p: Plan, layout: Layout) -> Group:
    """A rich renderable of ``p``: the layout, a table per group, the tables' bytes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        (f"{p.layout}", "bold"), f"  fp={p.fingerprint}  page_size={p.page_size}  dtype={p.dtype}\n",
        f"budget {p.budget_bytes:,d} B ({_gib(p.budget_bytes)})   sink {p.sink_bytes:,d} B   "
        f"post-capture reservation {p.reserve_bytes:,d} B ({_gib(p.reserve_bytes)})\n",
        ("source: ", "dim"), (layout.source, "dim"),
    )
    g = Table(title="groups (each group's pages if it had the whole budget)", title_justify="left")
    for col in ("group", "layers", "bytes/token", "page", "page bytes", "pages", "tokens", "v2p len", "sglang pages+1", "window"):
        g.add_column(col, justify="left" if col == "group" else "right")
    for x in p.groups:
        g.add_row(x.name, str(x.layers), f"{x.entry_bytes:,d}", str(x.page_size), f"{x.page_bytes:,d}", f"{x.pages:,d}",
                  f"{x.tokens:,d}" + (" slots" if x.name == "state" else ""), f"{x.v2p_len:,d}", f"{x.sglang_v2p_len:,d}",
                  str(x.window or ""))
    lines = [
        f"largest request: {p.largest_request_tokens:,d} tokens (prefill, every group at once); "
        f"{p.largest_received_tokens:,d} received (swa: window tail only)",
    ]
    if p.full_to_swa_pages is not None:
        lines.append(f"full:swa pages = {p.full_to_swa_pages:.3f} : 1")
    t = Table(title="mapping tables (int32; an eager daemon: reserved = budget)", title_justify="left")
    for col in ("group", "table", "entries", "bytes"):
        t.add_column(col, justify="left" if col in ("group", "table") else "right")
    for tp in p.tables:
        t.add_row(tp.group, tp.table, f"{tp.entries:,d}", f"{tp.bytes:,d}")
    tail = [f"tables: {p.tables_bytes:,d} B ({_mb(p.tables_bytes)}) eager; {p.post_capture_tables_bytes:,d} B "
            f"({_mb(p.post_capture_tables_bytes)}) at the post-capture reservation"]
    if p.swa_v2p_seed_bytes:
        s = p.swa_v2p_seed_bytes
        tail.append(f"swa v2p over the owner's ids: {_mb(s['owner_ids_int64'])} as int64 (seed 004's fix) vs "
                    f"{_mb(s['own_pages_int64'])} sized by its own pages (the bug); kvd's int32: {_mb(s['owner_ids_int32'])}")
    return Group(head, g, Text("\n".join(lines)), t, Text("\n".join(tail)))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
