"""Where the reference engine computes, and what keeps a GPU run bit-identical to its reference.

``kvd demo --device cuda`` runs both engines and the colocated reference on GPU 0 (each in its
own process) and still demands bit-identical logit traces; ``--decode-device cuda:1``
(:func:`place`) moves the decode daemon's arena and the decode engine to GPU 1, the prefill side
and the reference staying on GPU 0. That holds because of three things, all of which this module
or the engine code keeps:

1. **The same math per request.** The engines never batch across requests: every forward pass
   is one request's tokens (a prefill chunk, a draft step, a verify step), and its shapes are a
   function of the request's own history only (chunk size, committed length, draft length) --
   identical in the prefill-decode pair and in the colocated run. A retraction drops a round
   and recomputes it later from the same state, with the same shapes. So no matmul, reduction or
   softmax ever sees a different shape, and cuBLAS never picks a different algorithm, in one run
   than in the other. (The CPU path relies on the same property plus one intra-op thread.)
2. **Deterministic kernels.** :func:`prepare` runs first in every engine and reference process,
   before CUDA initialises: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reproducible across
   streams/workspaces), ``torch.use_deterministic_algorithms(True)``, TF32 off for matmuls and
   cuDNN, cuDNN deterministic and not benchmarking. Activations are float64, so no reduced
   precision path applies. All processes use the same GPU model (same architecture, same SM
   count), the condition under which cuBLAS promises bit-wise equal results.
3. **The same bytes.** The weights are drawn on the CPU from fixed seeds and then copied to the
   device (:func:`kvd.engine.model.build_models`), so every process holds the same bits; KV read
   from the arena is what was written (a transfer, compaction, offload or restore copies bytes).

Two GPUs. With the roles on two devices the decode engine's kernels run on GPU 1 while the
reference ran them on GPU 0. Identity still holds when the two are the same model on one host
(two H200s of one HGX board): one driver, one torch/cuBLAS build in every process, the same
architecture and SM count, so for the same shape cuBLAS's heuristics choose the same algorithm
and the same deterministic kernel computes the same bits -- a device index enters no kernel's
arithmetic. Points 1 and 3 are untouched: shapes are still per request, and the KV the decode
engine reads on GPU 1 is the bytes the prefill daemon copied there over NVLink (a copy, no
arithmetic). Mixed models (an H100 next to an H200, or MIG slices of different sizes) void the
guarantee: other SM counts can mean other cuBLAS algorithms and other rounding. ``kvd demo``
then prints a WARNING in its summary (it compares the names the engines report) rather than
refusing, since outputs may still agree; a difference fails the run as usual.

Cross-process ordering. CUDA work is asynchronous, and the daemon touches the arena from another
process, where stream order does not reach. :class:`Fenced` therefore waits for the engine's
device work before every call to its daemon (a Send, a compaction, an offload or a free must
see every KV write the engine queued before it). The daemon's half of that contract: a call that
moves arena bytes (Send's commit, Compact, Restore) replies only after those bytes moved. And an
engine's KV write changes only its own positions (:func:`kvd.engine.paged._put_rows`; CUDA's
deterministic ``index_put_`` would rewrite a whole layer view, racing the daemon's writes into
other requests' pages).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, NamedTuple

import torch

from kvd.errors import InvalidArgument, Unavailable

__all__ = ["DEVICES", "Placement", "resolve", "parse_device", "place", "prepare", "Fenced"]

#: what ``kvd demo --device`` accepts; ``cuda`` means GPU 0
DEVICES = ("cpu", "cuda")
#: the cuBLAS workspace setting that makes its results reproducible (CUDA >= 10.2)
CUBLAS_WORKSPACE = ":4096:8"


def resolve(device: str) -> torch.device:
    """``"cpu"`` or ``"cuda"`` (GPU 0) as a :class:`torch.device`. ``ValueError`` for anything
    else; :class:`~kvd.errors.Unavailable` for ``cuda`` where CUDA is not available. Changes
    nothing (does not initialise CUDA)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unavailable(
            "--device cuda but torch.cuda.is_available() is false (no GPU, no driver, or a CPU-only build of torch "
            f"{torch.__version__}); run on a machine with a CUDA GPU and a CUDA build of torch, or use --device cpu"
        )
    return torch.device("cuda", 0)


class Placement(NamedTuple):
    """Where each role of ``kvd demo`` lives (:func:`place`)."""

    prefill: torch.device  # the prefill daemon's arena, the prefill engine, the colocated reference
    decode: torch.device  # the decode daemon's arena, the decode engine

    @property
    def split(self) -> bool:
        """True when the roles are on two devices (the prefill daemon writes into a peer GPU)."""
        return self.prefill != self.decode


_DEVICE_RE = re.compile(r"(cpu|cuda)(?::([0-9]+))?")


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` (GPU 0) or ``cuda:N`` as a :class:`torch.device` with an index for CUDA.
    :class:`~kvd.errors.InvalidArgument` (a ``ValueError``) for anything else. Changes nothing."""
    m = _DEVICE_RE.fullmatch(text.strip())
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise InvalidArgument(f"device {text!r} is not cpu, cuda or cuda:N (N a GPU index, as CUDA_VISIBLE_DEVICES numbers them)")
    return torch.device("cpu") if m.group(1) == "cpu" else torch.device("cuda", int(m.group(2) or 0))


def _device_count() -> int:
    """CUDA devices this process sees; the seam CPU tests stub. ``torch.cuda.device_count`` does
    not initialise CUDA in this process (no context, torch's lazy init untouched)."""
    return torch.cuda.device_count()


def _can_access_peer(device: int, peer: int) -> bool:
    """Whether ``device`` can map and write memory that lives on ``peer`` (the CUDA driver's
    ``cuDeviceCanAccessPeer``, what ``torch.cuda.can_device_access_peer`` asks too). Asked through
    cuda-python (which the GPU arenas need anyway) so that this process creates no CUDA context:
    the driver call needs ``cuInit`` only, which ``torch.cuda.is_available`` already did. The seam
    CPU tests stub."""
    from kvd.memory.vmm import driver

    cu = driver()

    def call(what: str, result: Any) -> Any:  # a cuda.bindings result: (CUresult, *values)
        err, vals = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != cu.CUresult.CUDA_SUCCESS:
            raise Unavailable(f"asking the CUDA driver about peer access: {what} failed: {getattr(err, 'name', err)}")
        return vals[0] if vals else None

    call("cuInit(0)", cu.cuInit(0))
    dev = call(f"cuDeviceGet({device})", cu.cuDeviceGet(device))
    other = call(f"cuDeviceGet({peer})", cu.cuDeviceGet(peer))
    return bool(call(f"cuDeviceCanAccessPeer({device}, {peer})", cu.cuDeviceCanAccessPeer(dev, other)))


def place(device: str, decode_device: str | None = None) -> Placement:
    """The devices of ``kvd demo``'s two roles: ``device`` (``cpu`` or ``cuda``: GPU 0, see
    :func:`resolve`) for the prefill side and the reference; ``decode_device`` (``cuda:N``; None:
    the same as ``device``) for the decode side. Changes nothing and initialises no CUDA context.

    Refuses, before anything starts: a malformed or mixed (CPU with GPU) pair with
    :class:`~kvd.errors.InvalidArgument`; a GPU the machine does not have, or two GPUs where the
    prefill one cannot access the decode one's memory (the prefill daemon writes KV into the
    decode daemon's arena over NVLink / PCIe peer access), with :class:`~kvd.errors.Unavailable`."""
    prefill = resolve(device)
    if decode_device is None:
        return Placement(prefill, prefill)
    decode = parse_device(decode_device)
    if decode.type != prefill.type:
        raise InvalidArgument(
            f"--decode-device {decode_device} with --device {device}: both roles run on the CPU or both on GPUs "
            "(the local backend copies shared memory to shared memory, or GPU to GPU); use --device cuda "
            "--decode-device cuda:N, or leave --decode-device out"
        )
    if decode == prefill:
        return Placement(prefill, prefill)
    count = _device_count()
    if decode.index is None or decode.index >= count:
        raise Unavailable(
            f"--decode-device {decode} but this machine has {count} CUDA device(s) (as CUDA_VISIBLE_DEVICES numbers "
            f"them); pick an index below {count}, or leave --decode-device out to run both roles on {prefill}"
        )
    if not _can_access_peer(prefill.index or 0, decode.index):
        raise Unavailable(
            f"{prefill} cannot access the memory of {decode} (no CUDA peer access between them: no NVLink or PCIe P2P "
            "path, or P2P disabled); the prefill daemon writes KV straight into the decode daemon's arena, so the "
            "two roles need GPUs with peer access (see nvidia-smi topo -p2p w), or one GPU (leave --decode-device out)"
        )
    return Placement(prefill, decode)


def prepare(device: torch.device | str) -> torch.device:
    """Make this process compute deterministically on ``device``; call it before anything touches
    CUDA (first thing in a process entry point). On the CPU it changes nothing. Mutates process
    state: an environment variable and torch's global flags. Returns the device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # a caller's ":16:8" is reproducible too
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(dev)
    return dev


class Fenced:
    """``client`` with a device fence: every method call first waits for the work this process
    queued on ``device`` (``torch.cuda.synchronize``), so the daemon, which reads and moves arena
    bytes from its own process, sees every KV write the engine made before the call. On the CPU
    the client is returned unwrapped by :meth:`wrap`. Attributes that are not callables pass
    through."""

    def __init__(self, client: Any, device: torch.device) -> None:
        self._client = client
        self._device = device

    @classmethod
    def wrap(cls, client: Any, device: torch.device) -> Any:
        return cls(client, device) if device.type == "cuda" else client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        device = self._device

        @functools.wraps(attr)
        def fenced(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize(device)
            return attr(*args, **kwargs)

        return fenced
