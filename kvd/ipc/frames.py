"""Frames of protobuf messages on a held Unix stream socket: what kvd's two socket transports share.

The peer socket (:mod:`kvd.server.peer_socket`: a sender's calls to a receiving daemon) and the
engine socket (:mod:`kvd.server.engine_socket`: an engine's calls to its own daemon) carry the
v1 protobuf messages of their gRPC services unchanged, one per frame, both ways::

    [u32 n][u8 kind][n bytes: one protobuf message]          (n: big-endian; see MAX_REQUEST, MAX_FRAME)

A request's kind is its method id (each transport's table); a reply's kind is :data:`OK` (the
rpc's response) or :data:`REFUSED` (a ``PeerStatus``: code, message and metadata of
:func:`kvd.errors.to_status`, raised again by the caller through :func:`kvd.errors.from_status`),
or :data:`EVICTED` (a ``PeerStatus`` too, UNAVAILABLE: the server closed the connection without
reading the request, so nothing of it ran; a client that knows the kind sends it again on another
connection, one that does not raises the Unavailable). Kind :data:`HELLO` opens a connection where
the transport has one.
"""

from __future__ import annotations

import socket
import struct

from google.protobuf.message import Message

from kvd.ipc.unix_socket import recv_exact, recv_rest, spin_readable

__all__ = ["HEAD", "HELLO", "OK", "REFUSED", "EVICTED", "MAX_FRAME", "MAX_REQUEST", "frame", "read_head", "read_frame"]

HEAD = struct.Struct(">IB")
#: Kind of the first frame of a connection, both ways.
HELLO = 0
#: Reply kinds: the rpc's response message, or a PeerStatus refusal.
OK, REFUSED = 0, 1
#: Reply kind of a connection closed to make room (:class:`kvd.server.framed.FramedServer`): the
#: request it answers was never read.
EVICTED = 2
#: The largest reply a client reads (and a daemon sends), on these sockets and over gRPC: a
#: daemon's answer lists what it holds (GetActivity, GetVectors of many requests).
MAX_FRAME = 64 << 20
#: The largest request a daemon reads by default (its ``max_request_bytes``), on these sockets
#: and over gRPC: gRPC's own default receive limit. A request is ids, counts, short strings and
#: tickets (~4 bytes per page of each group): 4 MiB is some 14,000 request ids of the longest
#: kind, or a ticket of a million pages. The bound is what a flood of calls can make a daemon
#: hold: each call being read costs about five times its request in copies (transport, bytes,
#: message, strings), and gRPC reads one per thread. Clients check requests against
#: :data:`MAX_FRAME`, the most any daemon may be set to read.
MAX_REQUEST = 4 << 20


def frame(kind: int, msg: Message) -> bytes:
    """One frame: ``msg`` serialised behind its head."""
    body = msg.SerializeToString()
    return HEAD.pack(len(body), kind) + body


def read_head(sock: socket.socket, timeout: float | None = None) -> tuple[int, int] | None:
    """``(body length, kind)`` of the next frame, or None when the peer closed between frames.
    The first bytes wait as the socket's timeout says (a connection idle between frames); a head
    begun must be whole within ``timeout`` seconds of them (TimeoutError; None: no limit)."""
    first = sock.recv(HEAD.size)
    if not first:
        return None
    if len(first) < HEAD.size:
        first = recv_rest(sock, first, HEAD.size, timeout)
    n, kind = HEAD.unpack(first)
    return n, kind


def read_frame(sock: socket.socket, limit: int = MAX_FRAME, spin_s: float = 0.0) -> tuple[int, bytes]:
    """``(kind, body)`` of the next frame (a caller reading a reply). ConnectionError when the
    peer closed, or sent a frame over ``limit`` bytes (the stream cannot be followed past it).

    ``spin_s``: first look for the reply without sleeping, for up to that long
    (:func:`~kvd.ipc.unix_socket.spin_readable`), then wait as the socket's timeout says: up to
    ``spin_s`` of this thread's CPU for a wake-up saved."""
    spin_readable(sock, spin_s)
    # One recv usually brings head and body together (replies are small): read what is there.
    buf = sock.recv(65536)
    if not buf:
        raise ConnectionError("the daemon closed the connection")
    if len(buf) < HEAD.size:
        buf += recv_exact(sock, HEAD.size - len(buf))
    n, kind = HEAD.unpack_from(buf)
    if n > limit:
        raise ConnectionError(f"a frame of {n:,d} bytes exceeds the {limit:,d}-byte limit")
    have = len(buf) - HEAD.size
    if have > n:
        raise ConnectionError(f"{have - n} bytes past the end of a {n:,d}-byte frame: the stream is out of step")
    body = buf[HEAD.size:] if have == n else buf[HEAD.size:] + recv_exact(sock, n - have)
    return kind, body
