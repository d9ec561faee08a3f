"""kvd: a per-node KV-cache daemon for disaggregated LLM serving.

The core (no gRPC, no Prometheus): :mod:`kvd.layout`, :mod:`kvd.arena`, :mod:`kvd.pool`.
"""

from kvd.arena import Arena, ArenaHandle, ShmArena
from kvd.errors import *  # noqa: F401,F403  (the exception tree is part of the public surface)
from kvd.errors import __all__ as _errors_all
from kvd.layout import GroupKind, GroupSpec, Layout
from kvd.pool import AllocSpec, CompactionResult, Envelope, IndexVectors, Pool
from kvd.presets import load_layout, preset

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
