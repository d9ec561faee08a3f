"""A thread-per-connection server of frames (:mod:`kvd.ipc.frames`): what the peer socket and the
engine socket share.

:class:`FramedServer` holds the connections (a thread each, at most ``max_connections``; more
get an Unavailable refusal and close, or, where the server evicts, take the place of the connection
idle longest), reads each frame's head, counts the calls answered, the
connections refused and dropped, and ends every connection on :meth:`~UnixServer.stop`. A
subclass says what a connection does first (:meth:`FramedServer._opened`: the peer socket's
hello) and what one frame gets (:meth:`FramedServer._frame`), carrying a per-connection state
between frames (the engine socket's session).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

from kvd.errors import Code, Unavailable
from kvd.ipc.frames import EVICTED, MAX_REQUEST, REFUSED, frame, read_head
from kvd.ipc.unix_socket import UnixServer, recv_rest
from kvd.rpc.convert import status_to_pb
from kvd.v1 import kvd_pb2 as pb

__all__ = ["BODY_BUDGET_REQUESTS", "BUSY_RETRY_S", "Close", "FramedServer", "exhausted", "refusal"]

S = TypeVar("S")

#: Bytes of frame bodies one server reads at once across its connections (past what each
#: body's first recv brings), in its largest requests: without it every connection could park
#: one (256 engine-socket connections of 4 MiB: 1 GiB).
BODY_BUDGET_REQUESTS = 16

#: A refusal for want of a connection slot says to retry after this long (Unavailable's
#: ``retry_after_s``): the server is up, so a client keeps what it knows of it (its doorbells).
BUSY_RETRY_S = 0.5


def refusal(exc: BaseException) -> bytes:
    """The refusal frame of an exception (through the one mapping)."""
    return frame(REFUSED, status_to_pb(exc))


def exhausted(message: str) -> bytes:
    """A RESOURCE_EXHAUSTED refusal without kvd's error metadata: a transport's limit, as gRPC
    refuses a message over its limit (and :mod:`kvd.client.fast` a request over the frame
    limit). :func:`kvd.errors.from_status` raises it as a plain KvdError, never CapacityError,
    which would have an engine wait for pool memory that is not the problem."""
    return frame(REFUSED, pb.PeerStatus(code=Code.RESOURCE_EXHAUSTED, message=message))


class Close(Exception):
    """The connection cannot go on (a refused hello, a frame past the limit): reply, then close.
    ``why``: what :meth:`FramedServer.closed` counts it as -- ``refused``, ``evicted`` (closed
    idle to make room, its request unread) or ``cut`` (a wait cut short to make room)."""

    def __init__(self, reply: bytes, *, why: str = "refused") -> None:
        super().__init__()
        self.reply = reply
        self.why = why


class FramedServer(UnixServer, Generic[S]):
    """Frames on a Unix stream socket, a thread per connection; ``S``: what a connection carries
    from one frame to the next.

    A connection waits for its next frame as long as :meth:`_idle` allows for its state (by
    default without limit); past that it is closed. A frame begun arrives whole in bounded time
    however its bytes are split, each part under one deadline: the rest of its head within
    ``timeout`` of its first bytes; its body's first bytes within ``timeout`` of the head, the
    rest of the body within ``timeout`` of those (:meth:`_body`). So a frame is read, or its
    connection dropped, within 3 x ``timeout`` of its first byte; the reply's send has
    ``timeout`` in all (a handler's own time, a WaitReady's wait, is not bounded here).

    Bodies that come in pieces are parked while the rest arrives; those being read at once hold
    at most ``body_budget`` bytes across the connections (a body's first recv, bounded by the
    socket's buffer, is not counted: a body that comes whole costs no accounting). A frame
    whose body would pass it is refused RESOURCE_EXHAUSTED (:func:`exhausted`) and its
    connection closed: the stream cannot be followed without reading the body.

    :meth:`_frame` (and :meth:`_opened`) reply on the connection themselves, or raise
    :class:`Close` to send a last reply and close it; a caller gone mid-frame or too slow is
    dropped (counted in ``dropped``, logged). Neither stops the server.

    Eviction (``evicts``, the engine socket's): connections that idle without limit could hold
    every slot (a client that leaks connections, or anyone who can open the socket file), and
    every new engine would be refused. So a new connection with every slot taken evicts the
    connection that has waited longest for its next frame, if one waits: that connection's
    reader is woken (``shutdown(SHUT_RD)``), reads no frame after it -- not even one that arrived
    meanwhile -- and answers :data:`~kvd.ipc.frames.EVICTED` before it closes, so its client
    knows the request it may have sent was never read and sends it again elsewhere. With none
    idle, a connection parked in a wait (:meth:`_park`: a WaitReady, which only reads) is cut
    short instead, the one parked longest: its wait ends at its next wake-up and it answers
    EVICTED too (its client asks again), so waits cannot hold every slot either. A handler
    running is never evicted; only when every slot is in one is a new connection refused
    (busy, with :data:`BUSY_RETRY_S`)."""

    #: Whether a full server evicts its longest-idle connection for a new one (see the class).
    evicts: ClassVar[bool] = False

    #: In messages and logs ("peer socket"), and the name of each connection's thread.
    label: ClassVar[str]
    thread_name: ClassVar[str]
    #: What a refused caller should do, after "serves N connections already; ".
    busy_hint: ClassVar[str]
    log: ClassVar[logging.Logger]

    def __init__(self, path: str, setting: str, serves: str, *, timeout: float, max_connections: int, group: bool = False,
                 max_request: int = MAX_REQUEST) -> None:
        super().__init__(path, setting, serves, group=group)
        self.timeout = timeout
        self.max_connections = max_connections
        self.max_request = max_request
        self.body_budget = BODY_BUDGET_REQUESTS * max_request
        self._reading = 0  # bytes of the bodies being read in pieces now (under _lock)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._answered: dict[tuple[str, str], int] = {}  # (method, status code name) -> calls
        # Connections waiting for their next frame, the longest waiting first (each is put back
        # at the end when it starts waiting again), and those being evicted (under _lock).
        self._waiting: dict[socket.socket, None] = {}
        self._evicting: set[socket.socket] = set()
        # Connections in a wait that may be cut short, the longest parked first, each with what
        # cuts it (under _lock).
        self._parked: dict[socket.socket, Callable[[], None]] = {}
        #: connections refused (busy, a bad hello, a frame past the limit), dropped (gone
        #: mid-frame), evicted (closed idle to make room) and cut (a wait cut short to make room).
        self.refused = self.dropped = self.evicted = self.cut = 0

    # -- what it did ---------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    def answered(self) -> dict[tuple[str, str], int]:
        """Calls answered so far by ``(method, status code name)``; "OK" for a success."""
        with self._lock:
            return dict(self._answered)

    def closed(self) -> dict[str, int]:
        """Connections the server closed so far, by why: ``refused`` (busy, a bad hello, a frame
        past the limit), ``evicted`` (idle, for a new one), ``cut`` (a wait cut short, for a new one),
        ``dropped`` (gone or too slow mid-frame)."""
        with self._lock:
            return {"refused": self.refused, "evicted": self.evicted, "cut": self.cut, "dropped": self.dropped}

    def _count(self, name: str, code: str) -> None:
        with self._lock:
            self._answered[(name, code)] = self._answered.get((name, code), 0) + 1

    # -- what a subclass says ------------------------------------------------------------------
    def _opened(self, conn: socket.socket) -> S:
        """The state of a new connection, before its first frame (may read and reply)."""
        raise NotImplementedError

    def _frame(self, conn: socket.socket, n: int, kind: int, state: S) -> S:
        """Serve one frame whose head was read (its body is read here); the state for the next."""
        raise NotImplementedError

    def _body(self, conn: socket.socket, n: int) -> bytes:
        """The ``n``-byte body of a frame whose head was read (what :meth:`_frame` reads it
        with): its first bytes within ``timeout`` of the head, the rest within ``timeout`` of
        those, one deadline however finely they are split (TimeoutError: the caller is dropped).
        Close (RESOURCE_EXHAUSTED, as gRPC refuses a message over its limit) for a body over
        ``max_request``, or one that would pass ``body_budget``."""
        if n > self.max_request:  # refused unread, so the stream cannot be followed past it
            raise Close(exhausted(
                f"{self.label}: a request of {n:,d} bytes exceeds this daemon's {self.max_request:,d}-byte limit "
                "(max_request_bytes, over gRPC too); send less per call"))
        first = conn.recv(n) if n else b""  # under the socket's timeout, set after the head
        return first if len(first) == n else self._rest(conn, first, n)

    def _rest(self, conn: socket.socket, first: bytes, n: int) -> bytes:
        """The rest of an ``n``-byte body whose first recv brought only ``first``, its ``n``
        bytes counted against ``body_budget`` while it is read; Close (RESOURCE_EXHAUSTED) when
        they would pass it, before anything more is read."""
        with self._lock:
            reading = self._reading
            if reading + n <= self.body_budget:
                self._reading += n
        if reading + n > self.body_budget:
            raise Close(exhausted(
                f"{self.label}: a body of {n:,d} bytes with {reading:,d} being read already would pass the "
                f"{self.body_budget:,d}-byte budget of bodies read at once; retry the call later, or send less per call"))
        try:
            return recv_rest(conn, first, n, self.timeout)
        finally:
            with self._lock:
                self._reading -= n

    def _idle(self, state: S) -> float | None:
        """Seconds a connection in ``state`` may wait for its next frame before it is closed
        (counted in ``dropped``); None: without limit, as by default (a client's pooled
        connections idle between calls). Asked when a connection opens and when its state
        changes, never per frame."""
        return None

    # -- serving -------------------------------------------------------------------------------
    def _end(self) -> None:
        with self._lock:
            conns = dict(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv (close would not)
            except OSError:
                pass
        # One deadline for all: a thread that outlives it (a handler that ignores the stop) is
        # left, as a daemon thread, instead of each holding the stop up for its own timeout.
        deadline = time.monotonic() + self.timeout + 1.0
        for t in conns.values():
            t.join(max(0.0, deadline - time.monotonic()))

    def _accepted(self, conn: socket.socket) -> None:
        t = threading.Thread(target=self._serve, args=(conn,), name=self.thread_name, daemon=True)
        victim = None
        with self._lock:
            # A connection being evicted holds its slot only until its thread has answered.
            busy = len(self._conns) - len(self._evicting) >= self.max_connections
            if busy and self.evicts and self._waiting:
                victim = next(iter(self._waiting))
                del self._waiting[victim]  # its reader reads no frame from now on
                self._evicting.add(victim)
                busy = False
            elif busy and self.evicts and self._parked:
                parked = next(iter(self._parked))
                self._parked.pop(parked)()  # its wait ends at its next wake-up; it answers EVICTED
                self._evicting.add(parked)
                busy = False
            if not busy:
                self._conns[conn] = t
        if victim is not None:
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RD)  # wakes its thread's read (close would not)
        if busy:
            self._close(conn, refusal(Unavailable(
                f"{self.label} {self.path} serves {self.max_connections} connections already; {self.busy_hint}",
                retry_after_s=BUSY_RETRY_S)), "refused")
            return
        try:
            t.start()
        except RuntimeError as exc:  # "can't start new thread": the process's thread or memory limit
            with self._lock:
                self._conns.pop(conn, None)
            self.log.error("%s %s: could not start a thread for a new connection: %s", self.label, self.path, exc)
            self._close(conn, refusal(Unavailable(
                f"{self.label} {self.path} could not start a thread for this connection ({exc}): the daemon is at its "
                "thread or memory limit (a container's pids limit?); ask again, or raise the limit", retry_after_s=BUSY_RETRY_S)), "refused")

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout)
            state = self._opened(conn)
            idle = self._idle(state)
            while not self._stop.is_set():
                conn.settimeout(idle)  # between calls: as long as the state allows
                head = self._next_head(conn)
                if head is None:
                    return  # the caller closed it
                conn.settimeout(self.timeout)
                after = self._frame(conn, *head, state)
                if after is not state:  # an identity test per frame, the hook only on a change
                    state, idle = after, self._idle(after)
        except Close as c:
            self._close(conn, c.reply, c.why)
        except OSError as exc:  # gone or too slow mid-frame (ConnectionError, TimeoutError); or stop()
            if not self._stop.is_set():
                with self._lock:
                    self.dropped += 1
                self.log.info("%s: dropped a connection: %s", self.label, exc)
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(conn, None)
                self._waiting.pop(conn, None)
                self._parked.pop(conn, None)
                self._evicting.discard(conn)

    def _park(self, conn: socket.socket, cut: Callable[[], None]) -> None:
        """``conn`` waits in a call that may be cut short to make room (``cut``, called under the
        server's lock: it must be quick), until :meth:`_unpark`."""
        if self.evicts:
            with self._lock:
                self._parked[conn] = cut

    def _unpark(self, conn: socket.socket) -> bool:
        """``conn``'s wait is over; whether it was cut short (its connection is being evicted)."""
        if not self.evicts:
            return False
        with self._lock:
            self._parked.pop(conn, None)
            return conn in self._evicting

    def _cut_short(self) -> Close:
        """What a parked wait cut short answers (:meth:`_park`): EVICTED, then its connection closes."""
        return Close(frame(EVICTED, status_to_pb(Unavailable(
            f"{self.label} {self.path} cut this wait short and closed its connection to serve a new one "
            f"({self.max_connections} connections at most, none idle); ask again on another connection",
            retry_after_s=0.0))), why="cut")

    def _next_head(self, conn: socket.socket) -> tuple[int, int] | None:
        """The next frame's head (None: the caller closed), waiting listed as evictable; Close
        with the EVICTED answer when the connection was evicted meanwhile, whatever the read
        brought (a head read then is dropped with its body: the request never runs)."""
        if not self.evicts:
            return read_head(conn, self.timeout)
        with self._lock:
            self._waiting[conn] = None
        try:
            return read_head(conn, self.timeout)
        finally:
            with self._lock:
                self._waiting.pop(conn, None)
                evicted = conn in self._evicting
            if evicted:
                self.log.info("%s: evicted a connection idle longest, for a new one", self.label)
                # Unavailable with a hint of 0 (retry at once, elsewhere): the daemon is up, and a
                # client that reads this as a refusal (a hello, an older client) keeps what it knows.
                raise Close(frame(EVICTED, status_to_pb(Unavailable(
                    f"{self.label} {self.path} closed this idle connection to serve a new one ({self.max_connections} "
                    "connections at most); the request was not read: send it again on another connection",
                    retry_after_s=0.0))), why="evicted")

    def _close(self, conn: socket.socket, reply: bytes, why: str) -> None:
        with self._lock:
            if why == "evicted":
                self.evicted += 1
            elif why == "cut":
                self.cut += 1
            else:
                self.refused += 1
        try:
            conn.settimeout(self.timeout)
            conn.sendall(reply)
        except OSError:
            pass  # the caller is gone; nothing else to do
        conn.close()
