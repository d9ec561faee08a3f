"""A node's envelopes, built once per backing: what its tickets state and its Sends plan from.

A pool's envelopes (:meth:`kvd.pool.pool.Pool.envelopes`: one per group, the backed prefix) change
only with its backing -- ``finalize`` / ``resize``, which the node announces
(``Node.on_backing_change``) -- or with the pool itself (a layout adopted from the first engine).
:class:`Envelopes` builds them again only then, instead of once per ticket and per Send.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.records import Envelope

if TYPE_CHECKING:
    from kvd.daemon.node import Node

__all__ = ["Envelopes"]


class Envelopes:
    """``node.pool.envelopes()``, kept until the pool, its boot, its backed size or its backing
    (the node's hook) changes. Thread-safe; the list returned is shared: do not change it."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._changes = 0  # backing changes the node announced
        self._now: tuple[tuple[object, ...], list[Envelope]] | None = None
        node.on_backing_change.append(self._changed)

    def _changed(self) -> None:
        self._changes += 1

    def __call__(self) -> list[Envelope]:
        pool = self.node.pool
        key = (pool, pool.boot_id, pool.arena.backed, self._changes)
        now = self._now
        if now is None or now[0] != key:
            now = self._now = (key, pool.envelopes())
        return now[1]
