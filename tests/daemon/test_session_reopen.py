"""A client whose daemon forgot its session -- the daemon restarted (a sidecar restart, a rollout)
or reaped the session after a TTL without a call -- opens a new one by itself: the call that
met the loss raises SessionGone (a NotFound: what the old session held is gone), and the next
call runs on the new session, over the same transport. Before, every later call was refused
until the engine made a new client. A client that attached the arena is the exception: it opens
no session and keeps refusing (its engine's views use the old session's pages)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import grpc
import proc_kit
import pytest
from daemon_kit import REPO, expect, rid, start_inproc, stop_inproc, wait_for

from kvd import errors as E
from kvd.client import AsyncClient, Client, TransferState

TRANSPORTS = ("grpc", "fast")


@contextlib.contextmanager
def _across_a_restart(tmp_path, name: str, ttl: float, transport: str = "fast") -> Iterator[tuple[Client, Callable[[], object]]]:
    """A client of a daemon, and ``restart()``: stop that daemon and start another at the same
    paths (a new boot), returned. The client is closed first, then whichever daemon runs."""
    live = [start_inproc(tmp_path, backend="local")]
    c = Client.connect(live[0].unix, name=name, ttl=ttl, transport=transport)

    def restart() -> object:
        stop_inproc(live.pop())
        live.append(start_inproc(tmp_path, backend="local"))
        return live[0]

    try:
        yield c, restart
    finally:
        c.close()
        if live:
            stop_inproc(live[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_daemon_restarted_under_a_client_gets_a_new_session(tmp_path, transport):
    with _across_a_restart(tmp_path, "engine-0", 30.0, transport) as (c, restart):
        old, kept = c.session_id, rid("kept")
        c.allocate(kept, 16)
        t2 = restart()
        first = rid("first")
        with expect(E.SessionGone, grpc.StatusCode.NOT_FOUND, "unknown or expired") as info:
            c.allocate(first, 16)
        assert isinstance(info.value, E.NotFound)  # code that knows only NotFound still reads it
        assert c.reopened == 1 and c.session_id != old and c.transport == transport
        with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, first):
            c.vectors(first)  # the call that met the loss ran nowhere
        assert c.allocate(first, 16).tokens == 16  # the next call runs on the new session
        with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, kept) as gone:
            c.vectors(kept)  # the old session's requests went with the old daemon
        assert not isinstance(gone.value, E.SessionGone)
        assert t2.node.touch(c.session_id).name == "engine-0"  # the same name, on the new daemon
        _, lease = c.allocate_recv(rid("bell"), 16)
        if transport == "fast":  # the new session maps the new daemon's board
            assert c.doorbell(lease.rid) is TransferState.WAITING
        c.free(first)
        t2.node.check()
        assert c.reopened == 1


def test_the_heartbeat_reopens_before_any_call_meets_the_loss(tmp_path):
    """A client that makes no call while its daemon restarts finds a new session ready: its
    heartbeat (every TTL/3) met the loss first, so no engine call fails."""
    with _across_a_restart(tmp_path, "quiet", 0.6) as (c, restart):
        restart()
        wait_for(lambda: c.reopened == 1, 5.0, "the heartbeat to open a new session")
        assert c.allocate(rid("after"), 16).tokens == 16
        assert c.reopened == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_session_reaped_for_silence_is_reopened_and_its_old_connections_dropped(tmp_path, transport, monkeypatch):
    """An engine stalled past its session's TTL (no heartbeat: a stuck process) is reaped, its
    requests freed; once it moves again its next call opens a new session. The engine socket's
    pooled connections acted for the old session: none is used again."""
    monkeypatch.setattr(Client, "_heartbeat", lambda self: None)  # the stalled engine
    t = start_inproc(tmp_path, backend="local")
    c = Client.connect(t.unix, name="stalled", ttl=0.5, transport=transport)
    try:
        old, r = c.session_id, rid("reaped")
        c.allocate(r, 16)
        expired = t.node.stats().sessions_expired_total
        wait_for(lambda: t.node.stats().sessions_expired_total > expired, 5.0, "the daemon to reap the silent session")
        assert t.node.stats().pool.requests_live == 0
        with expect(E.SessionGone, grpc.StatusCode.NOT_FOUND, old):
            c.vectors(r)
        assert c.reopened == 1 and c.session_id != old
        if transport == "fast":
            assert all(sid == c.session_id for _, sid in c._fast._free)
        with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, r):
            c.vectors(r)
        assert c.allocate(r, 16).tokens == 16
        t.node.check()
    finally:
        c.close()
        stop_inproc(t)


def test_closing_a_client_whose_session_is_gone_opens_none(tmp_path):
    with _across_a_restart(tmp_path, "closing", 30.0) as (c, restart):
        t2 = restart()
        c.close()  # its CloseSession meets the loss: nothing to reopen for
        assert c.reopened == 0 and t2.node.stats().sessions_live == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_asyncio_client_reopens_too(tmp_path, transport):
    t = start_inproc(tmp_path, backend="local")
    holder: list = []

    async def go() -> None:
        c = await AsyncClient.connect(t.unix, name="async-engine", ttl=30.0, transport=transport)
        try:
            old = c.session_id
            stop_inproc(t)
            holder.append(start_inproc(tmp_path, backend="local"))
            with expect(E.SessionGone, grpc.StatusCode.NOT_FOUND, "unknown or expired"):
                await c.allocate(rid("first"), 16)
            assert c.reopened == 1 and c.session_id != old
            assert (await c.allocate(rid("second"), 16)).tokens == 16
        finally:
            await c.close()

    try:
        asyncio.run(go())
    finally:
        stop_inproc(holder[0] if holder else t)


def test_a_call_while_the_session_is_being_opened_again_hears_it_is_gone(tmp_path):
    """Between the engine socket forgetting the old session and the new one's OpenSession reply,
    another thread's call is not sent sessionless (which the daemon would refuse as a call before
    any session): it raises SessionGone, as on the old session, and runs nowhere."""
    t = start_inproc(tmp_path, backend="local")
    c = Client.connect(t.unix, name="racing", ttl=30.0, transport="fast")
    try:
        old = c.session_id
        c._fast.reset()  # what a reopen in another thread did first
        with expect(E.SessionGone, grpc.StatusCode.NOT_FOUND, "being opened"):
            c.allocate(rid("racer"), 16)
        assert t.node.stats().pool.requests_live == 0
        assert c.reopened == 1 and c.session_id != old  # this thread's reopen found nobody else's
        assert c.allocate(rid("after"), 16).tokens == 16
    finally:
        c.close()
        stop_inproc(t)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_that_attached_opens_no_new_session_after_a_restart(tmp_path, transport):
    """An engine's KV tensors are views of the arena it attached. After a restart the new daemon's
    page ids index a new arena those views do not map: a session on it would have the engine
    write and read its KV where neither daemon looks (wrong output, no error). So a client that
    attached opens no new session: every call is refused SessionGone, saying to reconnect and
    attach again; a new client attaches the new arena."""
    with _across_a_restart(tmp_path, "attached", 30.0, transport) as (c, restart):
        att = c.attach()
        t2 = restart()
        with pytest.raises(E.SessionGone, match="unknown or expired"):  # the daemon's answer
            c.allocate(rid("first"), 16)
        for _ in range(2):  # then the client's own, without a call
            with pytest.raises(E.SessionGone, match="attach again"):
                c.allocate(rid("again"), 16)
        assert c.reopened == 0 and t2.node.stats().sessions_live == 0 and t2.node.stats().pool.requests_live == 0
        del att
        fresh = Client.connect(t2.unix, name="fresh", transport=transport)
        try:
            fresh.attach()
            assert fresh.allocate(rid("fresh"), 16).tokens == 16
        finally:
            fresh.close()


def test_a_client_that_attached_opens_no_new_session_after_a_reap(tmp_path, monkeypatch):
    """Reaped (stalled past its TTL), the engine's requests were freed while its in-flight work may
    still use their pages through its views: a new session's allocations could be handed those very
    pages. Only the engine can end that work, so it is told (SessionGone), not given a session."""
    monkeypatch.setattr(Client, "_heartbeat", lambda self: None)  # stalled past its TTL
    t = start_inproc(tmp_path, backend="local")
    c = Client.connect(t.unix, name="attached-stalled", ttl=0.5, transport="fast")
    try:
        att = c.attach()
        expired = t.node.stats().sessions_expired_total
        wait_for(lambda: t.node.stats().sessions_expired_total > expired, 5.0, "the daemon to reap the silent session")
        with pytest.raises(E.SessionGone, match="unknown or expired"):
            c.allocate(rid("first"), 16)
        with pytest.raises(E.SessionGone, match="end every request that used them"):
            c.allocate(rid("second"), 16)
        assert c.reopened == 0 and t.node.stats().sessions_live == 0
        del att
    finally:
        c.close()
        stop_inproc(t)


_STALLED = r'''
import json, sys
from kvd.client import Client
c = Client.connect(sys.argv[1], name="stalled", ttl=float(sys.argv[2]), transport=sys.argv[3])
c.attach()
print("ready", flush=True)
sys.stdin.readline()  # the parent stops this process past its TTL, continues it, then says go
seen = {"stale_before": bool(c.stale), "overdue": c.overdue}
try:
    c.keep_alive()
    seen["keep_alive"] = "ok"
except Exception as exc:
    seen["keep_alive"] = type(exc).__name__
seen["stale_after"] = bool(c.stale)
print(json.dumps(seen), flush=True)
'''


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_stalled_past_its_ttl_learns_its_session_is_gone_before_it_writes(tmp_path, transport):
    """An engine's process stopped (SIGSTOP: swapped, paused) past its session's TTL: the daemon
    reaps the session and may hand its pages to other requests. Continued, the engine must not
    write through its views before it knows: ``overdue`` says no call was answered for half the
    TTL, and one ``keep_alive`` then says SessionGone and marks the client stale -- whether or not
    its heartbeat thread ran first. A client whose heartbeat runs is never overdue."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    t = start_inproc(tmp_path, backend="local")
    live = Client.connect(t.unix, name="live", ttl=1.0, transport=transport)
    p = subprocess.Popen([sys.executable, "-c", _STALLED, t.unix, "1.0", transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=REPO)
    try:
        assert p.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        assert t.node.stats().sessions_live == 2
        proc_kit.stop(p.pid)
        wait_for(lambda: t.node.stats().sessions_live == 1, 10, "the stopped client's session reaped")
        time.sleep(0.2)
        assert not live.overdue  # its heartbeat kept it answered throughout
        os.kill(p.pid, signal.SIGCONT)
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        seen = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        print(f"\n{transport}: after the stop: {seen}")
        assert seen["overdue"] and seen["keep_alive"] == "SessionGone" and seen["stale_after"], seen
        assert p.wait(10) == 0
        t.check()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        live.close()
        stop_inproc(t)
