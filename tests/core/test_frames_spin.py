"""read_frame's optional poll before sleeping (KVD_SPIN_US): the same frames, the socket's
timeout as it was, a reply that comes after the poll still read."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvd.ipc.frames import OK, frame, read_frame, spin_recv
from kvd.v1 import kvd_pb2 as pb


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.05])  # within the poll, just after it, long after it
def test_a_polled_read_gets_the_frame_and_leaves_the_timeout(delay):
    a, b = socket.socketpair()
    try:
        a.settimeout(2.0)
        msg = pb.Session(session_id="s" * 40)
        t = threading.Timer(delay, lambda: b.sendall(frame(OK, msg)))
        t.start()
        kind, body = read_frame(a, spin=0.001)
        t.join()
        assert (kind, pb.Session.FromString(body)) == (OK, msg)
        assert a.gettimeout() == 2.0
    finally:
        a.close()
        b.close()


def test_spin_recv_says_closed_and_nothing_apart():
    a, b = socket.socketpair()
    try:
        t0 = time.perf_counter()
        assert spin_recv(a, 16, 0.002) is None  # nothing came within the poll
        assert time.perf_counter() - t0 >= 0.002
        assert spin_recv(a, 16, 0.0) is None  # off: no read at all
        b.close()
        assert spin_recv(a, 16, 0.5) == b""  # the other side closed
    finally:
        a.close()
