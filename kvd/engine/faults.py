"""Test-only fault injection: tickets whose destination vectors are wrong in known ways.

The prefill engine takes an explicit ``ticket_rewrite`` (never set in production) and applies it
to a ticket before sending with it, so the sending daemon plans its writes from the edited
destination vectors exactly as it would from a buggy decode node's. The accuracy check
(:func:`kvd.engine.reference.compare`) must flag every one of these; the test suite keeps them
as negative controls.

* :func:`swa_through_full_ids` -- the seed-004 family: SWA pages translated through the *full*
  group's id space (the full group's physical ids used as SWA page ids);
* :func:`swa_kernel_ids` -- kernel-facing ids on the wire: the virtual page ids the engine's
  kernels index with, sent where physical SWA page ids belong;
* :func:`draft_scrambled` -- the draft vector points at the request's draft pages in the wrong
  order (the draft KV arrives, but not where the draft model reads it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvd.engine.records import TicketRewrite
from kvd.pool import IndexVectors
from kvd.v1 import kvd_pb2 as pb
from kvd.wire import vectors_from_pb, vectors_to_pb

__all__ = ["rewrite_vectors", "swa_through_full_ids", "swa_kernel_ids", "draft_scrambled", "FAULTS"]


def rewrite_vectors(fn: Callable[[IndexVectors], IndexVectors]) -> TicketRewrite:
    """A ticket rewrite that replaces the ticket's destination vectors by ``fn(vectors)``."""

    def rewrite(raw: bytes) -> bytes:
        t = pb.Ticket.FromString(raw)
        t.vectors.CopyFrom(vectors_to_pb(fn(vectors_from_pb(t.vectors))))
        return t.SerializeToString()

    return rewrite


def swa_through_full_ids(v: IndexVectors) -> IndexVectors:
    """SWA tail pages named by the full group's physical ids (the wrong id space)."""
    return v._replace(swa=v.full[v.swa_first_page :].clone())


def swa_kernel_ids(virtual_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[IndexVectors], IndexVectors]:
    """SWA tail pages named by their virtual (kernel-facing) ids. ``virtual_of`` maps the
    receiver's physical full ids to virtual ids (a test reads it from the receiving pool)."""

    def fn(v: IndexVectors) -> IndexVectors:
        return v._replace(swa=virtual_of(v.full[v.swa_first_page :]).to(torch.int32))

    return fn


def draft_scrambled(v: IndexVectors) -> IndexVectors:
    """The request's own draft pages, rotated by one (a request with one draft page is left as is)."""
    return v._replace(draft=v.draft.roll(1))


#: the faults that need nothing from the receiving pool, by name (``kvd demo --fault NAME``)
FAULTS: dict[str, Callable[[IndexVectors], IndexVectors]] = {
    "swa-full-ids": swa_through_full_ids,
    "draft-scrambled": draft_scrambled,
}
