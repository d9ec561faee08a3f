"""Shared fixtures. Names are prefixed ``kvd_`` so fixtures added later by other suites do not
collide; plain helpers (layouts, snapshots, page patterns) live in ``pool_testkit.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvd.memory.arena import ShmArena
from kvd.pool.layout import Layout
from kvd.pool.pool import Pool


@pytest.fixture
def kvd_arena_factory() -> Iterator[Callable[..., ShmArena]]:
    """``make(reserved, backed=0) -> ShmArena``; every arena made is closed (its file unlinked)
    when the test ends."""
    made: list[ShmArena] = []

    def make(reserved: int, backed: int = 0) -> ShmArena:
        arena = ShmArena(reserved, backed)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()


@pytest.fixture
def kvd_pool_factory(kvd_arena_factory: Callable[..., ShmArena]) -> Callable[..., Pool]:
    """``make(layout, reserved, backed, **pool_kwargs) -> Pool`` over a fresh shm arena.

    With ``post_capture=True`` the arena starts unbacked and the pool backs only the sink."""

    def make(layout: Layout, reserved: int, backed: int, **kwargs: object) -> Pool:
        arena = kvd_arena_factory(reserved, 0 if kwargs.get("post_capture") else backed)
        return Pool(layout, arena, **kwargs)

    return make
