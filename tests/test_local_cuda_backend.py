"""The local backend for CUDA arenas (kvd.backends.local_cuda), driven on the CPU.

memfd arenas stand in for CUDA arenas and an mmap stands in for the CUDA import (the
``_import`` seam), so everything but the device copy itself runs here: peers are found through
their handle sockets, mappings are cached and renewed when the peer's backing changes, and a
peer that is gone before or during a write gives Unavailable / Aborted as on the shm path. The
GPU tier (tests/gpu/test_gpu_daemon.py) runs the same path on a GPU."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from memfd_kit import MemfdArena, memfd_import

from kvd.memory.arena import ShmArena
from kvd.backends import PeerRegion, local_cuda, make_backend
from kvd.backends.local_cuda import CudaLocalBackend, copy_blocks
from kvd.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from kvd.ipc.fdpass import HandleHeader, HandleServer

MiB = 1 << 20


class Peer:
    """A peer daemon's handle side: a memfd arena served on a socket, restartable."""

    def __init__(self, path: str, backed: int = 2 * MiB, token: str = "") -> None:
        self.path, self.token = path, token
        self.arena = MemfdArena(8 * MiB, backed)
        self.arena.tensor().fill_(0)
        self.generation = 0
        self.device, self.gpu_uuid = -1, ""  # what the header says about the peer's GPU (-1: none)
        self.server = HandleServer(path, self.export, authorize=self.authorize).start()

    def export(self, want_fds: bool) -> tuple[HandleHeader, list[int]]:
        a = self.arena
        sizes = tuple(s for _, s in a.chunks)
        h = HandleHeader(a.region_id, "boot", a.backed, sizes if want_fds else (), self.generation, self.device, self.gpu_uuid)
        return h, [fd for fd, _ in a.export_fds()] if want_fds else []

    def authorize(self, req) -> None:
        if self.token and req.token != self.token:
            raise PermissionDenied("wrong peer token; configure the same peer_token on both daemons")

    def backing_changed(self) -> None:
        """What the daemon does on finalize/resize: a new generation, and the watchers told."""
        self.generation += 1
        self.server.notify()

    @property
    def region(self) -> PeerRegion:
        return PeerRegion(self.path, self.arena.base, self.arena.backed, self.arena.region_id)

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.server.stop()
        self.arena.close()


class Imports(list):
    """Headers of the imports made, in order; ``devices``: the device each was mapped for."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list = []


@pytest.fixture
def imports(monkeypatch):
    made = Imports()

    def fake(header, fds, device):
        made.append(header)
        made.devices.append(device)
        return memfd_import(header, fds, device)

    monkeypatch.setattr(local_cuda, "_import", fake)
    return made


@pytest.fixture
def writer(tmp_path, imports):
    arena = MemfdArena(8 * MiB, 4 * MiB)
    g = torch.Generator().manual_seed(1)
    arena.tensor().copy_(torch.randint(0, 256, (arena.backed,), dtype=torch.uint8, generator=g))
    b = CudaLocalBackend(str(tmp_path / "w.handles"), token="tok")
    b.register(arena)
    yield b, arena
    b.close()
    arena.close()


@pytest.fixture
def peer(tmp_path):
    p = Peer(str(tmp_path / "p.handles"), token="tok")
    yield p
    p.close()


def test_blocks_land_in_the_peer_and_nothing_else_changes(writer, peer, imports):
    b, arena = writer
    r = peer.region
    srcs, dsts, lens = [arena.base + 4096, arena.base + 65536], [r.base + 8192, r.base + MiB], [4096, 12288]
    b.write(r, srcs, dsts, lens)
    exp = torch.zeros(peer.arena.backed, dtype=torch.uint8)
    for s, d, n in zip(srcs, dsts, lens):
        exp[d - r.base : d - r.base + n] = arena.tensor()[s - arena.base : s - arena.base + n]
    assert torch.equal(peer.arena.tensor(), exp)
    assert b.bytes_written == 16384 and b.batches == 1
    b.write(r, [arena.base], [r.base], [512])  # the mapping is reused: no second import
    assert len(imports) == 1 and peer.arena.exports == 1
    assert b.endpoint.endswith("w.handles")


def test_a_new_backing_generation_or_a_bigger_ticket_maps_again(writer, peer, imports):
    b, arena = writer
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    peer.backing_changed()  # finalize/resize on the peer: chunks may have been replaced
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert len(imports) == 2
    peer.arena.set_backed(3 * MiB)  # grown (same generation here): the ticket promises more
    r = peer.region
    b.write(r, [arena.base], [r.base + 3 * MiB - 4096], [4096])
    assert len(imports) == 3 and imports[-1].backed == 3 * MiB
    assert torch.equal(peer.arena.tensor()[-4096:], arena.tensor()[:4096])


def test_a_dead_peer_is_unavailable_and_nothing_is_written(writer, peer):
    b, arena = writer
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert peer.path in b._peers
    peer.stop()
    before = peer.arena.tensor().clone()
    with pytest.raises(Unavailable, match="does not answer.*nothing was written"):
        b.write(peer.region, [arena.base + 4096], [peer.region.base + 4096], [4096])
    assert torch.equal(peer.arena.tensor(), before)
    assert peer.path not in b._peers  # a dead peer's arena must not stay mapped


def test_mapping_a_new_peer_drops_the_mapping_of_one_that_died_meanwhile(writer, peer, tmp_path):
    b, arena = writer
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    peer.stop()  # its watch fires; nothing is written to it again
    other = Peer(str(tmp_path / "o.handles"), token="tok")
    try:
        b.write(other.region, [arena.base], [other.region.base], [4096])
        assert peer.path not in b._peers and other.path in b._peers  # pruned without a round trip
    finally:
        other.close()


def test_a_restarted_peer_is_unavailable_for_old_tickets(writer, peer, tmp_path):
    b, arena = writer
    old = peer.region
    b.write(old, [arena.base], [old.base], [4096])
    peer.stop()
    new = Peer(peer.path, token="tok")  # same socket path, new arena
    try:
        with pytest.raises(Unavailable, match=r"now serves .* \(the peer restarted\); nothing was written"):
            b.write(old, [arena.base], [old.base], [4096])
        assert not bool(new.arena.tensor().any())
        b.write(new.region, [arena.base], [new.region.base], [4096])  # a fresh ticket works
        assert torch.equal(new.arena.tensor()[:4096], arena.tensor()[:4096])
    finally:
        new.close()


def test_a_peer_that_dies_during_the_copy_aborts_the_write(writer, peer, monkeypatch):
    b, arena = writer

    def copy_then_die(*args):
        n = copy_blocks(*args)
        peer.stop()
        return n

    monkeypatch.setattr(local_cuda, "copy_blocks", copy_then_die)
    with pytest.raises(Aborted, match="lost its owner during the write"):
        b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert peer.path not in b._peers


def test_a_peer_that_hangs_while_mapped_stalls_no_writer_to_another_peer(writer, peer, tmp_path, monkeypatch):
    """Mapping talks to the peer (fetch, import, watch) outside the mappings lock: while one
    peer's handle fetch hangs, a write that maps another peer, and the drop of a dead peer's
    mapping (its watch closed at once), go through."""
    b, arena = writer
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    dead_watch = b._peers[peer.path].watch
    slow, fast = Peer(str(tmp_path / "s.handles"), token="tok"), Peer(str(tmp_path / "f.handles"), token="tok")
    entered, release = threading.Event(), threading.Event()
    real_fetch = local_cuda.fdpass.fetch

    def fetch(path, **kw):
        if path == slow.path:
            entered.set()
            release.wait(10)
        return real_fetch(path, **kw)

    monkeypatch.setattr(local_cuda.fdpass, "fetch", fetch)
    hung = threading.Thread(target=b.write, args=(slow.region, [arena.base], [slow.region.base], [4096]))
    try:
        hung.start()
        assert entered.wait(5), "the slow peer's fetch never started"
        peer.stop()
        b.write(fast.region, [arena.base], [fast.region.base], [4096])  # maps a peer, prunes the dead one
        assert hung.is_alive() and fast.path in b._peers and peer.path not in b._peers
        assert dead_watch._sock is None  # closed with its mapping, not left to the collector
        release.set()
        hung.join(10)
        assert slow.path in b._peers
    finally:
        release.set()
        hung.join(10)
        slow.close()
        fast.close()


def test_a_wrong_token_is_refused_by_the_peer(tmp_path, imports):
    arena = MemfdArena(8 * MiB, MiB)
    p = Peer(str(tmp_path / "p.handles"), token="right")
    b = CudaLocalBackend(str(tmp_path / "w.handles"), token="wrong")
    try:
        b.register(arena)
        with pytest.raises(PermissionDenied, match="configure the same peer_token"):
            b.write(p.region, [arena.base], [p.region.base], [64])
        assert imports == []
    finally:
        b.close()
        p.close()
        arena.close()


def test_a_peer_that_shrank_under_the_ticket_is_refused(writer, peer):
    b, arena = writer
    r = PeerRegion(peer.path, peer.arena.base, 4 * MiB, peer.arena.region_id)  # promises more than it has
    with pytest.raises(Aborted, match="shrank under a live lease"):
        b.write(r, [arena.base], [r.base + 3 * MiB], [4096])


def test_misuse_is_refused(tmp_path):
    b = CudaLocalBackend("")
    with pytest.raises(FailedPrecondition, match="no handle socket"):
        b.endpoint
    shm = ShmArena(MiB, MiB, directory=str(tmp_path))
    try:
        with pytest.raises(InvalidArgument, match="cuda-vmm arenas only"):
            b.register(shm)
    finally:
        shm.close()
    with pytest.raises(FailedPrecondition, match="register"):
        b.write(PeerRegion("/x", 0, 4096, "x"), [0], [0], [1])
    b.close()


def test_make_backend_picks_the_local_backend_by_arena_kind():
    from kvd.backends.local import LocalBackend

    b = make_backend("local", arena_kind="cuda-vmm", handle_endpoint="/tmp/kvd.sock.handles", peer_token="t")
    assert isinstance(b, CudaLocalBackend) and b.endpoint == "/tmp/kvd.sock.handles" and b.name == "local"
    b.close()
    b2 = make_backend("local")
    assert isinstance(b2, LocalBackend)
    b2.close()
    with pytest.raises(InvalidArgument, match="shm or cuda-vmm arenas"):
        make_backend("local", arena_kind="nvme")


def test_copy_blocks_matches_a_byte_loop():
    rnd = random.Random(5)
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    exp = dst.clone()
    s, d, n = [], [], []
    used = 0
    for _ in range(40):  # disjoint destinations, 16-byte aligned
        k = 16 * rnd.randint(1, 40)
        a = 16 * rnd.randint(0, (len(src) - k) // 16)
        s.append(a)
        d.append(used)
        n.append(k)
        used += k + 16 * rnd.randint(0, 3)
    for a, b_, k in zip(s, d, n):
        exp[b_ : b_ + k] = src[a : a + k]
    assert copy_blocks(src, dst, s, d, n) == sum(n)
    assert torch.equal(dst, exp)
    assert copy_blocks(src, dst, [], [], []) == 0
    odd = torch.zeros(100, dtype=torch.uint8)
    copy_blocks(src, odd, [3], [7], [5])  # gcd 1: byte rows still work
    assert torch.equal(odd[7:12], src[3:8]) and int(odd.sum()) == int(src[3:8].sum())


# ---- the peer's arena on another GPU of the host (the GPU checks stubbed at their seams) -----


def _on_gpu(b: CudaLocalBackend, peer: Peer, monkeypatch, *, visible: bool = True, peer_access: bool = True) -> list:
    """Make the writer's arena look like cuda:0's and the peer's like cuda:1's; returns the
    (own, home) pairs the peer-access check was asked about."""
    b._dev = torch.device("cuda", 0)
    peer.device, peer.gpu_uuid = 1, "GPU-peer-uuid"
    asked: list = []

    def locate(header):
        if not visible:
            raise FailedPrecondition(f"the arena lives on GPU {header.gpu_uuid} (cuda:{header.device} of its owner), which this process does not see")
        assert header.gpu_uuid == "GPU-peer-uuid"
        return 1

    def can_access(own, home):
        asked.append((own, home))
        return peer_access

    monkeypatch.setattr(local_cuda, "_locate", locate)
    monkeypatch.setattr(local_cuda, "_can_access", can_access)
    return asked


def test_a_peer_gpu_without_peer_access_is_refused_naming_both_gpus(writer, peer, imports, monkeypatch):
    b, arena = writer
    asked = _on_gpu(b, peer, monkeypatch, peer_access=False)
    before = peer.arena.tensor().clone()
    with pytest.raises(FailedPrecondition) as info:
        b.write(peer.region, [arena.base], [peer.region.base], [4096])
    msg = str(info.value)
    assert "cuda:1" in msg and "cuda:0" in msg and "no peer access" in msg and "nothing was written" in msg
    assert asked == [(0, 1)]
    assert imports == [] and peer.path not in b._peers  # nothing mapped, nothing cached
    assert torch.equal(peer.arena.tensor(), before)


def test_a_peer_gpu_this_process_cannot_see_is_refused_naming_both(writer, peer, imports, monkeypatch):
    b, arena = writer
    asked = _on_gpu(b, peer, monkeypatch, visible=False)
    with pytest.raises(FailedPrecondition) as info:
        b.write(peer.region, [arena.base], [peer.region.base], [4096])
    msg = str(info.value)
    assert "GPU-peer-uuid (cuda:1 of the peer)" in msg and "cuda:0" in msg and "does not see" in msg
    assert asked == [] and imports == []


def test_a_peer_gpu_with_peer_access_is_mapped_for_the_own_gpu(writer, peer, imports, monkeypatch):
    b, arena = writer
    asked = _on_gpu(b, peer, monkeypatch)
    r = peer.region
    b.write(r, [arena.base + 8192], [r.base + 4096], [8192])
    assert torch.equal(peer.arena.tensor()[4096:12288], arena.tensor()[8192:16384])
    assert asked == [(0, 1)]
    assert imports.devices == [torch.device("cuda", 0)]  # mapped for this daemon's GPU, not the peer's
    assert b._peers[peer.path].home == 1  # the peer's physical GPU is recorded with the mapping
    b.write(r, [arena.base], [r.base], [4096])  # the mapping is reused: no second check, no second import
    assert asked == [(0, 1)] and len(imports) == 1


def test_the_same_gpu_needs_no_peer_access(writer, peer, imports, monkeypatch):
    b, arena = writer
    asked = _on_gpu(b, peer, monkeypatch, peer_access=False)
    monkeypatch.setattr(local_cuda, "_locate", lambda header: 0)  # the peer's arena is on cuda:0 too
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert asked == [] and b._peers[peer.path].home is None
    assert torch.equal(peer.arena.tensor()[:4096], arena.tensor()[:4096])


def test_the_owners_gpu_is_found_by_uuid_however_this_process_numbers_it(monkeypatch):
    """``arena_cuda.device_for`` (what ``_locate`` asks) with torch's device list stubbed: by
    UUID (``arena_cuda.gpu_uuid``, which the daemon's handle header carries too), the owner's
    index only where there is no UUID or torch cannot say one."""
    from types import SimpleNamespace

    from kvd.memory import vmm as arena_cuda

    uuids = ["GPU-a", "GPU-b"]

    def props(i):
        if uuids is None:
            raise AttributeError("this torch reports no uuid")
        return SimpleNamespace(uuid=uuids[i], name="stub")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert [arena_cuda.gpu_uuid(i) for i in range(2)] == uuids
    assert arena_cuda.device_for("GPU-b", 0) == 1  # the owner's cuda:0 is this process's cuda:1
    with pytest.raises(FailedPrecondition, match=r"GPU GPU-c \(cuda:1 of its owner\), which this process does not see"):
        arena_cuda.device_for("GPU-c", 1)
    assert arena_cuda.device_for("", 1) == 1
    with pytest.raises(FailedPrecondition, match=r"cuda:2 of its owner; this process has 2 CUDA device\(s\)"):
        arena_cuda.device_for("", 2)
    uuids = None  # torch cannot say: the owner's index is trusted
    assert arena_cuda.gpu_uuid(0) == "" and arena_cuda.device_for("GPU-b", 1) == 1


# ---- liveness by watch; the copy strategy ----------------------------------------------------


def test_writes_check_liveness_by_watch_without_pings(writer, peer):
    b, arena = writer
    r = peer.region
    b.write(r, [arena.base], [r.base], [4096])  # maps: one ping, a watch opened with the mapping
    pings = b.pings
    deadline = time.monotonic() + 5
    while peer.server.watching != 1 and time.monotonic() < deadline:  # kept just after its reply went out
        time.sleep(0.01)
    assert peer.server.watching == 1 and b._peers[peer.path].watch is not None
    for i in range(5):
        b.write(r, [arena.base + 4096 * i], [r.base + 4096 * i], [4096])
    assert b.pings == pings and b.polls == 11  # the first write's after-check, then before and after each: polls, no round trips
    assert torch.equal(peer.arena.tensor()[: 5 * 4096], arena.tensor()[: 5 * 4096])


def test_a_stopped_peer_is_seen_by_the_watch_within_one_check(writer, peer):
    b, arena = writer
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    w = b._peers[peer.path].watch
    assert w.quiet()
    peer.stop()
    assert not w.quiet()  # stop() closed the watched socket
    with pytest.raises(Unavailable, match="does not answer.*nothing was written"):
        b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert peer.path not in b._peers


def test_without_a_watch_the_writer_pings(writer, peer, monkeypatch):
    b, arena = writer

    def refuse(*a, **k):
        raise InvalidArgument("handle request op 'watch' is unknown")

    monkeypatch.setattr(local_cuda.fdpass, "watch", refuse)
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    b.write(peer.region, [arena.base], [peer.region.base], [4096])
    assert b._peers[peer.path].watch is None and b.polls == 0 and b.pings == 4
    peer.stop()
    with pytest.raises(Unavailable, match="does not answer"):
        b.write(peer.region, [arena.base], [peer.region.base], [4096])


def test_copy_strategy_is_a_pure_choice():
    from kvd.backends.local_cuda import CE_MAX_BLOCKS, CE_MIN_AVG_BLOCK, COPY_ENGINE, KERNEL, copy_strategy

    big = [CE_MIN_AVG_BLOCK] * 8
    assert copy_strategy(None, big) == COPY_ENGINE  # the same GPU: one batch beats the kernel
    assert copy_strategy(None, big, batch=False) == KERNEL  # ... a memcpy per block does not
    assert copy_strategy(1, big) == COPY_ENGINE
    assert copy_strategy(1, big, batch=False) == COPY_ENGINE  # across GPUs even a memcpy per block wins
    assert copy_strategy(None, [CE_MIN_AVG_BLOCK - 1] * 8) == KERNEL
    assert copy_strategy(1, [CE_MIN_AVG_BLOCK - 1] * 8) == KERNEL  # small blocks: one launch wins
    assert copy_strategy(1, [CE_MIN_AVG_BLOCK] * (CE_MAX_BLOCKS + 1)) == KERNEL  # too many memcpys
    assert copy_strategy(1, [4096, 2 * CE_MIN_AVG_BLOCK]) == COPY_ENGINE  # the average decides
    assert copy_strategy(1, []) == KERNEL


def test_a_peer_gpu_with_large_blocks_is_written_by_copy_engine(writer, peer, imports, monkeypatch):
    b, arena = writer
    _on_gpu(b, peer, monkeypatch)
    r = peer.region
    srcs, dsts, lens = [arena.base, arena.base + MiB], [r.base + 4096, r.base + MiB], [256 << 10, 512 << 10]
    b.write(r, srcs, dsts, lens)
    assert b.strategies == {"kernel": 0, "copy-engine": 1}
    for s_, d_, n_ in zip(srcs, dsts, lens):
        assert torch.equal(peer.arena.tensor()[d_ - r.base : d_ - r.base + n_], arena.tensor()[s_ - arena.base : s_ - arena.base + n_])
    b.write(r, [arena.base], [r.base], [4096])  # a small block: the kernel
    assert b.strategies == {"kernel": 1, "copy-engine": 1}


def test_an_async_write_checks_before_issuing_and_its_waiter_after_landing(writer, peer):
    """The pre-write checks run before write_async returns (a dead peer: Unavailable, nothing
    issued); the waiter does the post-write check (a peer gone meanwhile: Aborted, mapping
    dropped), accounting and the in-flight count."""
    b, arena = writer
    r = peer.region
    landed = b.write_async(r, [arena.base], [r.base], [4096])
    assert b._in_flight == 1 and b.bytes_written == 0  # counted when landed, not when issued
    landed()
    assert b._in_flight == 0 and b.bytes_written == 4096
    assert torch.equal(peer.arena.tensor()[:4096], arena.tensor()[:4096])
    landed = b.write_async(r, [arena.base + 4096], [r.base + 4096], [4096])
    peer.stop()  # dies after the copies were issued, before they were waited for
    with pytest.raises(Aborted, match="lost its owner during the write"):
        landed()
    assert b._in_flight == 0 and peer.path not in b._peers
    with pytest.raises(Unavailable, match="nothing was written"):
        b.write_async(r, [arena.base], [r.base], [4096])
    assert b._in_flight == 0
