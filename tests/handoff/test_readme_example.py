"""The README's engine example runs as written, against two real daemons on loopback (in this
process, backend ``local``): a doc a newcomer copies must not rot."""

from __future__ import annotations

import re
from pathlib import Path

import daemon_kit as dk  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## Using kvd from an engine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section holds one python example"
    return blocks[0]


def test_the_readme_engine_example_runs(tmp_path):
    targets = []
    for role in ("prefill", "decode"):
        (tmp_path / role).mkdir()
        targets.append(dk.start_inproc(tmp_path / role, backend="local"))
    try:
        scope = {"PREFILL": targets[0].unix, "DECODE": targets[1].unix}
        exec(compile(_example(), str(README), "exec"), scope)  # noqa: S102 -- the README's own code
        assert scope["pages"].tokens == 300
        p, d = (t.node.stats() for t in targets)
        assert d.pool.requests_live == 1 and d.transfers_in_ready_total == 1  # r1, READY on the decode node
        assert p.pool.requests_live == 0 and p.leases_live == 0 and d.leases_live == 0
        scope["kv"].close()
        for name in ("prefill", "decode"):
            scope[name].close()  # a closed session's requests are freed
        assert targets[1].node.stats().pool.requests_live == 0
        for t in targets:
            t.check()
    finally:
        for t in targets:
            dk.stop_inproc(t)
