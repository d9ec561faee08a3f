"""``kvd.ipc.http_server.BoundedThreads``, the bounds of kvd's HTTP servers (the daemon's /metrics,
the decode connector's ticket server), on a small server of its own: what idle or departed
clients cost the process. The servers themselves: tests/daemon/test_daemon_ops.py (/metrics) and
tests/core/test_ticket_server.py.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import pytest
from daemon_kit import wait_for

from kvd.ipc.http_server import BoundedThreads

BOUND = 4
IDLE_S = 0.5


class _Handler(WSGIRequestHandler):
    timeout = IDLE_S  # wsgiref's handler lets a timeout out of handle(): the server's handle_error sees it

    def log_message(self, *args: object) -> None:
        pass


class _Server(BoundedThreads, WSGIServer):
    """A WSGI server (as the daemon's /metrics is) answering "ok", serving once made."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bound("test server", logging.getLogger("kvd.test.http"), BOUND)
        self.set_app(lambda environ, start: (start("200 OK", [("Content-Length", "2")]), [b"ok"])[1])
        self.start("test-http")


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.close()


def _serving() -> int:
    """Connection threads of this process's test servers (socketserver names them Thread-N
    (process_request_thread))."""
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def _get(port: int, timeout: float = 30) -> tuple[int, float]:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/")
        return conn.getresponse().status, time.monotonic() - t0
    finally:
        conn.close()


def test_idle_connections_past_the_bound_cost_no_thread_and_each_is_served_in_turn(server, caplog):
    # Five times the bound of clients that connect and send nothing: at most BOUND threads serve
    # them; the others wait in the listen queue; each idle one is closed after the handler's
    # timeout, so a real request behind them all is answered, and nothing is printed per client.
    idle = [socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) for _ in range(5 * BOUND)]
    try:
        wait_for(lambda: server.waited >= 1, timeout=10, what="the accept loop waiting for a slot")
        assert _serving() <= BOUND
        status, took = _get(server.server_address[1])
        assert status == 200
        assert took < 5 * IDLE_S + 5, f"the request waited {took:.1f} s behind {5 * BOUND} idle clients"
        # Each idle client was closed by the server after IDLE_S (a read sees the end).
        for s in idle:
            s.settimeout(10)
            assert s.recv(1) == b""
        wait_for(lambda: _serving() == 0, timeout=10, what="the threads of closed connections to end")
        assert server.refused == 0
        assert "Traceback" not in caplog.text
        assert sum("the most it serves at once" in r.getMessage() for r in caplog.records) == 1  # once, not per client
    finally:
        for s in idle:
            s.close()


def test_closing_a_server_that_waits_for_a_slot_returns_at_once_and_frees_its_port():
    srv = _Server()
    port = srv.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(BOUND + 2)]
    try:
        wait_for(lambda: srv.waited >= 1, timeout=10, what="the accept loop waiting for a slot")
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 1.0
        srv.close()  # again: nothing
        with socket.socket() as s:  # the port is free to listen on (as a server made again would)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        for s in idle:
            s.close()


def test_a_client_that_stops_mid_request_is_a_debug_line_not_a_traceback(server, caplog, capfd):
    # socketserver printed a traceback to stderr for each (the timeout wsgiref lets out): a
    # client that means harm could fill a daemon's log with them.
    port = server.server_address[1]
    with caplog.at_level(logging.DEBUG, logger="kvd.test.http"):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"GET / HT")  # the request line never finished
                s.settimeout(10)
                assert s.recv(1) == b""  # closed by the server after IDLE_S
        wait_for(lambda: _serving() == 0, timeout=10, what="the connections' threads to end")
        assert _get(port)[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-2000:]
    assert sum("connection from" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records) == 3
