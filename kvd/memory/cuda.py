"""The CUDA driver and devices as kvd uses them: the ``cuda.bindings.driver`` module
(:func:`driver`) and its result tuples (:func:`_ok`), device indices and contexts, and what a
device is (UUID, label, peer access, GPUDirect RDMA on virtual memory).

Another process may number the host's GPUs differently (``CUDA_VISIBLE_DEVICES``): a GPU is
named across processes by its UUID (:func:`gpu_uuid`) and found here by :func:`device_for`.

``cuda.bindings.driver`` (the ``cuda-python`` package) is imported on the first call of
:func:`driver`, not when this module is imported: kvd runs without it on CPU nodes.
"""

from __future__ import annotations

from typing import Any

import torch

from kvd.errors import CapacityError, FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["driver", "gpu_uuid", "device_for", "can_access_peer", "gpu_label", "gpu_direct_rdma_vmm"]

_DRIVER: Any = None


def driver() -> Any:
    """The ``cuda.bindings.driver`` module; :class:`~kvd.errors.Unavailable` if it is missing."""
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as drv  # cuda-python >= 12.6
        except ImportError as exc:
            try:
                from cuda import cuda as drv  # type: ignore[no-redef]  # older cuda-python layout
            except ImportError:
                raise Unavailable(
                    "the CUDA virtual-memory arena needs the `cuda-python` package (module "
                    "cuda.bindings.driver); install cuda-python matching the node's CUDA driver, or "
                    "use the shm arena"
                ) from exc
        _DRIVER = drv
    return _DRIVER


def _ok(result: Any, what: str, nbytes: int = 0) -> Any:
    """Unpack a ``cuda.bindings`` result tuple ``(CUresult, *values)``; raise on an error."""
    cu = driver()
    err, vals = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != cu.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise CapacityError(
                f"{what}: the GPU has no {nbytes:,d} bytes of free memory ({name}); ask for less or free "
                "device memory first",
                shortfall_bytes=nbytes,
            )
        raise Unavailable(f"{what} failed: {name}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def _device_index(device: int | str | torch.device | None) -> int:
    if not torch.cuda.is_available():
        raise Unavailable("the CUDA virtual-memory arena needs a CUDA device; torch.cuda.is_available() is false")
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise InvalidArgument(f"the CUDA virtual-memory arena lives on a cuda device, not {d}")
    idx = torch.cuda.current_device() if d.index is None else d.index
    if not 0 <= idx < torch.cuda.device_count():
        raise InvalidArgument(f"cuda device {idx} does not exist (this host has {torch.cuda.device_count()})")
    return idx


def _on(dev: int) -> torch.cuda.device:
    """``with _on(dev):`` makes ``dev``'s primary context current for driver calls (and creates it
    the first time), without changing the caller's current device afterwards."""
    torch.cuda.init()
    return torch.cuda.device(dev)


def gpu_direct_rdma_vmm(dev: int) -> bool:
    """Whether device ``dev`` supports GPUDirect RDMA on CUDA virtual memory (the driver's
    ``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED``); False where the driver or
    the bindings cannot say. Call with ``dev``'s context current (``_on``)."""
    cu = driver()
    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", None)
    if attr is None:  # bindings older than CUDA 11.3
        return False
    err, handle = cu.cuDeviceGet(dev)
    if err != cu.CUresult.CUDA_SUCCESS:
        return False
    err, value = cu.cuDeviceGetAttribute(attr, handle)
    return err == cu.CUresult.CUDA_SUCCESS and bool(value)


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as torch reports it ("" when torch cannot say: a torch
    without ``.uuid``, no such device). Never empty otherwise: torch formats the 16 bytes."""
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 -- callers fall back to the index
        return ""


def device_for(owner_uuid: str, index: int) -> int:
    """This process's index of the CUDA device with ``owner_uuid`` (another process may number its
    devices differently: ``CUDA_VISIBLE_DEVICES``). Without a UUID, ``index`` is trusted.
    FailedPrecondition when this process cannot see that device."""
    count = torch.cuda.device_count()
    if owner_uuid:
        for i in range(count):
            mine = gpu_uuid(i)
            if not mine:  # torch cannot say: fall back to the index
                break
            if mine == owner_uuid:
                return i
        else:
            raise FailedPrecondition(
                f"the arena lives on GPU {owner_uuid} (cuda:{index} of its owner), which this process does not see; "
                "check CUDA_VISIBLE_DEVICES"
            )
    if not 0 <= index < count:
        raise FailedPrecondition(f"the arena lives on cuda:{index} of its owner; this process has {count} CUDA device(s)")
    return index


def can_access_peer(dev: int, home: int) -> bool:
    """Whether kernels on ``dev`` can read and write memory that lives on ``home`` (always true
    for one device; else the driver's peer-access capability: NVLink or PCIe P2P)."""
    return dev == home or bool(torch.cuda.can_device_access_peer(dev, home))


def gpu_label(index: int) -> str:
    """``cuda:i (name, uuid)`` for messages; just ``cuda:i`` when torch cannot say more."""
    try:
        p = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({p.name}, GPU-{str(p.uuid).removeprefix('GPU-')})"
    except Exception:  # noqa: BLE001 -- a label must never fail
        return f"cuda:{index}"
