"""``kvd`` command line: ``serve`` runs a daemon, ``status`` prints a daemon's pool as a table
(``--json`` for scripts), ``top`` redraws its pool and activity live (:mod:`kvd.tools.top`), ``plan``
sizes a model's layout for a memory budget (:mod:`kvd.pool.plan`), ``demo`` runs a prefill node and a
decode node with the reference engine and checks every output, ``proxy`` fronts a vLLM prefill/decode
pair that use kvd's connector (:mod:`kvd.connectors.vllm_proxy`).

Every ``serve`` option maps to a :class:`kvd.config.Settings` field (and a ``KVD_*`` variable);
``kvd serve --help`` lists them with their descriptions and defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.config import Settings, load_settings
from kvd.errors import KvdError

if TYPE_CHECKING:
    from kvd.server.app import Daemon

__all__ = ["main", "serve_parser", "cmd_serve"]


def serve_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` and its flags to ``sub``; a launcher that wraps ``kvd serve`` reuses it with :func:`cmd_serve`."""
    p = sub.add_parser(
        "serve",
        help="run a kvd daemon in the foreground",
        description="Run a kvd daemon. Settings come from --config FILE (YAML or TOML), KVD_* environment "
        "variables, and these flags (highest precedence). Stops on SIGTERM after draining in-flight calls.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML or TOML settings file (also KVD_CONFIG_FILE)")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"KVD_{name.upper()}"
        help_text = f"{field.description} [env {env}]"
        ann = field.annotation
        if ann is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text + f" (default {field.default})")
        else:
            p.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text + f" (default {field.default!r})")


def _status_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="print a daemon's pool: groups, pages used/free, leases, epoch",
        description="Connect to a running daemon and print its pool as a table.",
    )
    p.add_argument("--address", default="unix:/tmp/kvd.sock", help="daemon address: unix:/path or host:port (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the stats as JSON (for scripts)")


def _top_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="a live view of a daemon: the arena as one bar per group, requests, leases and transfers in flight, rates",
        description="Connect to a running daemon and redraw its pool and activity in place until Ctrl-C.",
    )
    p.add_argument("--address", default="unix:/tmp/kvd.sock", help="daemon address: unix:/path or host:port (default: %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--limit", type=int, default=20, help="rows of requests, leases and transfers (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one screen (rates over one interval) and exit")


def _cmd_top(args: argparse.Namespace) -> int:
    from kvd.client import Client
    from kvd.tools.top import run_top

    if args.interval <= 0 or not 0 < args.limit <= 1000:
        print("kvd top: --interval must be positive and --limit in 1..1000", file=sys.stderr)
        return 2
    with Client.connect(args.address, name="kvd-top", timeout=5) as kv:
        run_top(kv, args.address, interval=args.interval, once=args.once, limit=args.limit)
    return 0


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    from kvd.pool.models import MODEL_FAMILIES
    from kvd.pool.plan import GPUS

    p = sub.add_parser(
        "plan",
        help="size a model's KV layout for a memory budget: pages and tokens per group, largest request, table bytes",
        description="Derive the layout of one engine rank (from a Hugging Face config.json, a preset or a layout file) "
        "and print what a daemon with that budget holds. Model families read from config.json: "
        + "; ".join(MODEL_FAMILIES) + ".",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="CONFIG", help="path of the model's config.json (or its directory)")
    src.add_argument("--layout", help="a preset name or a layout YAML/JSON file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with --model; default: %(default)s)")
    p.add_argument("--draft", metavar="CONFIG", help="the draft model's config.json (with --model)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default: 16; SGLang's token pool: 1)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: the config's torch_dtype)")
    p.add_argument("--budget", metavar="BYTES", help="KV pool bytes per rank, e.g. 60GiB")
    p.add_argument("--gpu", choices=sorted(GPUS), help="instead of --budget: this GPU's memory x --mem-fraction - --other")
    p.add_argument("--gpu-memory", metavar="BYTES", help="instead of --gpu: the GPU's total memory")
    p.add_argument("--mem-fraction", type=float, default=0.8, help="share of the GPU for the KV pool (default: %(default)s)")
    p.add_argument("--other", metavar="BYTES", default="0", help="bytes of that share kept by weights/activations (default: 0)")
    p.add_argument("--reserve", metavar="BYTES", help="post-capture reservation (default: 4x the budget, as kvd serve)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from kvd.config import parse_bytes
    from kvd.errors import InvalidArgument
    from kvd.pool.models import load_model
    from kvd.pool.plan import format_plan, gpu_budget, plan
    from kvd.pool.presets import load_layout
    from kvd.tools.top import console

    def size(v: str | None, what: str) -> int | None:
        try:
            return None if v is None else parse_bytes(v)
        except ValueError as e:
            raise InvalidArgument(f"{what}: {e}") from None

    if args.layout and (args.tp != 1 or args.draft):
        raise InvalidArgument("--tp and --draft apply to --model (a config.json); a layout is already per rank")
    if args.model:
        layout = load_model(args.model, tp=args.tp, draft=args.draft, page_size=args.page_size or 16, dtype=args.dtype)
    else:
        layout = load_layout(args.layout)
        update = {k: v for k, v in (("page_size", args.page_size), ("dtype", args.dtype)) if v is not None}
        layout = type(layout).model_validate({**layout.model_dump(), **update}) if update else layout
    if args.budget is not None and (args.gpu or args.gpu_memory):
        raise InvalidArgument("give --budget or --gpu/--gpu-memory, not both")
    budget = size(args.budget, "--budget")
    if budget is None:
        budget = gpu_budget(args.gpu, memory=size(args.gpu_memory, "--gpu-memory"), fraction=args.mem_fraction,
                            other=size(args.other, "--other") or 0)
    p = plan(layout, budget, reserve=size(args.reserve, "--reserve"))
    if args.json:
        print(json.dumps(p.to_json(), indent=2))
    else:
        console().print(format_plan(p, layout))
    return 0


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a prefill and a decode node with the reference engine; check outputs against the colocated run",
        description="Start two daemons (prefill node, decode node) and two engine processes on loopback, run a "
        "workload through them and print a summary. Exits 1 if any output differs from the colocated reference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=None, help="requests in the workload: 64, or 16 with --quick%(default).0s")
    p.add_argument("--backend", choices=("auto", "mooncake", "nixl", "local"), default="auto",
                   help="data plane between the daemons; auto: Mooncake TCP when installed, else local")
    p.add_argument("--quick", action="store_true", help="a short run (16 requests, 32 tokens each) for CI")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per speculative round (0: plain greedy)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk in tokens")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the daemons' arenas, the engines and the colocated reference live; cuda: GPU 0 "
                   "(CUDA VMM arenas, local backend GPU to GPU; refused where CUDA is not available)")
    p.add_argument("--decode-device", type=_device_flag, default=None, metavar="cuda:N",
                   help="put the decode role (its daemon's arena and its engine) on GPU N, the prefill role and the "
                   "colocated reference staying on --device (needs --device cuda, N below the GPU count and peer "
                   "access between the two GPUs; e.g. cuda:1); default: the decode role on --device too%(default).0s")
    p.add_argument("--fault", choices=("swa-full-ids", "draft-scrambled"), default=None,
                   help="TEST ONLY: the prefill daemon places the KV in the wrong decode pages, in a known way (it "
                   "plans from corrupted destination vectors, after the sealed ticket's checks); the run must then fail")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the run's figures (outputs identical, TTFT p50/p95 PD vs colocated and their ratio, "
                   "warm-up) as JSON to FILE")


def _device_flag(text: str) -> str:
    """argparse type of a device flag: ``cpu``, ``cuda`` or ``cuda:N``, normalised (``cuda`` ->
    ``cuda:0``); a malformed value is a usage error (exit 2) before anything starts."""
    from kvd.engine.device import parse_device

    try:
        return str(parse_device(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.demo.run import DemoOptions, run_demo

    requests = args.requests if args.requests is not None else (16 if args.quick else 64)
    if requests <= 0 or args.spec_k < 0 or args.chunk <= 0:
        print("kvd demo: --requests and --chunk must be positive and --spec-k not negative", file=sys.stderr)
        return 2
    try:
        return run_demo(DemoOptions(requests=requests, backend=args.backend, quick=args.quick, seed=args.seed,
                                    spec_k=args.spec_k, chunk=args.chunk, device=args.device,
                                    decode_device=args.decode_device, fault=args.fault, json_path=args.json))
    except (RuntimeError, TimeoutError) as exc:  # a daemon or engine that failed: say so, no traceback of ours
        print(f"kvd demo: FAILED: {exc}", file=sys.stderr)
        return 2


def cmd_serve(args: argparse.Namespace, on_start: Callable[[Daemon], None] | None = None) -> int:
    """``kvd serve``; ``on_start``: see :func:`kvd.server.app.serve` (test launchers only)."""
    import signal

    from kvd.server.signals import StopSignals

    # Before the imports and the start-up, which take seconds: as a container's PID 1, kvd
    # never sees a SIGTERM sent before it has a handler.
    stops = StopSignals((signal.SIGTERM,))
    try:
        from kvd.server.app import serve

        overrides = {k: getattr(args, k) for k in Settings.model_fields if getattr(args, k, None) is not None}
        settings = load_settings(args.config, **overrides)
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(settings, on_start=on_start, stops=stops)
    finally:
        stops.close()
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kvd.client import Client

    import json

    from kvd.tools.top import console, render_status, status_json

    with Client.connect(args.address, name="kvd-status", timeout=5) as kv:
        st = kv.stats()
    if args.json:
        print(json.dumps(status_json(st), indent=2))
    else:
        console().print(render_status(st, args.address))
    return 0


def _proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible proxy for vLLM prefill/decode over kvd (completions and chat, streamed or not)",
        description="Prefill with max_tokens=1 on a --prefill instance carrying a ticket from a decode instance's "
        "KvdConnector (--tickets, its kvd_ticket_listen), then decode there; a request the handoff cannot serve "
        "goes to the decode instance alone. Repeat --prefill, and --decode with its --tickets, for several "
        "instances. See docs/vllm.md.",
    )
    p.add_argument("--listen", default="127.0.0.1:8000", help="host:port to serve on (default: %(default)s)")
    p.add_argument("--prefill", required=True, action="append", help="a prefill vLLM base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, action="append", help="a decode vLLM base URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--tickets", required=True, action="append",
                   help="that decode instance's ticket URL (its connector's kvd_ticket_listen), e.g. http://127.0.0.1:8201")
    p.add_argument("--prefill-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a prefill instance may take for one prompt before the decode instance serves it alone")


def _cmd_proxy(args: argparse.Namespace) -> int:
    from kvd.connectors.vllm_proxy import ProxyConfig, serve

    try:
        cfg = ProxyConfig(args.prefill, args.decode, args.tickets, prefill_timeout_s=args.prefill_timeout)
    except ValueError as exc:
        print(f"kvd proxy: {exc}", file=sys.stderr)
        return 2
    print(f"kvd proxy: serving on {args.listen}", flush=True)
    try:
        serve(args.listen, cfg)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd", description="kvd: per-node KV-cache daemon for disaggregated LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve_parser(sub)
    _status_parser(sub)
    _demo_parser(sub)
    _plan_parser(sub)
    _top_parser(sub)
    _proxy_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {
            "serve": cmd_serve, "status": _cmd_status, "demo": _cmd_demo, "plan": _cmd_plan, "top": _cmd_top, "proxy": _cmd_proxy,
        }[args.cmd](args)
    except KvdError as exc:
        print(f"kvd {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
