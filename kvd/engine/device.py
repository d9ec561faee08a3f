"""Where the reference engine computes, and what keeps a GPU run bit-identical to its reference.

``kvd demo --device cuda`` runs both engines and the colocated reference on GPU 0 (each in its
own process) and still demands bit-identical logit traces. That holds because of three things,
all of which this module or the engine code keeps:

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
   precision path applies. All processes use the same GPU (same architecture, same SM count),
   the condition under which cuBLAS promises bit-wise equal results.
3. **The same bytes.** The weights are drawn on the CPU from fixed seeds and then copied to the
   device (:func:`kvd.engine.model.build_models`), so every process holds the same bits; KV read
   from the arena is what was written (a transfer, compaction, offload or restore copies bytes).

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
from typing import Any

import torch

from kvd.errors import Unavailable

__all__ = ["DEVICES", "resolve", "prepare", "Fenced"]

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
