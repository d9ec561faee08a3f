"""Fixtures of the tier-2 tests: real daemons on a Unix socket and loopback port 0.

* ``inproc`` -- a fresh :class:`~kvd.server.app.Daemon` in this process per test (milliseconds to
  start); its node is at hand for ``check()`` and exact stats.
* ``subproc`` -- one ``python -m kvd.cli serve`` for the whole session (a second to start); tests
  on it use fresh request ids and close their clients, which frees their requests.
* ``target`` -- each of the two, for tests that run against both.

Every daemon is stopped in a finalizer, which also asserts that its arena file left /dev/shm and
its socket file was removed.
"""

from __future__ import annotations

import os

import pytest
from daemon_kit import ARENAS, STOPPED, Target, start_inproc, start_subproc, stop_inproc, stop_subproc


@pytest.fixture(scope="session", autouse=True)
def _no_arena_left_behind():
    yield
    left = [p for p in ARENAS if p in STOPPED and os.path.exists(p)]
    assert not left, f"arena files of this session's daemons left behind: {left}"


@pytest.fixture(params=["fast", "grpc"])
def transport(request) -> str:
    """How the tests' clients reach a daemon's Unix address: every client test runs over both
    the engine socket and gRPC."""
    return request.param


@pytest.fixture
def inproc(tmp_path, transport) -> Target:
    t = start_inproc(tmp_path)
    t.transport = transport
    yield t
    stop_inproc(t)


@pytest.fixture(scope="session")
def _subproc_daemon(tmp_path_factory) -> Target:
    t = start_subproc(tmp_path_factory.mktemp("kvd-subproc"))
    yield t
    rc = stop_subproc(t)
    assert rc == 0, f"daemon exited with {rc}"
    assert not os.path.exists(f"/dev/shm/{t.region_id}"), f"arena file {t.region_id} left in /dev/shm"
    assert not os.path.exists(t.unix.removeprefix("unix:")), "socket file left behind"


@pytest.fixture
def subproc(_subproc_daemon, transport) -> Target:
    assert _subproc_daemon.proc.poll() is None, "the shared subprocess daemon died"
    _subproc_daemon.transport = transport
    yield _subproc_daemon
    _subproc_daemon.close_clients()


@pytest.fixture(params=["inproc", "subproc"])
def target(request, transport) -> Target:  # noqa: ARG001 -- transport: its parameter, known before getfixturevalue
    return request.getfixturevalue(request.param)
