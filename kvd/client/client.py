"""The engine-side library: a synchronous and an asyncio client with one surface.

Every call is written once, in :class:`~kvd.client.surface.Surface`: it builds the request message
and names a parser for the reply (:mod:`kvd.client.replies`). The two transports differ only in ``_call``: :class:`Client` returns the
parsed value, :class:`AsyncClient` returns an awaitable of it. gRPC errors come back as kvd's
own exception classes (:func:`kvd.rpc.status.from_rpc_error`)::

    with Client.connect("unix:/tmp/kvd.sock", name="decode-0") as kv:
        vec = kv.allocate("req-1", 4096, receive=True)
        lease = kv.acquire_lease("req-1", "recv")      # lease.ticket -> the prefill side
        kv.attach().views["full"][0].k[vec.full]       # KV of layer 0, in place

    async with await AsyncClient.connect(addr) as kv:
        vec = await kv.allocate("req-2", 128)

A session is opened on connect and kept alive by a background heartbeat; if the engine dies,
the daemon frees its requests after the session TTL.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvd.client import fast as _fast
from kvd.client.replies import Ended, LeaseInfo, PoolInfo, SendOutcomes, SendSpec, TransferStatus
from kvd.client.surface import Surface
from kvd.errors import InvalidArgument, KvdError, NotFound, SessionGone, Unavailable
from kvd.ipc.frames import MAX_FRAME
from kvd.records import SendResult, TransferState
from kvd.rpc.convert import grpc_target
from kvd.rpc.engine_wire import WAITS
from kvd.rpc.status import from_rpc_error
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

__all__ = [
    "Client", "AsyncClient", "Ended", "PoolInfo", "LeaseInfo", "TransferStatus", "SendResult", "SendSpec", "SendOutcomes",
    "TransferState",
]

log = logging.getLogger("kvd.client")
T = TypeVar("T")


def _again_or_raise(method: str, first: Any, exc: grpc.RpcError, t0: float) -> tuple[Any, float]:
    """After a gRPC call (``first`` as first sent, at ``t0``, monotonic) failed with ``exc``: the
    kvd error it is, raised -- unless it is a wait (:data:`~kvd.rpc.engine_wire.WAITS`) the daemon
    refused for now (all its waits over gRPC taken: Unavailable with a retry hint). That one is
    sent again after the returned delay, waiting what is left of its timeout (at its end, one
    call that does not wait, which is never refused)."""
    err = from_rpc_error(exc)
    if method not in WAITS or not isinstance(err, Unavailable) or err.retry_after_s is None:
        raise err from exc
    left = first.timeout_seconds - (time.monotonic() - t0)
    delay = min(err.retry_after_s, max(0.0, left))
    again = copy.copy(first)
    again.timeout_seconds = max(0.0, left - delay)
    return again, delay


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME),
    # No daemon reads more (kvd.ipc.frames; its own max_request_bytes is at most this).
    ("grpc.max_send_message_length", MAX_FRAME),
    # After the daemon restarts, a client (or a new one: by default channels share connections
    # process-wide) must reach it within a second, not after gRPC's reconnect backoff, which
    # grows to 2 minutes while the old client's heartbeats keep failing.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Client(Surface):
    """Synchronous client. Use :meth:`connect`; close (or use as a context manager) when done."""

    def __init__(
        self, channel: grpc.Channel | None, session_id: str, ttl: float, timeout: float | None, fast: _fast.FastChannel | None = None,
        *, name: str = "", boot_id: str = "",
    ) -> None:
        self._channel = channel
        self._stub = pb_grpc.KvdStub(channel) if channel is not None else None
        self._fast = fast  # the engine socket (kvd.client.fast), else gRPC
        self.transport = "fast" if fast is not None else "grpc"
        self.name = name
        self.timeout = timeout
        #: Sessions opened again after the daemon forgot one (it restarted, or reaped it).
        self.reopened = 0
        self._reopening = threading.Lock()
        self._adopt(session_id, ttl, boot_id)
        self._closed = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, name="kvd-heartbeat", daemon=True)
        self._hb.start()

    def _now(self, value: T) -> T:
        return value

    @classmethod
    def connect(
        cls, address: str, *, name: str = "", ttl: float | None = None, timeout: float | None = 30.0, transport: str = "auto",
        spin_us: float = _fast.SPIN_US,
    ) -> Client:
        """Open a session on the daemon at ``address``. ``transport``: "auto" uses the daemon's
        engine socket when it serves one beside a ``unix:`` address (the same calls, several times
        cheaper: :mod:`kvd.client.fast`) or, found nowhere beside it, where the daemon's
        OpenSession reply says it serves one (``Session.engine_socket``); else gRPC; "grpc" or
        "fast" force one ("fast": the one beside the address). ``spin_us``: over the engine
        socket, how long a call looks for its reply before its thread sleeps (CPU spent for a
        wake-up saved; 0: sleep at once)."""
        if not isinstance(spin_us, (int, float)) or isinstance(spin_us, bool) or not 0 <= spin_us <= 1e6:
            raise InvalidArgument(f"spin_us must be a number of microseconds in [0, 1e6], got {spin_us!r}")
        path = _fast.pick(address, transport)
        if path is not None:
            fc = _fast.FastChannel(path, spin_us / 1e6)
            try:
                s = fc.call("OpenSession", pb.OpenSessionRequest(name=name, ttl_seconds=ttl or 0), timeout)
                return cls(None, s.session_id, s.ttl_seconds, timeout, fast=fc, name=name, boot_id=s.boot_id)
            except Unavailable:
                fc.close()
                if transport == "fast":
                    raise  # else: a socket file nobody serves (a daemon gone); gRPC says why
            except BaseException:
                fc.close()
                raise
        channel = grpc.insecure_channel(grpc_target(address), options=_CHANNEL_OPTIONS)
        stub = pb_grpc.KvdStub(channel)
        try:
            s = stub.OpenSession(pb.OpenSessionRequest(name=name, ttl_seconds=ttl or 0), timeout=timeout)
        except grpc.RpcError as exc:
            channel.close()
            raise from_rpc_error(exc) from exc
        if (there := _fast.advertised(address, transport, s.engine_socket)) is not None:
            fc = _fast.FastChannel(there, spin_us / 1e6)
            try:
                fc.adopt(s.session_id, timeout)
            except (KvdError, OSError):
                fc.close()  # not this daemon's socket after all, or gone: the session stays on gRPC
            else:
                channel.close()
                return cls(None, s.session_id, s.ttl_seconds, timeout, fast=fc, name=name, boot_id=s.boot_id)
        return cls(channel, s.session_id, s.ttl_seconds, timeout, name=name, boot_id=s.boot_id)

    def _call(self, method: str, request: Any, parse: Callable[[Any], T]) -> T:
        return parse(self._raw(method, request, self.timeout))

    def _raw(self, method: str, request: Any, timeout: float | None) -> Any:
        if self._stale:
            raise SessionGone(f"{method}: {self._stale}")
        sid, sent = self.session_id, time.monotonic()
        try:
            if self._fast is not None:
                reply = self._fast.call(method, _fast.bounded(method, request, timeout), timeout)
            else:
                first = request  # a WaitReady sent again waits what is left of this one's timeout
                while True:
                    try:
                        reply = getattr(self._stub, method)(request, metadata=self._md, timeout=timeout)
                        break
                    except grpc.RpcError as exc:
                        request, delay = _again_or_raise(method, first, exc, sent)
                    time.sleep(delay)
        except SessionGone:
            self._reopen(sid)
            raise  # this call ran nowhere, and what the old session held is gone: its caller must know
        if sid == self.session_id:
            self._ok_at = sent  # the session was alive when this call reached the daemon, or later
        return reply

    def keep_alive(self) -> None:
        """One KeepAlive now: the session touched (alive for its TTL from here), or SessionGone."""
        self._raw("KeepAlive", pb.KeepAliveRequest(), self.timeout)

    def _reopen(self, gone: str) -> None:
        """The daemon forgot session ``gone`` (it restarted, or reaped it): open a new one with the
        same name and TTL, unless the client is closing or another call did so already. A daemon
        that does not answer leaves the client as it was (its next call tries again)."""
        with self._reopening:
            if self._closed.is_set() or self._stale or self.session_id != gone or self._stays(gone):
                return
            self._bells.close()  # the old session's board tells nothing more
            req = pb.OpenSessionRequest(name=self.name, ttl_seconds=self.ttl)
            try:
                if self._fast is not None:
                    self._fast.reset()
                    s = self._fast.call("OpenSession", req, self.timeout)
                else:
                    assert self._stub is not None
                    s = self._stub.OpenSession(req, timeout=self.timeout)
            except (KvdError, grpc.RpcError) as exc:
                self._reopened(gone, None, exc)
                return
            self._reopened(gone, s)

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.ttl / 3):
            try:
                self._raw("KeepAlive", pb.KeepAliveRequest(), self.ttl / 3)
            except Unavailable as exc:
                if exc.retry_after_s is None:  # busy is not gone: the board stays true
                    self._bells.close()  # the daemon is gone: its board tells nothing more
            except SessionGone:
                pass  # opened again (_raw): the new session maps its own board
            except NotFound:
                self._bells.close()  # a daemon that predates SessionGone forgot the session
            except KvdError:
                pass  # the next call surfaces the error; the heartbeat only keeps the session warm

    def close(self, *, free_requests: bool = True) -> None:
        """End the session and the channel. Its leases are released and its requests freed; with
        ``free_requests=False`` the daemon keeps the requests until the session's TTL runs out."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._raw("CloseSession", pb.CloseSessionRequest(free_requests=free_requests), 5)
        except KvdError:
            pass
        if self._fast is not None:
            self._fast.close()
        if self._channel is not None:
            self._channel.close()
        self._bells.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(Surface):
    """asyncio client: the same methods as :class:`Client`, each returning an awaitable."""

    def __init__(
        self, channel: grpc.aio.Channel | None, session_id: str, ttl: float, timeout: float | None,
        fast: _fast.AsyncFastChannel | None = None, *, name: str = "", boot_id: str = "",
    ) -> None:
        self._channel = channel
        self._stub = pb_grpc.KvdStub(channel) if channel is not None else None
        self._fast = fast
        self.transport = "fast" if fast is not None else "grpc"
        self.name = name
        self.timeout = timeout
        self.reopened = 0  # as Client.reopened
        self._closing = False
        self._reopening = asyncio.Lock()
        self._adopt(session_id, ttl, boot_id)
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat())

    def _now(self, value: T) -> T:
        async def done() -> T:
            return value

        return done()  # type: ignore[return-value]  # an awaitable of T

    @classmethod
    async def connect(
        cls, address: str, *, name: str = "", ttl: float | None = None, timeout: float | None = 30.0, transport: str = "auto"
    ) -> AsyncClient:
        """As :meth:`Client.connect` (``transport`` too)."""
        path = _fast.pick(address, transport)
        if path is not None:
            fc = _fast.AsyncFastChannel(path)
            try:
                s = await fc.call("OpenSession", pb.OpenSessionRequest(name=name, ttl_seconds=ttl or 0), timeout)
                return cls(None, s.session_id, s.ttl_seconds, timeout, fast=fc, name=name, boot_id=s.boot_id)
            except Unavailable:
                await fc.close()
                if transport == "fast":
                    raise
            except BaseException:
                await fc.close()
                raise
        channel = grpc.aio.insecure_channel(grpc_target(address), options=_CHANNEL_OPTIONS)
        stub = pb_grpc.KvdStub(channel)
        try:
            s = await stub.OpenSession(pb.OpenSessionRequest(name=name, ttl_seconds=ttl or 0), timeout=timeout)
        except grpc.RpcError as exc:
            await channel.close()
            raise from_rpc_error(exc) from exc
        if (there := _fast.advertised(address, transport, s.engine_socket)) is not None:
            fc = _fast.AsyncFastChannel(there)
            try:
                await fc.adopt(s.session_id, timeout)
            except (KvdError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                await fc.close()
            else:
                await channel.close()
                return cls(None, s.session_id, s.ttl_seconds, timeout, fast=fc, name=name, boot_id=s.boot_id)
        return cls(channel, s.session_id, s.ttl_seconds, timeout, name=name, boot_id=s.boot_id)

    def _call(self, method: str, request: Any, parse: Callable[[Any], T]) -> T:
        async def go():
            return parse(await self._raw(method, request, self.timeout))

        return go()  # type: ignore[return-value]  # an awaitable of T

    async def _raw(self, method: str, request: Any, timeout: float | None) -> Any:
        if self._stale:
            raise SessionGone(f"{method}: {self._stale}")
        sid, sent = self.session_id, time.monotonic()
        try:
            if self._fast is not None:
                reply = await self._fast.call(method, _fast.bounded(method, request, timeout), timeout)
            else:
                first = request  # as the sync client
                while True:
                    try:
                        reply = await getattr(self._stub, method)(request, metadata=self._md, timeout=timeout)
                        break
                    except grpc.RpcError as exc:
                        request, delay = _again_or_raise(method, first, exc, sent)
                    await asyncio.sleep(delay)
        except SessionGone:
            await self._reopen(sid)
            raise  # as the sync client: the call at hand ran nowhere
        if sid == self.session_id:
            self._ok_at = sent
        return reply

    async def keep_alive(self) -> None:
        """As :meth:`Client.keep_alive`."""
        await self._raw("KeepAlive", pb.KeepAliveRequest(), self.timeout)

    async def _reopen(self, gone: str) -> None:
        """As :meth:`Client._reopen`."""
        async with self._reopening:
            if self._closing or self._stale or self.session_id != gone or self._stays(gone):
                return
            self._bells.close()
            req = pb.OpenSessionRequest(name=self.name, ttl_seconds=self.ttl)
            try:
                if self._fast is not None:
                    self._fast.reset()
                    s = await self._fast.call("OpenSession", req, self.timeout)
                else:
                    assert self._stub is not None
                    s = await self._stub.OpenSession(req, timeout=self.timeout)
            except (KvdError, grpc.RpcError) as exc:
                self._reopened(gone, None, exc)
                return
            self._reopened(gone, s)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self._raw("KeepAlive", pb.KeepAliveRequest(), self.ttl / 3)
            except Unavailable as exc:
                if exc.retry_after_s is None:
                    self._bells.close()  # as the sync client's heartbeat
            except SessionGone:
                pass
            except NotFound:
                self._bells.close()
            except KvdError:
                pass

    async def close(self, *, free_requests: bool = True) -> None:
        self._closing = True
        self._hb.cancel()
        try:
            await self._raw("CloseSession", pb.CloseSessionRequest(free_requests=free_requests), 5)
        except KvdError:
            pass
        if self._fast is not None:
            await self._fast.close()
        if self._channel is not None:
            await self._channel.close()
        self._bells.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
