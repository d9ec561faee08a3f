"""kvd plan: sizes per group, the seed-004 numbers, table bytes as the pool allocates them, --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.cli import main as cli_main
from kvd.errors import InvalidArgument
from kvd.pool.plan import gpu_budget, plan, _request_bytes
from kvd.pool.pool import Pool
from kvd.pool.presets import GEMMA4_31B_CONFIG, preset

REPO = Path(__file__).resolve().parents[1]
# A budget at which SGLang's token pool (page size 1) gives seed 004's v2p lengths: T // 40,960
# = 2,065,600 full and T // 409,600 = 206,560 swa pages.
SEED_BUDGET = 84_606_976_000


def test_gemma4_31b_tp2_at_the_seed_budget_gives_the_seed_table():
    layout = preset("gemma-4-31b-it-tp2").model_copy(update={"page_size": 1})
    p = plan(layout, SEED_BUDGET)
    g = {x.name: x for x in p.groups}
    assert (g["full"].sglang_v2p_len, g["swa"].sglang_v2p_len) == (2_065_601, 206_561)
    assert p.full_to_swa_pages == pytest.approx(10.0, rel=1e-4)
    # kvd's swa v2p spans the owner's ids (the seed's fix): 16.5 MB at the seed's int64, 1.65 MB the bug.
    assert round(p.swa_v2p_seed_bytes["owner_ids_int64"] / 1e6, 1) == 16.5
    assert round(p.swa_v2p_seed_bytes["own_pages_int64"] / 1e6, 2) == 1.65
    swa_v2p = next(t for t in p.tables if t.group == "swa" and t.table == "v2p")
    assert swa_v2p.entries == g["full"].v2p_len == 2_065_600
    assert p.reserve_bytes == 4 * SEED_BUDGET and p.post_capture_tables_bytes == pytest.approx(4 * p.tables_bytes, rel=1e-6)


def test_tables_and_capacities_match_a_real_pool(kvd_arena_factory):
    for name in ("tiny-hybrid", "gemma-4-31b-it-tp2", "qwen3.5-0.8b"):
        layout = preset(name)
        budget = 40 * layout.max_page_bytes + 12_345
        pool = Pool(layout, kvd_arena_factory(budget, budget))
        p = plan(layout, budget)
        caps = {g.name: g.capacity_pages for g in pool.stats().groups}
        assert {g.name: g.pages for g in p.groups} == caps, name
        real = {}
        for k, a in pool.groups.items():
            real[(k.value, "v2p")], real[(k.value, "p2v")], real[(k.value, "holes")] = (
                a.v2p.numel(), a.p2v.numel(), a._holes.numel())
        for k, r in pool._bindings.rings.items():
            real[(k.value, "id ring")] = r.size
            real[(k.value, "id -> request")] = pool._bindings.vid_req[k].numel()
        assert {(t.group, t.table): t.entries for t in p.tables} == real, name
        # The largest prefill request is what the pool's floor admits, and one more token is not.
        n = p.largest_request_tokens
        assert _request_bytes(layout, n, receive=False) == pool.floor_bytes(n) <= budget < pool.floor_bytes(n + 1)


def test_gpu_budget_and_refusals():
    assert gpu_budget("h100", fraction=0.5) == int((81_559 << 20) * 0.5)
    assert gpu_budget(memory=1000, fraction=0.8, other=100) == 700
    with pytest.raises(InvalidArgument, match="unknown GPU 'tpu'"):
        gpu_budget("tpu")
    with pytest.raises(InvalidArgument, match="leaves nothing"):
        gpu_budget(memory=1000, other=900)
    with pytest.raises(InvalidArgument, match="one-request floor"):
        plan(preset("gemma-4-31b-it-tp2"), 1000)


def test_kvd_plan_json_from_a_model_config(tmp_path, capsys):
    cfg = tmp_path / "gemma-4-31B-it" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": GEMMA4_31B_CONFIG}))
    assert cli_main(["plan", "--model", str(cfg), "--tp", "2", "--page-size", "1", "--budget", str(SEED_BUDGET), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"layout", "fingerprint", "budget_bytes", "reserve_bytes", "groups", "largest_request_tokens",
                        "largest_received_tokens", "full_to_swa_pages", "tables", "tables_bytes",
                        "post_capture_tables_bytes", "swa_v2p_seed_bytes"}
    g = {x["name"]: x for x in out["groups"]}
    assert (g["full"]["sglang_v2p_len"], g["swa"]["sglang_v2p_len"]) == (2_065_601, 206_561)
    assert (g["full"]["entry_bytes"], g["swa"]["entry_bytes"], g["swa"]["window"]) == (40_960, 409_600, 1024)
    assert out["fingerprint"] == preset("gemma-4-31b-it-tp2").model_copy(update={"page_size": 1}).fingerprint
    # A GPU and a fraction instead of a budget; the table for humans.
    assert cli_main(["plan", "--layout", "gpt-oss-20b", "--gpu", "h100", "--mem-fraction", "0.5", "--other", "20GiB"]) == 0
    text = capsys.readouterr().out
    assert "full:swa pages = 1.000 : 1" in text and "largest request" in text and "mapping tables" in text
    # Refusals: exit 2 with the reason.
    assert cli_main(["plan", "--layout", "gpt-oss-20b", "--tp", "2", "--budget", "1GiB"]) == 2
    assert "apply to --model" in capsys.readouterr().err
    assert cli_main(["plan", "--model", str(tmp_path / "nope.json"), "--budget", "1GiB"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_kvd_plan_runs_as_a_command():
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "plan", "--layout", "gemma-4-31b-it-tp2", "--budget", "60GiB"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "swa v2p over the owner's ids" in r.stdout and "post-capture reservation" in r.stdout
