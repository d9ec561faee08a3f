"""Unix stream sockets as kvd serves them: path checks, claiming a path, an accept loop (and
its pause when out of files, :class:`AcceptPause`, for any server's accept loop), exact reads.

Shared by the handle socket (:mod:`kvd.ipc.fdpass`) and the peer socket
(:mod:`kvd.server.peer_socket`). Each refusal names the setting an operator changes
(``handle_socket``, ``peer_socket``), so one message fits both.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvd.errors import InvalidArgument, Unavailable

__all__ = ["MAX_PATH", "AcceptPause", "UnixServer", "check_path", "listen", "open_to_group", "hung_up", "recv_exact", "recv_rest", "spin_readable", "stirred",
           "unlink_own"]

log = logging.getLogger("kvd.ipc.unix_socket")
_S = TypeVar("_S", bound="UnixServer")

#: accept() errors that say this process or the system is out of something (files, buffers):
#: the accept loop pauses, from _PAUSE_MIN_S doubling to _PAUSE_MAX_S, until one succeeds.
_STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_PAUSE_MIN_S, _PAUSE_MAX_S = 0.005, 0.1


class AcceptPause:
    """What an accept loop does when accept() fails for want of files or memory (EMFILE, ENFILE,
    ENOBUFS, ENOMEM): the connection stays queued, so trying again at once fails at once -- that
    spun a core and logged a traceback per try (2 MB/s) until files were freed. Instead: one
    error that names the limit and what to raise, a pause from 5 ms doubling to 0.1 s per
    failure, and a line when accepting works again. ``what`` and ``where`` name the socket in
    those lines; ``wait(seconds)`` pauses (a stop event's ``wait``, so a stop cuts it short)."""

    def __init__(self, what: str, where: str, logger: logging.Logger, wait: Callable[[float], object] = time.sleep) -> None:
        self.what, self.where, self.log, self._wait = what, where, logger, wait
        self.pause = 0.0  # > 0 while starved: the seconds the last pause took
        #: accept() failures for want of files or buffers (each one a pause): connections waited.
        self.starved = 0

    def failed(self, exc: OSError) -> bool:
        """After accept() raised ``exc``: pause and return True when it is starvation, else
        return False at once (the caller judges it)."""
        if exc.errno not in _STARVED:
            return False
        if not self.pause:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            self.log.error("%s on %s: cannot accept connections: %s (this process may open %d files); connections wait until "
                           "some close -- raise the open-file limit (ulimit -n; the container's nofile ulimit) or find the "
                           "client holding connections", self.what, self.where, exc.strerror, soft)
        self.starved += 1
        self.pause = min(max(2 * self.pause, _PAUSE_MIN_S), _PAUSE_MAX_S)
        self._wait(self.pause)
        return True

    def accepted(self) -> None:
        """After accept() succeeded: say so once when it had been starved."""
        if self.pause:
            self.log.warning("%s on %s: accepting connections again", self.what, self.where)
            self.pause = 0.0


#: Bytes of a Unix socket path (sun_path is 108 bytes with its terminating NUL).
MAX_PATH = 107


def check_path(path: str, setting: str = "handle_socket") -> None:
    """InvalidArgument unless ``path`` can name a Unix socket (not empty, at most 107 bytes).
    ``setting``: the configuration field that chose the path (named in the message)."""
    what = setting.replace("_", " ")
    if not path:
        raise InvalidArgument(f"{what}: empty path; set {setting} to a socket path")
    if len(os.fsencode(path)) > MAX_PATH:
        raise InvalidArgument(
            f"{what} path {path!r} is {len(os.fsencode(path))} bytes; Unix sockets allow {MAX_PATH}: "
            f"set {setting} (or listen_unix) to a shorter path"
        )


def _clear_stale(path: str, setting: str, serves: str) -> None:
    """Remove a socket file nobody listens on (its owner died); refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument(f"{setting.replace('_', ' ')} path {path} exists and is not a socket; set {setting} to another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a socket file left by a dead owner
        return
    finally:
        probe.close()
    raise Unavailable(f"another process serves {serves} on {path}; stop it or set {setting} to another path")


def listen(path: str, setting: str, serves: str, *, backlog: int = 64, group: bool = False) -> tuple[socket.socket, int]:
    """Bind and listen on ``path`` (after :func:`check_path`), replacing a stale socket file and
    refusing a live one. Returns the socket, whose ``accept`` wakes every 0.1 s (closing a socket
    does not wake a blocked accept: the loop checks for a stop that often), and the inode of the
    file bound, for :func:`unlink_own`. ``serves`` says what in messages ("handles"). ``group``:
    the file is made group-writable (connecting needs write access) before anyone may connect."""
    check_path(path, setting)
    _clear_stale(path, setting, serves)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        if group:
            open_to_group(path)
        s.listen(backlog)
        s.settimeout(0.1)
        ino = os.stat(path).st_ino
    except OSError as exc:
        s.close()
        raise Unavailable(f"cannot serve {serves} on {path}: {exc}; set {setting} to a writable path") from exc
    return s, ino


def open_to_group(path: str) -> None:
    """Give the owner's group read and write on socket file ``path`` (connecting needs write
    access), keeping the owner's bits and never others'."""
    mode = os.stat(path).st_mode & 0o700
    os.chmod(path, mode | ((mode >> 3) & 0o060))


def unlink_own(path: str, ino: int) -> None:
    """Unlink ``path`` if it is still the socket file we bound (inode ``ino``), not a successor's."""
    try:
        if ino and os.stat(path).st_ino == ino:
            os.unlink(path)
    except FileNotFoundError:
        pass


def recv_exact(conn: socket.socket, n: int, timeout: float | None = None) -> bytes:
    """Exactly ``n`` bytes; ConnectionError when the peer closes first (saying after how many).
    The first recv waits as the socket's own timeout says; ``timeout``: what did not come with it
    must all come within that many seconds of it, however finely split (:func:`recv_rest`)."""
    first = conn.recv(n) if n else b""
    return first if len(first) == n else recv_rest(conn, first, n, timeout)


def recv_rest(conn: socket.socket, first: bytes, n: int, timeout: float | None) -> bytes:
    """``first`` (what one recv brought, short of ``n`` bytes) and the rest, up to ``n`` bytes.
    ``timeout``: the rest within that many seconds from now, one deadline however finely it is
    split (TimeoutError past it); None: each recv waits as the socket's timeout says. The
    socket's timeout is set before each recv and restored after: only bytes that come in pieces
    pay for those calls."""
    if not first:
        raise ConnectionError(f"peer closed the connection after 0 of {n} bytes")
    buf = bytearray(first)
    was = conn.gettimeout()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(buf)} of {n} bytes, the rest not within {timeout}s")
                conn.settimeout(left)
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
            buf += chunk
    finally:
        if deadline is not None:
            conn.settimeout(was)
    return bytes(buf)


class UnixServer:
    """An accept loop on a Unix stream socket at ``path``, in a thread of its own.

    :meth:`start` binds (:func:`listen`: a stale socket file replaced, a live one refused) and
    starts the loop; :meth:`stop` ends it, lets the subclass end its connections
    (:meth:`_end`), closes the socket and unlinks the path if it is still ours. A subclass
    handles each new connection in :meth:`_accepted` (called on the accept thread: hand the
    connection to a thread, never block) and may do housekeeping in :meth:`_tick`, called
    at least every 0.1 s."""

    def __init__(self, path: str, setting: str, serves: str, *, group: bool = False) -> None:
        check_path(path, setting)
        self.path = path
        self._group = group  # the socket file group-writable (an engine of another user connects)
        self._setting = setting  # the configuration field named in refusals
        self._serves = serves  # what it serves, in messages ("handles", "peer calls")
        self._sock: socket.socket | None = None
        self._ino = 0  # inode of the socket file we bound: stop() unlinks only that one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pause = AcceptPause(setting.replace("_", " "), path, log, self._stop.wait)

    @property
    def starved(self) -> int:
        """accept() failures for want of files or buffers (each one a pause): connections waited."""
        return self._pause.starved

    def start(self: _S) -> _S:
        self._sock, self._ino = listen(self.path, self._setting, self._serves, group=self._group)
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvd-{self._setting.removesuffix('_socket')}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, end the connections (the subclass says how), unlink the path."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._end()
        if self._sock is not None:
            self._sock.close()
        unlink_own(self.path, self._ino)

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        """Housekeeping between accepts (nothing by default)."""

    def _end(self) -> None:
        """End the connections still open, after the accept loop stopped (nothing by default)."""

    def _accept_loop(self) -> None:
        assert self._sock is not None
        what = self._pause.what
        while not self._stop.is_set():
            self._tick()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if not self._pause.failed(exc) and exc.errno != errno.ECONNABORTED:  # aborted: the client gave up while queued
                    log.warning("%s on %s: accept failed: %s", what, self.path, exc)
                continue
            self._pause.accepted()
            try:
                self._accepted(conn)
            except Exception:  # the loop must outlive any one connection: ended, it would accept none again
                log.exception("%s on %s: a new connection failed; closed it", what, self.path)
                with contextlib.suppress(OSError):
                    conn.close()


#: Any of these on a held connection that the other side never writes to unasked (a watch, an
#: idle peer-socket connection): it closed, stopped, changed something, or misbehaves.
_STIRRED = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL


def spin_readable(sock: socket.socket, spin_s: float) -> None:
    """Look for anything to read on ``sock`` (data, or its peer gone) without sleeping, for up to
    ``spin_s``; reads nothing. A reader that then blocks finds the bytes at once instead of being
    woken for them: on a VM a wake-up across virtual CPUs costs about as much as a short call
    itself. The interpreter lock is let go at each look."""
    if spin_s <= 0:
        return
    p = select.poll()
    p.register(sock.fileno(), _STIRRED)
    end = time.perf_counter() + spin_s
    while not p.poll(0) and time.perf_counter() < end:
        pass


def stirred(fds: list[int]) -> list[int]:
    """The fds among ``fds`` with any of :data:`_STIRRED` pending: one zero-timeout poll, no I/O."""
    p = select.poll()
    for fd in fds:
        p.register(fd, _STIRRED)
    return [fd for fd, _ in p.poll(0)]


#: The other side hung up (closed, shut its end) or the connection failed; never data waiting.
_HUNG_UP = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL


def hung_up(fd: int) -> bool:
    """Whether the peer of connection ``fd`` hung up: one zero-timeout poll, no data consumed
    (bytes waiting unread are no hang-up)."""
    p = select.poll()
    p.register(fd, _HUNG_UP)
    return bool(p.poll(0))
