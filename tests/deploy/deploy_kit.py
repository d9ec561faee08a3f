"""Helpers of the deployment tests (``test_deploy.py``, ``test_helm_chart.py``): where the files
are, kvd settings as kvd itself loads them, ``KVD_*`` names, PromQL names and matchers.

Not a test module; the tests import it as ``deploy_kit`` (pytest puts this folder on the path).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import typing
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvd.config import Settings, load_settings, unknown_env

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
IMAGE_CONFIG = REPO / "deploy" / "docker" / "kvd.yaml"
COMPOSE = REPO / "deploy" / "compose.yaml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
RULES = REPO / "deploy" / "prometheus" / "kvd-rules.yaml"
RULES_TESTS = REPO / "deploy" / "prometheus" / "kvd-rules.test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvd-dashboard.json"
CHART = REPO / "helm" / "kvd"

_KVD_VAR = re.compile(r"\bKVD_[A-Z0-9_]+\b")


def read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def kvd_vars(text: str) -> set[str]:
    """Every ``KVD_*`` name written in ``text``."""
    return set(_KVD_VAR.findall(text))


def not_settings(names: set[str]) -> set[str]:
    """The ``KVD_*`` names among ``names`` that kvd would refuse at start-up (kvd's own check)."""
    return set(unknown_env(names))


def settings_from(config: Mapping[str, Any] | None, tmp: Path, env: Mapping[str, str] | None = None) -> Settings:
    """Settings as ``kvd serve --config <file>`` builds them from ``config`` (written as YAML, the
    way the chart's ConfigMap and the image's file reach kvd) and ``env`` (``KVD_*`` variables).
    Other ``KVD_*`` variables of this process are hidden meanwhile."""
    path = None
    if config is not None:
        fd, name = tempfile.mkstemp(dir=tmp, prefix="kvd-", suffix=".yaml")
        os.close(fd)
        path = Path(name)
        path.write_text(yaml.safe_dump(dict(config)))
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVD_")}
    try:
        os.environ.update(env or {})
        return load_settings(str(path) if path else None)
    finally:
        for k in list(os.environ):
            if k.startswith("KVD_"):
                del os.environ[k]
        os.environ.update(saved)


def literal_choices(field: str) -> set[Any]:
    """The values a ``Literal`` field of Settings accepts."""
    return set(typing.get_args(Settings.model_fields[field].annotation))


def tcp_port(listen_tcp: str) -> int:
    return int(listen_tcp.rsplit(":", 1)[1])


# ---- PromQL ---------------------------------------------------------------------------------

#: Labels Prometheus adds at scrape time (targets, relabelling), not kvd.
TARGET_LABELS = {"job", "instance", "role", "pod", "namespace"}
_SELECTOR = re.compile(r"(?<![\w:])((?:kvd|process)_[a-z0-9_]+)\b(\s*\{[^}]*\})?")  # a daemon's or the proxy's (process_*: its ProcessCollector)
#: KvdConnector's counters in a vLLM engine's /metrics (kvd/connectors/vllm_stats.py)
_VLLM_SELECTOR = re.compile(r"(?<![\w:])(vllm:kvd_[a-z0-9_]+)\b(\s*\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_RECORDED = re.compile(r"\bkvd:[a-z0-9_:]+")


def rule_exprs() -> Iterator[tuple[str, str]]:
    """``(rule name, expr)`` of every rule in kvd-rules.yaml."""
    for group in read_yaml(RULES)["groups"]:
        for rule in group["rules"]:
            yield rule.get("record") or rule["alert"], rule["expr"]


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    """``(panel title, expr)`` of every query of the dashboard, template variables included."""
    dash = read_json(DASHBOARD)
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            yield f"${var['name']}", var["definition"]
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]


def exprs() -> list[tuple[str, str, str]]:
    """``(source, name, expr)`` of every rule and every dashboard query."""
    return [("rules", n, e) for n, e in rule_exprs()] + [("dashboard", n, e) for n, e in dashboard_exprs()]


Selector = tuple[str, list[tuple[str, str, str]]]


def _read(pattern: re.Pattern[str], expr: str) -> Iterator[Selector]:
    for m in pattern.finditer(expr):
        yield m.group(1), _MATCHER.findall(m.group(2) or "")


def selectors(expr: str) -> Iterator[Selector]:
    """``(metric name, [(label, op, value), ...])`` of each kvd_* (or process_*) selector in ``expr``."""
    return _read(_SELECTOR, expr)


def vllm_selectors(expr: str) -> Iterator[Selector]:
    """As :func:`selectors`, for each vllm:kvd_* selector (a vLLM engine's series, checked
    against real vLLM servers in tests/vllm/test_vllm_proxy.py)."""
    return _read(_VLLM_SELECTOR, expr)


class Scrape:
    """What some servers' /metrics showed: sample names, their label names and label values."""

    def __init__(self, texts: list[str]) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.labels: dict[str, set[str]] = defaultdict(set)
        self.values: dict[tuple[str, str], set[str]] = defaultdict(set)
        for text in texts:
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    self.labels[s.name].update(s.labels)
                    for k, v in s.labels.items():
                        self.values[(s.name, k)].add(v)


def check_selected(scrape: Scrape, where: str, expr: str, used: list[Selector], exporter: str) -> None:
    """AssertionError (naming ``where``) unless every series ``used`` selects in ``expr`` is in
    ``scrape`` with every label it matches (and every literal value it matches on), and every
    label ``expr`` groups by is one of theirs or a target's. ``exporter``: where the series come
    from, for the message."""
    labels_here = set(TARGET_LABELS) | {"le"}
    for metric, matchers in used:
        assert metric in scrape.labels, f"{where}: {metric} is not exported ({exporter})"
        labels_here |= scrape.labels[metric]
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            assert label in scrape.labels[metric], f"{where}: {metric} has no label {label!r}"
            if "$" in value:
                continue
            wanted = value.split("|") if op in ("=~", "!~") else [value]
            missing = set(wanted) - scrape.values[(metric, label)]
            assert not missing, f"{where}: {metric}{{{label}}} never takes {sorted(missing)}"
    unknown = grouping_labels(expr) - labels_here
    assert not unknown, f"{where}: groups by labels no selected series has: {sorted(unknown)}"


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for m in _GROUPING.finditer(expr) for label in m.group(1).split(",") if label.strip()}


def recorded_names(expr: str) -> set[str]:
    return set(_RECORDED.findall(expr))
