"""Data-plane backends: register an arena once, write batches of blocks to a peer.

``make_backend("local" | "mooncake" | "nixl", arena_kind=...)`` returns a :class:`Backend`; see
:mod:`kvd.backends.base` for the contract and :mod:`kvd.backends.registry` for the names.
Implementations are imported when asked for and import their transport lazily, so importing
this package never needs Mooncake or NIXL."""

from __future__ import annotations

from kvd.backends.base import Backend, PeerRegion
from kvd.backends.registry import make_backend

__all__ = ["Backend", "PeerRegion", "make_backend"]
