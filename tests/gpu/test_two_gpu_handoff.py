"""The local backend across two GPUs of one host (issue 7): a prefill daemon on cuda:0 and a
decode daemon on cuda:1, in separate processes; the prefill daemon maps the decode arena's
chunks for its own GPU (peer access over NVLink or PCIe P2P) and its kernel writes through them.

* This process imports the decode arena for cuda:0 the way the prefill daemon does: the tensor is
  a cuda:0 tensor over the mapping (no copy), the import records cuda:1 as the memory's home, and
  a kernel on cuda:0 reads the decode arena's bytes.
* A hybrid-layout request (full, SWA, state, draft) handed off GPU 0 -> GPU 1 lands byte for
  byte as the CPU shm path computes it (``plan_chunk`` blocks applied with numpy to CPU copies),
  the sender's arena unchanged; a second request reuses the mapping.

Skipped without two GPUs, or when cuda:0 has no peer access to cuda:1 (the daemon refuses that
with FailedPrecondition; tests/test_local_cuda_backend.py covers the refusal on the CPU).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from gpu_kit import GPU, NEEDS_TRITON, NEEDS_VMM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handoff"))

import handoff_kit as hk  # noqa: E402
from test_gpu_daemon import cuda_pair, engines, hand_off_like_the_cpu_path, send_many_like_the_cpu_path  # noqa: E402

from kvd.ipc.fdpass import fetch

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
PEER_ACCESS = TWO_GPUS and torch.cuda.can_device_access_peer(0, 1)

pytestmark = [
    *GPU,
    NEEDS_VMM,
    NEEDS_TRITON,
    pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices (torch.cuda.device_count() >= 2)"),
    pytest.mark.skipif(TWO_GPUS and not PEER_ACCESS, reason="cuda:0 has no peer access to cuda:1 (no NVLink or P2P)"),
]


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    yield from cuda_pair(tmp_path_factory.mktemp("two-gpu-pair"), (0, 1), peer_timeout_s=10.0)


def test_the_decode_arena_maps_for_cuda0_with_its_home_on_cuda1(gpu_pair):
    from kvd.memory.vmm import import_arena

    d = hk.Engine(gpu_pair.decode, "decode-engine")
    try:
        assert d.arena.device == torch.device("cuda", 1)  # an engine's attach maps on the arena's own GPU
        hk.randomize(d.arena, 5)
        torch.cuda.synchronize(1)
        h, fds = fetch(str(gpu_pair.decode.workdir / "kvd.sock") + ".handles", session=d.c.session_id)
        try:
            owner, view = import_arena(h, fds, 0)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            assert h.device == 1 and owner.home == 1 and owner.device == torch.device("cuda", 0)
            assert view.device == torch.device("cuda", 0) and view.data_ptr() == owner.base and view.numel() == h.backed
            got = view[:65536].clone()  # a copy issued on cuda:0, reading cuda:1's memory
            torch.cuda.synchronize(0)
            assert got.device == torch.device("cuda", 0)
            assert torch.equal(got.cpu(), d.arena[:65536].cpu())
            del got, view
        finally:
            owner.close()
    finally:
        d.close_attachment()
        d.c.close()


def test_a_request_hands_off_gpu0_to_gpu1_byte_identical_to_the_cpu_path(gpu_pair):
    with engines(gpu_pair) as (p, d):
        assert p.arena.device == torch.device("cuda", 0) and d.arena.device == torch.device("cuda", 1)
        hand_off_like_the_cpu_path(gpu_pair.decode.workdir, p, d, seed=13, wait_s=30)


def test_send_many_gpu0_to_gpu1_is_byte_identical_to_the_cpu_path(gpu_pair):
    with engines(gpu_pair) as (p, d):
        send_many_like_the_cpu_path(p, d, seed=19, wait_s=30)


@pytest.mark.parametrize("dst_gpu", [0, 1])
def test_copy_engine_blocks_go_as_one_batch_off_the_default_stream(dst_gpu, monkeypatch):
    """Scattered blocks from GPU 0 into memory on GPU ``dst_gpu``: on a stream of its own they go
    as one cuMemcpyBatchAsync and land exactly; on the legacy default stream (which the driver
    refuses for batches) block by block, landing the same."""
    from kvd.backends import local_cuda as lc

    monkeypatch.setattr(lc, "_batch_ok", lc._batch_ok)  # a refusal here must not switch batches off for later tests

    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    n = [1 << 20, 3 << 20, 4096, 5 << 20, 512, 2 << 20]
    s = [0, 9 << 20, 20 << 20, 30 << 20, 50 << 20, 60 << 20]
    d = [40 << 20, 0, 2 << 20, 10 << 20, 30 << 20, 20 << 20]  # out of order, never overlapping
    exp = torch.zeros(64 << 20, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
    for a, b, k in zip(s, d, n):
        exp[b : b + k] = src[a : a + k].to(exp.device)
    for on_side_stream in (True, False):
        dst = torch.zeros(64 << 20, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
        stream = torch.cuda.Stream(0) if on_side_stream else torch.cuda.default_stream(0)
        got: list = []

        def issue() -> None:  # in a fresh thread, as a gRPC worker's first write: no CUDA call made on it yet
            # As the backend issues it: no torch device or stream context around the batch; on
            # the default stream kvd's own fallback copies block by block.
            got.append(lc._copy_batch(src, dst, s, d, n, dst_gpu, stream))  # device pointers: UVA spans both GPUs
            if not got[0]:
                lc.copy_engine_blocks(src, dst, s, d, n, dst_gpu, stream)

        t = threading.Thread(target=issue)
        t.start()
        t.join()
        assert got, "the copy raised (see the thread's traceback)"
        queued = got[0]
        stream.synchronize()
        torch.cuda.synchronize(dst_gpu)
        assert queued is on_side_stream, "the batch goes off the default stream, and only there"
        assert torch.equal(dst, exp)
    assert lc._batch_ok, "the driver took the batch"
