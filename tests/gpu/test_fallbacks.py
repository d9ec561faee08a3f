"""The GPU modules on a machine without a GPU: they import, fall back to the CPU implementation,
and say clearly what is missing. These run everywhere (no gpu mark)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvd.copy import kernels
from kvd.errors import InvalidArgument, Unavailable
from kvd.copy.runs import coalesce, copy_runs


def test_move_pages_on_cpu_is_copy_runs() -> None:
    gen = torch.Generator().manual_seed(1)
    view = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=gen)
    r = coalesce(torch.tensor([0, 1, 2, 10, 30]), torch.tensor([40, 41, 42, 50, 60]))
    ref = view.clone()
    copy_runs(ref, ref, r)
    kernels.move_pages(view, view, r)
    assert torch.equal(view, ref)
    kernels.move_pages(view, view, coalesce(torch.tensor([]), torch.tensor([])))  # no-op
    assert torch.equal(view, ref)


def test_translate_on_cpu() -> None:
    v2p = torch.tensor([5, -1, 7, 9], dtype=torch.int32)
    assert kernels.translate(v2p, torch.tensor([3, 0, 2])).tolist() == [9, 5, 7]
    assert kernels.translate(v2p, torch.tensor([3, 4, -1], dtype=torch.int32)).tolist() == [9, -1, -1]
    assert kernels.translate(v2p, torch.empty(0, dtype=torch.int64)).numel() == 0
    with pytest.raises(InvalidArgument, match=r"must lie in \[0, 4\)"):
        kernels.translate(v2p, torch.tensor([4]), check=True)
    with pytest.raises(InvalidArgument, match="must be 1-D"):
        kernels.translate(v2p.view(2, 2), torch.tensor([0]))


def test_missing_cuda_python_is_unavailable(monkeypatch) -> None:
    import kvd.memory.vmm as ac

    monkeypatch.setattr(ac, "_DRIVER", None)
    monkeypatch.setitem(sys.modules, "cuda", None)  # makes `import cuda...` raise ImportError
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(Unavailable, match="cuda-python"):
        ac.CudaVmmArena(1 << 20)
    with pytest.raises(Unavailable, match="cuda-python"):
        ac.map_imported([(0, 1 << 21)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_device_is_unavailable(monkeypatch) -> None:
    import kvd.memory.vmm as ac

    monkeypatch.setattr(ac, "driver", lambda: object())  # as if cuda-python were installed
    with pytest.raises(Unavailable, match=r"torch.cuda.is_available\(\) is false"):
        ac.CudaVmmArena(1 << 20)
