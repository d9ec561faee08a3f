"""The records the engines, the router and the tests share: configuration, requests, results,
and the slice of the kvd client the engines call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvd.records import CompactionResult, IndexVectors

__all__ = ["EngineConfig", "Request", "FirstToken", "Completion", "KVApi", "TicketRewrite"]

#: test-only: rewrites a ticket before the prefill engine sends with it (fault injection)
TicketRewrite = Callable[[bytes], bytes]


class KVApi(Protocol):
    """What the engines call on their daemon: :class:`kvd.client.Client` or, for the colocated
    reference, :class:`kvd.engine.local.LocalKV`. The handoff calls (``allocate_recv``, ``allocate``
    with a ticket, ``send``, ``wait_ready``, ``abort``) exist only on a client and are used only
    with one."""

    def allocate(self, rid: str, tokens: int, *, receive: bool = False) -> IndexVectors: ...
    def extend_many(self, items: Sequence[tuple[str, int]]) -> list[IndexVectors]: ...
    def vectors(self, rid: str) -> IndexVectors: ...
    def vectors_many(self, rids: Sequence[str]) -> list[IndexVectors]: ...
    def free(self, *rids: str) -> int: ...
    def offload(self, rid: str) -> int: ...
    def restore(self, rid: str) -> IndexVectors: ...
    def compact(self, *, around_pinned: bool = False) -> CompactionResult: ...


@dataclass(frozen=True)
class EngineConfig:
    chunk: int | None = None  # prefill chunk in tokens; None: the whole prompt in one pass
    spec_k: int = 0  # draft tokens proposed per round; 0: plain greedy decoding
    ready_wait: float = 1.0  # seconds one wait_ready may block a decode step (answered on READY, not polled)
    compact_every: int = 8  # completions between compactions (there is one after each retraction too)
    #: seconds an admitted request's RECV lease (its ticket) lives before its Send must come; a ticket
    #: may wait behind every prompt queued at the prefill engine. None: the daemon's lease TTL.
    ticket_ttl: float | None = None


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_new: int  # tokens to generate, the first one (from prefill) included


@dataclass(frozen=True)
class FirstToken:
    """What the prefill engine hands back: the first generated token and the transfer's cost."""

    rid: str
    token: int
    logit: float  # the target's logit of ``token``
    nbytes: int = 0  # KV bytes sent to the decode node
    send_seconds: float = 0.0
    chunks: int = 0
    error: str = ""
    #: seconds inside :meth:`PrefillEngine.prefill <kvd.engine.prefill.PrefillEngine.prefill>`, its
    #: allocate to its first token: with a ticket every daemon call of the handoff (the allocate
    #: that begins the transfer, the Sends) included; colocated, the compute alone. Queueing before it is not.
    prefill_s: float = 0.0


@dataclass(frozen=True)
class Completion:
    """A finished request. The traces are float64 sums that two runs agree on bit for bit when
    their math was the same: ``target_trace`` over the target's logit of every emitted token,
    ``draft_trace`` over the draft's top logit of every proposal (it moves with the draft KV)."""

    rid: str
    tokens: tuple[int, ...]
    target_trace: float
    draft_trace: float = 0.0
    proposed: int = 0
    accepted: int = 0
    retracted: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def same_as(self, other: Completion) -> bool:
        """Same tokens and bit-identical traces (the accuracy check)."""
        return (self.ok and other.ok and self.tokens == other.tokens and self.target_trace == other.target_trace
                and self.draft_trace == other.draft_trace)


