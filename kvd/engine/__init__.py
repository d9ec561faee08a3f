"""A small reference engine that uses kvd the way an SGLang or vLLM server would.

``kvd demo`` runs it as a prefill node and a decode node and proves every output equal to the
colocated run. The pieces, one noun per module:

* :mod:`~kvd.engine.model` -- the tiny hybrid target (full + sliding-window attention, GQA, a
  linear-recurrence state layer) and an independent draft model; their layout is ``tiny-hybrid``;
* :mod:`~kvd.engine.paged` -- one request's KV in the daemon's arena, by physical page id;
* :mod:`~kvd.engine.records` -- configuration, requests, results (shared by everything below);
* :mod:`~kvd.engine.prefill` -- the prefill role (chunked prefill, Send per chunk);
* :mod:`~kvd.engine.decode` -- the decode role (receive, greedy or speculative decoding,
  retraction, compaction) and the handoff walk;
* :mod:`~kvd.engine.local` -- the engine-facing calls over an in-process pool;
* :mod:`~kvd.engine.reference` -- the colocated reference, the accuracy comparison and a
  no-cache oracle;
* :mod:`~kvd.engine.device` -- where the engines compute (``kvd demo --device cuda``), the
  deterministic CUDA set-up of each process and the fence before every daemon call;
* :mod:`~kvd.engine.router` -- engine processes and the router between them;
* :mod:`~kvd.engine.demo` -- ``kvd demo``;
* :mod:`~kvd.engine.faults` -- test-only faults that misplace KV (negative controls), in a
  sending daemon or in a ticket.

Importing this package does not import the process or demo machinery.
"""

from kvd.engine.decode import DecodeEngine, DecodeStats
from kvd.engine.prefill import PrefillEngine
from kvd.engine.records import Completion, EngineConfig, FirstToken, Request
from kvd.engine.model import DraftConfig, Models, TargetConfig, build_models, layout_for
from kvd.engine.paged import PagedKV, SeqKV
from kvd.engine.reference import compare, recompute, run_colocated

__all__ = [
    "Completion", "DecodeEngine", "DecodeStats", "EngineConfig", "FirstToken", "PrefillEngine", "Request",
    "DraftConfig", "Models", "TargetConfig", "build_models", "layout_for",
    "PagedKV", "SeqKV",
    "compare", "recompute", "run_colocated",
]
