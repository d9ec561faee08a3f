"""Data-plane backends against a peer in another process (tests/backend_peer.py).

Each backend writes scattered blocks from this process into a peer arena owned by a child
process, and the peer hashes its own bytes: the blocks must land, everything else must stay.
Bad blocks are refused before a byte moves; a killed peer turns into Unavailable or Aborted
within seconds. Mooncake tests skip where ``mooncake.engine`` does not import.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvd.memory.arena import Arena, ArenaHandle, ShmArena
from kvd.backends import Backend, PeerRegion, make_backend
from kvd.backends.local import LocalBackend
from kvd.backends.nixl import parse_endpoint
from kvd.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable

MiB = 1 << 20
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "backend_peer.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mooncake_missing() -> str:
    from kvd.backends.mooncake import check_installed

    try:
        check_installed()  # not a bare import: that would skip the backend's log settings
    except Unavailable as exc:
        return str(exc)
    return ""


def _nixl_missing() -> str:
    from kvd.backends.nixl import missing

    return missing() or ""


MOONCAKE_MISSING = _mooncake_missing()
NIXL_MISSING = _nixl_missing()
BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("mooncake", id="mooncake", marks=pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING)),
    pytest.param("nixl", id="nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)),
]


def pattern(lo: int, hi: int) -> torch.Tensor:
    """The peer's initial bytes (same formula as tests/backend_peer.py)."""
    return (torch.arange(lo, hi, dtype=torch.int64) % 251).to(torch.uint8)


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy(), digest_size=16).hexdigest()


#: nixl peers by agent name: what the writer's metadata fetch asks (a daemon asks over Peer.TransferMetadata).
PEERS: dict[str, Peer] = {}


def fetch_from_peer(locator: str, agent: str) -> bytes:
    peer = PEERS.get(agent)
    if peer is None or peer.proc.poll() is not None:
        raise Unavailable(f"no nixl peer {agent!r} (test registry); nothing was written")
    reply = peer.cmd(f"meta {agent}")
    if "error" in reply:
        raise Unavailable(reply["error"])
    return bytes.fromhex(reply["metadata"])


class Peer:
    """A backend_peer.py process: its arena's region, and hashes of its bytes on request."""

    def __init__(self, backend: str, reserved: int, backed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, PEER_SCRIPT, backend, str(reserved), str(backed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        )
        self.info = self._reply()
        if backend == "nixl":
            PEERS[parse_endpoint(self.info["endpoint"]).agent] = self

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"backend_peer.py exited (rc={self.proc.poll()}); its stderr is in the captured output")
        return json.loads(line)

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._reply()

    @property
    def region(self) -> PeerRegion:
        i = self.info
        return PeerRegion(i["endpoint"], i["base"], i["backed"], i["region_id"])

    def hash(self, off: int, n: int) -> str:
        return self.cmd(f"hash {off} {n}")["hash"]

    def grow(self, backed: int) -> None:
        self.info = self.cmd(f"grow {backed}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
                self.proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.kill()
        # A killed peer cannot unlink its /dev/shm file.
        try:
            os.unlink(self.info["path"])
        except FileNotFoundError:
            pass


def writer_backend(name: str) -> Backend:
    """Small batches and blocks, so the tests cross batch and split boundaries."""
    if name == "local":
        return LocalBackend(max_batch=64)
    if name == "nixl":
        from kvd.backends.nixl import NixlBackend

        return NixlBackend("test", fetch_from_peer, max_batch=64, max_block=1 * MiB)
    from kvd.backends.mooncake import MooncakeBackend

    return MooncakeBackend(max_batch=64, max_block=1 * MiB)


@pytest.fixture(scope="module", params=BACKENDS)
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, Backend]]:
    """One peer and one writer backend per backend kind, for the tests that leave the peer
    alive: each test refills the peer and registers a fresh arena (a mooncake engine takes
    about a second to shut down, so one per test would double this file's run time)."""
    peer = Peer(request.param, 64 * MiB, 16 * MiB)
    backend = writer_backend(request.param)
    yield peer, backend
    backend.close()
    peer.close()


class Writer:
    """This process's side: a random-filled arena registered with a backend.

    ``written()`` and ``batches()`` count from the registration, so a shared backend's earlier
    tests do not show."""

    def __init__(self, backend: Backend, backed: int = 16 * MiB) -> None:
        self.arena = ShmArena(64 * MiB, backed)
        g = torch.Generator().manual_seed(7)
        self.arena.tensor().copy_(torch.randint(0, 256, (backed,), dtype=torch.uint8, generator=g))
        self.backend = backend
        self.reg_seconds = backend.register(self.arena)
        self._base_counts = (backend.bytes_written, backend.batches)

    def written(self) -> int:
        return self.backend.bytes_written - self._base_counts[0]

    def batches(self) -> int:
        return self.backend.batches - self._base_counts[1]


@pytest.fixture
def pair(shared: tuple[Peer, Backend]) -> Iterator[tuple[Writer, Peer]]:
    peer, backend = shared
    peer.cmd("fill")
    w = Writer(backend)
    yield w, peer
    w.arena.close()  # the next test registers its own arena, which unregisters this one


@pytest.fixture
def lone_writer() -> Iterator[Callable[[str, int], Writer]]:
    """``make(name, backed)``: a writer with its own backend, closed at the end of the test."""
    made: list[Writer] = []

    def make(name: str, backed: int) -> Writer:
        made.append(Writer(writer_backend(name), backed))
        return made[-1]

    yield make
    for w in made:
        w.backend.close()
        w.arena.close()


def scattered_blocks(w: Writer, peer: Peer, seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Three writes into disjoint parts of the peer: 300 page-aligned 4-12 KiB blocks (one copy
    each), 256 tiny 64-512 byte blocks (the local backend's gather path), 5 odd-sized blocks of
    just over 1 MiB at odd offsets (split into 1 MiB pieces by mooncake)."""
    rng = random.Random(seed)
    src_lo, dst_lo = w.arena.base, peer.region.base
    slots = rng.sample(range(512), 300)  # 16 KiB slots in the peer's [0, 8 MiB)
    small = (
        [src_lo + rng.randrange(0, 4000) * 4096 for _ in slots],
        [dst_lo + k * 16384 for k in slots],
        [4096 * rng.randint(1, 3) for _ in slots],
    )
    slots = rng.sample(range(1024), 256)  # 1 KiB slots in [8 MiB, 9 MiB)
    tiny = (
        [src_lo + rng.randrange(0, 1 << 18) * 64 for _ in slots],
        [dst_lo + 8 * MiB + k * 1024 for k in slots],
        [64 * rng.randint(1, 8) for _ in slots],
    )
    slot = (7 * MiB) // 5  # [9 MiB, 16 MiB)
    large = (
        [src_lo + rng.randrange(0, 8 * MiB) for _ in range(5)],
        [dst_lo + 9 * MiB + i * slot + rng.randrange(1000) for i in range(5)],
        [rng.randint(MiB + 1, MiB + MiB // 4) for _ in range(5)],
    )
    return [small, tiny, large]


def expected_image(w: Writer, peer: Peer, writes: list[tuple[list[int], list[int], list[int]]]) -> torch.Tensor:
    img = pattern(0, peer.region.backed_bytes)
    src = w.arena.tensor()
    for srcs, dsts, lens in writes:
        for s, d, n in zip(srcs, dsts, lens):
            img[d - peer.region.base : d - peer.region.base + n] = src[s - w.arena.base : s - w.arena.base + n]
    return img


# -- the data lands, nothing else moves ---------------------------------------------------


def test_scattered_blocks_land_and_bytes_outside_them_are_untouched(pair: tuple[Writer, Peer]) -> None:
    w, peer = pair
    writes = scattered_blocks(w, peer, seed=1)
    for srcs, dsts, lens in writes:
        w.backend.write(peer.region, srcs, dsts, lens)
    want = expected_image(w, peer, writes)
    assert peer.hash(0, peer.region.backed_bytes) == digest(want)
    # One block by itself, so a failure above is not only a whole-arena hash mismatch.
    s, d, n = writes[2][0][2], writes[2][1][2], writes[2][2][2]
    off = d - peer.region.base
    assert peer.hash(off, n) == digest(w.arena.tensor()[s - w.arena.base : s - w.arena.base + n])
    assert w.written() == sum(sum(lens) for _, _, lens in writes)
    assert w.batches() == 5 + 4 + 1  # 300 and 256 blocks in batches of 64, then 5 blocks (10 pieces) in one


def test_an_empty_write_is_a_no_op(pair: tuple[Writer, Peer]) -> None:
    w, peer = pair
    w.backend.write(peer.region, [], [], [])
    assert (w.written(), w.batches()) == (0, 0)


def test_an_async_write_is_in_flight_until_its_waiter_returned(pair: tuple[Writer, Peer]) -> None:
    """write_async: bytes landed once the waiter returned; until then register waits for the
    write; the waiter runs once; a refusal raises at once and leaves nothing in flight."""
    import threading

    from kvd.errors import InternalError

    w, peer = pair
    srcs, dsts, lens = scattered_blocks(w, peer, seed=3)[0]
    landed = w.backend.write_async(peer.region, srcs, dsts, lens)
    registering = threading.Thread(target=w.backend.register, args=(w.arena,))
    registering.start()
    registering.join(0.3)
    assert registering.is_alive(), "register did not wait for the write in flight"
    landed()
    registering.join(10)
    assert not registering.is_alive()
    assert peer.hash(0, peer.region.backed_bytes) == digest(expected_image(w, peer, [(srcs, dsts, lens)]))
    with pytest.raises(InternalError, match="waiter was called twice"):
        landed()
    with pytest.raises(InvalidArgument, match="nothing was written"):
        w.backend.write_async(peer.region, [w.arena.base], [peer.region.base - 4096], [4096])
    w.backend.register(w.arena)  # nothing in flight: returns at once
    assert w.backend.write_async(peer.region, [], [], [])() is None


# -- refusals: nothing is written -----------------------------------------------------------


@pytest.mark.parametrize("good", [2, 90], ids=["few blocks", "many blocks"])  # the loop's check, numpy's
def test_bad_blocks_are_refused_before_any_byte_moves(pair: tuple[Writer, Peer], good: int) -> None:
    w, peer = pair
    r, lo, size = peer.region, w.arena.base, w.arena.backed
    before = peer.hash(0, r.backed_bytes)
    good_s, good_d, good_n = [lo + 8192 * i for i in range(good)], [r.base + 8192 * i for i in range(good)], [4096] * good
    cases = {
        "dst past the peer's end": (good_s + [lo], good_d + [r.base + r.backed_bytes - 10], good_n + [20]),
        "dst below the peer's base": (good_s + [lo], good_d + [r.base - 4096], good_n + [4096]),
        "src past this arena": (good_s + [lo + size - 5], good_d + [r.base + 65536], good_n + [10]),
        "src below this arena": (good_s + [lo - 1], good_d + [r.base + 65536], good_n + [10]),
        "zero length": (good_s + [lo], good_d + [r.base + 65536], good_n + [0]),
        "negative length": (good_s + [lo], good_d + [r.base + 65536], good_n + [-4096]),
        "float address": (good_s + [float(lo)], good_d + [r.base + 65536], good_n + [4096]),
        "unequal lists": (good_s, good_d + [r.base], good_n),
    }
    for what, (srcs, dsts, lens) in cases.items():
        with pytest.raises(InvalidArgument) as err:
            w.backend.write(r, srcs, dsts, lens)  # type: ignore[arg-type]
        if what == "float address":
            assert "write takes int srcs, got elements of type float" in str(err.value), err.value
        elif what != "unequal lists":
            assert f"block {good} " in str(err.value) and "nothing was written" in str(err.value), what
    # Backing grown but not registered again: the new bytes are not the backend's to read yet.
    w.arena.set_backed(size + MiB)
    with pytest.raises(InvalidArgument, match="registered range"):
        w.backend.write(r, [lo + size], [r.base], [4096])
    assert peer.hash(0, r.backed_bytes) == before
    assert (w.written(), w.batches()) == (0, 0)


# -- registration -----------------------------------------------------------------------------


def test_registration_is_timed_and_repeated_after_the_backing_grows(pair: tuple[Writer, Peer]) -> None:
    w, peer = pair
    assert w.reg_seconds > 0 and w.backend.registration_seconds == w.reg_seconds
    assert peer.info["registration_seconds"] > 0
    assert w.backend.registered == (w.arena.base, 16 * MiB)
    # Both sides grow and register again; a block from the new source bytes into the new
    # destination bytes must land (local: the peer file is mapped again; mooncake: the peer
    # engine knows the larger range).
    old_src, old_dst = w.arena.backed, peer.region.backed_bytes
    w.arena.set_backed(old_src + 4 * MiB)
    w.arena.tensor()[old_src:].fill_(0x5A)
    assert w.backend.register(w.arena) > 0
    assert w.backend.registered == (w.arena.base, old_src + 4 * MiB)
    peer.grow(old_dst + 8 * MiB)
    r = peer.region
    assert r.backed_bytes == old_dst + 8 * MiB
    w.backend.write(r, [w.arena.base + old_src], [r.base + old_dst + MiB], [2 * MiB])
    assert peer.hash(old_dst + MiB, 2 * MiB) == digest(torch.full((2 * MiB,), 0x5A, dtype=torch.uint8))
    assert peer.hash(old_dst, MiB) == digest(pattern(old_dst, old_dst + MiB))


# -- the peer goes away -------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_a_killed_peer_fails_the_write_within_seconds(name: str, lone_writer: Callable[[str, int], Writer]) -> None:
    peer, w = Peer(name, 16 * MiB, 4 * MiB), lone_writer(name, 4 * MiB)
    try:
        r = peer.region
        w.backend.write(r, [w.arena.base], [r.base], [MiB])  # connection / mapping now cached
        peer.kill()
        for _ in range(2):  # the first failure must not leave a state where the second succeeds
            t0 = time.monotonic()
            with pytest.raises((Unavailable, Aborted)):
                w.backend.write(r, [w.arena.base], [r.base], [MiB])
            assert time.monotonic() - t0 < 5
        assert w.written() == MiB
    finally:
        peer.close()


def test_a_peer_that_never_existed_is_unavailable(shared: tuple[Peer, Backend]) -> None:
    _, backend = shared
    w = Writer(backend, MiB)
    try:
        endpoint = {"mooncake": "127.0.0.1:1", "nixl": "kvd-no-such-agent/1/DRAM@test"}.get(backend.name, "/dev/shm/kvd-no-such-arena")
        r = PeerRegion(endpoint, 1 << 40, MiB, "kvd-no-such-arena")
        with pytest.raises(Unavailable, match="nothing was written|does not exist"):
            backend.write(r, [w.arena.base], [r.base], [4096])
    finally:
        w.arena.close()


# -- the factory and misuse -----------------------------------------------------------------


def test_make_backend_refuses_unknown_names_and_names_the_choices() -> None:
    with pytest.raises(Unavailable, match="'local'.*'mooncake'.*'nixl'"):
        make_backend("ucx")


def test_a_missing_mooncake_install_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    monkeypatch.setattr("kvd.backends.mooncake._installed_wheel", lambda: None)
    with pytest.raises(Unavailable) as err:
        make_backend("mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in str(err.value)
    assert "apt-get install -y libibverbs1" in str(err.value)


@pytest.mark.parametrize(
    "error,wheel,libs,says,not_says",
    [
        # A fresh host without libibverbs1: the wheel is there, the system library is not.
        ("libibverbs.so.1: cannot open shared object file", "mooncake-transfer-engine-non-cuda", ["libibverbs.so.1"],
         "apt-get install -y libibverbs1", "pip install mooncake"),
        ("libnuma.so.1: cannot open shared object file", "mooncake-transfer-engine-non-cuda", ["libnuma.so.1", "libcurl.so.4"],
         "apt-get install -y libnuma1 libcurl4", "pip install mooncake"),
        ("No module named 'mooncake'", None, [], "pip install mooncake-transfer-engine-non-cuda", "is installed"),
        ("libcuda.so.1: cannot open shared object file", "mooncake-transfer-engine", [], "pip install mooncake-transfer-engine-non-cuda", "apt-get"),
        ("undefined symbol: foo", "mooncake-transfer-engine-non-cuda", [], "--force-reinstall", "apt-get"),
    ],
)
def test_mooncake_install_check_names_what_is_actually_missing(error, wheel, libs, says, not_says) -> None:
    from kvd.backends.mooncake import diagnose

    msg = diagnose(ImportError(error), wheel, libs)
    assert says in msg and not_says not in msg, msg
    if libs:
        assert all(lib in msg for lib in libs) and f"{wheel} is installed" in msg, msg


def test_every_backend_class_says_what_it_misses() -> None:
    from kvd.backends.base import BACKENDS, backend_class

    assert backend_class("local").missing() is None
    assert (backend_class("mooncake").missing() or "") == MOONCAKE_MISSING
    assert (backend_class("nixl").missing() or "") == NIXL_MISSING
    assert set(BACKENDS) == {"local", "mooncake", "nixl"}


class _DeviceArena(Arena):
    """Stands in for a CUDA arena: anything whose handle is not "shm"."""

    region_id = "dev"
    reserved = backed = base = 4096  # type: ignore[assignment]
    device = torch.device("cpu")  # type: ignore[assignment]

    def set_backed(self, nbytes: int) -> None:
        pass

    def tensor(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def handle(self) -> ArenaHandle:
        return ArenaHandle("cuda-vmm", "", 4096, "dev")

    def close(self) -> None:
        pass


def test_local_backend_misuse_is_refused() -> None:
    b = LocalBackend()
    with pytest.raises(InvalidArgument, match="shm arenas only"):
        b.register(_DeviceArena())
    with pytest.raises(FailedPrecondition, match="register"):
        b.endpoint  # noqa: B018 -- the property raises
    with pytest.raises(FailedPrecondition, match="register"):
        b.write(PeerRegion("/dev/shm/x", 0, 4096, "x"), [0], [0], [1])
    b.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        b.write(PeerRegion("/dev/shm/x", 0, 4096, "x"), [0], [0], [1])


@pytest.mark.parametrize(
    "cuda,intra_nvlink,cuda_arena,env,refused",
    [
        (True, True, True, {}, None),  # the CUDA build, a CUDA arena: RDMA or TCP
        (True, True, False, {}, None),  # the CUDA build moves shm arenas too
        (False, False, False, {}, None),  # the CPU build, a shm arena: what CI runs
        (False, False, True, {}, (Unavailable, "SUPPORT_CUDA is False")),
        (None, False, True, {}, (Unavailable, "does not say whether it has CUDA")),
        (True, True, True, {"MC_INTRANODE_NVLINK": "1"}, (InvalidArgument, "cudaIpcGetMemHandle, which refuses CUDA virtual memory")),
        (True, True, False, {"MC_INTRANODE_NVLINK": "1"}, (InvalidArgument, "an arena=shm pool is host memory")),
        (False, False, False, {"MC_INTRANODE_NVLINK": "1"}, None),  # not compiled in: the variable does nothing
        (False, False, True, {"MC_INTRANODE_NVLINK": ""}, (InvalidArgument, "cudaIpcGetMemHandle")),  # set at all is enough
        (True, True, True, {"MC_TCP_PROTO": "1"}, (InvalidArgument, "legacy TCP framing")),
        (False, False, False, {"MC_TCP_PROTO": "1"}, (InvalidArgument, "legacy TCP framing")),
        (True, True, True, {"MC_TCP_PROTO": "2"}, None),
    ],
)
def test_mooncake_refuses_builds_and_variables_that_cannot_move_the_arena(cuda, intra_nvlink, cuda_arena, env, refused) -> None:
    from kvd.backends.mooncake import BuildInfo, _refusal

    # A build that cannot read device memory is a missing install (Unavailable); a variable is a
    # setting to change (InvalidArgument).
    got = _refusal(BuildInfo(cuda=cuda, intra_nvlink=intra_nvlink), cuda_arena, env)
    if refused is None:
        assert got is None, got
    else:
        cls, phrase = refused
        assert type(got) is cls and phrase in str(got), got


@pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING)
def test_the_cpu_mooncake_build_refuses_to_register_a_cuda_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering device memory with the CPU-only build would crash on the first write (it reads
    the pointer as host memory): refused before the engine sees it, nothing registered."""
    from kvd.backends.mooncake import build_info

    if build_info().cuda:
        pytest.skip("the installed Mooncake is the CUDA build")
    for k in ("MC_INTRANODE_NVLINK", "MC_TCP_PROTO"):
        monkeypatch.delenv(k, raising=False)
    b = make_backend("mooncake", arena_kind="cuda-vmm")
    try:
        assert b.build.cuda is False
        with pytest.raises(Unavailable, match="needs Mooncake's CUDA build.*pip install mooncake-transfer-engine"):
            b.register(_DeviceArena())
        assert b.registered == (0, 0)
    finally:
        b.close()


def test_local_backend_lets_go_of_dead_peers_arenas(lone_writer: Callable[[str, int], Writer]) -> None:
    """A decode daemon that restarts comes back with a new arena file; the prefill side must not
    keep the dead one mapped (a whole arena of RAM per restart)."""
    w = lone_writer("local", 4 * MiB)
    old, new = Peer("local", 16 * MiB, 4 * MiB), Peer("local", 16 * MiB, 4 * MiB)
    try:
        r_old, r_new = old.region, new.region
        w.backend.write(r_old, [w.arena.base], [r_old.base], [MiB])
        assert r_old.endpoint in w.backend._maps
        old.kill()
        w.backend.write(r_new, [w.arena.base], [r_new.base], [MiB])  # mapping a new peer prunes dead ones
        assert r_old.endpoint not in w.backend._maps and r_new.endpoint in w.backend._maps
        assert new.hash(0, MiB) == digest(w.arena.tensor()[:MiB])
    finally:
        old.close()
        new.close()


# -- nixl specifics ---------------------------------------------------------------------------


@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)
def test_a_killed_nixl_peer_is_unavailable_within_a_second(lone_writer: Callable[[str, int], Writer]) -> None:
    """kill -9 of the receiver: the next write ends as Unavailable (UCX's peer failure, not the
    stall deadline) well inside the 1 s budget, and the backend writes to a new peer afterwards."""
    peer, w = Peer("nixl", 16 * MiB, 4 * MiB), lone_writer("nixl", 4 * MiB)
    fresh = Peer("nixl", 16 * MiB, 4 * MiB)
    try:
        r = peer.region
        w.backend.write(r, [w.arena.base], [r.base], [MiB])
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="cannot be reached"):
            w.backend.write(r, [w.arena.base], [r.base], [MiB])
        took = time.monotonic() - t0
        print(f"nixl: write to a killed peer refused after {took * 1e3:.1f} ms")
        assert took < 1.5
        f = fresh.region
        w.backend.write(f, [w.arena.base], [f.base], [MiB])
        assert fresh.hash(0, MiB) == digest(w.arena.tensor()[:MiB])
    finally:
        peer.close()
        fresh.close()


def test_nixl_applies_the_exit_crash_workaround_only_where_it_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvd.backends import nixl

    monkeypatch.setattr(nixl, "_has_infiniband", lambda: False)
    env: dict[str, str] = {}
    nixl._apply_env(env)
    assert env["UCX_MODULES"] == "^ib" and env["NIXL_LOG_LEVEL"] == "WARN"
    env = {"UCX_MODULES": "", "NIXL_LOG_LEVEL": "DEBUG"}  # the operator's own settings win
    nixl._apply_env(env)
    assert env["UCX_MODULES"] == "" and env["NIXL_LOG_LEVEL"] == "DEBUG"
    monkeypatch.setattr(nixl, "_has_infiniband", lambda: True)  # RDMA hosts keep UCX's ib module
    env = {}
    nixl._apply_env(env)
    assert "UCX_MODULES" not in env


@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)
def test_a_nixl_process_exits_cleanly() -> None:
    """Without UCX_MODULES=^ib (kvd sets it before NIXL loads) a process that created a UCX
    backend segfaults at exit on a host without InfiniBand."""
    code = "from kvd.backends.nixl import NixlBackend; b = NixlBackend(); b.close()"
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_nixl_endpoints_are_parsed_or_refused() -> None:
    from kvd.backends.nixl import parse_endpoint

    ep = parse_endpoint("kvd-1-ab/3/VRAM@10.0.0.5:7000")
    assert (ep.agent, ep.generation, ep.mem, ep.locator) == ("kvd-1-ab", 3, "VRAM", "10.0.0.5:7000")
    for bad in ("127.0.0.1:17000", "/dev/shm/kvd-x", "a/1/HBM@x", "a/x/DRAM@y", "/1/DRAM@y"):
        with pytest.raises(InvalidArgument, match="not a nixl endpoint"):
            parse_endpoint(bad)
