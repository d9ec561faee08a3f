"""A vLLM worker's hold on the kvd daemon beside it: the client, the arena attached, vLLM's KV
caches registered (each layer's block layout told and checked against kvd's layout) and the copy
stream. :class:`~kvd.connectors.vllm_saver.Saver` (a producer's saves and Sends) and
:class:`~kvd.connectors.vllm_loader.Loader` (a consumer's loads) copy through one :class:`Worker`.

A daemon that forgot the worker's session (it restarted, or reaped the session) is met by
:meth:`Worker.gone` before a byte is written and :meth:`Worker.renew` (a new client, the layout
proposed again, the new arena attached): the worker's ``kv``, ``att`` and ``views`` are replaced
then, so the savers and loaders read them from the worker at each use, never keep them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvd.client import Client
from kvd.connectors import vllm_blocks as vb
from kvd.connectors.vllm_layout import LayerSlot
from kvd.connectors.vllm_stats import CopyStats
from kvd.errors import InvalidArgument, KvdError, LayoutMismatch
from kvd.pool.layout import Layout

__all__ = ["RECONNECT_S", "Worker", "connect", "last_real"]

log = logging.getLogger("kvd.connectors.vllm")

#: A worker whose daemon forgot its session tries to connect again at most this often.
RECONNECT_S = 1.0


def connect(address: str, name: str, ttl: float | None) -> Client:
    """A client of the daemon at ``address``; RuntimeError saying what to set when none answers."""
    try:
        return Client.connect(address, name=name, ttl=ttl, timeout=10.0)
    except KvdError as exc:
        raise RuntimeError(
            f"KvdConnector: no kvd daemon answers at {address!r} ({type(exc).__name__}: {exc}); start `kvd serve` "
            "there first, or set kv_connector_extra_config.kvd_address to the daemon beside this vLLM"
        ) from exc


def last_real(ids: list[int], ln: str) -> int:
    """The last block of ``ids`` that is not vLLM's null block 0: where a Mamba layer keeps the state."""
    real = [b for b in ids if b != 0]
    if not real:
        raise RuntimeError(f"layer {ln}: vLLM gave the request no state block")
    return real[-1]


class Worker:
    """One vLLM worker's client of its daemon and its registered KV caches (see the module doc).

    ``kv``, ``att`` and ``views`` change on :meth:`reconnect`; everything else is set once, by
    :meth:`register_kv_caches`. ``copy_stats`` is what the worker reports to vLLM's telemetry."""

    def __init__(self, kv: Client, address: str, name: str, ttl: float | None, layout: Layout,
                 slots: dict[str, LayerSlot]) -> None:
        self.kv = kv
        self.address, self.name, self.ttl = address, name, ttl
        self.layout, self.slots, self.bs = layout, slots, layout.page_size
        self.caches: dict[str, torch.Tensor] = {}
        self.views: dict[str, list] = {}
        self.blocks: dict[str, vb.LayerBlocks] = {}
        self.layer_sets: dict[tuple[str, int], list[str]] = {}  # (kvd group, vLLM group) -> its attention layers
        self.att: Any = None
        self.copy = vb.CopyStream("cpu")
        self.copy_stats = CopyStats()
        self.renew_at = 0.0  # no reconnect before (monotonic): the last one failed
        self.probe_at = 0.0  # no KeepAlive probe before (monotonic): the last one failed (gone)
        self._on_renew: list[Callable[[], None]] = []

    def on_renew(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the session is renewed, before the new client connects: what was
        opened in the old session is gone with it."""
        self._on_renew.append(fn)

    def attach(self, kv: Client) -> Any:
        """This vLLM's layout proposed to ``kv``'s daemon, and its arena attached (the Attachment).
        A daemon started with layout_from_engine takes the layout; one with another layout refuses
        it, naming both."""
        try:
            kv.propose_layout(self.layout)
        except LayoutMismatch as exc:
            raise LayoutMismatch(
                f"KvdConnector: the kvd daemon at {self.address} refused this vLLM's layout "
                f"(kvd.connectors.vllm.layout_from_vllm): {exc}"
            ) from None
        return kv.attach()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], expect: str | None = None) -> None:
        """Attach the arena and take vLLM's KV tensors: each on the arena's device, of the
        layout's dtype, in a block layout :mod:`~kvd.connectors.vllm_blocks` knows and, where
        ``expect`` names one (the ``KVCacheLayout`` vLLM resolved), that one (InvalidArgument naming
        the layer otherwise)."""
        att = self.attach(self.kv)
        arena_dev = att.tensor.device
        blocks: dict[str, vb.LayerBlocks] = {}
        for ln, slot in self.slots.items():
            t = kv_caches.get(ln)
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"KvdConnector: layer {ln} registered {type(t).__name__}, not one KV tensor")
            if t.device != arena_dev and not (t.device.type == arena_dev.type == "cuda" and t.device.index == arena_dev.index):
                raise InvalidArgument(
                    f"KvdConnector: layer {ln} lives on {t.device}, the kvd daemon's arena on {arena_dev}: start the daemon "
                    f"beside this vLLM with {'--arena cuda --cuda-device ' + str(t.device.index) if t.is_cuda else '--arena shm'}"
                )
            if slot.group == "state":
                vb.state_bytes(t, 0)  # refuses a state block that is not one run of bytes
                continue
            g = self.layout.group(slot.group)
            if t.dtype != self.layout.torch_dtype(g):
                raise InvalidArgument(f"KvdConnector: layer {ln} is {t.dtype}, the layout says {self.layout.dtype}")
            try:
                blocks[ln] = vb.detect_layout(t, num_kv_heads=g.num_kv_heads, block_size=self.bs, head_size=g.head_dim,
                                              head_size_v=g.v_dim, expect=expect)
            except InvalidArgument as exc:
                raise InvalidArgument(f"KvdConnector: layer {ln}: {exc}") from None
        names = sorted({b.layout.name for b in blocks.values()})
        log.info("KvdConnector: vLLM KV on %s in layout %s; kvd arena on %s", arena_dev, ", ".join(names), arena_dev)
        self.caches = kv_caches
        self.blocks = blocks
        self.layer_sets = {}
        for ln, slot in self.slots.items():  # kvd layer order: one vLLM group's layers are consecutive in its kvd group
            if slot.group != "state":
                self.layer_sets.setdefault((slot.group, slot.vllm_group), []).append(ln)
        self.att = att
        self.views = att.views
        self.copy = vb.CopyStream(arena_dev)

    def reconnect(self, why: str) -> None:
        """The daemon beside this vLLM forgot this worker's session (it restarted, or reaped the
        session): a new client, the layout proposed again and the arena attached again (a restarted
        daemon's arena is a new one; the old views map memory no daemon reads). What was opened in
        the old session is gone with it (:meth:`on_renew`): a save opened there writes nothing more
        (after a reap its pages may be another request's) and its queued Send fails; a load is
        copied only from the arena its page ids index. The old views are dropped once the copy
        stream has drained. Raises (RuntimeError, KvdError) when the daemon does not answer: the
        next call tries again."""
        log.warning("KvdConnector: %s; connecting again to %s", why, self.address)
        for fn in self._on_renew:
            fn()
        kv = connect(self.address, self.name, self.ttl)
        try:
            att = self.attach(kv)
            if self.att is not None and att.tensor.device != self.att.tensor.device:
                raise InvalidArgument(f"KvdConnector: the kvd daemon at {self.address} came back with its arena on "
                                      f"{att.tensor.device}, this vLLM's KV is on {self.att.tensor.device}")
        except BaseException:
            kv.close()
            raise
        if self.copy.stream is not None:
            self.copy.stream.synchronize()  # no copy still reads or writes the old views
        old_kv, old_att = self.kv, self.att
        self.kv, self.att, self.views = kv, att, att.views
        if old_att is not None:
            old_att.close()
        old_kv.close()
        self.copy_stats.reconnects += 1
        log.warning("KvdConnector: connected again to %s (daemon boot %s)", self.address, kv.boot_id)

    def renew(self, why: str) -> bool:
        """:meth:`reconnect`, a failure logged: whether it connected. Tried at most every
        :data:`RECONNECT_S` (a daemon that does not answer must not hold every step of vLLM's
        forward for a connect timeout); meanwhile what needs the daemon fails at once."""
        now = time.monotonic()
        if now < self.renew_at:
            return False
        try:
            self.reconnect(why)
        except (RuntimeError, KvdError) as exc:
            self.renew_at = now + RECONNECT_S
            log.error("KvdConnector: cannot connect to the kvd daemon again (next try in %.0f s): %s", RECONNECT_S, exc)
            return False
        return True

    def gone(self) -> bool:
        """Whether this worker's session is gone (the daemon reaped or forgot it, and its pages may
        be other requests' by now): as the heartbeat found, or, where no call was answered for half
        the session's TTL (this process stalled and the heartbeat has not run since), as one
        KeepAlive finds now, before a byte is written. Called for every layer: the KeepAlive is
        tried at most every :data:`RECONNECT_S` (a daemon that hangs must not hold each layer of
        vLLM's forward for a call timeout)."""
        now = time.monotonic()
        if not self.kv.stale and now >= self.probe_at and self.kv.overdue:
            self.copy_stats.session_probes += 1
            try:
                self.kv.keep_alive()
            except KvdError as exc:  # SessionGone marks the client stale (it attached)
                self.probe_at = now + RECONNECT_S
                log.warning("KvdConnector: no call answered for over half the session's %.1f s TTL, and now: %s", self.kv.ttl, exc)
        return bool(self.kv.stale)

    def after_copies(self, done: torch.cuda.Event | None) -> None:
        """vLLM's stream waits for ``done`` (the copy stream's reads so far): vLLM may reuse the
        blocks a copy reads from the next step on -- a finished request's, a preempted one's.
        A wait on the device only; the host goes on."""
        if done is not None:
            torch.cuda.current_stream(self.copy.device).wait_event(done)
