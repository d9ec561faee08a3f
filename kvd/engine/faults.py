"""Test-only fault injection: KV placed in the wrong pages on the decode node, in known ways.

Tickets are sealed by the decode daemon that mints them (:mod:`kvd.handoff.ticket`), so a ticket with
rewritten destination vectors is refused at the seal before a byte moves: :func:`rewrite_vectors`
builds such a ticket, and the tests show it lands nothing. To show that the accuracy check still
catches misplaced KV, the fault sits where a bug could still put it -- in the *sending* daemon:
:func:`install` makes a prefill daemon plan its writes from edited destination vectors, after
every check of the genuine ticket (the test-only hook ``Outbox.dest_fault``, never a setting).
The accuracy check (:func:`kvd.engine.reference.compare`) must flag every one; the test suite
keeps them as negative controls:

* :func:`swa_through_full_ids` -- the seed-004 family: SWA pages translated through the *full*
  group's id space (the full group's physical ids used as SWA page ids);
* :func:`swa_kernel_ids` -- kernel-facing ids on the wire: the virtual page ids the engine's
  kernels index with, sent where physical SWA page ids belong;
* :func:`draft_scrambled` -- the draft vector points at the request's draft pages in the wrong
  order (the draft KV arrives, but not where the draft model reads it).

An in-process daemon gets the fault with :func:`install`; ``kvd demo --fault NAME`` runs its
prefill daemon as ``python -m kvd.engine.faults NAME serve ...`` (``kvd serve`` with the fault
installed). This is the one module of :mod:`kvd.engine` that reaches into a daemon: a buggy
daemon is what it models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvd.engine.records import TicketRewrite
from kvd.records import IndexVectors
from kvd.v1 import kvd_pb2 as pb
from kvd.rpc.convert import vectors_from_pb, vectors_to_pb

if TYPE_CHECKING:
    from kvd.server.app import Daemon

__all__ = ["Fault", "install", "rewrite_vectors", "swa_through_full_ids", "swa_kernel_ids", "draft_scrambled", "FAULTS", "main"]

#: a fault: the destination vectors a buggy node would place the KV by, from the right ones
Fault = Callable[[IndexVectors], IndexVectors]


def install(daemon: Daemon, fault: Fault | None) -> None:
    """Make ``daemon`` (a prefill daemon) plan every Send's writes from ``fault(destination
    vectors)`` instead of the ticket's, after the ticket's checks; None removes the fault."""
    if daemon.outbox is None:
        raise ValueError("the daemon runs no backend: it sends nothing, so a sending fault cannot apply")
    daemon.outbox.dest_fault = fault


def rewrite_vectors(fn: Fault) -> TicketRewrite:
    """A ticket rewrite that replaces the ticket's destination vectors by ``fn(vectors)`` under
    the old seal: what a buggy node that rewrote the ticket would pass on (refused at the seal)."""

    def rewrite(raw: bytes) -> bytes:
        sealed = pb.SealedTicket.FromString(raw)
        t = pb.Ticket.FromString(sealed.body)
        t.vectors.CopyFrom(vectors_to_pb(fn(vectors_from_pb(t.vectors))))
        return pb.SealedTicket(body=t.SerializeToString(), seal=sealed.seal).SerializeToString()

    return rewrite


def swa_through_full_ids(v: IndexVectors) -> IndexVectors:
    """SWA tail pages named by the full group's physical ids (the wrong id space)."""
    return v._replace(swa=v.full[v.swa_first_page :].clone())


def swa_kernel_ids(virtual_of: Callable[[torch.Tensor], torch.Tensor]) -> Fault:
    """SWA tail pages named by their virtual (kernel-facing) ids. ``virtual_of`` maps the
    receiver's physical full ids to virtual ids (a test reads it from the receiving pool)."""

    def fn(v: IndexVectors) -> IndexVectors:
        return v._replace(swa=virtual_of(v.full[v.swa_first_page :]).to(torch.int32))

    return fn


def draft_scrambled(v: IndexVectors) -> IndexVectors:
    """The request's own draft pages, rotated by one (a request with one draft page is left as is)."""
    return v._replace(draft=v.draft.roll(1))


#: the faults that need nothing from the receiving pool, by name (``kvd demo --fault NAME``)
FAULTS: dict[str, Fault] = {
    "swa-full-ids": swa_through_full_ids,
    "draft-scrambled": draft_scrambled,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvd.engine.faults NAME serve [kvd serve flags]``: ``kvd serve`` whose daemon
    sends with fault ``NAME`` installed (test only: the demo's ``--fault``)."""
    import argparse

    from kvd.cli import _serve_parser, cmd_serve
    from kvd.errors import KvdError

    ap = argparse.ArgumentParser(prog="python -m kvd.engine.faults", description=main.__doc__)
    ap.add_argument("fault", choices=sorted(FAULTS))
    _serve_parser(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    try:
        return cmd_serve(args, on_start=lambda d: install(d, FAULTS[args.fault]))
    except KvdError as exc:
        print(f"kvd serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
