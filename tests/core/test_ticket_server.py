"""The decode connector's ticket server (``kvd.connectors.vllm_ticket_server``) against what a
broken or hostile client can do to the engine process it runs in: exhaust its open files, meet it
at its thread limit. Its HTTP endpoints against the connector's real ticket book, on a real
daemon, are in tests/vllm/test_vllm_connector_pieces.py; the desk here answers from a table, so
that these run without vLLM.
"""

from __future__ import annotations

import http.client
import json
import resource
import socket
import socketserver
import subprocess
import sys
import time

import proc_kit
from daemon_kit import REPO, wait_for

from kvd.connectors.vllm_ticket_server import serve_tickets


class _Desk:
    def mint(self, prompt: object) -> dict:
        return {"kvd_rid": "r-1", "kvd_tokens": len(prompt) if isinstance(prompt, list) else 0}

    def cancel(self, rid: str) -> tuple[int, str]:
        return 404, f"no ticket {rid!r} here"

    def status(self, rid: str) -> dict | None:
        return None


def _mint(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/kvd/tickets", json.dumps({"prompt_token_ids": [1, 2, 3]}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        return json.loads(r.read())
    finally:
        conn.close()


_SERVER = """
import logging, sys
from kvd.connectors.vllm_ticket_server import serve_tickets

class Desk:
    def mint(self, prompt): return {"kvd_rid": "r-1", "kvd_tokens": len(prompt)}
    def cancel(self, rid): return 404, "none"
    def status(self, rid): return None

logging.basicConfig(level=logging.INFO)
srv = serve_tickets(Desk(), "127.0.0.1:0")
print(srv.server_address[1], flush=True)
sys.stdin.readline()
print(srv.pause.starved, flush=True)
srv.close()
"""


def test_a_ticket_server_out_of_files_waits_quietly_and_serves_again(tmp_path):
    """Out of open files (a client holding connections, a low nofile limit), accept() fails at
    once and the connection stays queued: socketserver selected and failed again at once, a core
    busy in the decode vLLM's process until files were freed. Now it pauses, says so once, and
    serves the queued connection once files free up."""
    limit = 64
    err = tmp_path / "server.stderr"
    with open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=e, text=True,
                             cwd=REPO, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    hogs: list[socket.socket] = []
    try:
        port = int(p.stdout.readline())  # type: ignore[union-attr]
        while proc_kit.open_files(p.pid) < limit and len(hogs) < 2 * limit:
            hogs.append(socket.create_connection(("127.0.0.1", port)))
            if len(hogs) % 8 == 0:
                time.sleep(0.05)  # let it accept what is queued
        wait_for(lambda: "cannot accept connections" in err.read_text(), 10, "the ticket server's error")
        cpu0 = proc_kit.cpu_seconds(p.pid)
        time.sleep(1.0)
        busy = proc_kit.cpu_seconds(p.pid) - cpu0
        log = err.read_text()
        assert log.count("cannot accept connections") == 1 and "Traceback" not in log, log[-2000:]
        assert "ulimit" in log and f"may open {limit} files" in log
        assert busy < 0.5, f"the ticket server used {busy:.2f} s of CPU in 1 s while it could not accept"
        print(f"\nticket server out of files: {busy:.2f} s of CPU in 1 s")
        for s in hogs:
            s.close()
        hogs.clear()
        assert _mint(port)["kvd_tokens"] == 3  # served again
        wait_for(lambda: "accepting connections again" in err.read_text(), 10, "the ticket server back")
        out, _ = p.communicate("stop\n", timeout=10)
        assert p.returncode == 0 and int(out) >= 1
    finally:
        for s in hogs:
            s.close()
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)


def test_a_connection_no_thread_can_serve_is_closed_and_the_server_serves_on(monkeypatch):
    """At the engine process's thread limit, starting a connection's thread fails: that
    connection is closed and counted, the next is served, and closing the server does not trip
    over the thread that never started (socketserver joined it: RuntimeError)."""
    proc_kit.failing_thread_starts(monkeypatch, socketserver, spare="kvd-ticket-server")
    srv = serve_tickets(_Desk(), "127.0.0.1:0")
    try:
        port = srv.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert s.recv(1) == b""  # closed unanswered
        assert srv.refused == 1
        assert _mint(port)["kvd_rid"] == "r-1"
    finally:
        srv.close()


def test_closing_the_server_frees_its_port():
    """``close`` stops serving and closes the listening socket: the connector's shutdown held the
    port before (shutdown alone), so a connector made again in that process could not listen."""
    srv = serve_tickets(_Desk(), "127.0.0.1:0")
    port = srv.server_address[1]
    assert _mint(port)["kvd_tokens"] == 3
    srv.close()
    srv.close()  # again: nothing
    again = serve_tickets(_Desk(), f"127.0.0.1:{port}")
    try:
        assert _mint(port)["kvd_tokens"] == 3
    finally:
        again.close()
