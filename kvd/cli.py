"""``kvd`` command line: ``serve`` runs a daemon, ``status`` prints a daemon's pool as a table,
``demo`` runs a prefill node and a decode node with the reference engine and checks every output,
``proxy`` fronts a vLLM prefill/decode pair that use kvd's connector (:mod:`kvd.connectors.vllm_proxy`).

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

__all__ = ["main"]


def _serve_parser(sub: argparse._SubParsersAction) -> None:
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


def _device_flag(text: str) -> str:
    """argparse type of a device flag: ``cpu``, ``cuda`` or ``cuda:N``, normalised (``cuda`` ->
    ``cuda:0``); a malformed value is a usage error (exit 2) before anything starts."""
    from kvd.engine.device import parse_device

    try:
        return str(parse_device(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from kvd.engine.demo import DemoOptions, run_demo

    requests = args.requests if args.requests is not None else (16 if args.quick else 64)
    if requests <= 0 or args.spec_k < 0 or args.chunk <= 0:
        print("kvd demo: --requests and --chunk must be positive and --spec-k not negative", file=sys.stderr)
        return 2
    try:
        return run_demo(DemoOptions(requests=requests, backend=args.backend, quick=args.quick, seed=args.seed,
                                    spec_k=args.spec_k, chunk=args.chunk, device=args.device,
                                    decode_device=args.decode_device, fault=args.fault))
    except (RuntimeError, TimeoutError) as exc:  # a daemon or engine that failed: say so, no traceback of ours
        print(f"kvd demo: FAILED: {exc}", file=sys.stderr)
        return 2


def cmd_serve(args: argparse.Namespace, on_start: Callable[[Daemon], None] | None = None) -> int:
    """``kvd serve``; ``on_start``: see :func:`kvd.server.app.serve` (test launchers only)."""
    from kvd.server.app import serve

    overrides = {k: getattr(args, k) for k in Settings.model_fields if getattr(args, k, None) is not None}
    settings = load_settings(args.config, **overrides)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, on_start=on_start)
    return 0


def format_status(st) -> str:
    """A readable table of a :class:`kvd.records.NodeStats`."""
    p = st.pool
    lines = [
        f"kvd  layout={st.layout_name}  boot={p.boot_id}  epoch={p.epoch}  "
        f"{'finalized' if p.finalized else 'NOT finalized (post-capture: call Finalize)'}",
        f"arena  reserved={_h(p.reserved_bytes)}  backed={_h(p.backed_bytes)}  gap={_h(p.gap_bytes)}  sink={_h(p.sink_bytes)}",
        "",
        f"{'group':<7}{'dir':<6}{'page':>10}{'used':>10}{'free':>10}{'holes':>8}{'used bytes':>12}  region",
    ]
    for g in p.groups:
        lines.append(
            f"{g.name:<7}{g.direction:<6}{_h(g.page_bytes):>10}{g.used_pages:>10,d}{g.free_pages:>10,d}{g.hole_pages:>8,d}"
            f"{_h(g.used_bytes):>12}  [{_h(g.region_lo_bytes)}, {_h(g.region_hi_bytes)})"
        )
    lines += [
        "",
        f"requests  live={p.requests_live}  offloaded={p.requests_offloaded}    sessions live={st.sessions_live} "
        f"expired={st.sessions_expired_total}",
        f"leases    live={st.leases_live}  expired={st.leases_expired_total}    stale refusals={st.stale_refusals_total}",
        f"compaction done={p.compactions_done}  refused={p.compactions_refused}  moved={_h(p.bytes_moved)}",
    ]
    return "\n".join(lines)


def _h(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_status(args: argparse.Namespace) -> int:
    from kvd.client import Client

    with Client.connect(args.address, name="kvd-status", timeout=5) as kv:
        print(format_status(kv.stats()))
    return 0


def _proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible proxy for vLLM prefill/decode over kvd (POST /v1/completions)",
        description="Prefill with max_tokens=1 on --prefill carrying a ticket from the decode instance's KvdConnector "
        "(--tickets, its kvd_ticket_listen), then decode on --decode; see docs/vllm.md.",
    )
    p.add_argument("--listen", default="127.0.0.1:8000", help="host:port to serve on (default: %(default)s)")
    p.add_argument("--prefill", required=True, help="prefill vLLM base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="decode vLLM base URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--tickets", required=True, help="the decode connector's ticket URL, e.g. http://127.0.0.1:8201")


def cmd_proxy(args: argparse.Namespace) -> int:
    from kvd.connectors.vllm_proxy import make_server

    srv = make_server(args.listen, args.prefill, args.decode, args.tickets)
    print(f"kvd proxy: serving on {args.listen}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd", description="kvd: per-node KV-cache daemon for disaggregated LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _status_parser(sub)
    _demo_parser(sub)
    _proxy_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "demo": cmd_demo, "proxy": cmd_proxy}[args.cmd](args)
    except KvdError as exc:
        print(f"kvd {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
