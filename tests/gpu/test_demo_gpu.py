"""``kvd demo --device cuda``: the prefill-decode pair on one GPU (two daemons with CUDA arenas,
the local backend copying GPU to GPU, both engines and the colocated reference on the GPU) gives
every request's output identical to the reference, bit for bit -- and an injected fault is still
caught there. Each run is a subprocess in its own session, bounded in time, leaving nothing behind.
"""

from __future__ import annotations

import re
import subprocess

from demo_kit import run_demo
from gpu_kit import GPU, NEEDS_TRITON, NEEDS_VMM

pytestmark = [*GPU, NEEDS_VMM, NEEDS_TRITON]

#: an H200 runs the quick demo in well under this (most of it is CUDA start-up in five processes)
LIMIT_S = 110


def _demo(*args: str) -> subprocess.CompletedProcess:
    return run_demo(["--device", "cuda", "--quick", "--backend", "local", *args], LIMIT_S)


def test_gpu_demo_outputs_are_identical_to_the_gpu_reference():
    r = _demo()
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"outputs identical to colocated +16 / 16\n", r.stdout), r.stdout
    assert "PASS: every output is identical to the colocated reference" in r.stdout
    assert re.search(r"over local;.*\ndevice cuda:0 .*both daemons' arenas \(CUDA VMM\), both engines and the colocated "
                     r"reference", r.stdout), r.stdout
    assert re.search(r"KV bytes moved +[0-9.]+ MiB in [1-9]", r.stdout), r.stdout  # the GPU-to-GPU path really ran


def test_gpu_demo_catches_an_injected_fault():
    r = _demo("--requests", "4", "--fault", "swa-full-ids")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL: 4 output(s) differ" in r.stdout, r.stdout
    # The faulty prefill daemon sent the KV, into the wrong pages: caught by the outputs, not refused.
    assert re.search(r"KV bytes moved +[0-9.]+ MiB in [1-9]", r.stdout), r.stdout
