"""CUDA virtual-memory arena: reserve a device address range once, back a prefix of it with
physical chunks, share the chunks with other processes as POSIX file descriptors.

    base                              backed  mapped                         reserved
     |<-- chunk 0 -->|<----- chunk 1 ----->|--|<-------- address space only -------->|
     [ sink | pages of every group ...     |  (touching this faults the kernel)      ]

* The address range (``cuMemAddressReserve``) is reserved once, rounded up to the allocation
  granularity (2 MiB on an H200); :attr:`base` never changes.
* :meth:`set_backed` grows in place by creating one physical chunk (``cuMemCreate``, exportable
  as a POSIX fd) for the missing bytes and mapping it right after the last one
  (``cuMemMap`` + ``cuMemSetAccess``). It shrinks by unmapping and releasing whole chunks that
  start at or past the new end (rounded up to the granularity); a chunk that straddles the new
  end stays mapped (:attr:`mapped_bytes` says how much physical memory is held). CUDA maps a
  physical allocation only whole (the map offset must be zero), so a straddling chunk cannot be
  cut: growth is made of chunks of at most ``chunk_bytes`` (1 GiB by default), so shrinking gives
  memory back at that grain and a 140 GiB arena exports 140 fds (SCM_RIGHTS passes up to 253
  per message).
* :meth:`tensor` is a ``torch.uint8`` CUDA tensor over ``[0, backed)`` built from
  ``__cuda_array_interface__`` (zero copy; ``data_ptr() == base``).
* Chunks are created RDMA-capable (``allocFlags.gpuDirectRDMACapable``) where the device says
  it supports GPUDirect RDMA on virtual memory
  (``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED``;
  :attr:`CudaVmmArena.gpu_direct_rdma`): a NIC can register VMM memory (as a dma-buf) only
  then, as the Mooncake backend's RDMA transport does. Elsewhere the flag stays off.
* :meth:`export_fds` exports each mapped chunk as a POSIX fd (pass them over a Unix socket with
  ``socket.send_fds``); :func:`map_imported` maps them in the receiving process at an address of
  its own, in order, so byte ``i`` is the same memory in both processes.
* Cross-GPU imports. The importer may map the chunks for another device than the one they live
  on (its *home*): ``cuMemSetAccess`` then grants that device peer access (NVLink or PCIe P2P;
  :func:`can_access_peer` says whether the pair allows it) and the tensor is a tensor of the
  accessing device, so a kernel launched there reads and writes the peer's memory directly.

``cuda.bindings.driver`` (the ``cuda-python`` package) is imported when an arena is made, not when
this module is imported: kvd runs without it on CPU nodes.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvd.memory.arena import Arena, ArenaHandle
from kvd.errors import CapacityError, FailedPrecondition, InvalidArgument, Unavailable

if TYPE_CHECKING:
    from kvd.ipc.fdpass import HandleHeader

__all__ = [
    "CudaVmmArena",
    "ImportedVmm",
    "map_imported",
    "import_arena",
    "device_for",
    "gpu_uuid",
    "can_access_peer",
    "gpu_label",
    "gpu_direct_rdma_vmm",
    "driver",
]

_DRIVER: Any = None
_LOCK = threading.Lock()
#: Default cap of one physical chunk: the grain at which shrinking gives memory back.
DEFAULT_CHUNK_BYTES = 1 << 30


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


def _prop(dev: int, *, gpu_direct_rdma: bool = False) -> Any:
    cu = driver()
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = dev
    p.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if gpu_direct_rdma:
        p.allocFlags.gpuDirectRDMACapable = 1
    return p


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


def _granularity(prop: Any) -> int:
    cu = driver()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_ok(cu.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))


def _set_access(ptr: int, size: int, dev: int) -> None:
    cu = driver()
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = dev
    d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(ptr, size, [d], 1), f"cuMemSetAccess of {size:,d} bytes")


def _round_up(n: int, g: int) -> int:
    return -(-n // g) * g


class _CudaArrayInterface:
    """A bare ``__cuda_array_interface__`` so torch wraps device memory it does not own."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _wrap(ptr: int, nbytes: int, dev: int, *, home: int | None = None) -> torch.Tensor:
    """A ``uint8`` tensor of device ``dev`` over ``[ptr, ptr + nbytes)``, without a copy.

    ``home`` is the device the memory physically lives on when that is not ``dev`` (a peer's
    chunks mapped for ``dev``'s access). torch places a tensor made from
    ``__cuda_array_interface__`` on the device the driver reports for the pointer -- the home
    device -- and ``as_tensor(..., device=dev)`` would then *copy* it; so a cross-GPU tensor is
    built on a non-owning storage that names ``dev`` explicitly."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}")
    if home is None or home == dev:
        t = torch.as_tensor(_CudaArrayInterface(ptr, nbytes), device=f"cuda:{dev}")
    else:
        make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
        if make is None:
            raise FailedPrecondition(
                f"this torch ({torch.__version__}) cannot wrap memory of cuda:{home} as a tensor of cuda:{dev} "
                "(torch._C._construct_storage_from_data_pointer is missing); use torch >= 2.2 for cross-GPU transfers"
            )
        storage = make(ptr, torch.device("cuda", dev), nbytes)
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage, 0, (nbytes,), (1,))
    if t.data_ptr() != ptr or t.dtype != torch.uint8 or t.numel() != nbytes or t.device != torch.device("cuda", dev):
        raise Unavailable(
            f"torch wrapped device address {ptr:#x} as {t.dtype}[{t.numel()}] at {t.data_ptr():#x} on {t.device}, "
            f"not uint8[{nbytes}] on cuda:{dev}"
        )
    return t


@dataclass(frozen=True, slots=True)
class _Chunk:
    offset: int  # bytes from base
    size: int  # bytes, a multiple of the granularity
    handle: Any  # CUmemGenericAllocationHandle


class CudaVmmArena(Arena):
    """An :class:`~kvd.memory.arena.Arena` in CUDA virtual memory on one device.

    ``reserved`` bytes of address space are reserved up front (nothing is allocated for them);
    ``backed`` bytes are backed now. ``chunk_bytes`` caps the size of one physical chunk (rounded
    up to the granularity): shrinking gives memory back at that grain, and each chunk is one fd
    to export. ``None`` makes each growth step one chunk."""

    def __init__(
        self,
        reserved: int,
        backed: int = 0,
        *,
        device: int | str | torch.device | None = None,
        name: str | None = None,
        chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not isinstance(reserved, int) or isinstance(reserved, bool) or reserved <= 0:
            raise InvalidArgument(f"arena reservation must be a positive byte count, got {reserved!r}")
        cu = driver()
        self._dev = _device_index(device)
        with _on(self._dev):
            torch.zeros(1, device=self.device)  # the primary context exists from here on
            self._gdr = gpu_direct_rdma_vmm(self._dev)
            self._prop = _prop(self._dev, gpu_direct_rdma=self._gdr)
            self._gran = _granularity(self._prop)
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0):
            raise InvalidArgument(f"chunk_bytes must be a positive byte count, got {chunk_bytes!r}")
        self._chunk_cap = None if chunk_bytes is None else _round_up(chunk_bytes, self._gran)
        self._reserved = reserved
        self._va_size = _round_up(reserved, self._gran)
        self.region_id = name or f"kvd-vmm-{uuid.uuid4().hex[:12]}"
        with _on(self._dev):
            self._base = int(
                _ok(cu.cuMemAddressReserve(self._va_size, 0, 0, 0), f"cuMemAddressReserve of {self._va_size:,d} bytes")
            )
        self._chunks: list[_Chunk] = []
        self._mapped = 0
        self._backed = 0
        self._view: torch.Tensor | None = None
        self._closed = False
        try:
            self.set_backed(backed)
        except BaseException:
            self.close()
            raise

    # ---- Arena interface ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._dev)

    @property
    def granularity(self) -> int:
        """Bytes of one allocation grain: chunk sizes and offsets are multiples of it."""
        return self._gran

    @property
    def gpu_direct_rdma(self) -> bool:
        """Whether the chunks are created RDMA-capable (the device supports GPUDirect RDMA on
        virtual memory), so an RDMA NIC can register the arena."""
        return self._gdr

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped now (``backed`` rounded up, plus any straddling chunk)."""
        return self._mapped

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every mapped chunk, in address order."""
        return [(c.offset, c.size) for c in self._chunks]

    def set_backed(self, nbytes: int) -> None:
        self._check_open()
        self._check_size(nbytes)
        want = _round_up(nbytes, self._gran)
        with _LOCK, _on(self._dev):
            if want > self._mapped:
                self._grow(want)
            elif want < self._mapped:
                self._shrink(want)
            self._backed = nbytes
            self._view = None

    def tensor(self) -> torch.Tensor:
        self._check_open()
        if self._view is None:
            self._view = _wrap(self._base, self._backed, self._dev)
        return self._view

    def handle(self) -> ArenaHandle:
        self._check_open()
        return ArenaHandle(kind="cuda-vmm", path="", backed=self._backed, region_id=self.region_id)

    def export_fds(self) -> list[tuple[int, int]]:
        """Export every mapped chunk as a POSIX fd: ``[(fd, size), ...]`` in address order.

        The fds are new and belong to the caller (send them with ``socket.send_fds``, then
        ``os.close`` them). Mapped in order by :func:`map_imported`, they cover ``[0, mapped)``,
        which includes the backed prefix."""
        self._check_open()
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out: list[tuple[int, int]] = []
        try:
            with _on(self._dev):
                for c in self._chunks:
                    fd = _ok(cu.cuMemExportToShareableHandle(c.handle, kind, 0), "cuMemExportToShareableHandle")
                    out.append((int(fd), c.size))
        except BaseException:
            for fd, _ in out:
                os.close(fd)
            raise
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view = None
        cu = driver()
        if self._chunks:
            torch.cuda.synchronize(self._dev)  # nothing may still be reading the memory we unmap
        with _LOCK, _on(self._dev):
            while self._chunks:
                self._release_last()
            _ok(cu.cuMemAddressFree(self._base, self._va_size), "cuMemAddressFree")

    def __del__(self) -> None:  # best effort: give the memory back if the owner forgot
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    # ---- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"arena {self.region_id} is closed")

    def _grow(self, want: int) -> None:
        cu = driver()
        while self._mapped < want:
            size = want - self._mapped
            if self._chunk_cap is not None:
                size = min(size, self._chunk_cap)
            h = _ok(cu.cuMemCreate(size, self._prop, 0), f"cuMemCreate of {size:,d} bytes", size)
            ptr = self._base + self._mapped
            try:
                _ok(cu.cuMemMap(ptr, size, 0, h, 0), f"cuMemMap of {size:,d} bytes at offset {self._mapped:,d}")
                try:
                    _set_access(ptr, size, self._dev)
                except BaseException:
                    cu.cuMemUnmap(ptr, size)
                    raise
            except BaseException:
                cu.cuMemRelease(h)
                raise
            self._chunks.append(_Chunk(self._mapped, size, h))
            self._mapped += size

    def _shrink(self, want: int) -> None:
        if self._chunks and self._chunks[-1].offset >= want:
            torch.cuda.synchronize(self._dev)
        while self._chunks and self._chunks[-1].offset >= want:
            self._release_last()

    def _release_last(self) -> None:
        cu = driver()
        c = self._chunks.pop()
        _ok(cu.cuMemUnmap(self._base + c.offset, c.size), "cuMemUnmap")
        _ok(cu.cuMemRelease(c.handle), "cuMemRelease")
        self._mapped = c.offset


class ImportedVmm:
    """Chunks of another process's arena, mapped here in order. Keep it alive while the tensor
    from :func:`map_imported` is in use; :meth:`close` unmaps (drop the tensor first).

    ``device`` is the device the mapping was made for (kernels touching it run there); ``home``
    the device index the memory physically lives on, when the caller said (``None``: unknown,
    or the same device)."""

    def __init__(self, dev: int, base: int, va_size: int, chunks: list[_Chunk], home: int | None = None) -> None:
        self.device = torch.device("cuda", dev)
        self.home = home
        self.base = base
        self.size = sum(c.size for c in chunks)
        self._va_size = va_size
        self._chunks = chunks
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cu = driver()
        with _on(self.device.index):
            if self._chunks:
                torch.cuda.synchronize(self.device)
            while self._chunks:
                c = self._chunks.pop()
                _ok(cu.cuMemUnmap(self.base + c.offset, c.size), "cuMemUnmap")
                _ok(cu.cuMemRelease(c.handle), "cuMemRelease")
            _ok(cu.cuMemAddressFree(self.base, self._va_size), "cuMemAddressFree")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def map_imported(
    fds_sizes: list[tuple[int, int]],
    device: int | str | torch.device | None = None,
    *,
    nbytes: int | None = None,
    home: int | None = None,
) -> tuple[ImportedVmm, torch.Tensor]:
    """Map chunks exported by :meth:`CudaVmmArena.export_fds` (received over ``SCM_RIGHTS``)
    contiguously at a new address, accessible from ``device``. Returns the owner (keep it alive;
    ``close()`` unmaps) and a ``uint8`` tensor of ``device`` over the first ``nbytes`` (default:
    every chunk's bytes).

    ``home``: this process's index of the device the chunks live on, when it is not ``device``
    (a cross-GPU import: ``device`` reaches them by peer access; check :func:`can_access_peer`
    first, or ``cuMemSetAccess`` refuses). The fds are not closed here; the memory stays alive
    through the mapping, so the caller may close them as soon as this returns."""
    if not fds_sizes:
        raise InvalidArgument("map_imported: no chunks given; pass the (fd, size) pairs of export_fds()")
    cu = driver()
    dev = _device_index(device)
    with _on(dev):
        torch.zeros(1, device=f"cuda:{dev}")  # the primary context exists from here on
        gran = _granularity(_prop(dev))
        for fd, size in fds_sizes:
            if not isinstance(fd, int) or fd < 0 or not isinstance(size, int) or size <= 0 or size % gran:
                raise InvalidArgument(
                    f"map_imported: chunk (fd={fd!r}, size={size!r}) is not a valid fd with a positive size that is "
                    f"a multiple of the {gran:,d}-byte granularity"
                )
        total = sum(size for _, size in fds_sizes)
        if nbytes is None:
            nbytes = total
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= total:
            raise InvalidArgument(f"map_imported: nbytes={nbytes!r} is outside [0, {total:,d}] (the chunks' bytes)")
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        base = int(_ok(cu.cuMemAddressReserve(total, 0, 0, 0), f"cuMemAddressReserve of {total:,d} bytes"))
        owner = ImportedVmm(dev, base, total, [], None if home == dev else home)
        try:
            off = 0
            for fd, size in fds_sizes:
                h = _ok(cu.cuMemImportFromShareableHandle(fd, kind), f"cuMemImportFromShareableHandle(fd={fd})")
                try:
                    _ok(cu.cuMemMap(base + off, size, 0, h, 0), f"cuMemMap of an imported chunk of {size:,d} bytes")
                except BaseException:
                    cu.cuMemRelease(h)
                    raise
                owner._chunks.append(_Chunk(off, size, h))
                _set_access(base + off, size, dev)
                off += size
        except BaseException:
            owner.close()
            raise
        owner.size = total
        try:
            view = _wrap(base, nbytes, dev, home=home)
        except BaseException:
            owner.close()
            raise
        return owner, view


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


def import_arena(
    header: HandleHeader, fds: list[int], device: int | str | torch.device | None = None
) -> tuple[ImportedVmm, torch.Tensor]:
    """Map an export received over a handle socket (:func:`kvd.ipc.fdpass.fetch`): the chunks in
    order, a ``uint8`` tensor over exactly ``header.backed`` bytes. The memory lives on the
    owner's GPU, found here by UUID (:func:`device_for`); ``device`` (default: that GPU) is the
    device the mapping is made for and the tensor belongs to. Another device than the owner's
    maps it for peer access (see :func:`map_imported`; callers check :func:`can_access_peer`).
    The fds stay the caller's to close."""
    home = device_for(header.gpu_uuid, header.device)
    dev = home if device is None else _device_index(device)
    return map_imported(list(zip(fds, header.sizes)), dev, nbytes=header.backed, home=home)
