"""``kvd top`` and ``kvd status``: a daemon's pool and activity on a terminal, drawn with rich.

:func:`render` turns one sample (``GetStats`` and ``GetActivity``) and the rates between two
samples into a renderable; :func:`run_top` redraws it in place (rich's ``Live``) every
``interval`` seconds until interrupted. Each group is one bar over its capacity (the pages it
would have with the whole backed arena)::

    full  ████▓▓▓▓▒▒▒░░░░░░·····   pinned ▓ (live leases), used █, holes ▒ (free in its region),
                                    shared gap ░ (free between regions), · other groups' regions
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvd.records import Activity, NodeStats

def console():
    """A rich console: the terminal's width on a terminal, 160 columns into a pipe or file (rich
    would wrap at 80 there)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


__all__ = ["console", "Rates", "rates", "render", "render_status", "status_json", "run_top"]

BAR = 48  # bar width in cells


@dataclass(slots=True)
class Rates:
    allocations_s: float = 0.0
    sent_bytes_s: float = 0.0
    received_bytes_s: float = 0.0
    compactions_s: float = 0.0


def rates(a: Activity, b: Activity, seconds: float) -> Rates:
    """Per-second rates from two samples ``seconds`` apart (counters only grow within a boot)."""
    if seconds <= 0:
        return Rates()
    d = lambda f: max(0, getattr(b, f) - getattr(a, f)) / seconds  # noqa: E731
    return Rates(d("allocations_total"), d("bytes_sent_total"), d("bytes_received_total"), d("compactions_done"))


def _h(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{s / 60:.1f}m" if s < 3600 else f"{s / 3600:.1f}h"


def _cells(counts: list[int], total: int) -> list[int]:
    """Split BAR cells over ``counts`` (of ``total``) so that any nonzero count gets a cell."""
    if total <= 0:
        return [0] * len(counts)
    cells = [(BAR * c) // total if c else 0 for c in counts]
    for i, c in enumerate(counts):
        if c and not cells[i]:
            cells[i] = 1
    while sum(cells) > BAR:
        i = max(range(len(cells)), key=lambda j: cells[j])
        cells[i] -= 1
    return cells


def _bars(st: NodeStats, act: Activity | None) -> Table:
    p = st.pool
    t = Table(title="arena: one bar per group over its capacity", title_justify="left", box=None, pad_edge=False)

    for col, just in (("group", "left"), ("map", "left"), ("used", "right"), ("pinned", "right"), ("holes", "right"),
                      ("gap", "right"), ("capacity", "right"), ("page", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for g in p.groups:
        pinned = min(g.used_pages, (act.pinned_pages.get(g.name, 0) if act else 0))
        gap = min(g.free_pages - g.hole_pages, p.gap_bytes // g.page_bytes) if g.page_bytes else 0
        other = max(0, g.capacity_pages - g.used_pages - g.hole_pages - gap)
        parts = [pinned, g.used_pages - pinned, g.hole_pages, gap, other]
        cells = _cells(parts, g.capacity_pages)
        bar = Text()
        for n, (ch, style) in zip(cells, (("▓", "bold red"), ("█", "green"), ("▒", "yellow"), ("░", "cyan"), ("·", "dim"))):
            bar.append(ch * n, style=style)
        bar.append(" " * (BAR - sum(cells)))
        t.add_row(g.name, bar, f"{g.used_pages:,d}", f"{pinned:,d}", f"{g.hole_pages:,d}", f"{gap:,d}",
                  f"{g.capacity_pages:,d}", _h(g.page_bytes))
    return t


def _header(st: NodeStats, address: str) -> Text:
    p = st.pool
    fin = "finalized" if p.finalized else "NOT finalized (post-capture: call Finalize)"
    return Text.assemble(
        ("kvd ", "bold"), (address, "bold cyan"), f"  layout={st.layout_name}  boot={p.boot_id}  epoch={p.epoch}  {fin}\n",
        f"reserved {_h(p.reserved_bytes)}  backed {_h(p.backed_bytes)}  shared gap {_h(p.gap_bytes)}  sink {_h(p.sink_bytes)}",
    )


def render(st: NodeStats, act: Activity, r: Rates | None, address: str, *, rows: int = 10) -> RenderableType:
    """One screen of ``kvd top``: header, group bars, rates, and the oldest requests, leases and
    transfers in flight (at most ``rows`` of each) with their ages."""
    legend = Text.assemble(("▓ pinned  ", "bold red"), ("█ used  ", "green"), ("▒ holes  ", "yellow"),
                           ("░ shared gap  ", "cyan"), ("· other groups", "dim"))
    r = r or Rates()
    rate = Text(
        f"rates  allocations {r.allocations_s:,.1f}/s  sent {_h(r.sent_bytes_s)}/s  received {_h(r.received_bytes_s)}/s  "
        f"compactions {r.compactions_s:,.2f}/s    totals: allocated {act.allocations_total:,d}  sent "
        f"{_h(act.bytes_sent_total)}  received {_h(act.bytes_received_total)}  compactions {act.compactions_done:,d}"
    )
    req = Table(title=f"requests: {act.requests_total:,d} live (oldest first)", title_justify="left", box=None)
    for col in ("rid", "session", "tokens", "full", "swa", "age", "leased"):
        req.add_column(col, justify="left" if col in ("rid", "session") else "right")
    for x in act.requests[:rows]:
        req.add_row(x.rid, x.session, f"{x.tokens:,d}", f"{x.full_pages:,d}", f"{x.swa_pages:,d}", _age(x.age_s),
                    "yes" if x.leased else "")
    les = Table(title=f"leases: {act.leases_total:,d} live", title_justify="left", box=None)
    for col in ("id", "rid", "kind", "age", "expires in"):
        les.add_column(col, justify="left" if col in ("rid", "kind") else "right")
    for le in act.leases[:rows]:
        les.add_row(str(le.lease_id), le.rid, le.kind, _age(le.age_s), _age(max(0.0, le.expires_in_s)))
    tra = Table(title=f"transfers: {act.transfers_total:,d} in flight", title_justify="left", box=None)
    for col in ("dir", "rid", "state", "peer", "bytes", "age"):
        tra.add_column(col, justify="right" if col in ("bytes", "age") else "left")
    for tr in act.transfers[:rows]:
        tra.add_row(tr.direction, tr.rid, tr.state, tr.peer, _h(tr.nbytes), _age(tr.age_s))
    return Group(_header(st, address), _bars(st, act), legend, Text(""), rate, Text(""), req, les, tra)


def render_status(st: NodeStats, address: str = "") -> RenderableType:
    """``kvd status``: the header, the group bars with their regions, the counters."""
    p = st.pool
    regions = Table(box=None, title="groups", title_justify="left", pad_edge=False)
    for col in ("group", "dir", "page", "used", "free", "holes", "used bytes", "region"):
        regions.add_column(col, justify="left" if col in ("group", "dir", "region") else "right")
    for g in p.groups:
        regions.add_row(g.name, g.direction, _h(g.page_bytes), f"{g.used_pages:,d}", f"{g.free_pages:,d}",
                        f"{g.hole_pages:,d}", _h(g.used_bytes), f"[{_h(g.region_lo_bytes)}, {_h(g.region_hi_bytes)})")
    counters = Text(
        f"requests  live={p.requests_live}  offloaded={p.requests_offloaded}    sessions live={st.sessions_live} "
        f"expired={st.sessions_expired_total}\n"
        f"leases    live={st.leases_live}  expired={st.leases_expired_total}    stale refusals={st.stale_refusals_total}\n"
        f"compaction done={p.compactions_done}  refused={p.compactions_refused}  moved={_h(p.bytes_moved)}"
    )
    return Group(_header(st, address), _bars(st, None), regions, counters)


def status_json(st: NodeStats) -> dict:
    """``kvd status --json``: the NodeStats record as plain JSON types."""
    return asdict(st)


def run_top(client, address: str, *, interval: float = 1.0, once: bool = False, limit: int = 20, console=None) -> None:
    """Draw ``kvd top`` for the daemon behind ``client`` until interrupted (``once``: one screen,
    its rates over one ``interval``)."""
    from rich.live import Live

    console = console or globals()["console"]()
    prev = client.activity(limit)
    t_prev = time.monotonic()
    if once:
        time.sleep(interval)
        act, now = client.activity(limit), time.monotonic()
        console.print(render(client.stats(), act, rates(prev, act, now - t_prev), address, rows=limit))
        return
    with Live(render(client.stats(), prev, None, address, rows=limit), console=console, auto_refresh=False,
              screen=False, transient=False) as live:
        try:
            while True:
                time.sleep(interval)
                act, now = client.activity(limit), time.monotonic()
                live.update(render(client.stats(), act, rates(prev, act, now - t_prev), address, rows=limit), refresh=True)
                prev, t_prev = act, now
        except KeyboardInterrupt:
            pass
