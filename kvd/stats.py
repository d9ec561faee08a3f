"""Plain stats records the core fills. The metrics exporter turns them into Prometheus series;
the core never imports prometheus_client."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GroupStats", "PoolStats"]


@dataclass(slots=True)
class GroupStats:
    name: str
    direction: str  # up | down | float
    page_bytes: int
    capacity_pages: int  # pages if the group had the whole backed arena
    used_pages: int
    free_pages: int  # capacity - used (invariant); the shared gap is counted by every group
    hole_pages: int  # free pages inside the group's region: what compaction/trim would give back
    region_lo_bytes: int
    region_hi_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes


@dataclass(slots=True)
class PoolStats:
    boot_id: str
    epoch: int
    reserved_bytes: int
    backed_bytes: int
    sink_bytes: int
    gap_bytes: int  # free bytes between the groups' regions
    finalized: bool
    requests_live: int
    requests_offloaded: int
    compactions_done: int
    compactions_refused: int
    pages_moved: int
    bytes_moved: int
    groups: list[GroupStats] = field(default_factory=list)
