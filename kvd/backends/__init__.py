"""Data-plane backends: register an arena once, write batches of blocks to a peer.

``make_backend("local" | "mooncake")`` returns a :class:`Backend`; see :mod:`kvd.backends.base`
for the contract. Implementations import their transport lazily, so importing this package
never needs Mooncake."""

from __future__ import annotations

from kvd.backends.base import INSTALL_HINT, Backend, PeerRegion, make_backend

__all__ = ["Backend", "PeerRegion", "make_backend", "INSTALL_HINT"]
