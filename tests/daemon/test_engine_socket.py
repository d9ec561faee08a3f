"""The engine socket (issue 16): the Kvd service framed on a held Unix socket beside the gRPC
listener. Raw frames here; the client tests run over it through the ``transport`` fixture."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import proc_kit
import pytest
from daemon_kit import expect, rid, start_inproc, stop_inproc

from kvd import errors as E
from kvd.client import Client
from kvd.ipc.frames import HEAD, HELLO, OK, REFUSED, frame, read_frame
from kvd.rpc.engine_wire import METHOD_IDS, METHODS, fast_path
from kvd.server import framed
from kvd.v1 import kvd_pb2 as pb


def _raw(target) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(fast_path(target.unix.removeprefix("unix:")))
    return s


def _status(s: socket.socket) -> pb.PeerStatus:
    kind, body = read_frame(s)
    assert kind == REFUSED, f"expected a refusal, got kind {kind}"
    return pb.PeerStatus.FromString(body)


def test_every_kvd_rpc_has_a_frame_kind():
    served = {m.name for m in METHODS.values()}
    assert served == {m.name for m in pb.DESCRIPTOR.services_by_name["Kvd"].methods}
    assert sorted(METHODS) == list(range(1, len(METHODS) + 1))


def test_bytes_that_do_not_parse_are_invalid_argument_naming_the_method(target):
    with _raw(target) as s:
        s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="raw")))
        assert read_frame(s)[0] == OK
        junk = b"\xff\xff\xff"
        s.sendall(HEAD.pack(len(junk), METHOD_IDS["Allocate"]) + junk)
        st = _status(s)
        assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "Allocate" in st.message, st
        s.sendall(HEAD.pack(0, 200))  # an unknown method: refused, the connection goes on
        st = _status(s)
        assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "unknown method id 200" in st.message, st
        s.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest(payload=b"x")))
        kind, body = read_frame(s)
        assert kind == OK and pb.EchoResponse.FromString(body).payload == b"x"


def test_a_call_before_a_session_is_refused_as_over_grpc(target):
    with _raw(target) as s:
        s.sendall(frame(METHOD_IDS["Allocate"], pb.AllocateRequest(requests=[pb.AllocSpec(rid=rid(), tokens=16)])))
        st = _status(s)
        assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no session" in st.message, st


def test_a_hello_naming_an_unknown_session_is_refused_and_closed(target):
    with _raw(target) as s:
        s.sendall(frame(HELLO, pb.Session(session_id="not-a-session")))
        st = _status(s)
        assert st.code == grpc.StatusCode.NOT_FOUND.value[0] and "unknown or expired" in st.message, st
        assert s.recv(1) == b""  # closed


def test_a_connection_acts_for_its_own_session_only(target):
    a = target.connect(name="owner")
    r = rid("own")
    a.allocate(r, 16)
    b = target.connect(name="other")
    with expect(E.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, "another client session"):
        b.vectors(r)
    assert a.free(r) == 1


def test_a_blocking_wait_does_not_hold_up_the_clients_other_calls(target):
    c = target.connect(name="waiter")
    r = rid("wait")
    v, lease = c.allocate_recv(r, 16)
    assert lease.ticket and v.tokens == 16
    done = []
    t = threading.Thread(target=lambda: done.append(c.wait_ready(r, 1.0)))
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    assert c.echo(b"hi") == b"hi"  # on another connection of the same client
    took = time.perf_counter() - t0
    assert not done and took < 0.5, (done, took)
    t.join(5)
    assert done and done[0].state.name == "WAITING"
    c.release_lease(lease.lease_id)
    c.free(r)


def test_transport_choice(target):
    assert target.connect(transport="auto").transport == "fast"
    assert target.connect(transport="grpc").transport == "grpc"
    assert target.connect(tcp=True, transport="auto").transport == "grpc"  # TCP: gRPC only
    with pytest.raises(E.InvalidArgument, match="no engine socket"):
        Client.connect(target.tcp, transport="fast")
    with pytest.raises(E.InvalidArgument, match="transport must be one of"):
        Client.connect(target.unix, transport="carrier-pigeon")


def test_allocate_with_lease_is_all_or_nothing(inproc, monkeypatch):
    c = inproc.connect(name="fused")
    node = inproc.node
    before = node.stats()

    def refuse(*a, **kw):
        raise E.FailedPrecondition("refused for the test")

    monkeypatch.setattr(node, "acquire_lease", refuse)
    with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "refused for the test"):
        c.allocate_recv(rid("fused"), 64)
    after = node.stats()
    assert after.pool.requests_live == before.pool.requests_live and after.leases_live == before.leases_live
    assert [g.used_pages for g in after.pool.groups] == [g.used_pages for g in before.pool.groups]
    node.check()


def test_the_doorbell_board_goes_to_a_session_only_and_read_only(target):
    from kvd.client.fast import fetch_doorbells
    from kvd.rpc.engine_wire import DOORBELLS

    path = fast_path(target.unix.removeprefix("unix:"))
    with _raw(target) as s:
        s.sendall(HEAD.pack(0, DOORBELLS))  # no session yet: refused, the connection goes on
        st = _status(s)
        assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "need a session" in st.message, st
        s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="raw")))
        kind, body = read_frame(s)
        sid = pb.Session.FromString(body).session_id
        s.sendall(HEAD.pack(3, DOORBELLS) + b"abc")  # a body: refused and closed
        st = _status(s)
        assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no body" in st.message, st
        try:
            assert s.recv(1) == b""  # closed (reset, when the unread body was still there)
        except ConnectionResetError:
            pass
    view, boot = fetch_doorbells(path, sid, 5)
    try:
        assert boot and view.slots > 0
        with pytest.raises(TypeError):
            view._map[0] = 1  # type: ignore[index]  # mapped read-only
    finally:
        view.close()
    with expect(E.SessionGone, grpc.StatusCode.NOT_FOUND, "unknown or expired"):
        fetch_doorbells(path, "no-such-session", 5)


def test_no_engine_can_write_or_shrink_the_doorbell_board(target):
    """The descriptor an engine gets is read-only, and the board is sealed: reopened read-write
    through /proc (a memfd's mode lets anyone), it still cannot be mapped writable, written or
    resized, so no engine changes another's state or pulls the board from under the daemon."""
    import mmap
    import os

    from kvd.rpc.engine_wire import DOORBELLS

    with _raw(target) as s:
        s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="raw-bells")))
        assert read_frame(s)[0] == OK
        s.sendall(HEAD.pack(0, DOORBELLS))
        data, fds, _, _ = socket.recv_fds(s, 4096, 1)
    assert len(fds) == 1 and data[HEAD.size - 1] == OK
    fd = fds[0]
    rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        assert size > 0
        for f in (fd, rw):
            with pytest.raises(PermissionError):
                mmap.mmap(f, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.write(rw, b"\x03")
        with pytest.raises(PermissionError):
            os.ftruncate(rw, 0)
        assert os.fstat(fd).st_size == size
    finally:
        os.close(rw)
        os.close(fd)


def test_a_client_whose_daemon_stopped_reads_no_doorbell(tmp_path):
    """A dead daemon's board stays as it was in the client's mapping: the client's heartbeat, once
    the daemon no longer answers, drops the board, so nothing reads a frozen state as current."""
    import daemon_kit as dk

    from kvd.client import TransferState

    t = dk.start_inproc(tmp_path, backend="local")
    c = Client.connect(t.unix, name="bells", ttl=0.6, transport="fast")
    try:
        _, lease = c.allocate_recv(rid("bell-dead"), 16)
        assert lease.bell and c.doorbell(lease.rid) is TransferState.WAITING
        dk.stop_inproc(t)
        end = time.monotonic() + 3.0
        while c.doorbell(lease.rid) is not None and time.monotonic() < end:
            time.sleep(0.05)
        assert c.doorbell(lease.rid) is None
        with expect(E.Unavailable, grpc.StatusCode.UNAVAILABLE, "engine socket"):
            c.wait_ready(lease.rid, 0)
    finally:
        c.close()


def test_a_busy_refusal_says_when_to_retry_and_keeps_the_doorbells(inproc, monkeypatch):
    """All connection slots taken (by other engines' connections): a new connection is refused
    Unavailable with a retry hint, and the client's heartbeat, refused so, keeps the doorbell
    board (the daemon is up: its board is true); only a daemon gone (no hint) drops it (the
    test above)."""
    from kvd.client import TransferState
    from kvd.client import fast as client_fast
    from kvd.server.framed import BUSY_RETRY_S

    es = inproc.daemon.engine_socket
    c = Client.connect(inproc.unix, name="busy-bells", ttl=3.0, transport="fast")
    others: list[socket.socket] = []
    try:
        _, lease = c.allocate_recv(rid("bell-busy"), 16)
        assert c.doorbell(lease.rid) is TransferState.WAITING
        monkeypatch.setattr(client_fast, "KEEP", 0)  # every call of this client opens a connection
        with c._fast._lock:  # and none it kept serves one (a call in flight closes its own after)
            kept, c._fast._free = c._fast._free, []
        for s, _ in kept:
            s.close()
        limit = es.max_connections
        es.max_connections = es.connections + 2
        go, entered = _stuck_echo(es, monkeypatch)
        # The last slots, held by other engines' calls in progress (until one is refused); twice:
        # a call of this client in flight meanwhile (its heartbeat) frees its slot only after.
        for _ in range(2):
            time.sleep(0.2)
            while True:
                s = _raw(inproc)
                try:
                    s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="slot-holder")))
                    refused = read_frame(s)[0] == REFUSED
                except (BrokenPipeError, ConnectionResetError):
                    refused = True  # refused and closed before the request went out
                if refused:
                    s.close()
                    break
                others.append(s)
                _busy(s, entered)
                assert len(others) <= 16, "no slot was ever refused"
        refused = es.refused
        try:
            end = time.monotonic() + 5.0
            while es.refused == refused and time.monotonic() < end:  # a heartbeat (every ttl/3) refused
                time.sleep(0.02)
            assert es.refused > refused, "the heartbeat never called"
            time.sleep(0.1)  # the heartbeat's handling of the refusal
            assert c.doorbell(lease.rid) is TransferState.WAITING, "a busy daemon's board was dropped"
            with expect(E.Unavailable, grpc.StatusCode.UNAVAILABLE, "connections already") as info:
                c.vectors(lease.rid)
            assert info.value.retry_after_s == BUSY_RETRY_S
        finally:
            es.max_connections = limit
            go.set()
        assert c.vectors(lease.rid).rid == lease.rid  # served again once a slot is free
    finally:
        for s in others:
            s.close()
        c.close()


def _in_wait(s: socket.socket, name: str, timeout: float = 30.0) -> None:
    """Put connection ``s`` (its session open) in a WaitReady on a transfer of its own that nobody
    sends (answered at ``timeout``, when ``s`` closes, or when the daemon cuts it short)."""
    r = rid(name)
    s.sendall(frame(METHOD_IDS["Allocate"], pb.AllocateRequest(requests=[pb.AllocSpec(rid=r, tokens=16, receive=True, lease=True)])))
    assert read_frame(s)[0] == OK
    s.sendall(frame(METHOD_IDS["WaitReady"], pb.WaitRequest(rid=r, timeout_seconds=timeout)))


def _stuck_echo(es, monkeypatch) -> tuple[threading.Event, threading.Semaphore]:
    """The engine socket's Echo handler made to block until the returned event is set: a call
    whose handler runs (a handler is never evicted, unlike an idle connection or a wait). The
    semaphore is released as each call enters it."""
    go, entered = threading.Event(), threading.Semaphore(0)
    echo = es._handlers[METHOD_IDS["Echo"]]

    def stuck(request, ctx):
        entered.release()
        go.wait(30)
        return echo(request, ctx)

    monkeypatch.setitem(es._handlers, METHOD_IDS["Echo"], stuck)
    return go, entered


def _busy(s: socket.socket, entered: threading.Semaphore) -> None:
    """Keep connection ``s`` in a call whose handler runs (an Echo, with :func:`_stuck_echo`), and
    return once it does (until then the connection idles, and the next one would evict it)."""
    s.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest()))
    assert entered.acquire(timeout=5), "the held call never reached its handler"


def _session_conn(t, name: str) -> socket.socket:
    """A raw connection of a session of its own, idle after its OpenSession."""
    s = _raw(t)
    # A raw connection sends no KeepAlive: its session lives as long as a test on a loaded runner
    s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name=name, ttl_seconds=120)))
    assert read_frame(s)[0] == OK
    return s


def _idle_order(es) -> list[socket.socket]:
    """The server's ends waiting for their next frame, idle longest first (the order it evicts)."""
    with es._lock:
        return list(es._waiting)


def _server_side(es, before: set) -> socket.socket:
    """The server's end of the one connection opened since ``before`` (a set of its ends)."""
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        with es._lock:
            new = set(es._conns) - before
        if new:
            (conn,) = new
            return conn
        time.sleep(0.005)
    raise AssertionError("the server never took the connection")


def test_a_new_connection_evicts_the_one_idle_longest(tmp_path):
    """Idle connections holding every slot (a client that leaks them, or a hoarder) lock no engine
    out: a new connection takes the place of the one idle longest, which is answered EVICTED (a
    PeerStatus UNAVAILABLE: what a client that predates the kind raises) and closed; the others
    go on."""
    import daemon_kit as dk

    from kvd.ipc.frames import EVICTED

    t = dk.start_inproc(tmp_path, metrics_port=0)
    es = t.daemon.engine_socket
    held = []
    try:
        es.max_connections = es.connections + 3
        ends = []
        for i in range(3):  # idle in this order: each reader back in its read before the next opens
            with es._lock:
                before = set(es._conns)
            held.append(_session_conn(t, f"hoarder-{i}"))
            ends.append(_server_side(es, before))
            assert _until(lambda: ends[-1] in es._waiting, 2.0)
        held[0].sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest()))  # in use since: no longer the longest idle
        assert read_frame(held[0])[0] == OK
        assert _until(lambda: _idle_order(es)[-1:] == [ends[0]], 2.0)  # its reader waiting again, last
        c = Client.connect(t.unix, name="newcomer", transport="fast")
        try:
            assert c.echo(b"in") == b"in"  # served: its connection evicted one
        finally:
            c.close()
        kind, body = read_frame(held[1])  # the one idle longest
        assert kind == EVICTED
        st = pb.PeerStatus.FromString(body)
        assert st.code == grpc.StatusCode.UNAVAILABLE.value[0] and "was not read: send it again" in st.message
        assert E.from_status(st.code, st.message, dict(st.metadata)).retry_after_s == 0.0  # up: a client keeps its board
        assert held[1].recv(1) == b""  # then closed
        assert _until(lambda: es.evicted == 1, 2.0)
        assert _until(lambda: es.connections == 2, 2.0)  # hoarders 0 and 2 (the newcomer closed, its thread ending)
        m = dk.samples(dk.scrape(t.metrics_port))  # what an operator sees: a client leaking or hoarding
        assert m[("kvd_engine_socket_closed_total", (("reason", "evicted"),))] == 1
        assert m[("kvd_engine_socket_closed_total", (("reason", "refused"),))] == 0
        assert m[("kvd_engine_socket_connections", ())] == 2
        assert m[("kvd_engine_socket_max_connections", ())] == es.max_connections
        for s in (held[0], held[2]):
            s.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest(payload=b"still")))
            kind, body = read_frame(s)
            assert kind == OK and pb.EchoResponse.FromString(body).payload == b"still"
        assert es.refused == 0
    finally:
        for s in held:
            s.close()
        dk.stop_inproc(t)


def test_waits_holding_every_slot_lock_no_engine_out(tmp_path):
    """Every slot in a WaitReady (hoarded waits, or an engine waiting per transfer) and none idle:
    a new connection cuts short the wait parked longest -- a wait only reads -- answered EVICTED
    and closed, and is served; the other waits go on. A client whose wait was cut asks again on
    another connection, waiting only what is left of its timeout."""
    import daemon_kit as dk

    from kvd.client import TransferState
    from kvd.ipc.frames import EVICTED

    t = dk.start_inproc(tmp_path, metrics_port=0)
    es = t.daemon.engine_socket
    held: list[socket.socket] = []
    c = Client.connect(t.unix, name="waiter", ttl=60.0, transport="fast")  # no heartbeat in the test's time
    try:
        r = rid("cut-short")
        c.allocate_recv(r, 16)
        got: dict = {}

        def wait() -> None:
            t0 = time.monotonic()
            got["state"] = c.wait_ready(r, timeout=1.5).state
            got["s"] = time.monotonic() - t0

        waiter = threading.Thread(target=wait)
        waiter.start()  # the client's one connection, parked first
        assert _until(lambda: len(es._parked) == 1, 2.0)
        held = [_session_conn(t, f"waiting-{i}") for i in range(2)]
        for i, s in enumerate(held):  # parked in this order (the next one sent once this one waits)
            _in_wait(s, f"waiting-{i}")
            assert _until(lambda: len(es._parked) == 2 + i, 2.0)
        es.max_connections = es.connections  # every slot in a wait, none idle
        newcomer = _session_conn(t, "newcomer")  # served: the wait parked longest was cut for it
        newcomer.close()
        waiter.join(5)
        assert got["state"] is TransferState.WAITING  # nobody sent: answered at its timeout ...
        assert 1.4 < got["s"] < 2.5, f"... the first one, not a second timeout after the cut: {got['s']:.2f} s"
        assert es.cut == 1 and es.evicted == 0 and es.refused == 0  # counted apart from idle connections evicted
        m = dk.samples(dk.scrape(t.metrics_port))
        assert m[("kvd_engine_socket_closed_total", (("reason", "cut"),))] == 1
        for s in held:  # parked later: still waiting, never cut
            s.settimeout(0.2)
            with pytest.raises(TimeoutError):
                s.recv(1)
        # A raw waiter cut short sees the EVICTED answer, then the close.
        c.close()  # its connection idle in its pool would go first
        assert _until(lambda: es.connections == 2, 2.0)
        es.max_connections = es.connections
        extra = _raw(t)
        held[0].settimeout(5)
        kind, body = read_frame(held[0])
        assert kind == EVICTED and "cut this wait short" in pb.PeerStatus.FromString(body).message
        assert held[0].recv(1) == b""
        extra.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest(payload=b"in")))
        assert read_frame(extra)[0] == OK  # the connection it made room for is served
        extra.close()
    finally:
        for s in held:
            s.close()
        c.close()
        dk.stop_inproc(t)


def test_a_request_on_a_connection_being_evicted_is_never_run(tmp_path):
    """The race: a request that reaches a connection already chosen for eviction is answered
    EVICTED, unread, and nothing of it runs (the client sends it again elsewhere)."""
    import daemon_kit as dk

    from kvd.ipc.frames import EVICTED

    t = dk.start_inproc(tmp_path)
    es = t.daemon.engine_socket
    c = Client.connect(t.unix, name="check", transport="grpc")
    try:
        with es._lock:
            before = set(es._conns)
        r = rid("raced")
        s = _session_conn(t, "racer")
        conn = _server_side(es, before)
        assert _until(lambda: conn in es._waiting, 2.0)  # its reader back in its read, after the OpenSession
        with es._lock:  # the reader, woken by the request, waits for this lock to see its fate
            s.sendall(frame(METHOD_IDS["Allocate"], pb.AllocateRequest(requests=[pb.AllocSpec(rid=r, tokens=16)])))
            time.sleep(0.05)
            assert conn in es._waiting
            del es._waiting[conn]
            es._evicting.add(conn)
        kind, _ = read_frame(s)
        assert kind == EVICTED
        with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, r):
            c.vectors(r)
        t.daemon.node.pool.check()
        s.close()
    finally:
        c.close()
        dk.stop_inproc(t)


@pytest.mark.parametrize("flavour", ["sync", "asyncio", "no resend"])
def test_a_call_on_an_evicted_connection_is_sent_again_once(tmp_path, flavour, monkeypatch):
    """A client's pooled connection evicted while idle (by a new connection of another engine):
    its next call is sent again on a new connection and runs exactly once. Negative control ("no
    resend"): a client that does not send it again raises Unavailable, and the call did not run."""
    import asyncio

    import daemon_kit as dk

    from kvd.client import AsyncClient
    from kvd.client import fast as client_fast

    t = dk.start_inproc(tmp_path)
    es = t.daemon.engine_socket
    others: list[socket.socket] = []
    r = rid("once")

    def fill() -> None:  # every slot taken; the next connection evicts the longest idle: this client's
        # Each reader back in its read after its last reply (until then it counts as in a call).
        assert _until(lambda: set(es._waiting) == set(es._conns), 2.0)
        es.max_connections = es.connections
        others.append(_session_conn(t, "newcomer"))
        end = time.monotonic() + 2.0
        while es.evicted < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert es.evicted == 1
        # The newcomer's reader back in its read after the OpenSession: the client's next
        # connection evicts it (before that, it counts as in a call, and the client is refused).
        assert _until(lambda: set(es._waiting) == set(es._conns) - es._evicting, 2.0)

    try:
        if flavour == "no resend":
            monkeypatch.setattr(client_fast, "RESENDS", 0)
            c = Client.connect(t.unix, name="pooled", transport="fast")
            try:
                fill()
                # The daemon's EVICTED reply, read after the write failed ("the request was not
                # read"), or, were none there, the client's own "before the request was written".
                with expect(E.Unavailable, grpc.StatusCode.UNAVAILABLE, "the request was"):
                    c.allocate(r, 16)
                with expect(E.NotFound, grpc.StatusCode.NOT_FOUND, r):
                    c.vectors(r)
            finally:
                c.close()
        elif flavour == "sync":
            c = Client.connect(t.unix, name="pooled", transport="fast")
            assert isinstance(c._fast, client_fast.FastChannel)
            try:
                with c._fast._lock:
                    assert len(c._fast._free) == 1  # the one connection it opened, idle in its pool
                fill()
                c.allocate(r, 16)
                # Its new connection took the place of the newcomer's, idle longest by then.
                assert _until(lambda: es.evicted == 2, 2.0) and es.refused == 0
                assert c.vectors(r).tokens == 16
            finally:
                c.close()
        else:
            async def go() -> None:
                c = await AsyncClient.connect(t.unix, name="pooled", transport="fast")
                try:
                    assert len(c._fast._free) == 1
                    fill()
                    await c.allocate(r, 16)
                    assert (await c.vectors(r)).tokens == 16
                finally:
                    await c.close()

            asyncio.run(go())
        t.daemon.node.pool.check()
        assert t.daemon.node.pool.stats().requests_live == 0  # closed clients freed theirs: allocated once
    finally:
        for s in others:
            s.close()
        dk.stop_inproc(t)


def _short_timeout(target, seconds: float = 0.3):
    """The in-process daemon's engine socket, its frame timeout made short for the test (the
    daemon passes none: the server's default stands)."""
    es = target.daemon.engine_socket
    es.timeout = seconds
    return es


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the daemon closes ``s`` within ``seconds`` (reading, never writing)."""
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_silent_connection_without_a_session_is_closed_after_timeout(inproc):
    """Opened and left silent, or one byte of a head sent: neither holds a connection thread
    past ``timeout`` (256 of them would refuse every engine); a connection with a session idles
    on (a client pools them between calls)."""
    es = _short_timeout(inproc)
    with _raw(inproc) as pooled:
        pooled.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="pooled")))
        assert read_frame(pooled)[0] == OK
        dropped = es.dropped
        with _raw(inproc) as silent, _raw(inproc) as begun:
            begun.sendall(b"\x00")  # one byte of a five-byte head
            assert _closed_within(silent, 3.0), "a connection that acts for no session must not idle without limit"
            assert _closed_within(begun, 3.0)
        assert es.dropped >= dropped + 2
        time.sleep(3 * es.timeout)
        pooled.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest(payload=b"still")))
        kind, body = read_frame(pooled)
        assert kind == OK and pb.EchoResponse.FromString(body).payload == b"still"


def test_a_head_begun_on_a_session_connection_must_end_within_timeout(inproc):
    es = _short_timeout(inproc)
    with _raw(inproc) as s:
        s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="half-head")))
        assert read_frame(s)[0] == OK
        dropped = es.dropped
        s.sendall(b"\x00\x00")  # two bytes of a head, on a connection that may idle without limit
        assert _closed_within(s, 3.0), "the rest of a head begun must come within timeout"
    assert es.dropped == dropped + 1


def test_a_body_dripped_byte_by_byte_is_cut_off_within_its_deadline(inproc):
    """A byte every 0.1 s beats a per-recv timeout of 0.3 s for ever; the body has one deadline
    (its rest within ``timeout`` of its first bytes), so the connection is dropped."""
    es = _short_timeout(inproc)
    with _raw(inproc) as s:
        s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="drip")))
        assert read_frame(s)[0] == OK
        dropped = es.dropped
        s.sendall(HEAD.pack(1000, METHOD_IDS["Echo"]))
        end = time.monotonic() + 5.0  # the body's bound is 2 x timeout (0.6 s) from the head
        cut = False
        while not cut and time.monotonic() < end:
            try:
                s.sendall(b"\x00")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
            time.sleep(0.1)
        assert cut, "a body dripped slower than its deadline but faster than a per-recv timeout was never cut off"
    assert es.dropped == dropped + 1


def test_bodies_read_at_once_are_bounded_across_connections(inproc):
    """Each connection could park a body of up to MAX_REQUEST; the bytes of bodies being read in
    pieces at once have one budget across connections: a body that would pass it is refused
    RESOURCE_EXHAUSTED and its connection closed; a body that comes whole is never counted."""
    es = _short_timeout(inproc, 3.0)
    body = pb.EchoRequest(payload=b"x" * 900).SerializeToString()
    es.body_budget = len(body) + len(body) // 2  # room for one such body in pieces, not two
    with _raw(inproc) as a, _raw(inproc) as b:
        a.sendall(HEAD.pack(len(body), METHOD_IDS["Echo"]) + body[:1])
        end = time.monotonic() + 1.0
        while getattr(es, "_reading", None) != len(body) and time.monotonic() < end:
            time.sleep(0.01)  # until a's body, begun, is counted
        b.sendall(HEAD.pack(len(body), METHOD_IDS["Echo"]) + body[:1])
        st = _status(b)
        assert st.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "budget of bodies read at once" in st.message, st
        assert not st.metadata, "a transport's limit, not the pool's capacity (no kvd error class)"
        assert _closed_within(b, 3.0)
        a.sendall(body[1:])
        kind, out = read_frame(a)
        assert kind == OK and pb.EchoResponse.FromString(out).payload == b"x" * 900
        assert es._reading == 0
        a.sendall(HEAD.pack(len(body), METHOD_IDS["Echo"]) + body)  # whole at once: one recv, not counted
        assert read_frame(a)[0] == OK


def _waiting(target, n: int, name: str) -> tuple[Client, list[socket.socket]]:
    """``n`` raw connections of one session, each blocked in a WaitReady of an hour. The session's
    client is not the target's: closing the target's clients (which frees their requests, and so
    ends their waits) leaves it."""
    c = Client.connect(target.unix, name=name, transport="fast")
    socks = []
    for i in range(n):
        r = rid(f"{name}-{i}")
        c.allocate_recv(r, 16)
        s = _raw(target)
        s.sendall(frame(HELLO, pb.Session(session_id=c.session_id)))
        assert read_frame(s)[0] == OK
        s.sendall(frame(METHOD_IDS["WaitReady"], pb.WaitRequest(rid=r, timeout_seconds=3600)))
        socks.append(s)
    return c, socks


def _until(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def test_a_wait_its_caller_abandoned_frees_its_connection(inproc):
    """The engine closed the connection of a WaitReady of an hour: the daemon's thread notices at
    its next wake-up (every 0.1 s) and lets the connection go."""
    es = inproc.daemon.engine_socket
    c, socks = _waiting(inproc, 3, "abandon")
    try:
        assert _until(lambda: es.connections >= 4, 2.0)  # the client's own, and three waits
        before = es.connections
        for s in socks:
            s.close()
        assert _until(lambda: es.connections == before - 3, 3.0), f"{es.connections} connections open, want {before - 3}"
    finally:
        c.close()


def test_stop_ends_waits_in_progress_promptly(tmp_path):
    """A WaitReady in progress ends once the server stops (its context is no longer active),
    so stop does not wait out each wait's join in turn."""
    import daemon_kit as dk

    t = dk.start_inproc(tmp_path)
    assert t.daemon is not None
    t.daemon.engine_socket.timeout = 2.0
    c, socks = _waiting(t, 3, "stop")
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        t.daemon.stop(0)
        took = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
        c.close()
        dk.stop_inproc(t)
    assert took < 2.0, f"stop took {took:.1f}s with three waits in progress (each could hold it timeout + 1 s)"


def test_stop_joins_its_connections_against_one_deadline(inproc, monkeypatch):
    """Handlers that ignore the stop hold it up once by timeout + 1 s, not that much each."""
    es = _short_timeout(inproc, 0.2)
    release = threading.Event()

    def stuck(request, context):
        release.wait(30)
        return pb.EchoResponse()

    monkeypatch.setitem(es._handlers, METHOD_IDS["Echo"], stuck)
    socks = [_raw(inproc) for _ in range(4)]
    try:
        for s in socks:
            s.sendall(frame(METHOD_IDS["Echo"], pb.EchoRequest()))
        assert _until(lambda: es.connections >= 4, 2.0)
        t0 = time.monotonic()
        es.stop()
        took = time.monotonic() - t0
    finally:
        release.set()
        for s in socks:
            s.close()
    assert took < 3.0, f"stop took {took:.1f}s: each stuck connection was joined for its own timeout + 1 s"


def test_a_frame_over_the_limit_is_resource_exhausted_as_over_grpc(inproc):
    """gRPC refuses a message over its limit RESOURCE_EXHAUSTED, and so does the client before it
    sends (kvd.client.fast); a raw caller hears the same from the daemon, told what to change."""
    from kvd.ipc.frames import MAX_REQUEST

    with _raw(inproc) as s:
        s.sendall(HEAD.pack(MAX_REQUEST + 1, METHOD_IDS["Allocate"]))
        st = _status(s)
        assert st.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], st
        assert f"exceeds this daemon's {MAX_REQUEST:,d}-byte limit (max_request_bytes" in st.message and "send less per call" in st.message, st
        assert not st.metadata, "a transport's limit, not the pool's capacity"
        assert _closed_within(s, 3.0), "the body is not read: the stream cannot be followed past it"


def test_a_connection_no_thread_can_serve_is_refused_and_the_socket_serves_on(tmp_path, monkeypatch):
    """At the process's thread limit (a container's pids limit, memory for a stack), starting a
    connection's thread fails. The connection is refused, saying so, and the next one is served:
    before, the error ended the accept loop, and the engine socket accepted nothing again."""
    t = start_inproc(tmp_path)
    try:
        es = t.daemon.engine_socket
        proc_kit.failing_thread_starts(monkeypatch, framed)
        refused = es.refused
        with _raw(t) as s:
            st = _status(s)
            assert st.code == grpc.StatusCode.UNAVAILABLE.value[0] and "could not start a thread" in st.message, st
            assert "pids limit" in st.message
            assert s.recv(1) == b""  # closed
        assert es.refused == refused + 1 and es.connections == 0
        # Any other failure with a new connection: logged, that connection closed, the loop goes on.
        real = es._accepted

        def broken(conn: socket.socket) -> None:
            monkeypatch.setattr(es, "_accepted", real)
            raise ValueError("a bug in a subclass")

        monkeypatch.setattr(es, "_accepted", broken)
        with _raw(t) as s:
            assert s.recv(1) == b""  # closed unanswered
        with _raw(t) as s:
            s.sendall(frame(METHOD_IDS["OpenSession"], pb.OpenSessionRequest(name="after")))
            assert read_frame(s)[0] == OK
    finally:
        stop_inproc(t)
