"""Fixtures of the GPU tests: CUDA virtual-memory arenas that are closed when the test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def vmm_arena_factory() -> Iterator[Callable[..., object]]:
    """``make(reserved, backed=0, **kw) -> CudaVmmArena``; every arena made is closed at teardown."""
    from kvd.memory.vmm import CudaVmmArena

    made: list[CudaVmmArena] = []

    def make(reserved: int, backed: int = 0, **kw: object) -> CudaVmmArena:
        arena = CudaVmmArena(reserved, backed, **kw)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()
