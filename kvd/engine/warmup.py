"""The start-up warm-up: requests an engine pair runs before it serves timed ones, as real engines
warm up (or capture graphs) at start-up.

The first request through a fresh process pays one-time costs that are not the request's: on a GPU
cuBLAS handles and workspaces, the caching allocator's first blocks, torch's first launch of each
op; in the daemons the Triton page-move kernels' JIT compiles and the first Send's connections
(the peer socket, the backend's wiring). Triton compiles a kernel once per *specialisation* of
its integer arguments (equal to 1, divisible by 16, neither), so one warm request is not enough:
:func:`warmup_requests` spans every shape the demo's workload
(:func:`kvd.demo.run.workload`) gives the engines and the daemons --

* prompts shorter than the SWA window, just under and over it, one page and one chunk
  (``chunk``, ``chunk + 1``), several windows, the workload's longest prompt, and one prompt
  of every pass count from 2 to ``ceil(10 * window / chunk)`` chunks: a last chunk of a full and
  of a partial length, page counts divisible by 16 and not, SWA tails bound and released;
* ``max_new`` tokens enough for full speculative rounds (``k`` drafts, the target scoring
  ``k + 1``) and the shortened ones at the end (``k - 1`` down to plain greedy);
* through both daemons when the router runs them (:meth:`kvd.engine.router.Router.run`): the
  RECV lease and ticket, BeginSend's plan, a Send per chunk, the last Send's free, WaitReady.

What the set does not reach for sure -- retraction and compaction happen only under memory
pressure -- the decode engine runs once before it reports ready
(:meth:`kvd.engine.decode.DecodeEngine.warm_up` with :data:`MOVE_LENGTHS`): an offload, a
restore and a compaction that moves pages, on scratch requests.

The warm-up's requests have their own ids (``warmup-N``), leave nothing behind, and are not
timed or compared.
"""

from __future__ import annotations

import torch

from kvd.engine.model import TargetConfig
from kvd.engine.records import EngineConfig, Request

__all__ = ["warmup_requests", "WARMUP_SEED", "MOVE_LENGTHS"]

WARMUP_SEED = 1_000_003  # not a workload seed: the warm-up's tokens are its own
#: DecodeEngine.warm_up's scratch requests: a hole of 64 tokens, then short, one-chunk and long
#: requests offloaded, restored and moved by the compaction (run counts of 1 and more)
MOVE_LENGTHS = (64, 5, 65, 320)


def warmup_requests(cfg: EngineConfig, target: TargetConfig = TargetConfig(), *, longest: int | None = None) -> list[Request]:
    """The warm-up set for engines configured with ``cfg`` (see the module doc). ``longest``: the
    longest prompt the engines will meet (default: ten SWA windows, the demo workload's longest)."""
    w = target.window
    chunk = cfg.chunk or 4 * w
    longest = longest or 10 * w
    passes = -(-longest // chunk)
    lengths = sorted({3, w - 1, w + 1, chunk, chunk + 1, 3 * w + 5, 4 * w, longest,
                      *(k * chunk - 5 for k in range(2, passes + 1))})  # every pass count, a partial last chunk
    max_new = 2 * (cfg.spec_k + 1) + 2
    g = torch.Generator().manual_seed(WARMUP_SEED)
    return [Request(f"warmup-{i}", tuple(torch.randint(0, target.vocab, (n,), generator=g).tolist()), max_new)
            for i, n in enumerate(lengths)]
