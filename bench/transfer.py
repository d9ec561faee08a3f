"""Transfer benchmark (issue 4): a request's KV moved prefill -> decode through kvd, against the raw engine.

    .venv/bin/python bench/transfer.py            # full run (a few minutes on a 2-core CPU)
    .venv/bin/python bench/transfer.py --quick    # smoke run (about 30 s)

Per backend (``nixl`` over UCX on loopback, ``mooncake`` over TCP loopback, then ``local``), two daemons run as separate
processes (``python -m kvd.cli serve --backend B --layout gemma-4-31b-it-tp2``): P (prefill) and
D (decode). This process is both engines, through one :class:`kvd.client.Client` per daemon.

Scatter. Before measuring, both pools are fragmented the way decoding leaves them: two filler
requests grow one page per step, taking turns (as concurrent decodes do), then one is freed.
The measured requests take those holes: their full-attention pages lie every other page, so
every page is its own block (640 KiB); their SWA pages (6.25 MiB) come from holes as well. The
sender builds its request by chunked prefill (``--chunk`` tokens per extend), which also keeps
its SWA pages to the window. ``--scatter none`` skips the fillers (fresh pools: pages in a few
large runs) for comparison.

Measured, medians over ``--repeats`` (order kvd / raw alternating every repeat):

* ``kvd``: ``Send`` (sender) + ``WaitReady`` (receiver) wall time, for one request whose KV
  was written (a distinct pattern per page; the first transfer of each size is checked byte
  for byte, page by page, and is not timed).
* ``raw``: the same number of bytes as large contiguous blocks (``--piece-mib``, 64 MiB) --
  mooncake: a separate pair of TransferEngine processes (the daemons' engine settings),
  ``batch_transfer_sync_write`` over tmpfs-backed buffers, timed inside the initiator; nixl: a
  separate pair of NIXL agent processes with the settings of kvd's backend (one WRITE request
  per batch, the initiator progressing it, the target's 1 ms progress loop); local: a
  plain memcpy (numpy slice assignment) between two tmpfs-backed buffers in this process.
  Buffers are ``--raw-buffer-mib`` each; bytes beyond that cycle through them.
* ``raw@kvd blocks`` (diagnostic): the raw engine moving kvd's own block sizes in kvd's batches
  (``Outbox.batch_blocks`` blocks per call): what the block structure alone costs.
* small requests (128, 512 tokens): the whole control-plane path, prefill allocate + decode
  allocate + RECV lease + Send + WaitReady + both frees; "per-request ms" is the median over
  repeats of (path - raw time of the same bytes), each pair measured back to back. Also shown:
  the same against raw@kvd blocks, Send's own ``seconds`` field, the calls other than Send and
  one Echo round trip (the floor of one RPC).

Ratios: the table's kvd/raw is the ratio of median GB/s; the summary lines add the median of
back-to-back ratios ("paired") and best/best. Other processes' CPU use is reported: on a shared
2-core host the spread between repeats is wide, so read the paired ratios and the ranges.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import mmap
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchkit import BenchDaemon, cpu_model, cpu_snap, med, others_line, own_cpu  # noqa: E402  (bench/ is sys.path[0])

MIB = 1 << 20
GIB = 1 << 30
LAYOUT = "gemma-4-31b-it-tp2"


# =============================================================================================
# the raw mooncake pair: this file run as `--raw-peer target|initiator BYTES` (no torch, no kvd)
# =============================================================================================
def _shm_buffer(nbytes: int, fill: int | None) -> tuple[mmap.mmap, int]:
    """A tmpfs-backed buffer (like a kvd arena), unlinked at once so a killed process leaves
    nothing behind; touched throughout so no page fault lands in a timed transfer."""
    path = os.path.join("/dev/shm", f"kvd-bench-raw-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    chunk = os.urandom(MIB) if fill is None else bytes([fill]) * MIB
    for off in range(0, nbytes, MIB):
        n = min(MIB, nbytes - off)
        mm[off : off + n] = chunk[:n]
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    return te


def _layout_items(lens: list[int], buf: int) -> list[int]:
    """Offsets for blocks laid end to end in a buffer of ``buf`` bytes, wrapping to 0."""
    offs, cur = [], 0
    for n in lens:
        if cur + n > buf:
            cur = 0
        offs.append(cur)
        cur += n
    return offs


def raw_peer(role: str, nbytes: int) -> None:
    out = sys.stdout
    te = _engine()
    mm, addr = _shm_buffer(nbytes, 0 if role == "target" else None)
    if te.register_memory(addr, nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    out.write(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}) + "\n")
    out.flush()
    peer = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "peer":
            peer = cmd
            out.write("{}\n")
            out.flush()
            continue
        # "write": blocks of lens (offsets end to end, wrapping), `batch` blocks per call
        lens = cmd["lens"]
        offs = _layout_items(lens, nbytes)
        batch = cmd["batch"]
        t0 = time.perf_counter()
        for i in range(0, len(lens), batch):
            j = i + batch
            rc = te.batch_transfer_sync_write(
                peer["session"], [addr + o for o in offs[i:j]], [peer["addr"] + o for o in offs[i:j]], lens[i:j]
            )
            if rc != 0:
                out.write(json.dumps({"error": f"batch_transfer_sync_write rc={rc}"}) + "\n")
                out.flush()
                break
        else:
            out.write(json.dumps({"seconds": time.perf_counter() - t0}) + "\n")
            out.flush()
    te.unregister_memory(addr)


def raw_nixl_peer(role: str, nbytes: int) -> None:
    """The raw NIXL pair: one agent each, the settings kvd's nixl backend uses (UCX backend, no
    busy progress thread, a 1 ms progress loop), one transfer request per batch, timed inside the
    initiator."""
    import threading

    import numpy as np

    from kvd.backends import nixl as kvd_nixl

    api = kvd_nixl._nixl()  # kvd's environment defaults first, as the daemons get them
    out = sys.stdout
    agent = api.nixl_agent(f"raw-{role}", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    lock = threading.Lock()
    mm, addr = _shm_buffer(nbytes, 0 if role == "target" else None)
    agent.register_memory([(addr, nbytes, 0, "")], "DRAM")

    def progress() -> None:
        while True:
            time.sleep(1e-3)
            with lock:
                agent.get_new_notifs()

    threading.Thread(target=progress, daemon=True).start()
    out.write(json.dumps({"meta": agent.get_agent_metadata().hex(), "addr": addr}) + "\n")
    out.flush()
    peer = name = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "peer":
            peer = cmd
            with lock:
                name = agent.add_remote_agent(bytes.fromhex(cmd["meta"])).decode()
            out.write("{}\n")
            out.flush()
            continue
        lens = np.asarray(cmd["lens"], dtype=np.uint64)
        offs = np.asarray(_layout_items(cmd["lens"], nbytes), dtype=np.uint64)
        batch = cmd["batch"]
        zeros = np.zeros(len(lens), np.uint64)
        t0 = time.perf_counter()
        for i in range(0, len(lens), batch):
            j = i + batch
            local = np.stack([offs[i:j] + addr, lens[i:j], zeros[i:j]], axis=1)
            remote = np.stack([offs[i:j] + peer["addr"], lens[i:j], zeros[i:j]], axis=1)
            with lock:
                h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), name)
                st = agent.transfer(h)
            while st == "PROC":
                with lock:
                    st = agent.check_xfer_state(h)
                time.sleep(0)
            with lock:
                agent.release_xfer_handle(h)
            if st != "DONE":
                out.write(json.dumps({"error": f"nixl transfer ended {st}"}) + "\n")
                out.flush()
                break
        else:
            out.write(json.dumps({"seconds": time.perf_counter() - t0}) + "\n")
            out.flush()
    os._exit(0)  # the progress thread holds the agent


class RawMooncake:
    """Two engine processes (initiator, target); the initiator writes, timing itself."""

    name = "mooncake"
    flag = "--raw-peer"

    def _env(self) -> dict[str, str]:
        from kvd.backends import mooncake as kvd_mc

        env = {**os.environ}
        for k, v in kvd_mc._ENV_DEFAULTS.items():  # the daemons' engine settings, exactly
            env.setdefault(k, v)
        return env

    def __init__(self, nbytes: int) -> None:
        env = self._env()
        self.nbytes = nbytes
        self.procs = []
        info = []
        for role in ("target", "initiator"):
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.flag, role, str(nbytes)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            self.procs.append(p)
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"raw {self.name} peer did not start (see its stderr)")
            info.append(json.loads(line))
        self.init = self.procs[1]
        self._rpc({"op": "peer", **info[0]})

    def _rpc(self, cmd: dict) -> dict:
        self.init.stdin.write(json.dumps(cmd) + "\n")
        self.init.stdin.flush()
        r = json.loads(self.init.stdout.readline())
        if "error" in r:
            raise RuntimeError(r["error"])
        return r

    def write(self, lens: list[int], batch: int) -> float:
        return self._rpc({"op": "write", "lens": lens, "batch": batch})["seconds"]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    p.stdin.flush()
                    p.wait(10)
                except (OSError, subprocess.TimeoutExpired, ValueError):
                    p.kill()
                    p.wait()


class RawNixl(RawMooncake):
    """Two NIXL agent processes (initiator, target), as kvd's nixl backend sets them up."""

    name = "nixl"
    flag = "--raw-nixl-peer"

    def _env(self) -> dict[str, str]:
        return {**os.environ}  # raw_nixl_peer applies kvd's defaults itself


class RawLocal:
    """Plain memcpy (numpy slice assignment: one single-threaded memcpy per piece) between two
    shm-backed buffers in this process."""

    name = "local"

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.nbytes = nbytes
        self._src_mm, _ = _shm_buffer(nbytes, None)
        self._dst_mm, _ = _shm_buffer(nbytes, 0)
        self.src = np.frombuffer(self._src_mm, dtype=np.uint8)
        self.dst = np.frombuffer(self._dst_mm, dtype=np.uint8)

    def write(self, lens: list[int], batch: int) -> float:  # noqa: ARG002 -- one copy per block
        offs = _layout_items(lens, self.nbytes)
        src, dst = self.src, self.dst
        t0 = time.perf_counter()
        for o, n in zip(offs, lens):
            dst[o : o + n] = src[o : o + n]
        return time.perf_counter() - t0

    def close(self) -> None:
        self.src = self.dst = None
        for mm in (self._src_mm, self._dst_mm):
            try:
                mm.close()
            except BufferError:
                pass


def pieces(nbytes: int, piece: int) -> list[int]:
    return [piece] * (nbytes // piece) + ([nbytes % piece] if nbytes % piece else [])


# =============================================================================================
# daemons
# =============================================================================================
# =============================================================================================
# sizes, scatter, data
# =============================================================================================
def sizes(layout, tokens: int) -> dict:
    """What one handed-off request of ``tokens`` moves: full pages, swa window tail, bytes."""
    from kvd.pool.layout import GroupKind

    ps = layout.page_size
    n = -(-tokens // ps)
    swa = layout.group(GroupKind.SWA)
    swa_first = max(0, tokens - swa.window) // ps
    pb_full, pb_swa = layout.page_bytes(layout.group(GroupKind.FULL)), layout.page_bytes(swa)
    return {"pages": n, "swa_pages": n - swa_first, "bytes": n * pb_full + (n - swa_first) * pb_swa,
            "pb_full": pb_full, "pb_swa": pb_swa}


def arena_bytes_for(layout, max_tokens: int, chunk: int, scatter: bool) -> int:
    """A (sparse) arena with room for the fillers, the largest request and the small ones."""
    s = sizes(layout, max_tokens)
    n = s["pages"]
    win_pages = s["swa_pages"] + 2
    full_pages = (2 * n + 64 if scatter else 0) + n + 2 * 64 + 64
    swa_pages = (2 * win_pages if scatter else 0) + (win_pages + 2 * (chunk // layout.page_size)) + 2 * 64 + 32
    need = layout.max_page_bytes + full_pages * s["pb_full"] + swa_pages * s["pb_swa"]
    return -(-int(need * 1.15) // GIB) * GIB


def scatter(kv, n_pages: int, receive: bool, tag: str) -> str:
    """Fragment a pool as concurrent decodes do: two fillers grow one page per step, taking
    turns, then one is freed. Leaves >= ``n_pages`` free pages, every other page by address.

    (Freed pages are handed out again in reverse order of their freeing, so a request built from
    them gets one block per page whatever the shape of the holes; see docs/benchmarks.md.)"""
    from kvd.records import AllocSpec

    fill = [f"{tag}-fill0", f"{tag}-fill1"]
    kv.allocate_many([AllocSpec(f, 16, receive) for f in fill])
    for _ in range(n_pages + 3):
        kv.extend_many([(f, 16) for f in fill])
    kv.free(fill[0])
    return fill[1]


def build_sender(kv, rid: str, tokens: int, chunk: int):
    """Chunked prefill on the sender: allocate the first chunk, extend chunk by chunk."""
    kv.allocate(rid, min(chunk, tokens))
    done = min(chunk, tokens)
    while done < tokens:
        add = min(chunk, tokens - done)
        kv.extend(rid, add)
        done += add
    return kv.vectors(rid)


class Pattern:
    """Distinct bytes per page: slices of a random buffer at a page-dependent offset."""

    def __init__(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.rnd = torch.randint(0, 256, (24 * MIB,), dtype=torch.uint8, generator=g)
        self.seed = seed

    def page(self, key: int, nbytes: int):
        off = ((key * 7919 + self.seed * 104729) * 64) % (self.rnd.numel() - nbytes)
        return self.rnd[off : off + nbytes]


def page_pairs(sv, dv, s: dict) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, bytes) of every page a full handoff moves (independent of the planner)."""
    pairs = []
    for i in range(s["pages"]):
        pairs.append((int(sv.full[i]) * s["pb_full"], int(dv.full[i]) * s["pb_full"], s["pb_full"]))
    for j in range(dv.swa_first_page, s["pages"]):
        a = int(sv.swa[j - sv.swa_first_page]) * s["pb_swa"]
        b = int(dv.swa[j - dv.swa_first_page]) * s["pb_swa"]
        pairs.append((a, b, s["pb_swa"]))
    return pairs


def fill_sender(att, sv, s: dict, pat: Pattern) -> None:
    """Write the pages the handoff will move (full: all; swa: the receiver's window tail)."""
    swa_first = s["pages"] - s["swa_pages"]
    t = att.tensor
    for i in range(s["pages"]):
        o = int(sv.full[i]) * s["pb_full"]
        t[o : o + s["pb_full"]].copy_(pat.page(i, s["pb_full"]))
    for j in range(swa_first, s["pages"]):
        o = int(sv.swa[j - sv.swa_first_page]) * s["pb_swa"]
        t[o : o + s["pb_swa"]].copy_(pat.page(100_000 + j, s["pb_swa"]))


def verify(p_att, d_att, sv, dv, s: dict) -> int:
    """Compare every moved page byte for byte; returns the bytes compared or raises."""
    import torch

    total = 0
    for a, b, n in page_pairs(sv, dv, s):
        if not torch.equal(p_att.tensor[a : a + n], d_att.tensor[b : b + n]):
            raise RuntimeError(f"verification failed: source page at offset {a:#x} != destination page at {b:#x}")
        total += n
    return total


def zero_receiver(d_att, sv, dv, s: dict) -> None:
    for _, b, n in page_pairs(sv, dv, s):
        d_att.tensor[b : b + n].zero_()


# =============================================================================================
# measurement
# =============================================================================================
@dataclass
class Row:
    backend: str
    tokens: int
    nbytes: int = 0
    blocks: int = 0
    block_sizes: str = ""
    kvd_s: list[float] = field(default_factory=list)  # Send + WaitReady wall
    send_field_s: list[float] = field(default_factory=list)  # SendResult.seconds (server side)
    send_wall_s: list[float] = field(default_factory=list)
    path_s: list[float] = field(default_factory=list)  # whole control-plane path (small requests)
    raw_s: list[float] = field(default_factory=list)
    rawblk_s: list[float] = field(default_factory=list)
    write_calls: int = 0
    echo_ms: float = 0.0  # median Echo round trip to the prefill daemon (the floor of one RPC)

    def gbps(self, xs: list[float]) -> float:
        return self.nbytes / med(xs) / 1e9

    @property
    def small(self) -> bool:
        return bool(self.path_s)

    def overhead_ms(self, base: list[float]) -> float:
        """Median over repeats of (whole control-plane path - baseline time of the same bytes),
        each pair measured back to back."""
        return med([p - b for p, b in zip(self.path_s, base)]) * 1e3

    @property
    def per_request_ms(self) -> float:
        return self.overhead_ms(self.raw_s)

    def paired(self, base: list[float]) -> float:
        """Median over repeats of kvd GB/s / baseline GB/s measured back to back (same load)."""
        return med([b / k for k, b in zip(self.kvd_s, base)])


def describe_blocks(lens: list[int]) -> str:
    from collections import Counter

    c = Counter(lens)
    parts = [f"{k}x{v / MIB:.3g}MiB" for v, k in sorted(((v, k) for v, k in c.items()), key=lambda x: -x[1])[:3]]
    return ", ".join(parts) + (", ..." if len(c) > 3 else "")


def plan_lens(p_kv, d_kv, layout, sv, dv, tokens: int) -> list[int]:
    from kvd.handoff.plan import plan_chunk

    plan = plan_chunk(layout, sv, dv, p_kv.info().envelopes, d_kv.info().envelopes, 0, tokens, True)
    return [b.length for b in plan.blocks]


def run_backend(backend: str, args, log) -> list[Row]:
    from kvd.client import Client
    from kvd.records import TransferState
    from kvd.handoff.outbox import Outbox
    from kvd.pool.presets import load_layout

    layout = load_layout(LAYOUT)
    batch_blocks = inspect.signature(Outbox).parameters["batch_blocks"].default  # blocks per backend.write
    big, small = args.tokens, args.small
    max_tokens = max(big + small)
    scatter_on = args.scatter == "pages"
    arena = args.arena_gib * GIB if args.arena_gib else arena_bytes_for(layout, max_tokens, args.chunk, scatter_on)
    max_bytes = max(sizes(layout, t)["bytes"] for t in big + small)
    raw_buf = min(args.raw_buffer_mib * MIB, -(-max_bytes // (64 * MIB)) * 64 * MIB)
    t0 = time.perf_counter()
    args_ = ("--listen-tcp", "127.0.0.1:0", "--backend", backend, "--layout", LAYOUT, "--arena-bytes", str(arena))
    P, D = BenchDaemon.spawn(*args_), BenchDaemon.spawn(*args_)
    raw = None
    rows: list[Row] = []
    try:
        raw = {"mooncake": RawMooncake, "nixl": RawNixl}.get(backend, RawLocal)(raw_buf)  # starts while the daemons do
        P.wait_ready()
        D.wait_ready()
        pc = Client.connect(P.unix, name="bench-prefill", timeout=120)
        dc = Client.connect(D.unix, name="bench-decode", timeout=120)
        p_att, d_att = pc.attach(), dc.attach()
        log(f"[{backend}] daemons + raw pair up in {time.perf_counter() - t0:.1f} s; arenas {arena / GIB:.0f} GiB each "
            f"(sparse), raw buffers {raw_buf / MIB:.0f} MiB")
        t1 = time.perf_counter()
        if scatter_on:
            n_max = sizes(layout, max_tokens)["pages"]
            scatter(pc, n_max, False, "p")
            scatter(dc, n_max, True, "d")
            log(f"[{backend}] scattered both pools in {time.perf_counter() - t1:.1f} s")
        piece = args.piece_mib * MIB

        # ---- large requests ------------------------------------------------------------------
        for tokens in big:
            s = sizes(layout, tokens)
            rid = f"big-{tokens}"
            row = Row(backend, tokens, s["bytes"])
            sv = build_sender(pc, rid, tokens, args.chunk)
            fill_sender(p_att, sv, s, Pattern(tokens))
            for rep in range(args.repeats + 1):  # repeat 0: warm-up, byte-for-byte check
                dv = dc.allocate(rid, tokens, receive=True)
                lease = dc.acquire_lease(rid, "recv")
                if rep == 0:
                    lens = plan_lens(pc, dc, layout, sv, dv, tokens)
                    row.blocks, row.block_sizes = len(lens), describe_blocks(lens)
                    row.write_calls = -(-len(lens) // batch_blocks)
                    zero_receiver(d_att, sv, dv, s)
                order = ("kvd", "raw", "rawblk") if rep % 2 else ("rawblk", "raw", "kvd")
                for what in order:
                    if what == "kvd":
                        gc.disable()
                        a = time.perf_counter()
                        res = pc.send(rid, lease.ticket)
                        b = time.perf_counter()
                        st = dc.wait_ready(rid, timeout=120)
                        c = time.perf_counter()
                        gc.enable()
                        if st.state is not TransferState.READY or res.nbytes != s["bytes"]:
                            raise RuntimeError(f"{backend} {tokens}: transfer ended {st.state.value} ({st.reason}), {res.nbytes:,d} bytes")
                        if rep:
                            row.kvd_s.append(c - a)
                            row.send_wall_s.append(b - a)
                            row.send_field_s.append(res.seconds)
                        else:
                            n = verify(p_att, d_att, sv, dv, s)
                            if res.blocks != row.blocks:
                                raise RuntimeError(f"daemon planned {res.blocks} blocks, this process {row.blocks}")
                            log(f"[{backend}] {tokens} tokens: {n:,d} bytes verified page by page; "
                                f"{row.blocks} blocks ({row.block_sizes}); first transfer {c - a:.2f} s")
                    elif what == "raw":
                        x = raw.write(pieces(s["bytes"], piece), batch=max(1, raw_buf // piece))
                        if rep:
                            row.raw_s.append(x)
                    else:
                        x = raw.write(lens, batch=batch_blocks)
                        if rep:
                            row.rawblk_s.append(x)
                dc.free(rid)
            pc.free(rid)
            rows.append(row)
            log(f"[{backend}] {tokens} tokens: kvd {row.gbps(row.kvd_s):.2f} GB/s, raw {row.gbps(row.raw_s):.2f} GB/s, "
                f"raw@kvd blocks {row.gbps(row.rawblk_s):.2f} GB/s")

        # ---- small requests: the whole control-plane path -----------------------------------
        echo = []
        for _ in range(60):
            a = time.perf_counter()
            pc.echo()
            echo.append(time.perf_counter() - a)
        echo_ms = med(echo[10:]) * 1e3
        for tokens in small:
            s = sizes(layout, tokens)
            row = Row(backend, tokens, s["bytes"])
            lens: list[int] = []
            for rep in range(args.small_repeats + 2):  # two warm-ups
                rid = f"small-{tokens}-{rep}"
                timed = rep >= 2
                order = ("kvd", "raw", "rawblk") if rep % 2 == 0 else ("rawblk", "raw", "kvd")
                for what in order:
                    if what == "raw":
                        x = raw.write(pieces(s["bytes"], piece), batch=max(1, raw_buf // piece))
                        if timed:
                            row.raw_s.append(x)
                        continue
                    if what == "rawblk":
                        if lens:
                            x = raw.write(lens, batch=batch_blocks)
                            if timed:
                                row.rawblk_s.append(x)
                        continue
                    gc.disable()
                    a = time.perf_counter()
                    sv = pc.allocate(rid, tokens)
                    dv = dc.allocate(rid, tokens, receive=True)
                    lease = dc.acquire_lease(rid, "recv")
                    b = time.perf_counter()
                    res = pc.send(rid, lease.ticket)
                    c = time.perf_counter()
                    st = dc.wait_ready(rid, timeout=60)
                    d = time.perf_counter()
                    pc.free(rid)
                    dc.free(rid)
                    e = time.perf_counter()
                    gc.enable()
                    if st.state is not TransferState.READY:
                        raise RuntimeError(f"{backend} {tokens}: transfer ended {st.state.value} ({st.reason})")
                    if not lens:
                        lens = plan_lens(pc, dc, layout, sv, dv, tokens)
                        row.blocks, row.block_sizes = len(lens), describe_blocks(lens)
                        row.write_calls = -(-len(lens) // batch_blocks)
                    if timed:
                        row.path_s.append(e - a)
                        row.kvd_s.append(d - b)
                        row.send_wall_s.append(c - b)
                        row.send_field_s.append(res.seconds)
            row.echo_ms = echo_ms
            rows.append(row)
            log(f"[{backend}] {tokens} tokens: path {med(row.path_s) * 1e3:.1f} ms, raw {med(row.raw_s) * 1e3:.1f} ms, "
                f"raw@kvd blocks {med(row.rawblk_s) * 1e3:.1f} ms, Send.seconds {med(row.send_field_s) * 1e3:.1f} ms")
        mem = [os.stat(f"/dev/shm/{a.region_id}").st_blocks * 512 for a in (p_att, d_att)]
        log(f"[{backend}] tmpfs in use by the arenas: P {mem[0] / GIB:.2f} GiB, D {mem[1] / GIB:.2f} GiB "
            f"(+ raw buffers 2 x {raw_buf / GIB:.2f} GiB); phase took {time.perf_counter() - t0:.0f} s")
        p_att.close()
        d_att.close()
        pc.close()
        dc.close()
    finally:
        if raw is not None:
            raw.close()
        P.stop()
        D.stop()
    return rows


# =============================================================================================
# report
# =============================================================================================
def machine() -> str:
    try:
        from importlib.metadata import version

        mc = version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001
        mc = "?"
    try:
        from importlib.metadata import version

        nx = version("nixl-cu12")
    except Exception:  # noqa: BLE001
        nx = "?"
    import torch

    tls = os.environ.get("UCX_TLS", "default")
    return f"{cpu_model()}, torch {torch.__version__}, mooncake-transfer-engine-non-cuda {mc}, nixl-cu12 {nx} (UCX_TLS {tls})"


def table(rows: list[Row]) -> str:
    hdr = (f"| {'backend':<8} | {'tokens':>6} | {'bytes':>13} | {'blocks':>6} | {'kvd GB/s':>8} | {'raw GB/s':>8} | "
           f"{'kvd/raw':>7} | {'per-req ms':>10} | {'raw@kvd-blocks GB/s':>19} |")
    lines = [hdr, "|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|"]
    for r in rows:
        kvd, rawg = r.gbps(r.kvd_s), r.gbps(r.raw_s)
        blk = f"{r.gbps(r.rawblk_s):>19.2f}" if r.rawblk_s else f"{'-':>19}"
        per_req = f"{r.per_request_ms:>10.1f}" if r.small else f"{'-':>10}"
        lines.append(f"| {r.backend:<8} | {r.tokens:>6,d} | {r.nbytes:>13,d} | {r.blocks:>6,d} | {kvd:>8.2f} | {rawg:>8.2f} | "
                     f"{kvd / rawg:>7.2f} | {per_req} | {blk} |")
    return "\n".join(lines)


def small_table(rows: list[Row]) -> str:
    hdr = (f"| {'backend':<8} | {'tokens':>6} | {'path ms':>7} | {'raw ms':>6} | {'raw@blk ms':>10} | {'path-raw':>8} | "
           f"{'path-raw@blk':>12} | {'Send wall':>9} | {'Send.seconds':>12} | {'other calls':>11} | {'Echo':>5} |")
    lines = [hdr, "|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|"]
    for r in rows:
        if not r.small:
            continue
        other = med([p - w for p, w in zip(r.path_s, r.send_wall_s)])
        lines.append(f"| {r.backend:<8} | {r.tokens:>6,d} | {med(r.path_s) * 1e3:>7.1f} | {med(r.raw_s) * 1e3:>6.1f} | "
                     f"{med(r.rawblk_s) * 1e3:>10.1f} | {r.per_request_ms:>8.1f} | {r.overhead_ms(r.rawblk_s):>12.1f} | "
                     f"{med(r.send_wall_s) * 1e3:>9.1f} | {med(r.send_field_s) * 1e3:>12.1f} | {other * 1e3:>11.1f} | {r.echo_ms:>5.2f} |")
    return "\n".join(lines)


def spread(xs: list[float], nbytes: int) -> str:
    g = sorted(nbytes / x / 1e9 for x in xs)
    return f"{g[0]:.2f}-{g[-1]:.2f}" if g else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4k and 128 tokens, one timed repeat (about 30 s)")
    ap.add_argument("--backends", default="nixl,mooncake,local", help="comma-separated (default: %(default)s)")
    ap.add_argument("--tokens", default=None, help="large request sizes (default 8192,32768; --quick 4096)")
    ap.add_argument("--small", default=None, help="small request sizes for the per-request overhead (default 128,512; --quick 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per large size (default 7; --quick 1)")
    ap.add_argument("--small-repeats", type=int, default=None, help="timed repeats per small size (default 21; --quick 3)")
    ap.add_argument("--scatter", choices=("pages", "none"), default="pages", help="fragment both pools first (default: %(default)s)")
    ap.add_argument("--chunk", type=int, default=2048, help="sender's chunked-prefill step in tokens (default: %(default)s)")
    ap.add_argument("--piece-mib", type=int, default=64, help="raw baseline block size (default: %(default)s MiB)")
    ap.add_argument("--raw-buffer-mib", type=int, default=1024, help="raw baseline buffer per side (default: %(default)s MiB)")
    ap.add_argument("--arena-gib", type=int, default=None, help="arena size per daemon (default: computed; sparse)")
    ap.add_argument("--raw-peer", nargs=2, metavar=("ROLE", "BYTES"), help=argparse.SUPPRESS)
    ap.add_argument("--raw-nixl-peer", nargs=2, metavar=("ROLE", "BYTES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_peer:
        raw_peer(args.raw_peer[0], int(args.raw_peer[1]))
        return
    if args.raw_nixl_peer:
        raw_nixl_peer(args.raw_nixl_peer[0], int(args.raw_nixl_peer[1]))
        return
    args.tokens = [int(x) for x in (args.tokens or ("4096" if args.quick else "8192,32768")).split(",")]
    args.small = [int(x) for x in (args.small or ("128" if args.quick else "128,512")).split(",") if x]
    args.repeats = args.repeats or (1 if args.quick else 7)
    args.small_repeats = args.small_repeats or (3 if args.quick else 21)
    import torch

    torch.set_num_threads(1)  # fill/verify only; torch's thread pool stalls on a busy 2-core host

    t_all = time.perf_counter()
    cpu0, own0 = cpu_snap(), own_cpu()

    def log(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    print(f"kvd transfer benchmark -- {machine()}")
    print(f"layout {LAYOUT}; scatter={args.scatter}; sender chunked prefill {args.chunk} tokens; raw: {args.piece_mib} MiB pieces; "
          f"repeats {args.repeats} (large), {args.small_repeats} (small); medians", flush=True)
    rows: list[Row] = []
    for backend in args.backends.split(","):
        rows += run_backend(backend, args, log)
    others = others_line(cpu0, own0)
    print()
    print(table(rows))
    print()
    print("Small requests, whole control-plane path (ms; medians; path-raw columns: medians of back-to-back differences):")
    print(small_table(rows))
    print()
    for r in rows:
        if not r.small:
            print(f"{r.backend} {r.tokens:,d} tokens: kvd/raw {r.gbps(r.kvd_s) / r.gbps(r.raw_s):.2f} (paired {r.paired(r.raw_s):.2f}, "
                  f"best/best {min(r.raw_s) / min(r.kvd_s):.2f}), kvd/raw@kvd-blocks {r.gbps(r.kvd_s) / r.gbps(r.rawblk_s):.2f} "
                  f"(paired {r.paired(r.rawblk_s):.2f}, best/best {min(r.rawblk_s) / min(r.kvd_s):.2f}); "
                  f"GB/s ranges kvd {spread(r.kvd_s, r.nbytes)}, raw {spread(r.raw_s, r.nbytes)}, "
                  f"raw@kvd-blocks {spread(r.rawblk_s, r.nbytes)}; {r.blocks} blocks ({r.block_sizes}) in {r.write_calls} "
                  f"write call(s); Send.seconds {med(r.send_field_s):.3f} s of {med(r.kvd_s):.3f} s Send+WaitReady")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s; {others}")


if __name__ == "__main__":
    main()
