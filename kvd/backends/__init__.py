"""Data-plane backends: register an arena once, write batches of blocks to a peer.

``make_backend("local" | "mooncake" | "nixl", arena_kind=...)`` returns a :class:`Backend`; see
:mod:`kvd.backends.base` for the contract and :mod:`kvd.backends.registry` for the names.
Implementations are imported when asked for and import their transport lazily, so importing
this package never needs Mooncake or NIXL; the names below are imported on first use (PEP 562),
so :mod:`kvd.config`, which checks backend names against the registry, never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvd.backends.base import Backend, PeerRegion
    from kvd.backends.registry import make_backend

_LAZY = {"Backend": "kvd.backends.base", "PeerRegion": "kvd.backends.base", "make_backend": "kvd.backends.registry"}

__all__ = ["Backend", "PeerRegion", "make_backend"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvd.backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
