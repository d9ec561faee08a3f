"""Handle passing (kvd.ipc.fdpass) and the daemon's exporter (kvd.server.handles), on the CPU.

memfds stand in for CUDA chunk fds: the bytes must be visible through the received fds, the
server must close its copies, refusals must come back as the same kvd exception, and no client
-- garbage, oversized, silent, or gone mid-request -- may stop the server."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import random
import socket
import struct
import threading
import time

import pytest
from memfd_kit import GRAN, MemfdArena, fds_settle_at, open_fds

from kvd import errors as E
from kvd.ipc.fdpass import (
    BUSY_RETRY_S,
    MAX_REQUEST,
    HandleHeader,
    HandleRequest,
    HandleServer,
    check_path,
    fetch,
    ping,
    watch,
)
from kvd.daemon.node import Node
from kvd.pool.pool import Pool
from kvd.pool.presets import preset
from kvd.server.handles import ArenaHandles

KiB = 1 << 10


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("kvd-test")
    os.write(fd, data)
    return fd


class Exporter:
    """Two memfd chunks with known bytes; exports dups of them (new fds, as export_fds does)."""

    def __init__(self) -> None:
        self.data = [bytes(range(256)) * 16, b"\xa5" * 8192]
        self.fds = [_memfd(d) for d in self.data]
        self.fail: E.KvdError | Exception | None = None
        self.calls = 0

    def __call__(self, want_fds: bool) -> tuple[HandleHeader, list[int]]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        sizes = tuple(len(d) for d in self.data)
        header = HandleHeader("kvd-memfd-test", "boot-1", sum(sizes) - 100, sizes if want_fds else (), 3)
        return header, [os.dup(fd) for fd in self.fds] if want_fds else []

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def served(tmp_path):
    exp = Exporter()
    srv = HandleServer(str(tmp_path / "h.sock"), exp, timeout=0.5).start()
    yield srv, exp
    srv.stop()
    exp.close()


def _raw(path: str, payload: bytes, *, close_after: bool = False) -> dict | None:
    """Send raw bytes; return the decoded reply header (None when the server sent nothing)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        if close_after:
            return None
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    if not buf:
        return None
    (n,) = struct.unpack(">I", buf[:4])
    return json.loads(buf[4 : 4 + n])


def _refused_as(reply: dict) -> str:
    """The class a refusal header names, after checking its code is that class's
    (:data:`kvd.errors.CODES`: the one table every transport uses)."""
    name = reply["metadata"]["kvd-error"]
    assert reply["code"] == E.CODES[getattr(E, name)], reply
    return name


def _framed(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def test_fds_arrive_and_map_the_same_bytes(served):
    srv, exp = served
    before = open_fds()
    header, fds = fetch(srv.path, session="s")
    try:
        assert header == HandleHeader("kvd-memfd-test", "boot-1", 8192 + 4096 - 100, (4096, 8192), 3)
        assert len(fds) == 2
        for fd, data in zip(fds, exp.data):
            with mmap.mmap(fd, len(data)) as mm:
                assert mm[:] == data
        with mmap.mmap(fds[1], 8192) as mm:  # shared memory: a write here is the owner's byte
            mm[10] = 0x11
        assert os.pread(exp.fds[1], 1, 10) == b"\x11"
    finally:
        for fd in fds:
            os.close(fd)
    # The server closed its copies after sending: nothing of the exchange stays open.
    assert fds_settle_at(before) == before
    assert srv.served == 1


def test_ping_answers_the_header_without_fds(served):
    srv, exp = served
    before = open_fds()
    h = ping(srv.path, token="t")
    assert h.region_id == "kvd-memfd-test" and h.sizes == () and h.generation == 3
    assert fds_settle_at(before) == before


@pytest.mark.parametrize(
    "error",
    [E.FailedPrecondition("arena has no backed bytes"), E.NotFound("session 'x' is unknown"), E.CapacityError("full", 7)],
    ids=["failed-precondition", "not-found", "capacity"],
)
def test_an_exporter_refusal_comes_back_as_the_same_class(served, error):
    srv, exp = served
    exp.fail = error
    with pytest.raises(E.KvdError) as info:
        fetch(srv.path, session="s")
    assert type(info.value) is type(error) and str(info.value) == str(error)
    assert srv.refused == 1


def test_a_bug_in_the_exporter_is_an_internal_error_and_the_server_lives_on(served):
    srv, exp = served
    exp.fail = ZeroDivisionError("oops")
    with pytest.raises(E.InternalError, match=r"handle export failed \(a bug in kvd\): ZeroDivisionError: oops"):
        fetch(srv.path)
    exp.fail = None
    h, fds = fetch(srv.path)
    for fd in fds:
        os.close(fd)
    assert len(fds) == 2


def test_authorization_is_asked_and_its_refusal_reaches_the_client(tmp_path):
    seen: list[HandleRequest] = []

    def authorize(req: HandleRequest) -> None:
        seen.append(req)
        if req.token != "secret":
            raise E.PermissionDenied("wrong peer token; configure the same peer_token on both daemons")

    exp = Exporter()
    with HandleServer(str(tmp_path / "a.sock"), exp, authorize=authorize) as srv:
        with pytest.raises(E.PermissionDenied, match="configure the same peer_token"):
            fetch(srv.path, token="guess")
        assert exp.calls == 0  # refused before anything was exported
        h, fds = fetch(srv.path, token="secret")
        for fd in fds:
            os.close(fd)
    exp.close()
    assert seen == [HandleRequest("export", "", "guess"), HandleRequest("export", "", "secret")]


@pytest.mark.parametrize(
    "payload,phrase",
    [
        (struct.pack(">I", MAX_REQUEST + 1), f"exceeds the {MAX_REQUEST:,d}-byte limit"),
        (struct.pack(">I", 5) + b"hello", "not JSON"),
        (_framed([1, 2]), "must be a JSON object"),
        (_framed({"op": "steal"}), "op 'steal' is unknown"),
        (_framed({"op": "export", "session": 5}), "must be strings"),
        (struct.pack(">I", 4000) + b"[" * 4000, "not JSON"),  # json's RecursionError: was INTERNAL
        (struct.pack(">I", 8) + b"\xff\xfe\x00\x01\x80\x81\xc0\xc1", "not JSON"),
        (_framed({"op": "export", "session": "s" * 257}), "session is 257 bytes, over the limit of 256"),
        (_framed({"op": "x" * 3000}), "is unknown"),
    ],
    ids=["oversized", "not-json", "not-an-object", "unknown-op", "bad-types", "deep-nesting", "not-utf8", "long-session",
         "long-op"],
)
def test_garbage_requests_are_refused_with_invalid_argument(served, payload, phrase):
    srv, exp = served
    reply = _raw(srv.path, payload)
    assert reply is not None and reply["ok"] is False and _refused_as(reply) == "InvalidArgument", reply
    assert phrase in reply["message"]
    assert exp.calls == 0
    h, fds = fetch(srv.path)  # the server is still there
    for fd in fds:
        os.close(fd)


def test_random_bytes_get_a_clean_refusal_and_the_server_serves_the_next_caller(served):
    """Whatever arrives, the handle socket answers a refusal header (never INTERNAL: a client's
    bytes are never a bug in kvd) or, for a length it cannot follow, closes; the next caller is
    served. Messages quote a bounded part of what came."""
    srv, exp = served
    rng = random.Random(13)
    for i in range(60):
        body = rng.randbytes(rng.randrange(1, 200))
        # Framed junk, or four bytes of junk that are an impossible length (answered unread).
        blob = struct.pack(">I", len(body)) + body if i % 2 else bytes([rng.randrange(1, 256)]) + body[:3].ljust(3, b"\0")
        reply = _raw(srv.path, blob)
        assert reply is not None and reply["ok"] is False and _refused_as(reply) == "InvalidArgument", (blob, reply)
        assert len(reply["message"]) < 400, reply["message"]
    assert exp.calls == 0
    h, fds = fetch(srv.path)
    for fd in fds:
        os.close(fd)


def test_clients_that_vanish_or_stall_do_not_stop_the_server(served):
    srv, exp = served
    _raw(srv.path, struct.pack(">I", 100) + b'{"op"', close_after=True)  # gone mid-request
    stalled = socket.socket(socket.AF_UNIX)
    stalled.connect(srv.path)
    stalled.sendall(struct.pack(">I", 10))  # ... and never sends the rest
    h, fds = fetch(srv.path)  # the server still serves
    for fd in fds:
        os.close(fd)
    deadline = time.monotonic() + 3
    while srv.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.dropped == 2  # the stalled one timed out (0.5 s), the other one left
    assert stalled.recv(1) == b""  # the server hung up on it
    stalled.close()


def test_a_stalled_client_does_not_hold_up_the_others(tmp_path):
    exp = Exporter()
    # The server would wait 30 s for the stalled client's request: a server that served one
    # client at a time could not answer the fetch below within its 5 s (it would raise).
    srv = HandleServer(str(tmp_path / "s.sock"), exp, timeout=30).start()
    stalled = socket.socket(socket.AF_UNIX)
    try:
        stalled.connect(srv.path)
        stalled.sendall(struct.pack(">I", 10))  # ... and never sends the rest
        h, fds = fetch(srv.path, timeout=5)
        for fd in fds:
            os.close(fd)
        assert h.region_id == "kvd-memfd-test"
    finally:
        stalled.close()
        srv.stop()
        exp.close()


def test_stop_unlinks_the_socket_and_a_client_then_gets_unavailable(tmp_path):
    exp = Exporter()
    srv = HandleServer(str(tmp_path / "s.sock"), exp).start()
    assert os.path.exists(srv.path)
    srv.stop()
    srv.stop()  # idempotent
    exp.close()
    assert not os.path.exists(srv.path)
    with pytest.raises(E.Unavailable, match="no handle server at"):
        fetch(srv.path)
    with pytest.raises(E.Unavailable, match="no handle server at"):
        ping(str(tmp_path / "never.sock"))


def test_a_stale_socket_is_replaced_and_a_live_one_refused(tmp_path):
    path = str(tmp_path / "x.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a killed daemon leaves
    exp = Exporter()
    with HandleServer(path, exp) as srv:
        with pytest.raises(E.Unavailable, match="another process serves handles on"):
            HandleServer(path, exp).start()
        assert ping(srv.path).region_id == "kvd-memfd-test"
    (tmp_path / "file").write_text("")
    with pytest.raises(E.InvalidArgument, match="exists and is not a socket"):
        HandleServer(str(tmp_path / "file"), exp).start()
    exp.close()


def test_paths_that_cannot_be_sockets_are_refused():
    with pytest.raises(E.InvalidArgument, match="Unix sockets allow 107"):
        check_path("/tmp/" + "x" * 120)
    with pytest.raises(E.InvalidArgument, match="empty path"):
        check_path("")


def test_a_busy_server_says_so(tmp_path):
    gate, inside = threading.Event(), threading.Event()

    def slow(want: bool) -> tuple[HandleHeader, list[int]]:
        inside.set()
        gate.wait(5)
        return HandleHeader("r", "b", 0, (), 0), []

    with HandleServer(str(tmp_path / "b.sock"), slow, max_clients=1) as srv:
        t = threading.Thread(target=lambda: ping(srv.path))
        t.start()
        assert inside.wait(5), "the first ping never reached the server"  # it holds the only slot
        with pytest.raises(E.Unavailable, match="is busy; retry") as busy:
            ping(srv.path, timeout=0.3)  # tried again until its timeout, then refused
        assert busy.value.retry_after_s == BUSY_RETRY_S, "a busy refusal says when to try again (the daemon is up)"
        threading.Timer(0.2, gate.set).start()
        assert ping(srv.path, timeout=5).region_id == "r"  # the slot freed while it retried
        t.join()


def test_a_connection_no_thread_can_serve_is_refused_busy_and_the_next_is_served(tmp_path, monkeypatch, caplog):
    """At the daemon's thread limit the connection's thread cannot start: it is refused as a busy
    server is (Unavailable with the retry hint; the client asks again), its slot is given back,
    the log names the limit, and the server serves the next ask and stops cleanly (no thread
    left in its list that never started)."""
    import logging

    import proc_kit
    from kvd.ipc import fdpass

    exp = Exporter()
    try:
        with HandleServer(str(tmp_path / "t.sock"), exp, max_clients=1) as srv:  # one slot: a slot kept is seen at once
            failures = proc_kit.failing_thread_starts(monkeypatch, fdpass)
            with caplog.at_level(logging.ERROR, "kvd.ipc.fdpass"):
                assert ping(srv.path, timeout=5).region_id == "kvd-memfd-test"  # refused once, asked again
            assert not failures
            assert "could not start a thread" in caplog.text
            assert ping(srv.path, timeout=5).region_id == "kvd-memfd-test"
            with srv._lock:
                assert all(w.ident is not None for w in srv._workers), "a thread that never started is waited for at stop"
    finally:
        exp.close()


# ---- the daemon's exporter ---------------------------------------------------------------------


@pytest.fixture
def node():
    arena = MemfdArena(4 << 20, (1 << 20) + 300)
    n = Node(Pool(preset("tiny-hybrid"), arena))
    yield n
    arena.close()


def test_daemon_exports_the_backed_chunks_to_sessions_and_peers(node, tmp_path):
    ah = ArenaHandles(node, token="tok")
    sid = node.open_session("engine").session_id
    arena = node.pool.arena
    arena.tensor()[:300] = 7
    with HandleServer(str(tmp_path / "d.sock"), ah.export, authorize=ah.authorize) as srv:
        for creds in (dict(session=sid), dict(token="tok")):
            h, fds = fetch(srv.path, **creds)
            try:
                assert (h.region_id, h.boot_id, h.backed, h.sizes) == (arena.region_id, node.pool.boot_id, arena.backed, (arena.chunks[0][1],))
                assert h.device == -1 and h.gpu_uuid == "" and h.generation == 0
                with mmap.mmap(fds[0], h.sizes[0]) as mm:
                    assert mm[:300] == b"\x07" * 300
            finally:
                for fd in fds:
                    os.close(fd)
        with pytest.raises(E.NotFound, match="unknown or expired"):
            fetch(srv.path, session="not-a-session")
        with pytest.raises(E.PermissionDenied, match="configure the same peer_token on both daemons"):
            fetch(srv.path, token="wrong")
        with pytest.raises(E.PermissionDenied):
            ping(srv.path)  # a peer without the token learns nothing either
        ah.backing_changed()
        assert ping(srv.path, token="tok").generation == 1


def test_without_a_peer_token_peers_are_allowed(node, tmp_path):
    ah = ArenaHandles(node, token=None)
    with HandleServer(str(tmp_path / "d.sock"), ah.export, authorize=ah.authorize) as srv:
        h, fds = fetch(srv.path)
        for fd in fds:
            os.close(fd)
        assert h.backed == node.pool.arena.backed


class _Straddling(MemfdArena):
    """Reports (and exports) one more chunk past the backed prefix than it has."""

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return [*super().chunks, (self._mapped, GRAN)]

    def export_fds(self) -> list[tuple[int, int]]:
        return [*super().export_fds(), (os.dup(self._fd), GRAN)]


def test_only_chunks_covering_the_backed_prefix_are_exported(tmp_path):
    arena = _Straddling(4 << 20, 1 << 20)
    n = Node(Pool(preset("tiny-hybrid"), arena))
    ah = ArenaHandles(n)
    before = open_fds()
    h, fds = ah.export(True)
    assert h.sizes == (1 << 20,) and len(fds) == 1  # the chunk past `backed` stayed home...
    os.close(fds[0])
    assert fds_settle_at(before) == before  # ... and its exported fd was closed
    arena.close()


def test_an_arena_with_nothing_backed_has_nothing_to_share():
    arena = MemfdArena(4 << 20, 1 << 20)
    n = Node(Pool(preset("tiny-hybrid"), arena))
    arena.set_backed(0)  # as if nothing were backed (the pool never does this by itself)
    with pytest.raises(E.FailedPrecondition, match="no backed bytes to share yet; finalize the pool first"):
        ArenaHandles(n).export(True)
    arena.close()


# ---- watches -----------------------------------------------------------------------------------


def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_watch_answers_the_header_and_stays_quiet_without_a_slot(tmp_path):
    exp = Exporter()
    srv = HandleServer(str(tmp_path / "h.sock"), exp, timeout=0.5, max_clients=1).start()
    try:
        watches = [watch(srv.path) for _ in range(3)]  # more watches than worker slots
        assert all(w.header.region_id == "kvd-memfd-test" and w.header.sizes == () for w in watches)
        _until(lambda: srv.watching == 3)  # kept just after each reply went out
        assert srv.watching == 3 and all(w.quiet() for w in watches)
        assert ping(srv.path).generation == 3  # the one worker slot is free
        got = fetch(srv.path)
        for fd in got.fds:
            os.close(fd)
        assert all(w.quiet() for w in watches)
        watches[0].close()
        _until(lambda: srv.watching == 2)  # the accept loop reaps it
        assert srv.watching == 2
        srv.notify()  # the backing changed: every watcher hears of it
        assert not any(w.quiet() for w in watches[1:])
    finally:
        srv.stop()
        exp.close()


def test_a_backing_change_while_a_watch_is_answered_still_reaches_it(tmp_path):
    """The notify that lands after a watch's header went out but before the server kept the watch
    (a loaded host: the watcher already holds the header) must not be lost: the watcher would
    trust a mapping of the old generation."""

    class Changing(Exporter):
        generation = 3

        def __call__(self, want_fds: bool) -> tuple[HandleHeader, list[int]]:
            h, fds = super().__call__(want_fds)
            return dataclasses.replace(h, generation=self.generation), fds

    exp = Changing()
    srv = HandleServer(str(tmp_path / "h.sock"), exp, timeout=0.5).start()
    keep = srv._keep_watch

    changer: list[threading.Thread] = []

    def late_keep(conn):  # the daemon's finalize/resize (another thread) runs between the reply and the keep
        def change():
            exp.generation += 1
            srv.notify()

        changer.append(threading.Thread(target=change))
        changer[0].start()
        changer[0].join(0.2)  # notify waits for the header and the keep to be one step
        return keep(conn)

    srv._keep_watch = late_keep
    try:
        try:
            w = watch(srv.path)
        except E.Unavailable as exc:  # told while it opened: it pings and maps again, as on any refusal
            assert "past its watch reply" in str(exc)
        else:
            assert w.header.generation == 3
            _until(lambda: not w.quiet(), 2.0)
            assert not w.quiet(), "the watcher was not told of the change it missed"
            w.close()
    finally:
        for t in changer:
            t.join(2.0)
        srv.stop()
        exp.close()


def test_stop_closes_every_watch(tmp_path):
    exp = Exporter()
    srv = HandleServer(str(tmp_path / "h.sock"), exp, timeout=0.5).start()
    w = watch(srv.path)
    assert w.quiet()
    srv.stop()
    assert not w.quiet() and srv.watching == 0
    assert not w.quiet()  # stays spent
    w.close()
    exp.close()


_SERVE = """
import os, sys, time
from kvd.ipc.fdpass import HandleHeader, HandleServer
srv = HandleServer(sys.argv[1], lambda want: (HandleHeader("kvd-child", "b", 0, (), 1), [])).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_owner_is_seen_by_the_watch_within_one_check(tmp_path):
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "child.sock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _SERVE, path], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        w = watch(path)
        assert w.header.region_id == "kvd-child" and w.quiet()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert not w.quiet()  # the kernel closed the dead owner's end
        with pytest.raises(E.Unavailable):
            ping(path)
        w.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def test_an_unknown_op_still_names_watch(served):
    srv, _ = served
    body = json.dumps({"op": "nope"}).encode()
    reply = _raw(srv.path, struct.pack(">I", len(body)) + body)
    assert _refused_as(reply) == "InvalidArgument" and "watch" in reply["message"]


@pytest.mark.parametrize("group", [False, True])
def test_the_handle_socket_is_group_writable_only_when_asked(tmp_path, group):
    """``group_access``: an engine of another user in the daemon's group must be able to connect
    (connecting needs write access to the socket file); never anyone else."""
    import stat

    exp = Exporter()
    old = os.umask(0o022)
    try:
        srv = HandleServer(str(tmp_path / "g.sock"), exp, group=group).start()
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(srv.path).st_mode)
        assert (mode & 0o060 == 0o060) if group else (mode & 0o020 == 0), oct(mode)
        assert mode & 0o002 == 0, oct(mode)  # others never write
    finally:
        srv.stop()
        exp.close()
