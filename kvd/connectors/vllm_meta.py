"""What the connector's scheduler side hands its workers each step (:class:`KvdMetadata`: the
step's saves and loads) and what the workers hand back (:class:`KvdWorkerMetadata`). Plain values:
vLLM may pickle them between processes.

No kvd import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["KvdMetadata", "KvdWorkerMetadata", "Load", "Save"]


@dataclass
class Save:
    """Prefill side: tokens ``[start, end)`` of vLLM request ``req_id`` to write from its blocks
    into its kvd pages this step; the request is sent once ``last``."""

    req_id: str
    rid: str  # the kvd request: the ticket's (both daemons name the request alike)
    ticket: bytes
    tokens: int  # L: the request's prompt length, all of it sent
    block_ids: tuple[list[int], ...]
    start: int  # tokens saved in this step: [start, end)
    end: int
    last: bool
    cached: int = 0  # ... of which vLLM's prefix cache held the first ``cached`` (computed in no step)


@dataclass
class Load:
    """Decode side: tokens ``[start, end)`` of vLLM request ``req_id`` to copy from kvd pages
    (``full`` / ``swa`` / ``state``, of daemon boot ``boot``) into its blocks, or a failure to
    report (``error``, ``aborted``) instead of copying."""

    req_id: str
    block_ids: tuple[list[int], ...]
    start: int  # load tokens [start, end) (start: vLLM's own prefix-cache hit)
    end: int
    full: list[int] = field(default_factory=list)
    swa_first: int = 0
    swa: list[int] = field(default_factory=list)
    state: int | None = None
    boot: str = ""  # the daemon boot whose arena the page ids index (IndexVectors.boot_id)
    error: str = ""  # the transfer failed: report, never copy
    sync: bool = False  # copied before this step's forward, which computes the request's tail
    aborted: bool = False  # vLLM ended the request first: reported (for vLLM to free its blocks), never copied


@dataclass
class KvdMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)


@dataclass
class KvdWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: the sync loads each worker finished copying (or failed),
    by vLLM request, counted per worker (vLLM aggregates the workers' objects of a step with
    :meth:`aggregate`; the scheduler sums across steps and frees a kvd request once every
    worker reported it)."""

    loaded: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvdWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with kvd's worker metadata")
        merged = dict(self.loaded)
        for req_id, n in other.loaded.items():
            merged[req_id] = merged.get(req_id, 0) + n
        return KvdWorkerMetadata(merged)
