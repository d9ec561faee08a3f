"""The device through the reference engine, on a machine without a GPU: ``--device cuda`` is
refused before anything starts, Mooncake is refused next to a GPU, and a model, its KV views and
the tensors it writes never mix devices silently (the ``meta`` device stands in for a GPU)."""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch

from kvd.engine.device import Fenced, prepare, resolve
from kvd.engine.local import LocalKV
from kvd.engine.model import Pending, build_models
from kvd.engine.paged import PagedKV
from kvd.errors import Unavailable
from kvd.client.views import LayerKV

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")


@NO_CUDA
def test_demo_refuses_cuda_without_a_gpu_with_status_2(capsys, monkeypatch):
    from kvd.cli import main
    from kvd.demo import run as demo

    def no_daemon(*a, **kw):
        raise AssertionError("a daemon started before the refusal")

    monkeypatch.setattr(demo, "_Daemon", no_daemon)  # refused before any daemon or engine starts
    assert main(["demo", "--device", "cuda", "--quick", "--backend", "local"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda but torch.cuda.is_available() is false" in err and "--device cpu" in err, err


@NO_CUDA
def test_resolve_cuda_without_a_gpu_is_unavailable():
    with pytest.raises(Unavailable, match="torch.cuda.is_available"):
        resolve("cuda")


def test_resolve_names_the_devices():
    assert resolve("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu' is not one of cpu, cuda"):
        resolve("tpu")


def test_cuda_demo_takes_the_local_backend_and_mooncake_only_as_the_cuda_build(monkeypatch):
    from kvd.demo.run import choose_backend

    engine = types.ModuleType("mooncake.engine")  # "installed", a build that names no flags
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    monkeypatch.delenv("MC_INTRANODE_NVLINK", raising=False)
    assert choose_backend("auto", io.StringIO(), "cpu") == "mooncake"
    assert choose_backend("auto", io.StringIO(), "cuda") == "local"
    assert choose_backend("local", io.StringIO(), "cuda") == "local"
    with pytest.raises(Unavailable, match=r"--backend mooncake with --device cuda: .*needs Mooncake's CUDA build.*use --backend local"):
        choose_backend("mooncake", io.StringIO(), "cuda")
    engine.SUPPORT_CUDA = False
    with pytest.raises(Unavailable, match=r"SUPPORT_CUDA is False.*pip install mooncake-transfer-engine"):
        choose_backend("mooncake", io.StringIO(), "cuda")
    engine.SUPPORT_CUDA = engine.SUPPORT_INTRA_NVLINK = True
    assert choose_backend("mooncake", io.StringIO(), "cuda") == "mooncake"
    assert choose_backend("auto", io.StringIO(), "cuda") == "local"  # the host's own links stay the default


def test_prepare_on_the_cpu_changes_nothing():
    before = torch.are_deterministic_algorithms_enabled()
    assert prepare("cpu") == torch.device("cpu")
    assert torch.are_deterministic_algorithms_enabled() == before


def test_fenced_waits_for_the_device_before_every_call(monkeypatch):
    calls: list[str] = []

    class FakeClient:
        address = "unix:/x"

        def send(self, rid: str, *, last: bool) -> str:
            calls.append(f"send {rid} {last}")
            return "sent"

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"sync {device}"))
    client = FakeClient()
    assert Fenced.wrap(client, torch.device("cpu")) is client  # nothing to wait for on the CPU
    fenced = Fenced.wrap(client, torch.device("cuda", 0))
    assert fenced.send("r1", last=True) == "sent"
    assert calls == ["sync cuda:0", "send r1 True"]
    assert fenced.address == "unix:/x"  # attributes pass through, no fence


def test_every_weight_lives_on_the_models_device():
    cpu, meta = build_models(), build_models(device="meta")
    assert cpu.device == torch.device("cpu") and meta.device == torch.device("meta")
    for model in (meta.target, meta.draft):
        assert model is not None
        tensors = [model.embed, model.unembed, model.prior, model.rope.inv, model.rope.cos]
        for layer in model.layers:
            tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        assert {t.device.type for t in tensors} == {"meta"}, [t.device for t in tensors]


def test_a_model_refuses_kv_views_on_another_device():
    models = build_models()
    kv = LocalKV(models.layout, 1 << 20)
    try:
        paged = PagedKV(models.layout, kv.views)
        assert paged.device == torch.device("cpu")
        seq = paged.seq(kv.allocate("r", 8))
        meta = build_models(device="meta")
        with pytest.raises(ValueError, match="model on meta but its KV arena views are on cpu"):
            meta.target.forward([1, 2, 3], 0, seq, Pending(0))
        k = torch.zeros(2, 2, 16, dtype=torch.float32, device="meta")
        with pytest.raises(ValueError, match="K/V on meta/meta for arena views on cpu"):
            seq.write("full", 0, 0, k, k)
        with pytest.raises(ValueError, match="state on meta for arena views on cpu"):
            seq.write_state(0, torch.zeros(64, device="meta"))
        # the CPU model on the CPU views still works (and leaves its KV in the arena)
        pend = Pending(0)
        logits = models.target.forward([1, 2, 3], 0, seq, pend)
        assert logits.shape == (3, 256) and logits.device.type == "cpu"
        pend.commit(seq)
        k0, _ = seq.read("full", 0, 0, 3)
        assert torch.equal(k0, pend.kv[("full", 0)][0])
    finally:
        kv.close()


def test_paged_kv_refuses_views_on_two_devices():
    models = build_models()
    cpu = torch.zeros(4, 4, 2, 16)
    views = {"full": [LayerKV(cpu, cpu)], "swa": [LayerKV(cpu.to("meta"), cpu.to("meta"))]}
    with pytest.raises(ValueError, match="more than one device"):
        PagedKV(models.layout, views)


def test_local_kv_has_no_arena_for_an_unknown_device():
    models = build_models()
    with pytest.raises(ValueError, match="no arena for device meta"):
        LocalKV(models.layout, 1 << 20, device="meta")


def test_kv_writes_touch_only_their_elements_also_in_deterministic_mode():
    """The GPU demo runs with deterministic algorithms on; a KV write must still change no byte
    outside its positions (the daemon may be writing other requests' pages at the same time)."""
    from kvd.engine.paged import _put_rows

    store = torch.full((2000,), -7.0)
    view = torch.as_strided(store, (12, 4, 2, 16), (160, 32, 16, 1), 40)  # page stride spans another layer
    page, slot = torch.tensor([3, 3, 5, 11]), torch.tensor([2, 3, 0, 1])
    rows = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(0))
    want = store.clone()
    torch.as_strided(want, view.shape, view.stride(), view.storage_offset()).index_put_((page, slot), rows)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _put_rows(view, page, slot, rows)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(store, want)
    assert int((store != -7.0).sum()) == rows.numel()
    with pytest.raises(ValueError, match="rows of shape"):
        _put_rows(view, page, slot, rows[:, :1])


def test_gpu_daemons_are_started_with_a_cuda_arena(monkeypatch, tmp_path):
    """What ``kvd demo --device cuda`` asks of each ``kvd serve`` (the flags follow the Settings
    names ``arena`` and ``cuda_device``) beyond the CPU demo's command line."""
    import subprocess

    from kvd.demo import run as demo

    started: list[tuple[list[str], dict | None]] = []

    class FakePopen:
        def __init__(self, cmd, *, env=None, **kw):
            started.append((cmd, env))

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for dev in (torch.device("cpu"), torch.device("cuda", 0)):
        d = demo._Daemon("decode", str(tmp_path), str(tmp_path), "layout.json", "local", True, device=dev)
        d._log.close()
    (cpu_cmd, cpu_env), (gpu_cmd, gpu_env) = started
    assert "--arena" not in cpu_cmd and cpu_env is None
    # both demos give a starved heartbeat 30 s (kvd.demo.run says why)
    assert cpu_cmd[cpu_cmd.index("--peer-timeout-s") + 1] == "30"
    assert gpu_cmd[:len(cpu_cmd)] == cpu_cmd
    assert gpu_cmd[len(cpu_cmd):] == ["--arena", "cuda", "--cuda-device", "0"]
    assert gpu_env is not None and gpu_env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
