"""The package's shape, checked from its source: every module says what it exports (``__all__``)
and exports what it defines; imports point one way through the layers; no import cycles.

* ``__all__``: every module under ``kvd/`` (the generated ``kvd.v1`` aside) has one, a list of
  unique strings each naming something the module has, and every public class or function the
  module defines at top level (not one it imports) is in it. A package ``__init__`` that imports
  and defines nothing (a docstring only) needs none: it exports nothing.
* layers: ``records / limits / errors / config`` < ``ipc`` < ``memory`` < ``copy`` < ``pool`` <
  ``daemon`` < ``handoff`` < ``rpc`` < ``server``, ``client`` < ``cli`` and the package face
  (``kvd/__init__.py``). A module may import its own package and any lower layer, with
  whitelists for the side branches: ``backends`` only memory, copy, ipc and the bottom layer;
  ``client`` not daemon, pool.pool, handoff or server; ``connectors`` only the client surface,
  records, errors and ``kvd.pool.layout``; ``engine`` those and the pool and memory (its
  colocated reference runs kvd's pool in-process); ``demo`` (the launchers: they start and
  patch daemons) stands with ``cli``. A few single imports across layers are allowed by name
  (EXCEPTIONS, each with its reason). Every import counts here, also one inside a function or
  under ``TYPE_CHECKING``: each is a dependency of the module.
* core code (everything below rpc, and backends) imports neither grpc nor prometheus_client.
* cycles: none in the graph of module-level imports (``TYPE_CHECKING`` blocks and imports inside
  functions excluded: they do not run at import).

The source is parsed with :mod:`ast`, so a violation names the file and line to change.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvd

ROOT = Path(kvd.__file__).resolve().parent
GENERATED = "kvd.v1"


def _name(path: Path) -> str:
    parts = ("kvd", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of the package by dotted name (kvd.v1's generated stubs included: they are
#: import targets, but no check below applies to them as a source).
PATHS = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
MODULES = sorted(m for m in PATHS if not (m == GENERATED or m.startswith(GENERATED + ".")))
#: Modules that import an optional dependency at the top, and a submodule of it that shows it is
#: installed (bare ``vllm`` would import tests/vllm as a namespace package). vllm: only in
#: .venv-vllm, where `PYTHONPATH=. .venv-vllm/bin/python -m pytest tests/core/test_package_surface.py` runs these.
_VLLM = ("vllm", "vllm_layout", "vllm_loader", "vllm_meta", "vllm_saver", "vllm_scheduler", "vllm_stats", "vllm_ticket_book",
         "vllm_worker")
NEEDS = {
    **{f"kvd.connectors.{m}": "vllm.distributed" for m in _VLLM},
    "kvd.connectors.vllm_proxy": "aiohttp.web",
}


@dataclass(frozen=True)
class Import:
    target: str  # the kvd module (or top-level third-party package) imported
    names: tuple[str, ...]  # for ``from X import a, b``: the names; () for ``import X``
    line: int
    runtime: bool  # runs at import: module level, not under TYPE_CHECKING


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(module: str) -> list[Import]:
    """Every import statement of ``module``, resolved to kvd module names (``from kvd.v1 import
    kvd_pb2`` is ``kvd.v1.kvd_pb2``) or to the top-level name of a third-party package."""
    path = PATHS[module]
    tree = ast.parse(path.read_text(), str(path))
    out: list[Import] = []

    def target(name: str) -> str:
        return name if name.split(".")[0] == "kvd" else name.split(".")[0]

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Import(target(a.name), (), node.lineno, runtime) for a in node.names)
            return
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.name == "__init__.py", node)
            by_target: dict[str, list[str]] = {}
            for a in node.names:
                sub = f"{base}.{a.name}"
                by_target.setdefault(sub if sub in PATHS else target(base), []).append(a.name)
            out.extend(Import(t, tuple(ns), node.lineno, runtime) for t, ns in by_target.items())
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        inner = runtime and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return out


# -- __all__ ------------------------------------------------------------------------------------


def _bare_package(module: str) -> bool:
    """A package ``__init__`` holding a docstring and nothing else."""
    path = PATHS[module]
    if path.name != "__init__.py":
        return False
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def _defined_public(module: str) -> list[str]:
    """Public classes and functions ``module`` defines at top level (under an ``if`` too)."""
    tree = ast.parse(PATHS[module].read_text())
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
                names.append(n.name)
            elif isinstance(n, (ast.If, ast.Try)):
                visit(n.body)
                visit(getattr(n, "orelse", []))

    visit(tree.body)
    return names


#: Public definitions a module leaves out of ``__all__`` on purpose, with the reason.
UNLISTED = {
    # kvd.errors.__all__ is the exception tree: the package face re-exports it with ``*`` and
    # tests/daemon/test_daemon_status_map.py holds it equal to CODES. The status table's helpers
    # are the transports' API (kvd.rpc.status, the Unix sockets), imported by name.
    "kvd.errors": {"Code", "Status", "to_status", "from_status"},
}


@pytest.mark.parametrize("module", MODULES)
def test_all_is_honest(module: str) -> None:
    if _bare_package(module):
        return
    if module in NEEDS:
        pytest.importorskip(NEEDS[module], reason=f"{module} needs {NEEDS[module]}, not installed here")
    mod = importlib.import_module(module)
    exported = getattr(mod, "__all__", None)
    assert exported is not None, f"{PATHS[module]}: no __all__; list the names the module exports"
    assert isinstance(exported, (list, tuple)) and all(isinstance(n, str) for n in exported), (
        f"{PATHS[module]}: __all__ must be a list of strings, not {exported!r}"
    )
    dupes = sorted({n for n in exported if list(exported).count(n) > 1})
    assert not dupes, f"{PATHS[module]}: __all__ lists {dupes} more than once"
    missing = [n for n in exported if not hasattr(mod, n)]
    assert not missing, f"{PATHS[module]}: __all__ names {missing}, which the module does not have"
    unlisted = [n for n in _defined_public(module) if n not in exported and n not in UNLISTED.get(module, ())]
    assert not unlisted, (
        f"{PATHS[module]}: defines public {unlisted} but leaves them out of __all__; "
        "add them, or make them private (a leading underscore)"
    )


# -- layers -------------------------------------------------------------------------------------

#: Layer of each package (or top-level module): a module may import its own package and lower
#: layers. Packages of one rank may import each other (server and client do not: see ALLOWED).
RANK = {
    "kvd.records": 0,
    "kvd.limits": 0,
    "kvd.errors": 0,
    "kvd.config": 0,
    "kvd.v1": 0,  # the wire's messages (who may use the gRPC stubs: NO_GRPC below)
    "kvd.ipc": 1,
    "kvd.memory": 2,
    "kvd.copy": 3,
    "kvd.pool": 4,
    "kvd.backends": 4,
    "kvd.daemon": 5,
    "kvd.handoff": 6,
    "kvd.rpc": 7,
    "kvd.server": 8,
    "kvd.client": 8,
    "kvd.engine": 9,
    "kvd.connectors": 9,
    "kvd.cli": 10,
    "kvd.demo": 10,  # launchers beside the CLI: `kvd demo`, the fault launcher (`kvd serve` with a fault)
    "kvd": 10,  # the package face
}

BOTTOM = ("kvd.records", "kvd.limits", "kvd.errors")
#: Side branches: what they may import instead of "every lower layer" (their own package always).
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvd.backends": (*BOTTOM, "kvd.memory", "kvd.copy", "kvd.ipc"),
    "kvd.client": (*BOTTOM, "kvd.config", "kvd.v1", "kvd.ipc", "kvd.memory", "kvd.copy", "kvd.pool.layout", "kvd.rpc"),
    # The reference engine is a client of kvd, but its colocated run (kvd.engine.local) holds
    # kvd's own pool in-process, and kvd.engine.device uses the CUDA helpers of kvd.memory.
    "kvd.engine": (*BOTTOM, "kvd.client", "kvd.pool", "kvd.memory"),
    "kvd.connectors": (*BOTTOM, "kvd.client", "kvd.pool.layout"),
}
#: Single imports across the layers, allowed by name: (importer, imported) -> the reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # The ticket server runs in the decode vLLM's process: bounded as the daemon's /metrics
    # server is, by the same one class (stdlib only below it).
    ("kvd.connectors.vllm_ticket_server", "kvd.ipc.http_server"): "the ticket server is bounded as the daemon's HTTP server is",
    # The backend setting is validated against the registry's table of names; the registry
    # imports only kvd.errors at module level (each backend's module lazily, when asked).
    ("kvd.config", "kvd.backends.registry"): "config checks backend names against the registry's table",
    # The ticket is itself a wire message: its pb <-> record conversions are kvd.rpc.convert's.
    ("kvd.handoff.ticket", "kvd.rpc.convert"): "the ticket is a wire message: converted by the rpc layer's codecs",
}
#: Core packages: no gRPC, no Prometheus (the rpc layer and the server own the wire and metrics).
CORE = ("kvd.records", "kvd.limits", "kvd.errors", "kvd.ipc", "kvd.memory", "kvd.copy", "kvd.pool", "kvd.backends", "kvd.daemon", "kvd.handoff")
NO_GRPC = ("grpc", "grpc_health", "grpc_reflection", "prometheus_client", "kvd.v1.kvd_pb2_grpc")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _package(module: str) -> str:
    """The key of RANK that ``module`` falls under (the longest match)."""
    return max((p for p in RANK if _within(module, p)), key=len)


def _violation(src: str, imp: Import) -> str | None:
    dst = imp.target
    if not dst.startswith("kvd") or _within(dst, _package(src)):
        return None
    if (src, dst) in EXCEPTIONS:
        return None
    if dst == "kvd" and imp.names == ("__version__",):
        return None  # the face's version string: importing any kvd module imports the face first anyway
    allowed = ALLOWED.get(_package(src))
    if allowed is not None:
        return None if any(_within(dst, a) for a in allowed) else f"{_package(src)} may import only {list(allowed)}"
    if RANK[_package(dst)] > RANK[_package(src)]:
        return f"{_package(dst)} is a layer above {_package(src)}"
    if _package(dst) == "kvd.client" and _package(src) == "kvd.server" or _package(dst) == "kvd.server" and _package(src) == "kvd.client":
        return "server and client stand side by side: neither imports the other"
    return None


def test_imports_point_down_the_layers() -> None:
    bad = []
    for m in MODULES:
        for imp in imports(m):
            why = _violation(m, imp)
            if why:
                bad.append(f"{PATHS[m].relative_to(ROOT.parent)}:{imp.line}: {m} imports {imp.target} ({why})")
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_core_has_no_grpc_or_prometheus() -> None:
    bad = [
        f"{PATHS[m].relative_to(ROOT.parent)}:{imp.line}: {m} imports {imp.target}"
        for m in MODULES
        if any(_within(m, c) for c in CORE)
        for imp in imports(m)
        if any(_within(imp.target, n) for n in NO_GRPC)
    ]
    assert not bad, "core modules that import gRPC or Prometheus:\n" + "\n".join(bad)


# -- cycles -------------------------------------------------------------------------------------


def _graph() -> dict[str, set[str]]:
    return {m: {i.target for i in imports(m) if i.runtime and i.target in PATHS and i.target != m} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each back edge a depth-first search meets (each cycle reported once)."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cyc = stack[stack.index(v):] + [v]
                if frozenset(cyc) not in seen:
                    seen.add(frozenset(cyc))
                    found.append(cyc)
            elif v not in state:
                dfs(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    """A negative control: the search is not blind."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(_graph())
    assert not found, "import cycles (module-level imports):\n" + "\n".join(" -> ".join(c) for c in found)
