"""The decode connector's ticket server: HTTP on ``kvd_ticket_listen``, in the decode vLLM's
process (:class:`TicketServer`, started by :func:`serve_tickets`).

``POST /v1/kvd/tickets`` mints a ticket, ``DELETE /v1/kvd/tickets/{rid}`` gives back one whose
request never came (the proxy's prefill failed), ``GET /v1/kvd/transfers/{rid}`` says where a
ticket's transfer stands. What each does is the :class:`TicketDesk`'s (the connector's ticket
book); this module is the HTTP around it, and keeps a broken or hostile client from costing the
engine more than a refused connection: out of open files it pauses instead of spinning, and a
connection no thread can be started for is closed, not left to break the server's close.

Standard library and :mod:`kvd.ipc.unix_socket`'s :class:`AcceptPause` only: no vLLM import.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvd.errors import InvalidArgument, KvdError
from kvd.ipc.unix_socket import AcceptPause

__all__ = ["MAX_TICKET_BODY", "TicketDesk", "TicketServer", "serve_tickets"]

log = logging.getLogger("kvd.connectors.tickets")

#: Bytes of a ticket request's body (a prompt's token ids as JSON).
MAX_TICKET_BODY = 1 << 20
_TICKETS = "/v1/kvd/tickets/"
_TRANSFERS = "/v1/kvd/transfers/"


class TicketDesk(Protocol):
    """What the ticket server serves (the decode connector's :class:`~kvd.connectors.vllm_ticket_book.TicketBook`)."""

    def mint(self, prompt: object) -> dict:
        """A ticket for ``prompt`` (the body's ``prompt_token_ids``, unchecked JSON); raises
        InvalidArgument for a bad prompt, another KvdError when the daemon cannot mint one."""
        ...

    def cancel(self, rid: str) -> tuple[int, str]:
        """Give back the ticket ``rid``: (HTTP status, why)."""
        ...

    def status(self, rid: str) -> dict | None:
        """Where the transfer of ticket ``rid`` stands; None: no such ticket."""
        ...


def _reply_json(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)


class _Handler(BaseHTTPRequestHandler):
    server: TicketServer
    # Keep-alive: a proxy's pooled connection is served by one thread, not a new connection and
    # thread per ticket (~1 ms more a ticket through aiohttp's client); an idle one is dropped
    # after `timeout` seconds.
    protocol_version = "HTTP/1.1"
    timeout = 60
    disable_nagle_algorithm = True  # headers and body go as two writes: no 40 ms delayed-ACK stall

    def _reply(self, code: int, body: dict) -> None:
        _reply_json(self, code, body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        n = int(self.headers.get("Content-Length") or 0)
        if self.path != "/v1/kvd/tickets":
            self.close_connection = True  # its body left unread
            return self._reply(404, {"error": f"no such endpoint {self.path[:64]!r}; POST /v1/kvd/tickets"})
        if not 0 < n <= MAX_TICKET_BODY:
            self.close_connection = True
            return self._reply(400, {"error": f"body of {n} bytes: send JSON {{prompt_token_ids: [...]}} of at most {MAX_TICKET_BODY}"})
        try:
            body = json.loads(self.rfile.read(n))
            self._reply(200, self.server.desk.mint(body.get("prompt_token_ids") if isinstance(body, dict) else None))
        except (ValueError, InvalidArgument) as exc:
            self._reply(400, {"error": str(exc)})
        except KvdError as exc:
            self._reply(503, {"error": f"{type(exc).__name__}: {exc}"})

    def do_DELETE(self) -> None:  # noqa: N802
        if int(self.headers.get("Content-Length") or 0):
            self.close_connection = True  # a body nobody reads
        if not self.path.startswith(_TICKETS):
            return self._reply(404, {"error": f"no such endpoint {self.path[:64]!r}; DELETE {_TICKETS}{{kvd_rid}}"})
        rid = self.path[len(_TICKETS):]
        code, why = self.server.desk.cancel(rid)
        self._reply(code, {"kvd_rid": rid[:64], "released": code == 200, "reason": why})

    def do_GET(self) -> None:  # noqa: N802
        if int(self.headers.get("Content-Length") or 0):
            self.close_connection = True
        st = self.server.desk.status(self.path[len(_TRANSFERS):]) if self.path.startswith(_TRANSFERS) else None
        self._reply(200, st) if st else self._reply(404, {"error": "no such kvd request here"})

    def log_message(self, *args: object) -> None:
        pass


class TicketServer(ThreadingHTTPServer):
    """A thread per connection, serving ``desk``; :meth:`close` stops it (what
    ``shutdown`` + ``server_close`` do, once). ``pause.starved``: accepts that failed for want
    of files or memory; ``refused``: connections closed because no thread could be started."""

    daemon_threads = True
    # Closing never waits for the connections' threads: a kept-alive idle one lasts `timeout`.
    block_on_close = False

    def __init__(self, address: tuple[str, int], desk: TicketDesk) -> None:
        super().__init__(address, _Handler)
        self.desk = desk
        self.pause = AcceptPause("ticket server", f"{address[0]}:{self.server_address[1]}", log)
        self.refused = 0
        self._closed = False

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            got = super().get_request()
        except OSError as exc:
            # socketserver drops the failure and selects again: the connection is still queued,
            # so out of files it would try again at once, a core busy in the engine's process.
            self.pause.failed(exc)
            raise
        self.pause.accepted()
        return got

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except RuntimeError as exc:  # "can't start new thread": at the process's thread limit
            self.refused += 1
            log.warning("ticket server: closed a connection from %s: no thread could serve it (%s); "
                        "the engine process is at its thread limit", client_address, exc)
            self.shutdown_request(request)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.shutdown()
        self.server_close()


def serve_tickets(desk: TicketDesk, listen: str) -> TicketServer:
    """A :class:`TicketServer` for ``desk`` on ``listen`` (``host:port``, host defaulting to
    127.0.0.1), serving on a thread of its own."""
    host, _, port = listen.rpartition(":")
    srv = TicketServer((host or "127.0.0.1", int(port)), desk)
    threading.Thread(target=srv.serve_forever, name="kvd-ticket-server", daemon=True).start()
    return srv
