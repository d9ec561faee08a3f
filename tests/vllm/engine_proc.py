"""One vLLM engine (offline LLM API, in-process engine core) driven over stdin/stdout by the tests.

    python engine_proc.py MODEL [--kv JSON] [--layout-out FILE] [--block-size N] [--max-num-batched-tokens N]

Prints ``READY`` once the engine is up (and, with --layout-out, writes the kvd layout derived from
this engine's own KV cache config there). Then each stdin line is a job
``{"prompts": [[ids]], "params": [kv_transfer_params | null], "max_tokens": N}`` (or ``{"stats": true}``:
the connector's CopyStats), answered by one
line ``RESULT {"tokens": [[ids]], "finish": [reason], "kv_params": [...], "seconds": s}`` (with
--kv also ``copy_stats``: the connector's CopyStats so far). ``{"scheduler": true}``: the
preemptions so far, the decode connector's TicketStats, the requests vLLM holds and its free blocks. A job with ``"busy": M`` adds its prompts
while M other requests decode and answers each prompt's steps and seconds to its first token
(:func:`busy`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time

PREEMPTIONS = [0]  # requests the scheduler preempted so far


def busy(llm, job: dict, sps: list) -> dict:
    """``job["busy"]`` background requests (random prompts of ``bg_tokens``) decoding for
    ``warm_steps`` steps, then the job's prompts added: the engine steps until each has its first
    token. Returns, per prompt, the steps and seconds from its arrival to its first token, and
    its tokens; the background requests are aborted after."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    tag = time.monotonic_ns()
    bg = [f"bg-{tag}-{i}" for i in range(job["busy"])]
    for i, rid in enumerate(bg):
        prompt = [(7 * i + 13 * k) % 500 + 1 for k in range(job.get("bg_tokens", 64))]
        eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True))
    for _ in range(job.get("warm_steps", 8)):
        eng.step()
    ids = [f"fg-{tag}-{i}" for i in range(len(job["prompts"]))]
    t0 = time.perf_counter()
    for rid, p, sp in zip(ids, job["prompts"], sps):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    first: dict[str, tuple[int, float]] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while len(tokens) < len(ids) and steps < 10_000:
        outs = eng.step()
        steps += 1
        for o in outs:
            if o.request_id in ids and o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = (steps, time.perf_counter() - t0)
            if o.request_id in ids and o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    eng.abort_request(bg)
    for _ in range(4):
        eng.step()
    return {"steps": [first.get(r, (-1, 0.0))[0] for r in ids], "seconds": [first.get(r, (-1, 0.0))[1] for r in ids],
            "tokens": [tokens.get(r, []) for r in ids]}


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: every thread's stack to stderr (a hung engine)
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv", default=None)
    ap.add_argument("--layout-out", default=None)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step (default: the longest prompt in one step); below a prompt: chunked prefill")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix caching on (its default; the tier's engines run without it)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (num_gpu_blocks_override): few, and vLLM preempts")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(model=a.model, dtype="float32", max_model_len=a.max_model_len, enforce_eager=True, max_num_seqs=8,
              seed=0, enable_prefix_caching=a.prefix_caching, block_size=a.block_size,
              max_num_batched_tokens=a.max_num_batched_tokens or max(2048, a.max_model_len))
    if a.num_blocks:
        kw["num_gpu_blocks_override"] = a.num_blocks
    if a.kv:
        kw["kv_transfer_config"] = KVTransferConfig(**json.loads(a.kv))
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler  # VLLM_ENABLE_V1_MULTIPROCESSING=0: in this process
    preempt = sched._preempt_request

    def counted(*args, **kwargs):  # the preemptions, counted for {"scheduler": true}
        PREEMPTIONS[0] += 1
        return preempt(*args, **kwargs)

    sched._preempt_request = counted
    if a.layout_out:
        from kvd.connectors.vllm_layout import layout_from_vllm

        core = llm.llm_engine.engine_core.engine_core  # VLLM_ENABLE_V1_MULTIPROCESSING=0: in this process
        layout, _ = layout_from_vllm(core.scheduler.kv_cache_config, name=a.model.rstrip("/").rsplit("/", 1)[-1])
        with open(a.layout_out, "w") as f:
            f.write(layout.model_dump_json())
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("stats"):  # the connector's CopyStats only (a Send finishes after its request)
            from dataclasses import asdict

            from vllm.distributed.kv_transfer import get_kv_transfer_group

            print("RESULT " + json.dumps({"copy_stats": asdict(get_kv_transfer_group().copy_stats)}), flush=True)
            continue
        if job.get("scheduler"):  # what the scheduler saw: preemptions, the ticket book's stats (decode side)
            from dataclasses import asdict

            side = getattr(sched.connector, "sched", None)  # KvdConnector's scheduler side
            book = getattr(side, "book", None)
            pool = sched.kv_cache_manager.block_pool
            print("RESULT " + json.dumps({"ticket_stats": asdict(book.stats) if book is not None else None,
                                          "preemptions": PREEMPTIONS[0], "requests": len(sched.requests),
                                          "free_blocks": pool.get_num_free_blocks(), "blocks": pool.num_gpu_blocks}), flush=True)
            continue
        params = job.get("params") or [None] * len(job["prompts"])
        sps = [SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 32), ignore_eos=True,
                              extra_args={"kv_transfer_params": p} if p else None) for p in params]
        if job.get("abort_after_steps") is not None:  # a client gone mid-request: aborted after that many steps
            eng = llm.llm_engine
            ids = [f"abort-{time.monotonic_ns()}-{i}" for i in range(len(job["prompts"]))]
            for rid, p, sp in zip(ids, job["prompts"], sps):
                eng.add_request(rid, {"prompt_token_ids": p}, sp)
            done: set[str] = set()
            for _ in range(job["abort_after_steps"]):
                done |= {o.request_id for o in eng.step() if o.finished}
            eng.abort_request([r for r in ids if r not in done])
            for _ in range(job.get("idle_steps", 4)):  # what the abort leaves the engine to do (vLLM tells the worker next step)
                eng.step()
            print("RESULT " + json.dumps({"finished_before_abort": sorted(done)}), flush=True)
            continue
        if job.get("busy") is not None:  # the prompts arriving while the engine decodes others
            print("RESULT " + json.dumps(busy(llm, job, sps)), flush=True)
            continue
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sps, use_tqdm=False)
        res = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                   finish=[o.outputs[0].finish_reason for o in outs],
                   kv_params=[o.kv_transfer_params for o in outs], seconds=time.perf_counter() - t0)
        if a.kv:  # the worker-side connector (in this process): what it copied and sent so far
            from dataclasses import asdict

            from vllm.distributed.kv_transfer import get_kv_transfer_group

            stats = getattr(get_kv_transfer_group(), "copy_stats", None)  # KvdConnector's (not NixlConnector's)
            if stats is not None:
                res["copy_stats"] = asdict(stats)
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
