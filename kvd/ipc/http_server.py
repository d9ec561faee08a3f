"""A threaded HTTP server whose cost a broken or hostile client cannot grow without bound: the
base of the daemon's /metrics endpoint (:mod:`kvd.server.metrics`) and of the decode connector's
ticket server (:mod:`kvd.connectors.vllm_ticket_server`).

socketserver's ThreadingMixIn starts a thread per connection and keeps it while the connection
is open, read without a timeout: idle connections held open cost the process a thread each, for
good (1,000 idle connections to a daemon's /metrics were 1,000 more daemon threads, all still
there 30 s later), until the process meets its thread limit and its own threads cannot start.
Out of open files, accept() fails with the connection still queued, and socketserver selects
and fails again at once: a core busy. With :class:`BoundedThreads` mixed in:

* at most ``max_connections`` connections are served at once; past that the accept loop waits
  for one to end, and new connections wait in the kernel's listen queue (``request_queue_size``),
  costing the process nothing;
* a connection is closed once it has been idle for the handler's ``timeout`` seconds (the handler
  class sets it), so a slot held by an idle client is freed;
* out of files the accept loop pauses (:class:`~kvd.ipc.unix_socket.AcceptPause`), not spins;
* a connection no thread can be started for (the thread limit) is closed and counted;
* a client's broken or timed-out connection is a debug line, never a traceback on stderr;
* :meth:`BoundedThreads.start` serves from a thread of its own; :meth:`BoundedThreads.close`
  stops serving and frees the port, once.

Standard library and :mod:`kvd.ipc.unix_socket` only.
"""

from __future__ import annotations

import logging
import socketserver
import sys
import threading
import time
from typing import Any

from kvd.ipc.unix_socket import AcceptPause

__all__ = ["LOG_EVERY_S", "BoundedThreads"]

#: A server at its bounds says so at most this often (a flood of connections is one line, not one each).
LOG_EVERY_S = 10.0
#: How often the accept loop, waiting for a free slot, checks whether the server is closing.
_CLOSE_POLL_S = 0.1


class BoundedThreads(socketserver.ThreadingMixIn):
    """Mixed in before a socketserver TCP server class (``class S(BoundedThreads, HTTPServer)``);
    the subclass calls :meth:`bound` in its ``__init__``, after the server's own. Threads are
    daemon threads and closing never joins them (an idle kept-alive connection lasts the handler's
    ``timeout``). Counters, read at any time: ``waited`` (connections that waited for a slot),
    ``refused`` (closed: no thread could be started), ``pause.starved`` (accepts that failed for
    want of files or memory)."""

    daemon_threads = True
    block_on_close = False
    #: The kernel's queue of connections not yet accepted (socketserver's default is 5): where
    #: connections wait while every slot is taken.
    request_queue_size = 128

    what: str
    log: logging.Logger
    max_connections: int
    pause: AcceptPause
    waited: int
    refused: int

    def bound(self, what: str, log: logging.Logger, max_connections: int) -> None:
        """Set the bounds: ``what`` names the server in log lines (with its address), ``log``
        takes them, ``max_connections`` are served at once."""
        host, port = self.server_address[:2]  # type: ignore[attr-defined]  # the server class's
        self.what, self.log, self.max_connections = what, log, max_connections
        self.pause = AcceptPause(what, f"{host}:{port}", log)
        self.waited = self.refused = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._said_at: dict[str, float] = {}  # per message: a flood of waits does not hide a refusal
        self._closed = False

    @property
    def starved(self) -> int:
        """Accepts that failed for want of files or memory (each one a pause)."""
        return self.pause.starved

    def get_request(self) -> tuple[Any, Any]:
        try:
            got = super().get_request()  # type: ignore[misc]  # the server class's
        except OSError as exc:
            # socketserver drops the failure and selects again: the connection is still queued,
            # so out of files it would try again at once, a core busy.
            self.pause.failed(exc)
            raise
        self.pause.accepted()
        return got

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.waited += 1
            self._say("serving %d connections, the most it serves at once: the next waits until one ends (an idle "
                      "one is closed after %g s); a client holding connections open?", self.max_connections,
                      getattr(self.RequestHandlerClass, "timeout", None) or 0)  # type: ignore[attr-defined]
            while not self._slots.acquire(timeout=_CLOSE_POLL_S):
                if self._closed:
                    self.shutdown_request(request)  # type: ignore[attr-defined]
                    return
        try:
            super().process_request(request, client_address)
        except RuntimeError as exc:  # "can't start new thread": at the process's thread limit
            self._slots.release()
            self.refused += 1
            self._say("closed a connection from %s unanswered: no thread could serve it (%s); the process is at its "
                      "thread limit (%d refused so far)", client_address, exc, self.refused)
            self.shutdown_request(request)  # type: ignore[attr-defined]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away, or sat idle past the timeout
            self.log.debug("%s: connection from %s ended: %s", self.what, client_address, exc)
        else:
            self.log.exception("%s: error serving %s", self.what, client_address)

    def start(self, thread_name: str) -> None:
        """Serve (``serve_forever``) from a daemon thread named ``thread_name``."""
        threading.Thread(target=self.serve_forever, name=thread_name, daemon=True).start()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop serving (``serve_forever`` returns) and close the listening socket; again: nothing.
        Only for a started server (``shutdown`` waits for ``serve_forever``)."""
        if self._closed:
            return
        self._closed = True
        self.shutdown()  # type: ignore[attr-defined]
        self.server_close()  # type: ignore[attr-defined]

    def _say(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._said_at.get(msg, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._said_at[msg] = now
            self.log.warning("%s on %s: " + msg, self.what, self.pause.where, *args)
