"""The decode connector's ticket server: HTTP on ``kvd_ticket_listen``, in the decode vLLM's
process (:class:`TicketServer`, started by :func:`serve_tickets`).

``POST /v1/kvd/tickets`` mints a ticket, ``DELETE /v1/kvd/tickets/{rid}`` gives back one whose
request never came (the proxy's prefill failed), ``GET /v1/kvd/transfers/{rid}`` says where a
ticket's transfer stands. What each does is the :class:`TicketDesk`'s (the connector's ticket
book); this module is the HTTP around it, and keeps a broken or hostile client from costing the
engine more than a waiting or refused connection (:class:`~kvd.ipc.http_server.BoundedThreads`):
at most :data:`MAX_TICKET_CONNECTIONS` threads, an idle connection closed after 60 s, out of open
files a pause instead of a spin, a connection no thread can be started for closed.

Standard library and :mod:`kvd.ipc.http_server` only: no vLLM import.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Protocol

from kvd.errors import InvalidArgument, KvdError
from kvd.ipc.http_server import BoundedThreads

__all__ = ["MAX_TICKET_BODY", "MAX_TICKET_CONNECTIONS", "TicketDesk", "TicketServer", "serve_tickets"]

log = logging.getLogger("kvd.connectors.tickets")

#: Bytes of a ticket request's body (a prompt's token ids as JSON).
MAX_TICKET_BODY = 1 << 20
#: Connections served at once (a thread each); more wait to be accepted. The proxy keeps a pool
#: of them alive (aiohttp, unbounded): this is room for a burst of that many tickets at once.
MAX_TICKET_CONNECTIONS = 512
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


class TicketServer(BoundedThreads, HTTPServer):
    """A thread per connection, at most :data:`MAX_TICKET_CONNECTIONS` at once, serving ``desk``
    (:class:`~kvd.ipc.http_server.BoundedThreads`: :meth:`close` stops it; ``waited``,
    ``refused`` and ``pause.starved`` count what a client holding connections or the process's
    limits cost)."""

    def __init__(self, address: tuple[str, int], desk: TicketDesk) -> None:
        super().__init__(address, _Handler)
        self.desk = desk
        self.bound("ticket server", log, MAX_TICKET_CONNECTIONS)


def serve_tickets(desk: TicketDesk, listen: str) -> TicketServer:
    """A :class:`TicketServer` for ``desk`` on ``listen`` (``host:port``, host defaulting to
    127.0.0.1), serving on a thread of its own."""
    host, _, port = listen.rpartition(":")
    srv = TicketServer((host or "127.0.0.1", int(port)), desk)
    srv.start("kvd-ticket-server")
    return srv
