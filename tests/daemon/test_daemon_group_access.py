"""``group_access``: an engine running as another user of the daemon's group can connect to the
daemon's Unix socket and map and write its arena file; without it, it can do neither (the
arena file is 0600, the socket follows the umask). The engine here is a process forked from
the test and dropped to user 65534 with the daemon's group as a supplementary group (what a
Kubernetes pod's ``fsGroup`` gives its containers); the kernel checks exactly what an engine's
connect and mmap would meet. Needs root, to change user; skipped otherwise."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable

import pytest
from daemon_kit import start_inproc, stop_inproc

OTHER_UID = 65534  # "nobody": not the daemon's user, not root
DENIED = 13  # the child's exit status when the kernel refused (EACCES)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")


def _as_other_user(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child that became OTHER_UID with this process's group as a
    supplementary group. Returns 0 (done), DENIED (PermissionError) or 1 (anything else)."""
    gid = os.getgid()
    pid = os.fork()
    if pid == 0:  # the child: only system calls from here, then _exit (no atexit, no gRPC)
        code = 1
        try:
            os.setgroups([gid])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            fn()
            code = 0
        except PermissionError:
            code = DENIED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _connect(path: str) -> Callable[[], None]:
    def go() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)

    return go


def _write(path: str, offset: int, nbytes: int) -> Callable[[], None]:
    def go() -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            with mmap.mmap(fd, offset + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                mm[offset : offset + nbytes] = b"\x07" * nbytes
        finally:
            os.close(fd)

    return go


@pytest.fixture
def sock_dir():
    # Not tmp_path: pytest's directories are 0700, which the other user could not traverse.
    d = tempfile.mkdtemp(prefix="kvd-group-", dir="/tmp")
    os.chmod(d, 0o750)  # the daemon's group may enter, others not
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(tmp_path, sock_dir: str, **kw):
    old = os.umask(0o022)  # the usual umask: group and others lose write
    try:
        return start_inproc(tmp_path, listen_unix=os.path.join(sock_dir, "kvd.sock"), **kw)
    finally:
        os.umask(old)


def _first_page(t) -> tuple[int, int]:
    """Allocate a request (as the daemon's own user) and return the arena file offset of its
    first full page and the page's size."""
    kv = t.connect(name="owner")
    vec = kv.allocate("g1", 16)
    pb = t.node.pool.layout.page_bytes(t.node.pool.layout.group("full"))
    return int(vec.full[0]) * pb, pb


def _modes(t) -> tuple[int, int]:
    return (stat.S_IMODE(os.stat(t.node.pool.arena.path).st_mode),
            stat.S_IMODE(os.stat(t.unix.removeprefix("unix:")).st_mode))


def test_group_access_lets_an_engine_of_the_group_in(sock_dir, tmp_path):
    t = _start(tmp_path, sock_dir, group_access=True)
    try:
        arena_mode, sock_mode = _modes(t)
        assert arena_mode == 0o660 and sock_mode & 0o060 == 0o060 and sock_mode & 0o007 == 0, (oct(arena_mode), oct(sock_mode))
        offset, pb = _first_page(t)
        assert _as_other_user(_connect(t.unix.removeprefix("unix:"))) == 0
        assert _as_other_user(_write(t.node.pool.arena.path, offset, 64)) == 0
        # What the other user wrote is in the daemon's arena, in the request's page.
        page = t.node.pool.page_view("full")[offset // pb]
        assert page[:64].tolist() == [7] * 64
        t.check()
    finally:
        stop_inproc(t)


def test_without_group_access_the_arena_and_socket_stay_the_daemons_users(sock_dir, tmp_path):
    t = _start(tmp_path, sock_dir)
    try:
        arena_mode, sock_mode = _modes(t)
        assert arena_mode == 0o600 and sock_mode & 0o022 == 0, (oct(arena_mode), oct(sock_mode))
        offset, pb = _first_page(t)
        before = t.node.pool.page_view("full")[offset // pb][:64].clone()
        assert _as_other_user(_connect(t.unix.removeprefix("unix:"))) == DENIED
        assert _as_other_user(_write(t.node.pool.arena.path, offset, 64)) == DENIED
        assert t.node.pool.page_view("full")[offset // pb][:64].equal(before)
        t.check()
    finally:
        stop_inproc(t)
