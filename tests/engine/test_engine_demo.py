"""``kvd demo`` end to end as a user runs it: separate processes, a summary, the exit status,
and nothing left behind (no process of its session, no arena file, no socket)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from demo_kit import run_demo

import kvd.engine as engine


def _demo(*args: str) -> subprocess.CompletedProcess:
    return run_demo(["--quick", "--backend", "local", *args], limit_s=240)


def test_demo_quick_passes_and_prints_the_summary():
    r = _demo("--requests", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    for row in (r"outputs identical to colocated +10 / 10", "time to first token", "tokens/s", "KV bytes moved",
                "compactions", "retractions", r"leases .* live at end 0, expired 0", r"stale refusals +0\n", "PASS"):
        assert re.search(row, r.stdout), f"{row!r} missing from:\n{r.stdout}"
    assert "10/10 requests" in r.stderr  # the progress line


def test_demo_with_an_injected_fault_fails_with_status_1():
    r = _demo("--requests", "5", "--fault", "swa-full-ids")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL: 5 output(s) differ" in r.stdout
    # The faulty prefill daemon sent the KV, into the wrong pages (the sealed ticket passed every
    # check): the outputs catch it, no refusal does.
    assert "FAULT INJECTED (test only): swa-full-ids" in r.stdout
    assert re.search(r"KV bytes moved +[0-9.]+ MiB in [1-9]\d* Send calls", r.stdout), r.stdout


def test_engine_package_all_is_honest():
    for name in engine.__all__:
        assert hasattr(engine, name), name
    assert len(set(engine.__all__)) == len(engine.__all__)


@pytest.mark.parametrize("bad", [["--requests", "0"], ["--chunk", "0"], ["--spec-k", "-1"]])
def test_demo_refuses_bad_flags(bad):
    from kvd.cli import main

    assert main(["demo", *bad]) == 2


def test_auto_backend_falls_back_to_local_with_a_notice(monkeypatch):
    import io

    from kvd.engine.demo import choose_backend
    from kvd.errors import Unavailable

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # the import now fails, as where it is absent
    err = io.StringIO()
    assert choose_backend("auto", err) == "local"
    assert "NOTICE" in err.getvalue() and "falling back to the `local` backend" in err.getvalue()
    with pytest.raises(Unavailable, match="--backend local"):
        choose_backend("mooncake", err)
    assert choose_backend("local", io.StringIO()) == "local"
