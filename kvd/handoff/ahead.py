"""Sends planned ahead: what :meth:`kvd.handoff.outbox.Outbox.begin` plans while the prompt computes.

A prefill engine opens its transfer when the ticket arrives (BeginSend); the sending daemon then
plans the request's Sends from its current vectors, without a lease. A Send of such a range uses
its plan only while the request's pages and this pool's envelopes are unchanged; any other Send
plans itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.errors import KvdError
from kvd.handoff.plan import Plan, plan_chunk
from kvd.records import Envelope, IndexVectors, TicketInfo

if TYPE_CHECKING:
    from kvd.daemon.node import Node

__all__ = ["Ahead", "plan_ahead"]

log = logging.getLogger("kvd.handoff.ahead")


@dataclass(frozen=True, slots=True)
class Ahead:
    """Sends planned by :meth:`~kvd.handoff.outbox.Outbox.begin` while the prompt computes, from
    the request's vectors ``src`` and this pool's envelopes ``env``: ``plans`` maps ``(start, end,
    last)`` to its plan. A Send of such a range uses it only while both are unchanged
    (:meth:`kvd.pool.pool.Pool.unchanged`, checked under the Send's lease, and envelope equality);
    any other Send plans itself."""

    src: IndexVectors
    env: list[Envelope]
    plans: dict[tuple[int, int, bool], Plan]


def plan_ahead(
    node: Node, session: str, rid: str, ticket: TicketInfo, env: list[Envelope], chunk: int,
    dest: Callable[[TicketInfo], IndexVectors],
) -> Ahead | None:
    """The Sends of ``rid`` (held by ``session`` on ``node``) to the ticket's receiver planned now:
    the whole request, or each chunk of ``chunk`` tokens (the final one ``last``), from this
    pool's envelopes ``env`` to the destination vectors ``dest(ticket)``. None where planning
    refuses (the Send that tries it reports why, as it would without begin). Never raises:
    planning ahead only saves the Sends time, and the transfer is open at the receiver already."""
    try:
        (src,) = node.vectors(session, [rid])
        n = src.tokens
        step = chunk or n
        plans = {}
        for t0 in range(0, n, step):
            key = (t0, min(n, t0 + step), t0 + step >= n)
            plans[key] = plan_chunk(node.layout, src, dest(ticket), env, ticket.envelopes, *key)
    except KvdError:
        return None
    except Exception:  # a bug: the Send plans for itself (and meets it there, reported)
        log.exception("planning the sends of %s ahead failed", rid)
        return None
    return Ahead(src, env, plans)
