"""kvd: a per-node KV-cache daemon for disaggregated LLM serving.

The core (no gRPC, no Prometheus): :mod:`kvd.pool.layout`, :mod:`kvd.memory.arena`, :mod:`kvd.pool.pool`.

The exception tree is imported with the package; the names below it (arena, pool, layout,
records) are imported on first use (PEP 562), since they need torch: ``import kvd.config`` --
what the image's health check and the CLI's settings read -- then costs milliseconds, not the
seconds torch takes to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvd.errors import *  # noqa: F401,F403  (the exception tree is part of the public surface)
from kvd.errors import __all__ as _errors_all

if TYPE_CHECKING:
    from kvd.memory.arena import Arena, ArenaHandle, ShmArena
    from kvd.pool.layout import GroupKind, GroupSpec, Layout
    from kvd.pool.pool import Pool
    from kvd.pool.presets import load_layout, preset
    from kvd.records import AllocSpec, CompactionResult, Envelope, IndexVectors

__version__ = "0.1.0"

#: The names imported on first use, and the module each comes from.
_LAZY = {
    "Arena": "kvd.memory.arena",
    "ArenaHandle": "kvd.memory.arena",
    "ShmArena": "kvd.memory.arena",
    "GroupKind": "kvd.pool.layout",
    "GroupSpec": "kvd.pool.layout",
    "Layout": "kvd.pool.layout",
    "Pool": "kvd.pool.pool",
    "AllocSpec": "kvd.records",
    "IndexVectors": "kvd.records",
    "Envelope": "kvd.records",
    "CompactionResult": "kvd.records",
    "load_layout": "kvd.pool.presets",
    "preset": "kvd.pool.presets",
}

__all__ = [*_LAZY, *_errors_all]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
