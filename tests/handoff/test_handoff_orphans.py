"""Issue 13, parts 3 and 3b: an open transfer whose engine goes away at either end.

* Sender side: a prefill request that ends before its last Send committed -- freed, its session
  closed, its engine killed (SIGKILL) or hung (SIGSTOP) until its session is reaped -- aborts the
  transfer toward the decode daemon; the decode engine's ``wait_ready`` fails within about a
  second of the free (of the reap, for a dead engine), and neither pool keeps a lease or a page.
* Receiver side: a decode request still receiving whose engine closes its session or is killed
  is not freed outright: its pages stay fenced while another engine on the same daemon
  allocates at once, the sender is told, and its next Send is refused; not one byte of the new
  request changes.

The detect times are printed (``-s``): ``pytest -s tests/handoff/test_handoff_orphans.py``.
"""

from __future__ import annotations

import signal
import threading
import time

import daemon_kit as dk
import handoff_kit as hk
import pytest
import torch

from kvd.client import Client, TransferState
from kvd.errors import Aborted, KvdError, NotFound
from kvd.records import IndexVectors

FAILED, RECEIVING = TransferState.FAILED, TransferState.RECEIVING
TOKENS = 103
CHUNK = 40  # the first (not last) chunk
#: The bound the issue asks for ("within 1 s"), with room for a loaded machine.
DETECT_S = 1.5
#: Session TTL of the engines killed here (the daemon reaps them this long after their last call).
ENGINE_TTL_S = 1.0


def _why(proc, line: str) -> str:
    """What a child engine that answered ``line`` said on stderr: an empty line is its stdout
    closed, so it is exiting (waited for briefly; its exit is not yet seen when stdout closes)."""
    if not line:
        try:
            proc.wait(5)
        except Exception:  # noqa: BLE001 -- still running: nothing to read without blocking
            return ""
    return proc.stderr.read() if proc.poll() is not None else ""


_PREFILL_ENGINE = """
import sys, time
from kvd.client import Client
addr, rid, tokens, ticket, chunk, ttl = sys.argv[1:]
ticket = bytes.fromhex(ticket)
c = Client.connect(addr, name="doomed-prefill", ttl=float(ttl))
c.allocate(rid, int(tokens))
c.begin_send(rid, ticket)
c.send(rid, ticket, end=int(chunk), last=False)
print("sent", flush=True)
time.sleep(120)
"""

_DECODE_ENGINE = """
import sys, time
from kvd.client import Client
addr, rid, tokens, ttl = sys.argv[1:]
c = Client.connect(addr, name="doomed-decode", ttl=float(ttl))
c.allocate(rid, int(tokens), receive=True)
print(c.acquire_lease(rid, "recv").ticket.hex(), flush=True)
time.sleep(120)
"""


def _pages(v: IndexVectors) -> dict[str, torch.Tensor]:
    """Every page a request holds, by group."""
    out = {"full": v.full, "swa": v.swa, "draft": v.draft}
    if v.state is not None:
        out["state"] = torch.tensor([v.state])
    return {g: ids for g, ids in out.items() if ids.numel()}


def _bytes_of(arena: torch.Tensor, v: IndexVectors) -> torch.Tensor:
    """The request's bytes, page by page, group by group (a copy)."""
    return torch.cat([hk.rows(arena, hk.PB[g])[ids.long()].flatten() for g, ids in _pages(v).items()])


def _reaped(c: Client, before: int, timeout: float) -> float:
    """Wait until the daemon reaped one more session than ``before``; returns when it saw that."""
    dk.wait_for(lambda: c.stats().sessions_expired_total > before, timeout, "the engine's session reaped", interval=0.01)
    return time.monotonic()


def _ready_to_send(hp, prefix: str):
    """Allocate ``rid`` on both sides (decode: this test's decode engine), take the RECV lease,
    fill the prefill arena. Returns ``(rid, src, dst, lease)``."""
    return hp.setup_request(TOKENS, scatter=False, prefix=prefix)


def _assert_sender_clean(hp, p_used: dict[str, int]) -> None:
    """The prefill daemon holds no lease and no open transfer, and its pool is as it was."""
    dk.wait_for(lambda: hp.p.c.stats().leases_live == 0, 3.0, "the prefill leases released")
    assert hp.p.used() == p_used, f"prefill pages {hp.p.used()} != {p_used} at the start"
    d = hp.pair.prefill.t.daemon
    if d is not None:
        assert d.outbox.open_count() == 0, "an outbound transfer of the ended request is still open"
        d.node.check()


def _assert_failed_fast(hp, rid: str, t_event: float, what: str, *phrases: str) -> float:
    st = hp.d.c.wait_ready(rid, 5.0)
    dt = time.monotonic() - t_event
    print(f"\n[{hp.pair.backend}/{hp.pair.mode}] {what}: decode wait_ready {st.state.value} {dt * 1000:.0f} ms after it ({st.reason})")
    assert st.state is FAILED, f"{what}: the decode side still says {st.state.value} after 5 s"
    for p in phrases:
        assert p in st.reason, st.reason
    assert dt < DETECT_S, f"{what}: the decode engine learned after {dt:.2f} s"
    return dt


# ---- part 3: the sender goes away --------------------------------------------------------------


@pytest.mark.parametrize("how", ["free", "close"])
def test_a_sending_request_ended_mid_transfer_fails_the_receiver_at_once(hp, how):
    p_used, d_used = hp.p.used(), hp.d.used()
    rid, src, dst, lease = _ready_to_send(hp, f"orph-{how}")
    assert hp.p.c.begin_send(rid, lease.ticket) is True
    hp.p.c.send(rid, lease.ticket, end=CHUNK, last=False)
    assert hp.d.c.wait_ready(rid, 0).state is RECEIVING
    t0 = time.monotonic()
    if how == "free":
        hp.p.free(rid)
        _assert_failed_fast(hp, rid, t0, "prefill free", "sender aborted", "ended at the sender", "freed it")
    else:
        hp.p.reconnect()  # closes the session, freeing its requests
        _assert_failed_fast(hp, rid, t0, "prefill close", "sender aborted", "ended at the sender", "closed its session")
    # The sender said nothing of it is in flight: the receiver's RECV lease is gone at once.
    assert hp.d.c.stats().leases_live == 0
    _assert_sender_clean(hp, p_used)
    assert hp.d.free(rid) == 1
    assert hp.d.used() == d_used
    hp.check()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "hung-ttl-reap"])
def test_a_prefill_engine_gone_mid_transfer_fails_the_receiver_at_its_reaping(hp, sig):
    """The engine process dies (SIGKILL) or hangs (SIGSTOP: it no longer heartbeats) after a
    non-last Send; its daemon reaps the session after its TTL, and that reaping aborts the
    transfer: the decode engine's wait fails within about a second of it."""
    p_used, d_used = hp.p.used(), hp.d.used()
    rid = dk.rid("orph-engine")
    hp.d.alloc(rid, TOKENS, receive=True)
    # A TTL that outlasts the child engine's start-up (it imports torch: on a loaded machine,
    # longer than the daemon's default lease TTL). Nothing below waits on it.
    lease = hp.d.c.acquire_lease(rid, "recv", ttl=60)
    expired0 = hp.p.c.stats().sessions_expired_total
    args = (hp.pair.prefill.t.unix, rid, str(TOKENS), lease.ticket.hex(), str(CHUNK), str(ENGINE_TTL_S))
    with dk.child(_PREFILL_ENGINE, *args) as proc:
        line = proc.stdout.readline()
        assert line.strip() == "sent", f"the prefill engine did not send: {line!r} {_why(proc, line)}"
        assert hp.d.c.wait_ready(rid, 0).state is RECEIVING
        t_kill = time.monotonic()
        proc.send_signal(sig)
        out: dict = {}
        waiter = threading.Thread(target=lambda: out.update(st=hp.d.c.wait_ready(rid, ENGINE_TTL_S + 6.0), t=time.monotonic()))
        waiter.start()
        t_reap = _reaped(hp.p.c, expired0, ENGINE_TTL_S + 5.0)
        waiter.join(10)
        if sig is signal.SIGSTOP:
            proc.kill()
    st = out["st"]
    assert st.state is FAILED, f"the decode side still says {st.state.value} {ENGINE_TTL_S + 6:.0f} s after the engine went"
    assert "ended at the sender" in st.reason and "expired" in st.reason, st.reason
    # The reaping is seen here by polling (10 ms): the failure may even look a little earlier.
    dt = out["t"] - t_reap
    print(
        f"\n[{hp.pair.backend}/{hp.pair.mode}] prefill engine {sig.name}: reaped {t_reap - t_kill:.2f} s after it, "
        f"decode wait_ready FAILED {dt * 1000:.0f} ms after the reaping seen by a 10 ms poll, "
        f"{out['t'] - t_kill - ENGINE_TTL_S:.2f} s after the TTL from the signal ran out ({st.reason})"
    )
    assert dt < DETECT_S, f"the decode engine learned {dt:.2f} s after the reaping"
    assert hp.d.c.stats().leases_live == 0
    _assert_sender_clean(hp, p_used)
    assert hp.d.free(rid) == 1
    assert hp.d.used() == d_used
    hp.check()


# ---- part 3b: the receiver goes away ----------------------------------------------------------


def _another_engine_allocates(hp, tokens: int) -> tuple[str, IndexVectors, torch.Tensor]:
    """Another engine of the decode daemon allocates at once and writes a pattern into every page
    of its new request. Returns its rid, vectors and the pattern's bytes."""
    rid = dk.rid("newcomer")
    v = hp.d.alloc(rid, tokens)
    arena = hp.d.arena
    g = torch.Generator().manual_seed(hp.seed + 99)
    for grp, ids in _pages(v).items():
        r = hk.rows(arena, hk.PB[grp])
        r[ids.long()] = torch.randint(0, 256, (ids.numel(), hk.PB[grp]), dtype=torch.uint8, generator=g)
    return rid, v, _bytes_of(arena, v)


def _next_send_refused_and_nothing_changed(hp, rid, ticket, new_rid, new_v, pattern, what: str) -> None:
    with pytest.raises(KvdError) as info:
        hp.p.c.send(rid, ticket, start=CHUNK, last=True)
    assert isinstance(info.value, (Aborted, NotFound)), f"{what}: the next Send failed otherwise: {info.value!r}"
    got = _bytes_of(hp.d.arena, new_v)
    changed = int((got != pattern).sum())
    print(f"\n[{hp.pair.backend}/{hp.pair.mode}] {what}: next Send refused ({type(info.value).__name__}: {info.value}); "
          f"{changed} bytes of the new request changed")
    assert changed == 0, f"{what}: {changed} bytes of {new_rid!r} were overwritten by the old transfer"


def test_a_receiving_request_closed_mid_transfer_keeps_its_pages_from_the_next_engine(hp):
    p_used, d_used = hp.p.used(), hp.d.used()
    victim = hk.Engine(hp.pair.decode, "decode-victim")
    rid = dk.rid("orph-recv")
    hp.p.alloc(rid, TOKENS)
    victim.alloc(rid, TOKENS, receive=True)
    hk.randomize(hp.p.arena, hp.seed)
    lease = victim.c.acquire_lease(rid, "recv")
    assert hp.p.c.begin_send(rid, lease.ticket) is True
    hp.p.c.send(rid, lease.ticket, end=CHUNK, last=False)
    t0 = time.monotonic()
    victim.c.close(free_requests=True)
    hp.pair.decode.t.clients.remove(victim.c)
    new_rid, new_v, pattern = _another_engine_allocates(hp, TOKENS)
    _next_send_refused_and_nothing_changed(hp, rid, lease.ticket, new_rid, new_v, pattern, "decode close")
    # The sender knows: it refuses again before writing, naming the receiver's reason while it
    # still lists the aborted transfer, and after that (it forgets it once lease_ttl has passed,
    # sooner under load or a fast transport) the receiver refuses the ticket of a lease that ended.
    # The sender's heartbeat may hear of the end before the receiver's AbortSend arrives (then its
    # reason, "no longer accepts", stands until the AbortSend's replaces it: Outbox's heartbeat).
    with pytest.raises((Aborted, NotFound),
                       match="receiving request ended mid-transfer|lease .* is not live|the receiver no longer accepts this transfer"):
        hp.p.c.send(rid, lease.ticket, start=CHUNK, last=True)
    dk.wait_for(lambda: hp.d.c.stats().leases_live == 0, hk.FENCE_S + 3.0, "the fence ended")
    print(f"[{hp.pair.backend}/{hp.pair.mode}] decode close: fence over {time.monotonic() - t0:.2f} s after the close")
    assert hp.d.free(new_rid) == 1
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    assert hp.d.used() == d_used
    hp.p.free(rid)
    _assert_sender_clean(hp, p_used)
    hp.check()


def test_a_decode_engine_killed_mid_transfer_keeps_its_pages_from_the_next_engine(hp):
    p_used, d_used = hp.p.used(), hp.d.used()
    rid = dk.rid("orph-kill")
    hp.p.alloc(rid, TOKENS)
    hk.randomize(hp.p.arena, hp.seed)
    expired0 = hp.d.c.stats().sessions_expired_total
    with dk.child(_DECODE_ENGINE, hp.pair.decode.t.unix, rid, str(TOKENS), str(ENGINE_TTL_S)) as proc:
        line = proc.stdout.readline().strip()
        assert line, f"the decode engine gave no ticket: {_why(proc, line)}"
        ticket = bytes.fromhex(line)
        assert hp.p.c.begin_send(rid, ticket) is True
        hp.p.c.send(rid, ticket, end=CHUNK, last=False)
        t_kill = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        t_reap = _reaped(hp.d.c, expired0, ENGINE_TTL_S + 5.0)
    new_rid, new_v, pattern = _another_engine_allocates(hp, TOKENS)
    print(f"\n[{hp.pair.backend}/{hp.pair.mode}] decode engine kill -9: reaped {t_reap - t_kill:.2f} s after it; "
          f"the next engine allocated {(time.monotonic() - t_reap) * 1000:.0f} ms after the reaping")
    _next_send_refused_and_nothing_changed(hp, rid, ticket, new_rid, new_v, pattern, "decode kill -9")
    dk.wait_for(lambda: hp.d.c.stats().leases_live == 0, hk.FENCE_S + 3.0, "the fence ended")
    assert hp.d.free(new_rid) == 1
    hp.d.wait_reclaimed(hk.FENCE_S + 3.0)
    assert hp.d.used() == d_used
    hp.p.free(rid)
    _assert_sender_clean(hp, p_used)
    hp.check()
