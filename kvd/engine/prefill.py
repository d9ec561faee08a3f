"""The prefill role: compute prompts into the own daemon's arena, send each chunk as it is written.

::

    allocate(r, n)                      every page of the prompt (SWA pages for every token)
    allocate(r, n, ticket, chunk)       the transfer begun too: the decode daemon checks the ticket meanwhile, not in the first send;
                                        this daemon plans every chunk's send
    for each chunk [t0, t1):
        target + draft forward          reads earlier chunks from the arena, writes this one
        send(r, ticket, t0, t1, last)   the daemon moves the chunk's pages to the decode node;
                                        the last chunk carries the recurrent state, and with
                                        free=True the daemon frees r once it landed (the decode
                                        node owns it now): no Free round trip

Without a ticket (the colocated reference) the request stays in the pool for a decode engine.
"""

from __future__ import annotations

import time

from kvd.engine.model import Models, Pending
from kvd.engine.paged import PagedKV
from kvd.engine.records import EngineConfig, FirstToken, KVApi, Request, TicketRewrite
from kvd.errors import KvdError

__all__ = ["PrefillEngine"]


class PrefillEngine:
    """Computes prompts into its daemon's arena and sends each chunk to the decode node.

    ``ticket_rewrite`` is for fault-injection tests only: it edits every ticket before use."""

    def __init__(self, kv: KVApi, paged: PagedKV, models: Models, cfg: EngineConfig, *,
                 ticket_rewrite: TicketRewrite | None = None) -> None:
        self.kv = kv
        self.paged = paged
        self.models = models
        self.cfg = cfg
        self.ticket_rewrite = ticket_rewrite
        self.send_leases = 0  # one SEND lease per Send call, taken by the daemon

    def prefill(self, req: Request, ticket: bytes | None) -> FirstToken:
        """Run ``req``'s prompt (in chunks). With a ticket: send every chunk as it is written; the
        last Send also frees the request (``free=True``; freed here when the daemon could not).
        Without (colocated): keep the request for a decode engine."""
        n = len(req.prompt)
        if n == 0:
            raise ValueError(f"request {req.rid!r} has an empty prompt")
        t_start = time.perf_counter()
        if ticket is not None and self.ticket_rewrite is not None:
            ticket = self.ticket_rewrite(ticket)
        step = self.cfg.chunk or n
        nbytes, secs, chunks = 0, 0.0, 0
        if ticket is None:
            vec = self.kv.allocate(req.rid, n)
        else:
            # The Allocate also begins the transfer: the decode daemon checks the ticket while
            # the prompt computes (the first Send collects its answer), and this daemon plans
            # the chunks' Sends meanwhile. A ticket refused on sight allocates nothing.
            try:
                vec = self.kv.allocate(req.rid, n, ticket=ticket, chunk_tokens=step if step < n else 0)  # type: ignore[call-arg]
            except KvdError as exc:
                return FirstToken(req.rid, -1, 0.0, 0, 0.0, 0, error=f"{type(exc).__name__}: {exc}", prefill_s=time.perf_counter() - t_start)
        seq = self.paged.seq(vec)
        draft = self.models.draft if self.cfg.spec_k else None
        try:
            for t0 in range(0, n, step):
                t1 = min(n, t0 + step)
                pend = Pending(t0)
                logits = self.models.target.forward(req.prompt[t0:t1], t0, seq, pend)
                pend.commit(seq)
                if draft is not None:
                    dpend = Pending(t0)
                    draft.forward(req.prompt[t0:t1], t0, seq, dpend)
                    dpend.commit(seq)
                if ticket is not None:
                    last = t1 == n
                    res = self.kv.send(req.rid, ticket, start=t0, end=t1, last=last, free=last)  # type: ignore[attr-defined]
                    self.send_leases += 1
                    nbytes, secs, chunks = nbytes + res.nbytes, secs + res.seconds, chunks + 1
                    if last and "free" not in res.phases:
                        self.kv.free(req.rid)  # the daemon could not free it with the Send (the result says so)
        except KvdError as exc:
            self.kv.free(req.rid)
            return FirstToken(req.rid, -1, 0.0, nbytes, secs, chunks, error=f"{type(exc).__name__}: {exc}",
                              prefill_s=time.perf_counter() - t_start)
        token = int(logits[-1].argmax())  # the last chunk's last position: the first generated token
        return FirstToken(req.rid, token, float(logits[-1, token]), nbytes, secs, chunks,
                          prefill_s=time.perf_counter() - t_start)
