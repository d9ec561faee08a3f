"""The connector's scheduler side: which tokens of which requests each step saves (a producer),
and which requests wait for KV from kvd and which loads are ready (a consumer, through its
:class:`~kvd.connectors.vllm_ticket_book.TicketBook`).

A producer's request is saved when the proxy sent it with a decode side's ticket
(``kv_transfer_params`` ``kvd_ticket``, ``kvd_rid``, ``kvd_tokens``): each step's
:class:`~kvd.connectors.vllm_meta.Save` covers the tokens computed since the last one, from the
first token (a prefix-cache hit's blocks too), out of the request's blocks as vLLM holds them
then (a preempted request's all new ones). The workers copy and send them
(:mod:`~kvd.connectors.vllm_saver`).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from kvd.connectors.vllm_meta import KvdMetadata, KvdWorkerMetadata, Save
from kvd.connectors.vllm_ticket_book import TicketBook

__all__ = ["Scheduler"]

log = logging.getLogger("kvd.connectors.vllm")


class Scheduler:
    """vLLM's scheduler-side hooks, by the same names. ``producer``: this vLLM sends KV; ``book``:
    a consumer's ticket book (None on a producer). ``saving``: the producer's ticketed requests by
    vLLM request id, with their blocks and how far they are saved; entries live until the
    request finishes."""

    def __init__(self, producer: bool, book: TicketBook | None) -> None:
        self.producer = producer
        self.book = book
        self.saving: dict[str, dict] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.book is not None:
            return self.book.matched(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.book is not None and num_external_tokens > 0:
            self.book.allocated(request, blocks, num_external_tokens)
            return
        params = request.kv_transfer_params or {}
        if not (self.producer and "kvd_ticket" in params) or request.request_id in self.saving:
            return
        n = len(request.prompt_token_ids or [])
        if params.get("kvd_tokens") != n:
            log.error("request %s: its prompt has %d tokens, the ticket is for %r (send the decode side's prompt[:kvd_tokens]); "
                      "not sending its KV", request.request_id, n, params.get("kvd_tokens"))
            return
        try:
            ticket = base64.b64decode(params["kvd_ticket"], validate=True)
        except (ValueError, TypeError):
            log.error("request %s: kvd_ticket is not base64; not sending its KV", request.request_id)
            return
        rid = params.get("kvd_rid")
        if not isinstance(rid, str):
            log.error("request %s: kv_transfer_params has a kvd_ticket but no kvd_rid; not sending its KV", request.request_id)
            return
        self.saving[request.request_id] = {"ticket": ticket, "rid": rid, "tokens": n, "blocks": None, "params": params}

    def build_connector_meta(self, scheduler_output: Any) -> KvdMetadata:
        meta = KvdMetadata()
        if self.saving:
            steps = scheduler_output.num_scheduled_tokens
            for r in scheduler_output.scheduled_new_reqs:
                s = self.saving.get(r.req_id)
                if s is not None:
                    s["blocks"] = tuple(list(b) for b in r.block_ids)
                    self._save_step(meta, r.req_id, s, r.num_computed_tokens, steps.get(r.req_id, 0))
            cached = scheduler_output.scheduled_cached_reqs
            resumed = getattr(cached, "resumed_req_ids", ())
            for i, req_id in enumerate(cached.req_ids):
                s = self.saving.get(req_id)
                if s is None or s["blocks"] is None:
                    continue
                new = cached.new_block_ids[i]
                if req_id in resumed:  # preempted, then scheduled again: its blocks are all new
                    s["blocks"] = tuple(list(b) for b in new) if new is not None else s["blocks"]
                elif new is not None:
                    s["blocks"] = tuple(old + list(b) for old, b in zip(s["blocks"], new))
                self._save_step(meta, req_id, s, cached.num_computed_tokens[i], steps.get(req_id, 0))
        if self.book is not None:
            meta.loads = self.book.ready_loads()
        return meta

    def _save_step(self, meta: KvdMetadata, req_id: str, s: dict, computed: int, scheduled: int) -> None:
        # From the first token not saved yet, not from vLLM's first computed one: a prefix-cache
        # hit starts a request's first step past the cached blocks, whose KV (in the request's
        # blocks all the same) must reach the decode side too.
        start, end = s.get("saved", 0), min(computed + scheduled, s["tokens"])
        if end > start and not s.get("sent"):
            last = end >= s["tokens"]
            s["sent"], s["saved"] = last, end
            meta.saves.append(Save(req_id, s["rid"], s["ticket"], s["tokens"], s["blocks"], start, end, last, max(0, computed - start)))

    def update_connector_output(self, connector_output: Any) -> None:
        if self.book is None:
            return
        if connector_output.finished_recving:
            self.book.finished(set(connector_output.finished_recving), set(getattr(connector_output, "failed_recving", None) or ()))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvdWorkerMetadata) and meta.loaded:
            self.book.loaded(meta.loaded)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        s = self.saving.pop(request.request_id, None)
        if self.book is not None:
            self.book.ended(request.request_id)
        if s is None:
            return False, None
        # The KV is in kvd already (copied in save_kv_layer / wait_for_save): vLLM may free its blocks now.
        return False, {"kvd_rid": s["params"].get("kvd_rid"), "kvd_tokens": s["tokens"]}
