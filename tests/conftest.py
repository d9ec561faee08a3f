"""Shared fixtures. Names are prefixed ``kvd_`` so fixtures added later by other suites do not
collide; plain helpers (layouts, snapshots, page patterns) live in ``pool_testkit.py``."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator

import pytest
from proc_kit import live_processes

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
def kvd_shm_dir() -> Iterator[str]:
    """A directory of this test's own on /dev/shm (the same tmpfs, so the same room), removed
    when the test ends. A test that asserts "no arena file left" lists it, not /dev/shm itself,
    where tests on the other xdist workers make and remove arenas meanwhile."""
    path = os.path.join("/dev/shm", f"test-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kvd_pool_factory(kvd_arena_factory: Callable[..., ShmArena]) -> Callable[..., Pool]:
    """``make(layout, reserved, backed, **pool_kwargs) -> Pool`` over a fresh shm arena.

    With ``post_capture=True`` the arena starts unbacked and the pool backs only the sink."""

    def make(layout: Layout, reserved: int, backed: int, **kwargs: object) -> Pool:
        arena = kvd_arena_factory(reserved, 0 if kwargs.get("post_capture") else backed)
        return Pool(layout, arena, **kwargs)

    return make


def _daemon_children() -> dict[int, str]:
    """This process's child processes running ``kvd.cli serve``: pid -> command line."""
    me = os.getpid()
    return {p.pid: p.cmd for p in live_processes() if p.ppid == me and "kvd.cli serve" in p.cmd}


@pytest.fixture(scope="session", autouse=True)
def kvd_no_daemon_outlives_the_tests() -> Iterator[None]:
    """Every ``kvd serve`` a test (or a fixture) started is stopped by the end of the session:
    one left running would outlive pytest (orphaned, holding its arena and sockets). Set up
    first, torn down last; what it finds is killed and reported as an error."""
    yield
    left = _daemon_children()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail("daemons still running when the tests ended (killed now): " + "; ".join(f"{p}: {c}" for p, c in left.items()))
