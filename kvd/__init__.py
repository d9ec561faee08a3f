"""kvd: a per-node KV-cache daemon for disaggregated LLM serving.

The core (no gRPC, no Prometheus): :mod:`kvd.pool.layout`, :mod:`kvd.memory.arena`, :mod:`kvd.pool.pool`.
"""

from kvd.memory.arena import Arena, ArenaHandle, ShmArena
from kvd.errors import *  # noqa: F401,F403  (the exception tree is part of the public surface)
from kvd.errors import __all__ as _errors_all
from kvd.pool.layout import GroupKind, GroupSpec, Layout
from kvd.records import AllocSpec, CompactionResult, Envelope, IndexVectors
from kvd.pool.pool import Pool
from kvd.pool.presets import load_layout, preset

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "ArenaHandle",
    "ShmArena",
    "GroupKind",
    "GroupSpec",
    "Layout",
    "Pool",
    "AllocSpec",
    "IndexVectors",
    "Envelope",
    "CompactionResult",
    "load_layout",
    "preset",
    *_errors_all,
]
