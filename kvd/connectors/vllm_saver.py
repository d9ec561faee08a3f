"""A producer (prefill) worker's saves: each ticketed request opened in kvd, its KV written into
its kvd pages as vLLM computes it, and sent once its last chunk is saved.

Per step (the step's metadata lists its :class:`~kvd.connectors.vllm_meta.Save` s):

1. open: the step's new requests allocated and their transfers begun, together in one Allocate
   (the decode daemon checks each ticket while the prompt computes), on an opener thread from
   the step's first hook (:meth:`Saver.handle_preemptions`), joined before anything reads what it
   opened (:meth:`Saver.opened`); a refused batch falls back to a call each, so that only the
   request at fault fails;
2. write: :meth:`Saver.save_kv_layer` copies each attention layer's new tokens on the worker's
   copy stream, after vLLM's write of that layer; :meth:`Saver.wait_for_save` copies Mamba state
   slots once the forward is done;
3. send: a request's last chunk queues a ``Send(last, free)`` for the sender thread, which waits
   for the step's copy event first (vLLM frees its blocks at once; its stream waits for the
   copies' reads, never the host).

A request vLLM ended before its last chunk (:meth:`Saver.abandon`) has its transfer aborted (the
receiver told at once) and its kvd request freed. A session the daemon forgot is renewed before
a byte is written (:meth:`~kvd.connectors.vllm_worker.Worker.gone`); what was opened in it is
forgotten, and those requests send nothing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvd.connectors import vllm_blocks as vb
from kvd.connectors.vllm_meta import Save
from kvd.connectors.vllm_worker import Worker, last_real
from kvd.errors import AlreadyExists, KvdError, SessionGone

__all__ = ["HOLD_SEND_ENV", "Saver"]

log = logging.getLogger("kvd.connectors.vllm")

#: test-only: while the file this names exists, the prefill sender holds each Send (after begin_send:
#: the transfer is open at the decode daemon), so a test can kill the prefill vLLM mid-transfer
HOLD_SEND_ENV = "KVDCONN_TEST_HOLD_FILE"


class Saver:
    """The saves of one worker ``w`` (``producer``: whether its vLLM sends KV at all). Its sender
    and opener threads start with the first request that needs them; :meth:`close` ends them.
    Mutates ``w.copy_stats``."""

    def __init__(self, w: Worker, producer: bool) -> None:
        self.w = w
        self.producer = producer
        self.vecs: dict[str, dict[str, Any]] = {}  # by vLLM request: its open kvd request (rid, page ids, state slot)
        self.queued: set[str] = set()  # requests whose last chunk is saved, handed to the sender thread
        self.bad_saves: set[str] = set()  # requests whose transfer could not open: they send nothing
        self.sends: queue.Queue = queue.Queue()
        self.sender: threading.Thread | None = None
        self.opener: ThreadPoolExecutor | None = None  # opens a step's new requests (handle_preemptions)
        self.opening: Future | None = None  # ... this step's, until the forward thread joins it (opened)
        self.slots_meta: object = None  # the step whose slots step_slots holds
        self.step_slots: dict[tuple[str, int], vb.DeviceSlots] = {}
        w.on_renew(self._forget)

    def _forget(self) -> None:
        """The session is being renewed: what was opened in it writes and sends nothing more."""
        self.bad_saves.update(self.vecs)
        self.vecs.clear()
        self.slots_meta, self.step_slots = None, {}

    def handle_preemptions(self, meta: Any) -> None:
        """The first call of each step, with its metadata, before vLLM prepares the step's
        inputs: the step's new requests are opened here, on the opener thread (each allocated and
        its transfer begun, as :meth:`_open_step` and :meth:`_open` do), so that the Allocate's
        round trip overlaps that preparation and the first layers' compute rather than holding
        the forward at its first save. Every other entry point of the worker joins that work
        first (:meth:`opened`); a vLLM that never calls this leaves the opening to the first
        save."""
        saves = getattr(meta, "saves", ())
        if not self.producer or self.opening is not None or not self._new(saves):
            return
        if self.opener is None:
            self.opener = ThreadPoolExecutor(1, thread_name_prefix="kvd-opener")
        self.opening = self.opener.submit(self._open_all, saves)

    def _open_all(self, saves: Sequence[Save]) -> None:
        """The opener thread: ``saves``' requests opened, new ones together where there are several."""
        if self.w.gone():  # its pages are not ours to write: a new session first, as save_kv_layer does
            self.w.renew("this worker's session is gone")
        self._open_step(saves)
        for sv in saves:
            self._open(sv)

    def opened(self) -> None:
        """Wait for the opener's work of this step, if any (:meth:`handle_preemptions`): the
        forward thread reads ``vecs`` and the client only after it. What it raised is raised here,
        where the forward would have met it."""
        f, self.opening = self.opening, None
        if f is not None:
            f.result()

    def save_kv_layer(self, layer_name: str, step_meta: Callable[[], Any]) -> None:
        """Copy ``layer_name``'s KV of the step's saves (``step_meta()``: the step's metadata, asked
        only for a layer that saves) into their kvd pages, after vLLM's write of the layer on its
        stream."""
        if self.opening is not None:
            self.opened()
        w = self.w
        slot = w.slots.get(layer_name)
        if slot is None or slot.group == "state":
            return  # state slots are copied once the step's forward is done (wait_for_save)
        meta = step_meta()
        saves = getattr(meta, "saves", ())
        if saves and w.gone():  # its pages are not ours to write
            w.renew("this worker's session is gone")
        if self.slots_meta is not meta:  # a new step: its requests' slots, once per vLLM group
            self.slots_meta, self.step_slots = meta, {}
            self._open_step(saves)
        for sv in saves:
            vec = self._open(sv)
            if vec is None:
                continue
            view, lb = w.views[slot.group][slot.layer_index], w.blocks[layer_name]
            t0 = time.perf_counter()
            with w.copy.after_current():  # after this layer's KV write on vLLM's stream
                key = (sv.req_id, slot.vllm_group)
                at = self.step_slots.get(key)
                if at is None:
                    pages = vec["full"] if slot.group == "full" else vec["swa"]
                    at = self.step_slots[key] = w.copy.slots(
                        vb.token_slots(sv.block_ids[slot.vllm_group], sv.start, sv.end, w.bs, pages, 0, what=f"layer {layer_name}"),
                        lb)
                w.copy_stats.save_bytes += vb.save_layer(lb, at, view)
            w.copy_stats.save_s += time.perf_counter() - t0  # on CUDA: the time to issue the copies
            if log.isEnabledFor(logging.DEBUG):  # a checksum: it waits for the device
                log.debug("save %s %s [%d, %d): %d tokens", sv.req_id, layer_name, sv.start, sv.end, at.tokens)

    def wait_for_save(self, meta: Any) -> None:
        """The end of the step's forward: state slots copied, and each request whose last chunk
        this step saved queued for its Send."""
        self.opened()
        w = self.w
        saves = getattr(meta, "saves", ())
        if saves and w.gone():
            w.renew("this worker's session is gone")
        self._open_step(saves)  # a model of state slots only opens its requests here
        waited = False
        for sv in saves:
            w.copy_stats.cached_tokens += sv.cached if sv.req_id in self.vecs else 0
            if not sv.last:
                continue
            if sv.req_id in self.bad_saves:
                self.bad_saves.discard(sv.req_id)
                continue
            v = self._open(sv)
            if v is None:
                continue
            with w.copy.after_current():
                for ln, slot in w.slots.items():
                    if slot.group == "state":
                        t0 = time.perf_counter()
                        dst = w.views["state"][slot.layer_index].k[v["state"]]
                        dst.copy_(vb.state_bytes(w.caches[ln], last_real(sv.block_ids[slot.vllm_group], ln)), non_blocking=True)
                        w.copy_stats.save_s += time.perf_counter() - t0
                        w.copy_stats.save_bytes += dst.numel()
                done = w.copy.record()  # after every copy of this step (the chunks' too)
            w.after_copies(done)
            waited = True
            if self.sender is None:
                self.sender = threading.Thread(target=self._send_loop, name="kvd-sender", daemon=True)
                self.sender.start()
            self.queued.add(sv.req_id)
            self.sends.put((sv, done))
        if saves and not waited:
            # Chunks only: vLLM frees a preempted request's blocks and may write them from the next
            # step on, so its stream waits for this step's reads, as for a request's last chunk.
            w.after_copies(w.copy.record())

    def _open_step(self, saves: Sequence[Save]) -> None:
        """The step's new requests opened in one Allocate (each allocated and its transfer begun),
        not one call each on the forward thread. All or nothing: where the daemon refuses the
        batch (one bad ticket, no room for all), :meth:`_open` opens each alone, so that only
        the request at fault fails."""
        new = self._new(saves)
        if len(new) < 2:
            return
        w = self.w
        specs, tickets = [(sv.rid, sv.tokens) for sv in new], [sv.ticket for sv in new]
        try:
            try:
                vecs = w.kv.allocate_many(specs, tickets=tickets)
            except SessionGone:  # the call ran nowhere: once more on a new session, if one opens
                if not w.renew("the daemon forgot this worker's session"):
                    raise
                vecs = w.kv.allocate_many(specs, tickets=tickets)
        except KvdError as exc:
            w.copy_stats.batches_refused += 1
            log.warning("kvd: the step's %d new requests were refused together (%s); opening each alone", len(new), exc)
            return
        w.copy_stats.opens += 1
        w.copy_stats.opened += len(new)
        for sv, vec in zip(new, vecs):
            self.vecs[sv.req_id] = {"rid": sv.rid, "full": vec.full.tolist(), "swa": vec.swa.tolist(), "state": vec.state}

    def _new(self, saves: Sequence[Save]) -> list[Save]:
        """The saves whose requests are not open yet and have not failed to open."""
        return [sv for sv in saves if sv.req_id not in self.vecs and sv.req_id not in self.bad_saves]

    def _open(self, sv: Save) -> dict | None:
        """The producer's kvd request for ``sv`` (allocated, transfer opened), or None if that failed.

        A refused open leaves nothing to free (an Allocate is all or nothing). One refused because
        the kvd request exists already is either another vLLM request's here with the same ticket
        (a client's retry while the first still computes: that one goes on, untouched, and this
        one sends nothing) or this worker's own, opened by a step's Allocate whose reply was lost
        (:meth:`_open_step`: it carries on with it)."""
        v = self.vecs.get(sv.req_id)
        if v is None and sv.req_id not in self.bad_saves:
            w = self.w
            try:
                # allocated and the transfer begun in one call: the decode daemon checks the
                # ticket while the prompt computes, and the first Send collects its answer
                try:
                    vec = w.kv.allocate(sv.rid, sv.tokens, ticket=sv.ticket)
                except SessionGone:  # the call ran nowhere: once more on a new session, if one opens
                    if not w.renew("the daemon forgot this worker's session"):
                        raise
                    vec = w.kv.allocate(sv.rid, sv.tokens, ticket=sv.ticket)
                except AlreadyExists:
                    if any(o["rid"] == sv.rid for o in self.vecs.values()):
                        raise  # another vLLM request's, here: not ours to write, nor to free
                    vec = w.kv.vectors(sv.rid)  # this session's (else PermissionDenied): a lost reply's
                    w.copy_stats.adopted += 1
                v = {"rid": sv.rid, "full": vec.full.tolist(), "swa": vec.swa.tolist(), "state": vec.state}
                self.vecs[sv.req_id] = v
                w.copy_stats.opens += 1
                w.copy_stats.opened += 1
            except KvdError as exc:
                log.error("kvd: cannot open the transfer of request %s: %s", sv.req_id, exc)
                self.bad_saves.add(sv.req_id)
                return None
        return v

    def _send_loop(self) -> None:
        hold = os.environ.get(HOLD_SEND_ENV)
        w = self.w
        while (item := self.sends.get()) is not None:
            sv, done = item
            while hold and os.path.exists(hold):
                time.sleep(0.05)
            try:
                if done is not None:
                    done.synchronize()  # this thread, not the forward: the pages hold the KV before the daemon reads them
                # the daemon frees the request once it is sent: no Free call
                res = w.kv.send(sv.rid, sv.ticket, start=0, end=sv.tokens, last=True, free=True)
                log.debug("kvd: sent %s: %d bytes in %.4f s", sv.req_id, res.nbytes, res.seconds)
                w.copy_stats.send_bytes += res.nbytes
                w.copy_stats.send_s += res.seconds
                w.copy_stats.sends += 1
                freed = "free" in res.phases
            except KvdError as exc:
                log.error("kvd: sending request %s failed: %s", sv.req_id, exc)
                freed = False
                try:
                    w.kv.abort(sv.rid, f"the prefill vLLM's send failed: {exc}")
                except KvdError:
                    pass
            self._drop(sv.req_id, sv.rid, freed=freed)

    def _drop(self, req_id: str, rid: str, *, freed: bool = False) -> None:
        """Forget ``req_id``'s kvd request and free it, unless its Send freed it already."""
        self.vecs.pop(req_id, None)
        self.queued.discard(req_id)  # after the pop: abandon never sees it open and not queued
        if freed:
            return
        try:
            self.w.kv.free(rid)
        except KvdError as exc:
            log.debug("free %s: %s", rid, exc)

    def abandon(self, finished: set[str]) -> None:
        """What vLLM ended before its last chunk was saved (aborted: a client gone, a deadline)
        has no Send coming. Each opened kvd request among them is aborted (its receiver told at
        once, with the reason) and freed, instead of holding its pages, and the receiver's, for
        as long as this worker's session lives."""
        for req_id in finished:
            self.bad_saves.discard(req_id)
            v = self.vecs.get(req_id)
            if v is None or req_id in self.queued:
                continue
            log.info("kvd: request %s ended before its prompt was computed: its transfer is aborted", req_id)
            try:
                self.w.kv.abort(v["rid"], "the prefill vLLM ended the request before its prompt was computed (aborted)")
            except KvdError as exc:
                log.debug("abort %s: %s", v["rid"], exc)
            self._drop(req_id, v["rid"])
            self.w.copy_stats.abandoned += 1

    def close(self) -> None:
        """End the opener (its work done) and the sender (the Sends queued sent first, 30 s at most)."""
        if self.opener is not None:
            self.opener.shutdown(wait=True)
        if self.sender is not None:
            self.sends.put(None)
            self.sender.join(timeout=30)

