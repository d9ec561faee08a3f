"""A blocking engine-socket call looks for its reply before it sleeps (``Client.connect(spin_us=)``,
:func:`kvd.ipc.frames.read_frame`'s ``spin_s``): what it reads is the same either way, a wait never
spins, and a spin that bad input asks for is refused before anything is opened."""

from __future__ import annotations

import socket
import threading

import pytest
from daemon_kit import rid, start_inproc, stop_inproc

from kvd import errors as E
from kvd.client import Client
from kvd.client import fast as F
from kvd.ipc.frames import HEAD, OK, frame, read_frame
from kvd.v1 import kvd_pb2 as pb


@pytest.fixture
def daemon(tmp_path):
    t = start_inproc(tmp_path)
    yield t
    stop_inproc(t)


def _pair(timeout: float) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(timeout)
    return a, b


def test_a_spun_read_gets_the_same_frame_and_leaves_the_timeout_as_it_was():
    a, b = _pair(5.0)
    try:
        msg = pb.EchoResponse(payload=b"x" * 100)
        b.sendall(frame(OK, msg))  # there before the read: the first look finds it
        assert read_frame(a, spin_s=0.001) == (OK, msg.SerializeToString())
        # Sent after the spin ran out: the read then sleeps for it, as without a spin.
        t = threading.Timer(0.05, lambda: b.sendall(frame(OK, msg)))
        t.start()
        assert read_frame(a, spin_s=0.0005) == (OK, msg.SerializeToString())
        t.join()
        # A frame split in two sends: the rest is read after the spin found the first part.
        raw = frame(OK, msg)
        b.sendall(raw[: HEAD.size + 10])
        threading.Timer(0.02, lambda: b.sendall(raw[HEAD.size + 10:])).start()
        assert read_frame(a, spin_s=0.001) == (OK, msg.SerializeToString())
        assert a.gettimeout() == 5.0
    finally:
        a.close()
        b.close()


def test_a_spun_read_times_out_and_sees_a_close_as_before():
    a, b = _pair(0.05)
    try:
        with pytest.raises(TimeoutError):
            read_frame(a, spin_s=0.001)
        assert a.gettimeout() == 0.05
        b.close()
        with pytest.raises(ConnectionError, match="closed the connection"):
            read_frame(a, spin_s=0.001)
    finally:
        a.close()


def test_calls_spin_as_the_client_says_and_waits_never(daemon, monkeypatch):
    spins: list[float] = []  # each reply read's spin, in order
    real = F.read_frame

    def spy(s, limit=F.MAX_FRAME, spin_s=0.0):
        kind, body = real(s, limit, spin_s)
        spins.append(spin_s)
        return kind, body

    c = Client.connect(daemon.unix, name="spin", transport="fast", spin_us=150)
    quiet = Client.connect(daemon.unix, name="no-spin", transport="fast", spin_us=0)
    try:
        monkeypatch.setattr(F, "read_frame", spy)
        c.echo()
        assert spins[-1] == pytest.approx(150e-6)
        quiet.echo()
        assert spins[-1] == 0.0
        r = rid("spin")
        c.allocate_recv(r, 16)
        c.abort(r, "ended for the test")
        assert not c.wait_ready(r, 1).ready  # a wait: it sleeps at once
        assert spins[-1] == 0.0
        assert c.wait_ended(0, 0).transfers  # the other wait too
        assert spins[-1] == 0.0
        c.free(r)
        assert spins[-1] == pytest.approx(150e-6)
    finally:
        c.close()
        quiet.close()
    daemon.check()


@pytest.mark.parametrize("bad", [-1, 2e6, "200", True, None])
def test_a_spin_out_of_range_is_refused_before_any_session_opens(daemon, bad):
    before = daemon.node.stats().sessions_live
    with pytest.raises(E.InvalidArgument, match="spin_us must be a number of microseconds"):
        Client.connect(daemon.unix, name="bad-spin", transport="fast", spin_us=bad)
    assert daemon.node.stats().sessions_live == before
