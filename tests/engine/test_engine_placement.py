"""``kvd demo --decode-device cuda:N`` on a machine without a GPU: the roles' devices are parsed
and placed, a missing GPU or a pair without peer access is refused (exit 2) before anything
starts, the demo wires each role's daemon and engine to its own device and the reference to the
prefill one, and the summary names both devices. The device count and the peer-access query are
stubbed at their seams (``kvd.engine.device._device_count`` / ``_can_access_peer``)."""

from __future__ import annotations


import pytest
import torch

from kvd.engine import demo
from kvd.engine import device as devmod
from kvd.engine.device import Placement, parse_device, place
from kvd.errors import InvalidArgument, Unavailable

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture
def gpus(monkeypatch):
    """A pretend host: ``gpus(count, peer=True)``; records every peer-access question asked."""
    asked: list[tuple[int, int]] = []

    def set_up(count: int, peer: bool = True) -> list[tuple[int, int]]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(devmod, "_device_count", lambda: count)

        def can_access(a: int, b: int) -> bool:
            asked.append((a, b))
            return peer

        monkeypatch.setattr(devmod, "_can_access_peer", can_access)
        return asked

    return set_up


@pytest.mark.parametrize("text, want", [("cpu", torch.device("cpu")), ("cuda", CUDA0), ("cuda:1", CUDA1),
                                        (" cuda:7 ", torch.device("cuda", 7))])
def test_parse_device_accepts_cpu_cuda_and_cuda_n(text, want):
    assert parse_device(text) == want


@pytest.mark.parametrize("bad", ["gpu1", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "1", "", "CUDA:1"])
def test_parse_device_refuses_anything_else(bad):
    with pytest.raises(InvalidArgument, match="is not cpu, cuda or cuda:N"):
        parse_device(bad)


def test_place_defaults_to_one_device_and_asks_nothing(gpus):
    asked = gpus(1)
    assert place("cpu") == Placement(torch.device("cpu"), torch.device("cpu"))
    assert place("cpu", "cpu") == Placement(torch.device("cpu"), torch.device("cpu"))
    assert place("cuda") == Placement(CUDA0, CUDA0) and not place("cuda").split
    assert place("cuda", "cuda:0") == Placement(CUDA0, CUDA0)
    assert place("cuda", "cuda") == Placement(CUDA0, CUDA0)
    assert asked == []  # one device: no peer access needed


def test_place_splits_the_roles_over_two_gpus_with_peer_access(gpus):
    asked = gpus(2)
    p = place("cuda", "cuda:1")
    assert p == Placement(CUDA0, CUDA1) and p.split
    assert asked == [(0, 1)]  # the prefill GPU writes into the decode GPU's memory


def test_place_refuses_a_gpu_the_machine_does_not_have(gpus):
    asked = gpus(1)
    with pytest.raises(Unavailable, match=r"--decode-device cuda:1 but this machine has 1 CUDA device\(s\).*below 1"):
        place("cuda", "cuda:1")
    gpus(2)
    with pytest.raises(Unavailable, match="has 2 CUDA device"):
        place("cuda", "cuda:5")
    assert asked == []


def test_place_refuses_two_gpus_without_peer_access(gpus):
    gpus(2, peer=False)
    with pytest.raises(Unavailable, match=r"cuda:0 cannot access the memory of cuda:1 \(no CUDA peer access"):
        place("cuda", "cuda:1")


def test_place_refuses_a_cpu_role_next_to_a_gpu_role(gpus):
    gpus(2)
    with pytest.raises(InvalidArgument, match="--decode-device cuda:1 with --device cpu: both roles"):
        place("cpu", "cuda:1")
    with pytest.raises(InvalidArgument, match="--decode-device cpu with --device cuda"):
        place("cuda", "cpu")


@pytest.mark.parametrize("count, peer, message", [
    (1, True, "--decode-device cuda:1 but this machine has 1 CUDA device(s)"),
    (2, False, "cuda:0 cannot access the memory of cuda:1"),
])
def test_demo_refuses_a_missing_or_unreachable_decode_gpu_with_status_2(gpus, monkeypatch, capsys, count, peer, message):
    from kvd.cli import main

    gpus(count, peer)
    monkeypatch.setattr(demo, "_require_gpu_stack", lambda: None)  # cuda-python and Triton "installed"

    def no_daemon(*a, **kw):
        raise AssertionError("a daemon started before the refusal")

    monkeypatch.setattr(demo, "_Daemon", no_daemon)
    assert main(["demo", "--device", "cuda", "--decode-device", "cuda:1", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"kvd demo: Unavailable: {message}" in err, err


def test_demo_refuses_a_malformed_decode_device_as_a_usage_error(capsys):
    from kvd.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda", "--decode-device", "gpu1"])
    assert exc.value.code == 2
    assert "argument --decode-device: device 'gpu1' is not cpu, cuda or cuda:N" in capsys.readouterr().err


def test_demo_refuses_a_gpu_decode_role_next_to_a_cpu_prefill_role(capsys):
    from kvd.cli import main

    assert main(["demo", "--decode-device", "cuda:1", "--quick"]) == 2
    assert "InvalidArgument: --decode-device cuda:1 with --device cpu" in capsys.readouterr().err


class _Stop(Exception):
    pass


def test_demo_puts_each_role_on_its_device_and_the_reference_on_the_prefill_one(gpus, monkeypatch):
    """run_demo with the roles on cuda:0 / cuda:1, up to the point where it waits for the daemons:
    which device each daemon, engine and the reference process were given."""
    gpus(2)
    monkeypatch.setattr(demo, "_require_gpu_stack", lambda: None)
    daemons: list[tuple[str, torch.device]] = []
    processes: list[tuple[str, tuple]] = []

    class FakeDaemon:
        def __init__(self, name, workdir, arena_dir, layout_path, backend, speculative, device, fault=None):
            self.name, self.address = name, f"unix:/nowhere/{name}.sock"
            daemons.append((name, device))

        def wait_serving(self):
            raise _Stop

        def stop(self):
            pass

    class FakeProcess:
        def __init__(self, *, target, args, name, daemon):
            processes.append((name, args))

        def start(self):
            pass

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    class FakeContext:
        Process = FakeProcess

        @staticmethod
        def Pipe(duplex=True):
            return object(), object()

    monkeypatch.setattr(demo, "_Daemon", FakeDaemon)
    monkeypatch.setattr(demo.mp, "get_context", lambda kind: FakeContext)
    with pytest.raises(_Stop):
        demo.run_demo(demo.DemoOptions(requests=2, quick=True, device="cuda", decode_device="cuda:1"))
    assert daemons == [("prefill", CUDA0), ("decode", CUDA1)]
    by_name = dict(processes)
    assert by_name["kvd-demo-reference"][-1] == "cuda:0"
    assert by_name["kvd-demo-prefill-engine"][0].device == "cuda:0"
    assert by_name["kvd-demo-decode-engine"][0].device == "cuda:1"
    assert by_name["kvd-demo-prefill-engine"][0].role == "prefill" and by_name["kvd-demo-decode-engine"][0].role == "decode"


def test_a_daemon_on_the_second_gpu_is_started_there(monkeypatch, tmp_path):
    import subprocess

    started: list[list[str]] = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append(cmd)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    d = demo._Daemon("decode", str(tmp_path), str(tmp_path), "layout.json", "local", True, device=CUDA1)
    d._log.close()
    i = started[0].index("--cuda-device")
    assert started[0][i - 2:i + 2] == ["--arena", "cuda", "--cuda-device", "1"]


def test_the_summary_names_both_devices_and_warns_on_mixed_models():
    h200 = "NVIDIA H200"
    assert demo._device_lines(Placement(torch.device("cpu"), torch.device("cpu")), {}) == []
    (one,) = demo._device_lines(Placement(CUDA0, CUDA0), {"prefill": h200, "decode": h200})
    assert one.startswith("device cuda:0 (NVIDIA H200): both daemons' arenas (CUDA VMM), both engines and the colocated")
    two = demo._device_lines(Placement(CUDA0, CUDA1), {"prefill": h200, "decode": h200})
    assert len(two) == 2, two
    assert two[0].startswith("prefill device cuda:0 (NVIDIA H200): prefill daemon's arena (CUDA VMM), prefill engine "
                             "and the colocated reference")
    assert two[1].startswith("decode device  cuda:1 (NVIDIA H200): decode daemon's arena (CUDA VMM) and decode engine")
    assert "local backend cuda:0 -> cuda:1 (peer access)" in two[1]
    over_mooncake = demo._device_lines(Placement(CUDA0, CUDA1), {"prefill": h200, "decode": h200}, "mooncake")
    assert "mooncake backend cuda:0 -> cuda:1 (Transfer Engine)" in over_mooncake[1]
    mixed = demo._device_lines(Placement(CUDA0, CUDA1), {"prefill": h200, "decode": "NVIDIA H100 80GB HBM3"})
    assert len(mixed) == 3 and mixed[2].startswith("WARNING: the two GPUs are different models ('NVIDIA H200' vs "
                                                   "'NVIDIA H100 80GB HBM3')"), mixed
