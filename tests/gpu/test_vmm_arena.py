"""CudaVmmArena: reserve once, grow and shrink the backing in place (the base never moves), the
pool's post-capture sizing on top of it, and a second process mapping the exported chunks."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_kit import GPU, NEEDS_VMM

import kvd
from kvd.memory.arena import ShmArena
from kvd.errors import InvalidArgument
from kvd.pool.layout import GroupKind
from kvd.pool.pool import Pool
from kvd.pool.presets import preset

pytestmark = [*GPU, NEEDS_VMM]

MiB = 1 << 20
GiB = 1 << 30


def _up(n: int, g: int) -> int:
    return -(-n // g) * g


def _rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def test_grow_and_shrink_keep_base_and_bytes(vmm_arena_factory) -> None:
    a = vmm_arena_factory(4 * GiB, chunk_bytes=None)  # one chunk per growth step
    g = a.granularity
    assert g > 0 and a.base % g == 0
    base = a.base
    assert a.backed == 0 and a.mapped_bytes == 0 and a.chunks == [] and a.tensor().numel() == 0
    assert a.device.type == "cuda" and a.reserved == 4 * GiB

    a.set_backed(3 * MiB)
    t = a.tensor()
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 3 * MiB and t.data_ptr() == base
    data = _rand(3 * MiB, 1)
    t.copy_(data)

    a.set_backed(40 * MiB + 5)  # grows by mapping a second chunk right after the first
    assert a.base == base and a.tensor().data_ptr() == base and a.backed == 40 * MiB + 5
    assert a.chunks == [(0, _up(3 * MiB, g)), (_up(3 * MiB, g), _up(40 * MiB + 5, g) - _up(3 * MiB, g))]
    assert a.mapped_bytes == _up(40 * MiB + 5, g)
    assert torch.equal(a.tensor()[: 3 * MiB], data)
    tail = _rand(a.backed, 2)
    a.tensor().copy_(tail)  # every backed byte is writable, the last one too
    torch.cuda.synchronize()
    assert torch.equal(a.tensor(), tail)

    a.set_backed(2 * MiB)  # the second chunk starts past the new end: unmapped and released
    assert a.chunks == [(0, _up(3 * MiB, g))] and a.mapped_bytes == _up(3 * MiB, g)
    assert a.tensor().data_ptr() == base and torch.equal(a.tensor(), tail[: 2 * MiB])

    a.set_backed(0)
    assert a.chunks == [] and a.mapped_bytes == 0 and a.tensor().numel() == 0
    a.set_backed(8 * MiB)
    assert a.base == base and a.tensor().data_ptr() == base
    a.tensor().fill_(3)
    assert int(a.tensor().sum()) == 3 * 8 * MiB


def test_chunk_bytes_caps_chunks_so_shrinking_gives_back_more(vmm_arena_factory) -> None:
    a = vmm_arena_factory(GiB, chunk_bytes=4 * MiB)
    g = a.granularity
    cap = _up(4 * MiB, g)
    a.set_backed(20 * MiB)
    assert all(size <= cap for _, size in a.chunks) and sum(s for _, s in a.chunks) == _up(20 * MiB, g)
    a.set_backed(9 * MiB)
    # chunks that start at or past the new end go back; the one straddling it stays
    assert a.mapped_bytes == _up(_up(9 * MiB, g), cap) and a.tensor().numel() == 9 * MiB


def test_default_chunks_are_at_most_one_gib(vmm_arena_factory) -> None:
    from kvd.memory.vmm import DEFAULT_CHUNK_BYTES

    a = vmm_arena_factory(8 * GiB, 2 * MiB)
    a.set_backed(2 * GiB + GiB // 2)
    assert DEFAULT_CHUNK_BYTES == GiB and all(size <= GiB for _, size in a.chunks) and len(a.chunks) == 4
    a.tensor()[-(1 << 20) :].fill_(1)  # the far end of the last chunk is mapped
    a.set_backed(GiB)  # chunks starting at or past 1 GiB go back; the one straddling it stays
    assert a.mapped_bytes == 2 * MiB + GiB and a.tensor().numel() == GiB


def test_refusals_match_the_shm_arena(vmm_arena_factory, kvd_arena_factory) -> None:
    a, shm = vmm_arena_factory(64 * MiB), kvd_arena_factory(64 * MiB)
    for bad in (-1, 64 * MiB + 1, 1.5, True, None):
        with pytest.raises(InvalidArgument) as e_cpu:
            shm.set_backed(bad)
        with pytest.raises(InvalidArgument) as e_gpu:
            a.set_backed(bad)
        assert str(e_gpu.value) == str(e_cpu.value)
    assert a.backed == 0 and a.chunks == []
    from kvd.memory.vmm import CudaVmmArena

    for bad in (0, -5, 2.0):
        with pytest.raises(InvalidArgument, match="positive byte count"):
            CudaVmmArena(bad)
    with pytest.raises(InvalidArgument, match="lives on a cuda device"):
        CudaVmmArena(MiB, device="cpu")
    with pytest.raises(InvalidArgument, match="does not exist"):
        CudaVmmArena(MiB, device=torch.cuda.device_count())
    closed = CudaVmmArena(8 * MiB, MiB)
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(InvalidArgument, match="is closed"):
        closed.tensor()


def test_handle_names_the_kind_and_the_backed_prefix(vmm_arena_factory) -> None:
    a = vmm_arena_factory(GiB, 5 * MiB, name="kvd-vmm-test")
    h = a.handle()
    assert h == kvd.ArenaHandle(kind="cuda-vmm", path="", backed=5 * MiB, region_id="kvd-vmm-test")
    fds = a.export_fds()
    try:
        assert [size for _, size in fds] == [size for _, size in a.chunks]
        assert all(fd >= 0 for fd, _ in fds)
    finally:
        for fd, _ in fds:
            os.close(fd)


def test_chunks_are_rdma_capable_exactly_where_the_device_supports_it(vmm_arena_factory) -> None:
    """The allocation flag an RDMA NIC needs to register VMM memory (Mooncake's GPUDirect path)
    is set when the device reports GPUDirect RDMA on virtual memory, and only then; the chunks
    still export and the bytes still read back."""
    from kvd.memory.vmm import _ok, driver, gpu_direct_rdma_vmm

    cu = driver()
    a = vmm_arena_factory(GiB, 5 * MiB, chunk_bytes=4 * MiB)  # two chunks
    with torch.cuda.device(a.device):
        supported = gpu_direct_rdma_vmm(a.device.index)
        dev = _ok(cu.cuDeviceGet(a.device.index), "cuDeviceGet")
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
        assert supported == bool(_ok(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))
        assert a.gpu_direct_rdma == supported
        for c in a._chunks:
            prop = _ok(cu.cuMemGetAllocationPropertiesFromHandle(c.handle), "cuMemGetAllocationPropertiesFromHandle")
            assert bool(prop.allocFlags.gpuDirectRDMACapable) == supported
    data = _rand(5 * MiB, 9)
    a.tensor().copy_(data)
    torch.cuda.synchronize()
    assert torch.equal(a.tensor(), data)
    fds = a.export_fds()
    for fd, _ in fds:
        os.close(fd)
    assert len(fds) == 2


def test_pool_finalize_backs_in_place(vmm_arena_factory) -> None:
    """Post-capture sizing on a VMM arena: the base address, the page views' address and the
    tables' storage do not move through finalize and resize; pages hold what is written."""
    layout = preset("gpt-oss-20b")
    arena = vmm_arena_factory(8 * GiB)
    pool = Pool(layout, arena, post_capture=True)
    base = arena.base
    assert arena.backed == layout.max_page_bytes and not pool.finalized
    tables = {k: (a.v2p.data_ptr(), a.p2v.data_ptr()) for k, a in pool.groups.items()}
    pool.finalize(2 * GiB)
    assert arena.base == base and arena.backed == 2 * GiB and pool.finalized
    assert pool.page_view("full").data_ptr() == base
    assert all(e.base == base and e.backed_bytes == 2 * GiB for e in pool.envelopes())
    assert {k: (a.v2p.data_ptr(), a.p2v.data_ptr()) for k, a in pool.groups.items()} == tables
    v = pool.allocate("a", 4000)
    full = pool.page_view(GroupKind.FULL)
    pages = v.full.to(torch.int64)
    full[pages] = 7
    assert int(full[pages].sum()) == 7 * pages.numel() * full.shape[1]
    pool.check()
    pool.free("a")
    pool.resize(GiB)  # shrink: chunks (1 GiB each by default) past the new end go back
    assert arena.base == base and arena.backed == GiB and arena.mapped_bytes < 2 * GiB
    assert all(size <= GiB for _, size in arena.chunks)
    pool.resize(3 * GiB)  # grow again in place
    assert arena.base == base and arena.backed == 3 * GiB and pool.page_view("full").data_ptr() == base
    pool.allocate("b", 30_000)  # 1,875 pages in each group: 1.4 GiB of the 3 GiB
    pool.check()


_CHILD = Path(__file__).with_name("vmm_child.py")


def test_second_process_maps_the_same_bytes(vmm_arena_factory, tmp_path) -> None:
    """Export the chunks as fds, pass them over a Unix socket (SCM_RIGHTS) to a fresh process,
    which maps them, hashes the bytes and writes a marker that this process then reads."""
    a = vmm_arena_factory(GiB, 6 * MiB, chunk_bytes=None)
    a.set_backed(12 * MiB + 123)  # two chunks
    assert len(a.chunks) == 2
    a.tensor().copy_(_rand(a.backed, 3))
    torch.cuda.synchronize()
    digest = hashlib.sha256(a.tensor().cpu().numpy().tobytes()).hexdigest()
    write_at = 7 * MiB + 4096  # inside the second chunk

    path = str(tmp_path / "vmm.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(180)
    root = str(Path(kvd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, str(_CHILD), path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        conn, _ = srv.accept()
        conn.settimeout(180)
        fds = a.export_fds()
        try:
            info = {"sizes": [s for _, s in fds], "backed": a.backed, "write_at": write_at, "fill": 0xA5, "n": 4096}
            socket.send_fds(conn, [json.dumps(info).encode()], [fd for fd, _ in fds])
        finally:
            for fd, _ in fds:
                os.close(fd)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        conn.close()
        out, _ = child.communicate(timeout=120)
    finally:
        srv.close()
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out.decode(errors="replace")
    got = json.loads(reply)
    assert got["digest"] == digest and got["nbytes"] == a.backed
    seen = a.tensor()[write_at : write_at + 4096]
    assert bool((seen == 0xA5).all()), "the child's write is not visible in the owner's arena"


def test_map_imported_refusals() -> None:
    from kvd.memory.vmm import map_imported

    with pytest.raises(InvalidArgument, match="no chunks given"):
        map_imported([])
    with pytest.raises(InvalidArgument, match="multiple of the"):
        map_imported([(0, 12345)])


def test_arena_tensor_survives_many_views(vmm_arena_factory) -> None:
    """tensor() is cached per backing; slicing and viewing it never copies."""
    a = vmm_arena_factory(GiB, 4 * MiB)
    t1, t2 = a.tensor(), a.tensor()
    assert t1.data_ptr() == t2.data_ptr() == a.base
    v = t1[: 2 * MiB].view(torch.int64)
    v.fill_(-1)
    assert bool((a.tensor()[: 2 * MiB] == 255).all())


def test_cpu_and_vmm_arenas_share_the_interface(vmm_arena_factory) -> None:
    a, s = vmm_arena_factory(64 * MiB, MiB), ShmArena(64 * MiB, MiB)
    try:
        for arena in (a, s):
            assert arena.tensor().numel() == arena.backed == MiB
            assert arena.tensor().data_ptr() == arena.base
            assert arena.handle().backed == MiB
    finally:
        s.close()
