"""kill -9 matrix (issue 13, "keep them fixed"): victim x point, every one a real SIGKILL.

Victims: the prefill engine, the decode engine (each its own process: a tiny engine driven over a
pipe, :data:`ENGINE`), the prefill daemon, the decode daemon (``kvd serve`` subprocesses, backend
local). Points: before BeginSend (the ticket issued, nothing begun), between chunks (the first
half sent, ``last=False``), during the last Send (a large request; the kill follows the engine's
"issued" line, so it lands while the daemon runs the Send -- or, if the Send was quicker than the
kill, after it: a race, reported as ``landed after`` and then only the clean-up is asserted).

For each case the survivor learns: the engine on the other side sees its wait FAILED (decode) or
its next BeginSend / Send refused (prefill) within ~1 s of the kill -- plus the session TTL
(:data:`TTL_S`) where the victim is an engine, whose death a daemon can only learn by its silence.
Before BeginSend no sender ever began, so a decode engine cannot learn of a dead prefill side
(nobody knows the ticket was delivered to a dead process): there the prefill side's survivor
learns (a dead engine's pages reaped within the TTL; a dead daemon refuses the engine at once),
and the decode engine gives up by Abort, as a router's timeout would. Afterwards on every
surviving daemon: the pages used, requests and leases are the bystander's alone (0 leaked, 0 live
leases), and the bystander -- a request of another session on each daemon, allocated before, a
known pattern written into its pages through attach() -- is unchanged byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

import daemon_kit as dk
import handoff_kit as hk
import pytest
import torch

from kvd.client import Client

#: the session TTL of the daemons here: a dead engine is noticed this long after its last call
TTL_S = 1.0
#: "within ~1 s" (the issue), generously for a loaded 2-core CI machine
LEARN_S = 1.5
#: a large request for "during the last Send": ~36 MiB moved by its last Send
BIG_TOKENS = 60_000
OPTS = dict(session_ttl_s=TTL_S, arena_bytes=96 << 20, sweep_interval_s=0.05)

#: The engine process: one Client on its daemon; one JSON command per stdin line, one JSON answer
#: per stdout line ({"ok": value} or {"err": class, "msg": text}); "send" first answers
#: {"issued": true} just before it calls the daemon.
ENGINE = r"""
import json, sys
from kvd.client import Client
c = Client.connect(sys.argv[1], name=sys.argv[2], timeout=30)
print(json.dumps({"ok": c.session_id}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    op, rid = cmd["op"], cmd.get("rid")
    tk = bytes.fromhex(cmd.get("ticket", ""))
    try:
        if op == "alloc":
            out = c.allocate(rid, cmd["tokens"], receive=cmd.get("receive", False)).tokens
        elif op == "lease":
            out = c.acquire_lease(rid, "recv").ticket.hex()
        elif op == "begin":
            out = c.begin_send(rid, tk)
        elif op == "send":
            print(json.dumps({"issued": True}), flush=True)
            out = c.send(rid, tk, start=cmd["start"], end=cmd["end"], last=cmd["last"]).nbytes
        elif op == "wait":
            st = c.wait_ready(rid, cmd["timeout"])
            out = [st.state.name, st.reason]
        elif op == "abort":
            out = c.abort(rid, "given up")
        elif op == "free":
            out = c.free(rid)
        res = {"ok": out}
    except Exception as exc:
        res = {"err": type(exc).__name__, "msg": str(exc)}
    print(json.dumps(res), flush=True)
"""


class EngineProc:
    """An engine process on one daemon (its own session), killable with SIGKILL."""

    def __init__(self, side: hk.Side, name: str) -> None:
        self.name = name
        self.p = subprocess.Popen(
            [sys.executable, "-c", ENGINE, side.t.unix, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=dk.REPO
        )

    def ready(self) -> None:
        assert "ok" in self._read(), f"{self.name} did not connect"

    def _read(self) -> dict:
        line = self.p.stdout.readline()  # type: ignore[union-attr]
        assert line, f"{self.name} exited ({self.p.poll()})"
        return json.loads(line)

    def post(self, op: str, **kw) -> None:
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]

    def answer(self) -> dict:
        return self._read()

    def call(self, op: str, **kw) -> dict:
        self.post(op, **kw)
        return self._read()

    def ok(self, op: str, **kw):
        r = self.call(op, **kw)
        assert "ok" in r, f"{self.name} {op}: {r}"
        return r["ok"]

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()  # type: ignore[union-attr]
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        for f in (self.p.stdin, self.p.stdout):
            if f and not f.closed:
                f.close()


@dataclass
class Bystander:
    """A request of the test's own session on one daemon, with a known pattern in its pages."""

    side: hk.Side
    c: Client
    rid: str
    pages: dict[str, torch.Tensor]
    before: dict[str, torch.Tensor]
    used: dict[str, int]
    requests: int

    @classmethod
    def make(cls, side: hk.Side, seed: int) -> Bystander:
        c = side.connect("bystander")
        rid = dk.rid("bystander")
        v = c.allocate(rid, 40)
        att = c.attach()
        g = torch.Generator().manual_seed(seed)
        pages = {"full": v.full, "swa": v.swa, "draft": v.draft, "state": torch.tensor([v.state])}
        before = {}
        for name, ids in pages.items():
            rows = hk.rows(att.tensor, hk.PB[name])
            rows[ids.long()] = torch.randint(0, 256, (ids.numel(), hk.PB[name]), dtype=torch.uint8, generator=g)
            before[name] = rows[ids.long()].clone()
        att.close()
        s = c.stats()
        return cls(side, c, rid, pages, before, {gs.name: gs.used_pages for gs in s.pool.groups}, s.pool.requests_live)

    def clean(self) -> bool:
        s = self.c.stats()
        return (
            {gs.name: gs.used_pages for gs in s.pool.groups} == self.used
            and s.leases_live == 0
            and s.pool.requests_live == self.requests
        )

    def assert_unchanged(self) -> None:
        att = self.c.attach()
        try:
            for name, ids in self.pages.items():
                got = hk.rows(att.tensor, hk.PB[name])[ids.long()]
                assert torch.equal(got, self.before[name]), f"{self.side.role}: the bystander's {name} pages changed"
        finally:
            att.close()


@pytest.fixture(scope="module")
def kpair(tmp_path_factory):
    p = hk.make_pair(tmp_path_factory.mktemp("kill-matrix"), "local", "subproc", **OPTS)
    yield p
    for s in p.sides:
        s.stop()


VICTIMS = ["prefill-engine", "decode-engine", "prefill-daemon", "decode-daemon"]
POINTS = ["before-begin", "between-chunks", "during-last-send"]


def _poll(fn, timeout: float):
    """Call ``fn`` until it returns something truthy; returns (value, seconds) or (None, seconds)."""
    t0 = time.monotonic()
    while True:
        v = fn()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None, time.monotonic() - t0
        time.sleep(0.02)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_kill_matrix(kpair, victim, point):
    for s in kpair.sides:
        if not s.alive():
            s.restart()
    seed = hash((victim, point)) & 0xFFFF
    bys = {s.role: Bystander.make(s, seed + i) for i, s in enumerate(kpair.sides)}
    pe, de = EngineProc(kpair.prefill, "prefill-engine"), EngineProc(kpair.decode, "decode-engine")
    engines = {"prefill-engine": pe, "decode-engine": de}
    try:
        pe.ready()
        de.ready()
        rid = dk.rid("km")
        n = BIG_TOKENS if point == "during-last-send" else 80
        half = n // 2
        pe.ok("alloc", rid=rid, tokens=n)
        de.ok("alloc", rid=rid, tokens=n, receive=True)
        ticket = de.ok("lease", rid=rid)
        if point != "before-begin":
            assert pe.ok("begin", rid=rid, ticket=ticket)
            r = pe.call("send", rid=rid, ticket=ticket, start=0, end=half, last=False)
            assert r == {"issued": True}
            assert "ok" in pe.answer()
        pending_send = False
        if point == "during-last-send":
            pe.post("send", rid=rid, ticket=ticket, start=half, end=n, last=True)
            assert pe.answer() == {"issued": True}
            pending_send = True

        # ---- the kill
        t_kill = time.monotonic()
        if victim in engines:
            engines[victim].kill()
        else:
            (kpair.prefill if victim == "prefill-daemon" else kpair.decode).kill()
        prefill_side = victim.startswith("prefill")
        bound = LEARN_S + (TTL_S if victim.endswith("engine") else 0.0)
        landed = "during"  # "completed": the Send finished before the kill could matter
        how = ""

        # ---- the survivor learns
        if prefill_side:
            if point == "before-begin":
                if victim == "prefill-daemon":  # the prefill engine is refused at once
                    r = pe.call("begin", rid=rid, ticket=ticket)
                    learned = time.monotonic() - t_kill
                    assert "err" in r, f"BeginSend on a dead daemon: {r}"
                    how = f"prefill engine's BeginSend: {r['err']}"
                else:  # the prefill daemon reaps the dead engine's request within the TTL
                    _, learned = _poll(bys["prefill"].clean, bound + 2)
                    how = "prefill daemon reaped the dead engine's pages"
                    assert bys["prefill"].clean(), "the dead prefill engine's pages were not reaped"
                de.ok("abort", rid=rid)  # the decode engine gives up (its router's timeout)
            else:
                st, learned = _poll(lambda: (lambda s: s if s[0] != "RECEIVING" else None)(de.ok("wait", rid=rid, timeout=0.05)), bound + 3)
                if st is not None and st[0] == "READY":
                    landed = "completed"
                how = f"decode engine's wait: {st}"
                if landed == "during":
                    assert st is not None and st[0] == "FAILED", f"the decode engine never learned: {how}"
            if pending_send and victim == "prefill-daemon":
                r = pe.answer()
                how += f"; the engine's Send: {r}"
        else:
            if pending_send:
                r = pe.answer()
                learned = time.monotonic() - t_kill
                how = f"prefill engine's last Send: {r}"
                if "ok" in r:
                    landed = "completed"
                    if victim == "decode-engine":  # the dead engine's READY request is reaped
                        _, learned = _poll(bys["decode"].clean, bound + 2)
            else:
                op = "begin" if point == "before-begin" else "send"
                kw = dict(rid=rid, ticket=ticket)
                if op == "send":
                    kw.update(start=0, end=half, last=False)

                def refused():
                    r = pe.call(op, **kw)
                    if op == "send":
                        r = pe.answer()
                    return r if "err" in r else None

                r, learned = _poll(refused, bound + 3)
                how = f"prefill engine's {op}: {r}"
                assert r is not None, f"the prefill engine never learned: its {op} kept succeeding"
        print(f"\n{victim} killed {point}: landed {landed}, learned in {learned:.2f}s ({how})")
        if landed == "during":
            assert learned < bound, f"learned after {learned:.2f}s (bound {bound:.1f}s): {how}"

        # ---- the survivors clean up; the daemons keep only the bystanders
        freed = {}
        for e in (pe, de):
            if e.p.poll() is None and not (e is pe and victim == "prefill-daemon") and not (e is de and victim == "decode-daemon"):
                freed[e.name] = e.call("free", rid=rid)
        for role, b in bys.items():
            if not b.side.alive():
                continue
            try:
                dk.wait_for(b.clean, hk.FENCE_S + TTL_S + 3.0, f"{role}: no leaked page, request or lease after {victim} was killed {point}")
            except BaseException:
                print(f"{role} stats: {b.c.stats()}; the survivors' frees: {freed}")
                raise
            b.assert_unchanged()
    finally:
        for e in (pe, de):
            e.close()
        for b in bys.values():
            if b.side.alive():
                b.c.close()
                b.side.t.clients.remove(b.c)
