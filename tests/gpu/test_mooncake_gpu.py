"""The Mooncake backend with CUDA arenas (Mooncake's CUDA build, ``mooncake-transfer-engine``).

* Two cuda daemons with ``backend: mooncake`` hand a hybrid request off, on one GPU (both arenas
  on cuda:0) and from cuda:0 to cuda:1 when the host has two GPUs; the decode arena then equals
  what the CPU shm path computes for the same plan, byte for byte, as for the local backend
  (``hand_off_like_the_cpu_path``, the same fixture generator with ``backend="mooncake"``).
  The transport is what Mooncake picks on the host: RDMA (GPUDirect) where it finds HCAs, else
  TCP, which stages device memory through host buffers.
* ``MC_INTRANODE_NVLINK`` with a cuda arena is refused at start-up (Mooncake's intra-node NVLink
  transport registers memory through cudaIpcGetMemHandle, which refuses CUDA virtual memory),
  leaving nothing behind; ``kvd serve`` exits 2 saying so.

Skipped without CUDA, cuda-python or Triton, or where the installed Mooncake is not the CUDA
build (the CPU build's refusal is tested on the CPU: tests/daemon/test_daemon_config.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_kit import GPU, HAS_CUDA, NEEDS_TRITON, NEEDS_VMM, mooncake_cuda_missing

import handoff_kit as hk  # noqa: E402
from test_gpu_daemon import cuda_pair, hand_off_like_the_cpu_path  # noqa: E402

from kvd.cli import main as cli_main  # noqa: E402
from kvd.config import load_settings  # noqa: E402
from kvd.errors import InvalidArgument  # noqa: E402
from kvd.server.app import Daemon  # noqa: E402

MISSING = mooncake_cuda_missing() if HAS_CUDA else "needs a CUDA device"
TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2

pytestmark = [*GPU, NEEDS_VMM, NEEDS_TRITON, pytest.mark.skipif(bool(MISSING), reason=MISSING)]


@pytest.fixture(autouse=True, scope="module")
def _no_refused_transport_variables():
    """The daemons inherit this process's environment: no transport selector kvd refuses."""
    saved = {k: os.environ.pop(k) for k in ("MC_INTRANODE_NVLINK", "MC_TCP_PROTO") if k in os.environ}
    yield
    os.environ.update(saved)


def _hand_off(pair, seed: int, devices: tuple[int, int]) -> None:
    p, d = hk.Engine(pair.prefill, "prefill-engine"), hk.Engine(pair.decode, "decode-engine")
    try:
        pi, di = p.c.info(), d.c.info()
        assert pi.backend == di.backend == "mooncake" and "handoff" in pi.capabilities and "cuda-arena" in pi.capabilities
        assert (p.arena.device, d.arena.device) == (torch.device("cuda", devices[0]), torch.device("cuda", devices[1]))
        hand_off_like_the_cpu_path(pair.decode.workdir, p, d, seed=seed, wait_s=60)
    finally:
        for e in (p, d):
            e.close_attachment()
            e.c.close()


@pytest.fixture(scope="module")
def mooncake_pair(tmp_path_factory):
    yield from cuda_pair(tmp_path_factory.mktemp("mooncake-pair"), backend="mooncake")


@pytest.fixture(scope="module")
def mooncake_two_gpu_pair(tmp_path_factory):
    if not TWO_GPUS:
        pytest.skip("needs two CUDA devices (torch.cuda.device_count() >= 2)")
    yield from cuda_pair(tmp_path_factory.mktemp("mooncake-two-gpu-pair"), (0, 1), backend="mooncake", peer_timeout_s=10.0)


def test_two_cuda_daemons_hand_off_over_mooncake_byte_identical_to_the_cpu_path(mooncake_pair):
    _hand_off(mooncake_pair, seed=17, devices=(0, 0))


def test_gpu0_to_gpu1_over_mooncake_byte_identical_to_the_cpu_path(mooncake_two_gpu_pair):
    """No peer access needed: Mooncake moves the bytes (through host buffers over TCP, or by
    GPUDirect RDMA), not a kernel on one GPU writing the other's memory."""
    _hand_off(mooncake_two_gpu_pair, seed=19, devices=(0, 1))


def test_mc_intranode_nvlink_with_a_cuda_arena_is_refused_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    s = load_settings(arena="cuda", backend="mooncake", listen_unix=str(tmp_path / "kvd.sock"), arena_bytes="4MiB")
    with pytest.raises(InvalidArgument, match=r"MC_INTRANODE_NVLINK is set: .*cudaIpcGetMemHandle, which refuses CUDA "
                                              r"virtual memory.*use backend=local"):
        Daemon.start(s)
    assert sorted(os.listdir(tmp_path)) == []  # no socket, no handle socket
    rc = cli_main(["serve", "--arena", "cuda", "--backend", "mooncake", "--arena-bytes", "4MiB",
                   "--listen-unix", str(tmp_path / "kvd.sock")])
    assert rc == 2 and "MC_INTRANODE_NVLINK is set" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []
