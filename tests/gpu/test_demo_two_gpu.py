"""``kvd demo --device cuda --decode-device cuda:1``: the prefill daemon and engine on GPU 0, the
decode daemon and engine on GPU 1, each in its own process (the ``local`` backend writes KV from
GPU 0 into the decode arena on GPU 1 through peer access), the colocated reference on GPU 0 --
every request's output identical to the reference, bit for bit. A subprocess in its own session,
bounded in time, leaving nothing behind (as ``test_demo_gpu.py``)."""

from __future__ import annotations

import re

import pytest
import torch

from demo_kit import run_demo
from gpu_kit import GPU, NEEDS_TRITON, NEEDS_VMM

pytestmark = [
    *GPU, NEEDS_VMM, NEEDS_TRITON,
    # device_count does not initialise CUDA in the test process
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

#: the quick demo on two H200s; most of it is CUDA start-up in five processes and Triton's JIT
LIMIT_S = 115


def test_two_gpu_demo_outputs_are_identical_to_the_reference():
    r = run_demo(["--device", "cuda", "--decode-device", "cuda:1", "--quick", "--backend", "local"], LIMIT_S)
    out, err = r.stdout, r.stderr
    assert r.returncode == 0, out + err
    assert re.search(r"outputs identical to colocated +16 / 16\n", out), out
    assert "PASS: every output is identical to the colocated reference" in out
    assert re.search(r"over local;.*\nprefill device cuda:0 \([^)\n]+\): prefill daemon's arena \(CUDA VMM\), prefill "
                     r"engine and the colocated reference\n", out), out
    assert re.search(r"\ndecode device +cuda:1 \([^)\n]+\): decode daemon's arena \(CUDA VMM\) and decode engine; "
                     r"local backend cuda:0 -> cuda:1 \(peer access\)\n", out), out
    assert "WARNING: the two GPUs are different models" not in out, out  # two GPUs of one host, one model
    assert re.search(r"KV bytes moved +[0-9.]+ MiB in [1-9]", out), out  # the GPU 0 -> GPU 1 path really ran
