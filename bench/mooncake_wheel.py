"""Mooncake's CUDA build, trimmed so a device call can carry it (``.whl/``, git-ignored).

The full ``mooncake-transfer-engine`` wheel (0.3.13.post1, CUDA build) is 98 MB; a device call
carries 64 MiB. kvd needs only ``mooncake.engine`` and the libraries it loads, so ``build``
writes a 20 MB wheel of exactly that into ``.whl/``, where ``bench/gpu_check.sh`` installs it:

    python3 bench/mooncake_wheel.py build                 # pieces from ~/.cache/kvd-mooncake (--fetch gets them)
    python3 bench/mooncake_wheel.py build --fetch         # pip download the two wheels first
    python3 bench/mooncake_wheel.py libdir /tmp/site      # on the GPU host: a folder for LD_LIBRARY_PATH

What goes in, and where it comes from (the build needs python3, pip for ``--fetch``, ``ldd``
and ``ldconfig``; it runs on a Debian 12 x86-64 host like the CPU machines):

* ``mooncake/engine.so`` and its own libraries (``libasio.so``, ``libetcd_wrapper.so``: NEEDED
  even with the P2P handshake; glog, gflags, jsoncpp, yaml-cpp from ``mooncake_transfer_engine.libs``),
  ``mooncake/__init__.py`` and the two modules it imports, from the full wheel::

      pip download --no-deps --only-binary=:all: --python-version 3.12 \\
          --platform manylinux_2_28_x86_64 mooncake-transfer-engine==0.3.13.post1

  Dropped: the store, the process group (162 MB), EP, the benchmark binary and the other Python
  modules (connectors, CLI), none of which ``mooncake.engine`` loads.
* ``libcudart.so.12`` (CUDA 12.9 runtime, 0.7 MB), put next to the bundled libraries, on
  ``engine.so``'s RPATH: ``engine.so`` NEEDs it and was built with CUDA >= 12.8
  (``cudaMemcpyBatchAsync``), while the GPU image's torch (cu130) brings only
  ``libcudart.so.13``. From the runtime wheel (``nvidia/cuda_runtime/lib/libcudart.so.12``)::

      pip download --no-deps --only-binary=:all: --python-version 3.12 \\
          --platform manylinux2014_x86_64 nvidia-cuda-runtime-cu12==12.9.79

  (The driver's ``libcuda.so.1`` comes from the GPU host itself; a CUDA 13 driver runs 12.x runtimes.)
* ``mooncake_transfer_engine.syslibs/``: the system libraries ``engine.so`` NEEDs that a GPU
  image may lack (``libibverbs``, ``libmlx5``, ``libnuma``, ``libcurl``) and everything they load
  but glibc, copied from *this* host (Debian 12: ``apt-get install -y libibverbs1
  ibverbs-providers libnuma1 libcurl4``), found with ``ldconfig -p`` and closed over with ``ldd``.
  They are on no RPATH: ``libdir`` links only those the GPU host cannot load itself into a folder
  for ``LD_LIBRARY_PATH`` (they need glibc >= 2.34), so the host's own copies always win.

``build`` checks the result: every library a kept ``.so`` NEEDs (``readelf -d``) is in the wheel,
in the syslibs, the driver's ``libcuda.so.1`` or glibc. The wheel's RECORD is rewritten with fresh
hashes, entry times are fixed, so the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "kvd-mooncake"
FULL = "mooncake-transfer-engine==0.3.13.post1"
CUDART = "nvidia-cuda-runtime-cu12==12.9.79"
CUDART_MEMBER = "nvidia/cuda_runtime/lib/libcudart.so.12"
LIBS = "mooncake_transfer_engine.libs"
SYSLIBS = "mooncake_transfer_engine.syslibs"

#: What ``import mooncake.engine`` loads, as paths in the full wheel (``readelf -d`` of engine.so:
#: RPATH ``$ORIGIN:$ORIGIN/../mooncake_transfer_engine.libs``). ``mooncake/__init__.py`` imports
#: ``buffer_pool``, which tolerates the missing store.
KEEP = (
    "mooncake/__init__.py",
    "mooncake/buffer_pool.py",
    "mooncake/transfer_engine_topology_dump.py",
    "mooncake/engine.so",
    "mooncake/libasio.so",
    "mooncake/libetcd_wrapper.so",
    f"{LIBS}/libgflags-8aee0f6c.so.2.1.2",
    f"{LIBS}/libglog-6ed04f2c.so.0.0.0",
    f"{LIBS}/libjsoncpp-4b349785.so.1.8.4",
    f"{LIBS}/libyaml-cpp-2ec4b324.so.0.7.0",
)
KEEP_DIST_INFO = ("METADATA", "WHEEL", "top_level.txt", "sboms/auditwheel.cdx.json")
#: The one console script left whose module is kept.
ENTRY_POINTS = "[console_scripts]\ntransfer_engine_topology_dump = mooncake.transfer_engine_topology_dump:main\n"
#: System libraries engine.so NEEDs that are not glibc's, the driver's or the CUDA runtime.
SYSTEM_ROOTS = ("libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1", "libcurl.so.4")
#: Never bundled: glibc and the C++ runtime; every Linux host has them (and must use its own).
BASE_SYSTEM = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libresolv.so.2",
         "ld-linux-x86-64.so.2", "linux-vdso.so.1", "libstdc++.so.6", "libgcc_s.so.1"}
#: Found at run time on the GPU host, not bundled.
FROM_HOST = {"libcuda.so.1"}
#: Zip entry time: fixed, so a rebuild from the same inputs is byte-identical.
EPOCH = (2026, 1, 1, 0, 0, 0)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the pieces ---------------------------------------------------------------------------------


def fetch(cache: Path) -> None:
    """pip download the full wheel and the CUDA 12 runtime wheel into ``cache`` (no dependencies)."""
    cache.mkdir(parents=True, exist_ok=True)
    for spec, platform in ((FULL, "manylinux_2_28_x86_64"), (CUDART, "manylinux2014_x86_64")):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--platform", platform, "-d", str(cache), spec]
        log("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True)


def find_wheel(cache: Path, dist: str) -> Path:
    """The one wheel of distribution ``dist`` (pip's name, e.g. ``mooncake_transfer_engine-0.3.13``) in ``cache``."""
    got = sorted(cache.glob(f"{dist}-*.whl"))
    if len(got) != 1:
        raise SystemExit(f"need exactly one {dist}-*.whl in {cache}, found {[p.name for p in got]}; run with --fetch "
                         "or pass the path")
    return got[0]


def system_closure(roots: tuple[str, ...] = SYSTEM_ROOTS) -> dict[str, Path]:
    """soname -> path of ``roots`` and every library they load (``ldd``), glibc excepted."""
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"^\s*(\S+) \(libc6,x86-64\) => (\S+)$", cache, re.M))
    out: dict[str, Path] = {}
    for soname in roots:
        if soname not in found:
            raise SystemExit(f"{soname} is not installed here; on Debian 12: apt-get install -y libibverbs1 "
                             "ibverbs-providers libnuma1 libcurl4")
        path = Path(found[soname])
        out[soname] = path
        ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout
        for name, dep in re.findall(r"^\s*(\S+) => (\S+) \(0x", ldd, re.M):
            if name not in BASE_SYSTEM:
                out.setdefault(name, Path(dep))
    return out


def needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of an ELF file (``readelf -d``)."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        text = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", text)


# ---- the wheel ----------------------------------------------------------------------------------


class _Writer:
    """A wheel being written: fixed entry times, RECORD kept as entries go in."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9)
        self.record: list[str] = []

    def put(self, name: str, data: bytes, mode: int = 0o644) -> None:
        info = zipfile.ZipInfo(name, date_time=EPOCH)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o100000 | mode) << 16
        self.zip.writestr(info, data, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append(f"{name},sha256={digest},{len(data)}")

    def close(self, dist_info: str) -> None:
        record = f"{dist_info}/RECORD"
        body = "\n".join([*self.record, f"{record},,"]) + "\n"
        info = zipfile.ZipInfo(record, date_time=EPOCH)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o100644 << 16
        self.zip.writestr(info, body, compresslevel=9)
        self.zip.close()


def build(full: Path, cudart_wheel: Path, out_dir: Path) -> Path:
    """Write the trimmed wheel into ``out_dir`` (same file name as ``full``); returns its path."""
    dist_info = "-".join(full.name.split("-")[:2]) + ".dist-info"
    keep = set(KEEP) | {f"{dist_info}/{n}" for n in KEEP_DIST_INFO}
    with zipfile.ZipFile(cudart_wheel) as z:
        cudart = z.read(CUDART_MEMBER)
    system = system_closure()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / full.name
    w = _Writer(out)
    shared: dict[str, bytes] = {}  # every .so in the wheel, by file name (what the loader matches)
    dropped = 0
    try:
        with zipfile.ZipFile(full) as z:
            for info in z.infolist():
                if info.is_dir():
                    continue
                if info.filename not in keep:
                    dropped += info.file_size
                    continue
                data = z.read(info)
                w.put(info.filename, data, (info.external_attr >> 16) & 0o777 or 0o644)
                if ".so" in info.filename:
                    shared[Path(info.filename).name] = data
        missing = keep - {r.split(",")[0] for r in w.record}
        if missing:
            raise SystemExit(f"{full.name} lacks {sorted(missing)}: not the 0.3.13.post1 layout this script knows")
        w.put(f"{dist_info}/entry_points.txt", ENTRY_POINTS.encode())
        w.put(f"{LIBS}/libcudart.so.12", cudart, 0o755)
        shared["libcudart.so.12"] = cudart
        for soname, path in system.items():
            w.put(f"{SYSLIBS}/{soname}", path.resolve().read_bytes(), 0o755)
    finally:
        w.close(dist_info)
    # Nothing a kept library loads may be missing (the system closure was closed by ldd already).
    for name, data in shared.items():
        lost = [n for n in needed(data) if n not in shared and n not in system and n not in BASE_SYSTEM and n not in FROM_HOST]
        if lost:
            out.unlink()
            raise SystemExit(f"{name} needs {lost}, which the trimmed wheel would not provide; add them to KEEP")
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {len(system)} system libraries; dropped "
        f"{dropped / 1e6:.0f} MB of the full wheel, unpacked)")
    return out


# ---- on the GPU host ----------------------------------------------------------------------------


def libdir(site: Path) -> str:
    """A folder of links to the bundled system libraries this host cannot load ("" when it lacks
    none of :data:`SYSTEM_ROOTS`, or the wheel is not installed under ``site``)."""
    bundled = site / SYSLIBS
    if not bundled.is_dir():
        return ""

    def loads(soname: str) -> bool:
        try:
            ctypes.CDLL(soname)
        except OSError:
            return False
        return True

    if all(loads(s) for s in SYSTEM_ROOTS):
        return ""
    folder = Path(tempfile.mkdtemp(prefix="kvd-mooncake-syslibs-"))
    for lib in sorted(bundled.iterdir()):
        if not loads(lib.name):  # a missing library's own dependencies may be missing too
            (folder / lib.name).symlink_to(lib)
    return str(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the trimmed wheel into --out")
    b.add_argument("--cache", type=Path, default=CACHE, help=f"where the downloaded wheels are (default {CACHE})")
    b.add_argument("--fetch", action="store_true", help="pip download the full wheel and the CUDA 12 runtime wheel first")
    b.add_argument("--full", type=Path, help="the full mooncake_transfer_engine wheel (default: the one in --cache)")
    b.add_argument("--cudart-wheel", type=Path, help="the nvidia_cuda_runtime_cu12 wheel (default: the one in --cache)")
    b.add_argument("--out", type=Path, default=ROOT / ".whl", help="output folder (default .whl/ of the repo)")
    d = sub.add_parser("libdir", help="print a folder for LD_LIBRARY_PATH with the bundled libraries this host lacks")
    d.add_argument("site", type=Path, help="where the wheel was installed (pip install --target SITE)")
    args = ap.parse_args()
    if args.cmd == "libdir":
        print(libdir(args.site))
        return 0
    if args.fetch:
        fetch(args.cache)
    full = args.full or find_wheel(args.cache, "mooncake_transfer_engine")
    cudart = args.cudart_wheel or find_wheel(args.cache, "nvidia_cuda_runtime_cu12")
    print(build(full, cudart, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
