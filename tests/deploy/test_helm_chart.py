"""The Helm chart (helm/kvd) against kvd: its settings load through kvd's own loader, it names only
real KVD_* variables, its schema knows exactly kvd's fields; and, where a ``helm`` binary is on
PATH (.ci/run installs one), ``helm lint`` passes and ``helm template`` of several value sets
renders pods whose probes, ports, mounts and config agree with the settings kvd will load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import deploy_kit as K
import pytest
import yaml

from kvd.config import Settings
from kvd.pool.presets import load_layout
from kvd.v1 import kvd_pb2 as pb

ROLES = ("prefill", "decode")
HELM = shutil.which("helm")
helm_only = pytest.mark.skipif(HELM is None, reason="no helm binary on PATH (.ci/run installs one)")

_QUANTITY = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(q: str | int) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i?|k)?", str(q))
    assert m, f"not a Kubernetes byte quantity: {q!r}"
    return int(m.group(1)) * _QUANTITY[m.group(2) or ""]


def role_config(values: dict, role: str) -> dict:
    """kvd.config with the role's kvdConfig over it (what the kvd.config template merges)."""
    return {**values["kvd"]["config"], **(values["roles"][role].get("kvdConfig") or {})}


# ---- without helm -------------------------------------------------------------------------------


def test_chart_files_are_the_deploy_files():
    """One dashboard and one rule file: the chart's files/ are links to deploy/, not copies."""
    for name, target in (("kvd-dashboard.json", K.DASHBOARD), ("kvd-rules.yaml", K.RULES)):
        path = K.CHART / "files" / name
        assert path.is_symlink() and path.resolve() == target.resolve(), f"{path} should link to {target}"


def test_templates_name_only_real_kvd_variables():
    names = set()
    for path in (K.CHART / "templates").iterdir():
        names |= K.kvd_vars(path.read_text())
    assert names >= {"KVD_ADVERTISE", "KVD_TRANSFER_HOST", "KVD_PEER_TOKEN"}
    assert K.not_settings(names) == set()


@pytest.mark.parametrize("role", ROLES)
def test_default_settings_load_for_each_role(tmp_path, role):
    values = K.read_yaml(K.CHART / "values.yaml")
    s = K.settings_from(role_config(values, role), tmp_path, {"KVD_ADVERTISE": "10.0.0.7:50051", "KVD_TRANSFER_HOST": "10.0.0.7"})
    load_layout(s.layout)  # the preset exists
    assert s.listen_tcp == "0.0.0.0:50051" and s.metrics_host == "0.0.0.0" and s.metrics_port
    assert s.backend == "mooncake", "between pods only mooncake moves KV"
    assert s.peer_socket == "", "pods share no socket directory: peers call over gRPC"
    assert quantity(values["shm"]["sizeLimit"]) > s.reserved, "the tmpfs must hold the arena file"
    assert values["kvd"]["securityContext"]["runAsUser"] == 10001, "the image's user: the arena file is 0600"


def test_schema_knows_exactly_kvds_settings():
    schema = K.read_json(K.CHART / "values.schema.json")
    defs = schema["definitions"]
    cfg = defs["kvdSettings"]  # written once; kvd.config and each role's kvdConfig refer to it
    assert cfg["additionalProperties"] is False
    assert set(cfg["properties"]) == set(Settings.model_fields)
    for field in ("arena", "backend", "log_level"):
        assert set(cfg["properties"][field]["enum"]) == K.literal_choices(field), field
    ref = {"$ref": "#/definitions/kvdSettings"}
    assert ref in schema["properties"]["kvd"]["properties"]["config"]["allOf"]
    roles = schema["properties"]["roles"]["properties"]
    assert roles == {"prefill": {"$ref": "#/definitions/role"}, "decode": {"$ref": "#/definitions/role"}}
    assert ref in defs["role"]["properties"]["kvdConfig"]["allOf"]


# ---- with helm ----------------------------------------------------------------------------------

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "engine-monitoring": {
        "engine": {"image": {"repository": "registry.example/engine", "tag": "1.0"}, "command": ["python", "-m", "engine"],
                   "args": ["--kvd", "unix:/run/kvd/kvd.sock"], "ports": [{"name": "http", "containerPort": 8000}],
                   "resources": {"limits": {"memory": "64Gi"}}},
        "roles": {"prefill": {"replicas": 2, "engine": {"args": ["--role", "prefill"], "gpus": 2}},
                  "decode": {"kvdConfig": {"arena_bytes": "1536MiB", "grace_s": 30, "layout": "qwen3.5-0.8b"},
                             "engine": {"image": {"tag": "1.1"}}}},  # a part of the image only: the rest from engine
        "kvd": {"peerToken": {"secretName": "kvd-token"}},
        "proxy": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True, "enginePort": "http"}, "prometheusRule": {"enabled": True},
                    "grafanaDashboard": {"enabled": True}},
        "networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
                          "extraIngress": [{"ports": [{"port": 9999}]}]},
    },
    "decode-only-local-plain-container": {
        "engine": {"image": {"repository": "registry.example/engine", "tag": "1.0"}, "gpus": 0},
        "roles": {"prefill": {"enabled": False}},
        "kvd": {"config": {"backend": "local", "listen_tcp": "0.0.0.0:7000", "metrics_port": 7001, "listen_unix": "/sock/kvd.sock",
                           "arena_dir": "/arena"},
                "nativeSidecar": False, "advertisePodIP": False},
    },
}


def helm(*args: str, values: dict | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    argv = [HELM, *args, str(K.CHART)]
    if values is not None:
        assert tmp is not None
        f = tmp / f"values-{len(list(tmp.iterdir()))}.yaml"
        f.write_text(yaml.safe_dump(values))
        argv += ["-f", str(f)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def render(values: dict, tmp: Path) -> dict[str, list[dict]]:
    r = helm("template", "t1", "--namespace", "serving", values=values, tmp=tmp)
    assert r.returncode == 0, r.stderr
    out: dict[str, list[dict]] = defaultdict(list)
    for doc in yaml.safe_load_all(r.stdout):
        if doc:
            out[doc["kind"]].append(doc)
    return out


def merge(a: dict, b: dict) -> dict:
    """``b`` over ``a``, maps merged key by key (as helm merges values)."""
    return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()}}


def merged_values(overrides: dict) -> dict:
    return merge(K.read_yaml(K.CHART / "values.yaml"), overrides)


def role_engine(values: dict, role: str) -> dict:
    """The engine a role's pods run: ``engine`` with ``roles.<role>.engine`` over it."""
    return merge(values["engine"], values["roles"][role].get("engine", {}))


@helm_only
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint(tmp_path, name):
    r = helm("lint", "--strict", values=VALUE_SETS[name], tmp=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def _kvd_container(spec: dict) -> tuple[dict, bool]:
    """The kvd container and whether it runs as a native sidecar."""
    for c in spec.get("initContainers", []):
        if c["name"] == "kvd":
            return c, True
    return next(c for c in spec["containers"] if c["name"] == "kvd"), False


def _mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


@helm_only
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_pods_agree_with_the_settings_kvd_loads(tmp_path, name):
    values = merged_values(VALUE_SETS[name])
    objs = render(VALUE_SETS[name], tmp_path)
    roles = [r for r in ROLES if values["roles"][r]["enabled"]]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in objs["StatefulSet"]) == sorted(roles)
    config_maps = {cm["metadata"]["name"]: cm for cm in objs["ConfigMap"]}
    services = {svc["metadata"]["labels"]["app.kubernetes.io/component"]: svc for svc in objs["Service"]}
    loaded: dict = {}  # role -> the settings kvd loads
    for sts in objs["StatefulSet"]:
        role = sts["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = sts["spec"]["template"]
        spec = pod["spec"]
        assert sts["spec"]["replicas"] == values["roles"][role]["replicas"]
        assert pod["metadata"]["labels"].items() >= sts["spec"]["selector"]["matchLabels"].items()
        kvd, native = _kvd_container(spec)
        engine_on = bool(role_engine(values, role)["image"]["repository"])
        assert native == (values["kvd"]["nativeSidecar"] and engine_on)
        assert kvd.get("restartPolicy") == ("Always" if native else None)
        assert kvd["args"] == ["serve", "--config", "/etc/kvd/kvd.yaml"]

        # The settings kvd will run with: the ConfigMap's file plus the container's KVD_* env.
        volumes = {v["name"]: v for v in spec["volumes"]}
        cm = config_maps[volumes["kvd-config"]["configMap"]["name"]]
        file_cfg = yaml.safe_load(cm["data"]["kvd.yaml"])
        assert file_cfg == role_config(values, role), "the ConfigMap writes kvd.config + the role's kvdConfig, nothing else"
        env = {e["name"]: e.get("value", "<secret>") for e in kvd["env"]}
        assert K.not_settings(set(env)) == set()
        pod_ip = "10.1.2.3"
        s = loaded[role] = K.settings_from(file_cfg, tmp_path, {k: v.replace("$(POD_IP)", pod_ip) for k, v in env.items() if k.startswith("KVD_")})
        load_layout(s.layout)

        port = K.tcp_port(s.listen_tcp)
        ports = {p["name"]: p["containerPort"] for p in kvd["ports"]}
        assert ports["grpc"] == port and ports.get("metrics") == s.metrics_port
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert kvd[kind]["grpc"]["port"] == port, kind
        assert kvd["readinessProbe"]["grpc"]["service"] == pb.DESCRIPTOR.services_by_name["Kvd"].full_name
        assert "service" not in kvd["livenessProbe"]["grpc"]  # "": the server as a whole
        if values["kvd"]["advertisePodIP"]:
            assert s.advertise == f"{pod_ip}:{port}"
        if s.backend == "mooncake":
            assert s.transfer_host == pod_ip
            lo, hi = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
            assert sorted(p for n, p in ports.items() if n.startswith("mooncake-")) == list(range(lo, hi + 1))
        else:
            assert "MC_MIN_RPC_PORT" not in env and not any(n.startswith("mooncake-") for n in ports)
        assert ("KVD_PEER_TOKEN" in env) == bool(values["kvd"]["peerToken"]["secretName"])

        # The engine sees the daemon's sockets and arena at kvd's paths.
        assert volumes["kvd-shm"]["emptyDir"]["medium"] == "Memory"
        assert quantity(volumes["kvd-shm"]["emptyDir"]["sizeLimit"]) > s.reserved
        want = {"kvd-run": os.path.dirname(s.listen_unix), "kvd-shm": s.arena_dir}
        assert _mounts(kvd).items() >= want.items()
        engines = [c for c in spec["containers"] if c["name"] == "engine"]
        assert len(engines) == engine_on
        for engine in engines:
            image = role_engine(values, role)["image"]
            assert engine["image"] == f"{image['repository']}:{image['tag']}"
            assert _mounts(engine).items() >= want.items()
            gpus = values["roles"][role].get("engine", {}).get("gpus", values["engine"]["gpus"])
            assert engine.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == (gpus or None)
        assert spec["terminationGracePeriodSeconds"] >= s.grace_s + 10, "the drain must fit before SIGKILL"

        svc = services[role]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        engine_port = _engine_metrics_port(values, role)
        svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert {p["port"] for n, p in svc_ports.items() if n != "engine-metrics"} == set(ports.values())
        if engine_port is None:
            assert "engine-metrics" not in svc_ports
        else:  # the engine's own /metrics, for the ServiceMonitor's second endpoint
            assert svc_ports["engine-metrics"] == {"name": "engine-metrics", "port": engine_port,
                                                   "targetPort": values["metrics"]["serviceMonitor"]["enginePort"]}
            assert engine_port in {p["containerPort"] for c in engines for p in c.get("ports", [])}

    _check_network_policies(values, objs, loaded)

    monitoring = values["metrics"]
    assert len(objs.get("ServiceMonitor", [])) == monitoring["serviceMonitor"]["enabled"]
    for sm in objs.get("ServiceMonitor", []):
        label = sm["spec"]["jobLabel"]
        assert all(svc["metadata"]["labels"][label] == "kvd" for svc in services.values()), "rules select job=\"kvd\""
        sm_cfg = monitoring["serviceMonitor"]
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"] + (["engine-metrics"] if sm_cfg.get("enginePort") else [])
        assert {r["targetLabel"] for r in sm["spec"]["endpoints"][0]["relabelings"]} >= {"role"}
        for e in sm["spec"]["endpoints"][1:]:  # the engines: job "kvd-engine" (job="kvd" is the daemons', KvdDown's)
            assert e["path"] == sm_cfg["enginePath"] and {"targetLabel": "job", "replacement": "kvd-engine"} in e["relabelings"]
            assert {r["targetLabel"] for r in e["relabelings"]} >= {"job", "role", "pod"}
    assert len(objs.get("PrometheusRule", [])) == monitoring["prometheusRule"]["enabled"]
    for rule in objs.get("PrometheusRule", []):
        assert rule["spec"] == K.read_yaml(K.RULES)
    dashboards = [cm for cm in objs["ConfigMap"] if "kvd-dashboard.json" in cm["data"]]
    assert len(dashboards) == monitoring["grafanaDashboard"]["enabled"]
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"]["kvd-dashboard.json"]) == K.read_json(K.DASHBOARD)


def _engine_metrics_port(values: dict, role: str) -> int | None:
    """The containerPort of the engine port metrics.serviceMonitor.enginePort names in ``role``'s
    pods: None where the engines are not scraped."""
    sm = values["metrics"]["serviceMonitor"]
    engine = role_engine(values, role)
    if not (sm["enabled"] and sm.get("enginePort") and engine["image"]["repository"]):
        return None
    return next(p["containerPort"] for p in engine["ports"] if p["name"] == sm["enginePort"])


def _check_network_policies(values: dict, objs: dict[str, list[dict]], loaded: dict) -> None:
    """With networkPolicy.enabled, each role's pods admit kvd's ports from the release's pods, the
    metrics port from metricsFrom, the engine's ports, and extraIngress; nothing without it."""
    np = values["networkPolicy"]
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in objs.get("NetworkPolicy", [])}
    sets = {s["metadata"]["labels"]["app.kubernetes.io/component"]: s for s in objs["StatefulSet"]}
    assert set(policies) == (set(sets) if np["enabled"] else set())
    for role, pol in policies.items():
        sts = sets[role]
        spec = pol["spec"]
        assert spec["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"] and spec["policyTypes"] == ["Ingress"]
        s = loaded[role]  # the settings kvd loads for this role
        peers, *rest = spec["ingress"]
        # Every daemon pod of the release (either role) is a peer; nothing else is, by default.
        for other in sets.values():
            assert other["spec"]["template"]["metadata"]["labels"].items() >= peers["from"][0]["podSelector"]["matchLabels"].items()
        assert len(peers["from"]) == 1 + len(np["peersFrom"])
        want = [{"protocol": "TCP", "port": K.tcp_port(s.listen_tcp)}]
        if s.backend == "mooncake":
            mc = values["kvd"]["mooncakePorts"]
            want.append({"protocol": "TCP", "port": mc["min"], "endPort": mc["max"]})
        assert peers["ports"] == want
        metrics, *rest = rest
        scraped = [s.metrics_port] + ([] if _engine_metrics_port(values, role) is None else [_engine_metrics_port(values, role)])
        assert metrics["ports"] == [{"protocol": "TCP", "port": p} for p in scraped] and metrics.get("from", []) == np["metricsFrom"]
        engine = role_engine(values, role)
        if engine["image"]["repository"] and engine["ports"]:
            rule, *rest = rest
            assert rule["ports"] == [{"protocol": "TCP", "port": p["containerPort"]} for p in engine["ports"]]
        assert rest == np["extraIngress"]


@helm_only
@pytest.mark.parametrize("overrides,phrase", [
    ({"kvd": {"config": {"role": "prefill"}}}, "additional properties 'role' not allowed"),
    ({"kvd": {"config": {"backend": "ucx"}}}, "value must be one of 'none', 'local', 'mooncake', 'nixl'"),
    ({"roles": {"decode": {"kvdConfig": {"arena_size": "1GiB"}}}}, "additional properties 'arena_size' not allowed"),
    ({"kvd": {"config": {"listen_tcp": "127.0.0.1:50051"}}}, "is loopback"),
    ({"kvd": {"config": {"listen_tcp": "0.0.0.0:0"}}}, "with a fixed port"),
    ({"kvd": {"mooncakePorts": {"min": 17000, "max": 17000}}}, "give 2 to 16 ports"),
    ({"engine": {"image": {"repository": "e", "tag": "1"}, "ports": [{"name": "api", "containerPort": 8000}]},
      "metrics": {"serviceMonitor": {"enabled": True, "enginePort": "http"}}}, 'enginePort "http" names none of the prefill engine\'s ports'),
])
def test_helm_refuses_what_kvd_would_not_run(tmp_path, overrides, phrase):
    r = helm("template", "t1", values=overrides, tmp=tmp_path)
    assert r.returncode != 0 and phrase in r.stderr, r.stderr


_PARENT_POD = """\
{{- $kvd := dict "Values" .Values.kvd "role" "decode" "configMap" "my-engine-kvd" "appVersion" "0.1.0" }}
{{ include "kvd.configMap" $kvd }}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: my-engine
spec:
  selector: {matchLabels: {app: my-engine}}
  template:
    metadata: {labels: {app: my-engine}}
    spec:
      initContainers:
        {{- include "kvd.sidecar" $kvd | nindent 8 }}
      containers:
        - name: engine
          image: my-engine:1
          volumeMounts:
            {{- include "kvd.engineVolumeMounts" $kvd | nindent 12 }}
      volumes:
        {{- include "kvd.sidecarVolumes" $kvd | nindent 8 }}
"""


@helm_only
def test_an_engine_chart_adds_kvd_with_the_named_templates(tmp_path):
    """The usage _helpers.tpl documents: kvd as a dependency of an engine's chart, its pair off,
    the engine's own Deployment built with kvd.sidecar, kvd.engineVolumeMounts, kvd.sidecarVolumes
    and kvd.configMap."""
    parent = tmp_path / "my-engine"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: my-engine\nversion: 0.1.0\n")
    (parent / "values.yaml").write_text(yaml.safe_dump({"kvd": {
        "roles": {"prefill": {"enabled": False}, "decode": {"enabled": False}},
        "kvd": {"config": {"arena_bytes": "512MiB", "layout": "qwen3.5-0.8b"}},
    }}))
    (parent / "templates" / "deployment.yaml").write_text(_PARENT_POD)
    shutil.copytree(K.CHART, parent / "charts" / "kvd")  # links followed: what `helm package` ships
    r = subprocess.run([HELM, "template", "p", str(parent)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment"], "the pair's objects rendered too"
    cm, dep = sorted(docs, key=lambda d: d["kind"])
    s = K.settings_from(yaml.safe_load(cm["data"]["kvd.yaml"]), tmp_path)
    assert (s.arena_bytes, s.layout) == (512 << 20, "qwen3.5-0.8b")
    spec = dep["spec"]["template"]["spec"]
    kvd, native = _kvd_container(spec)
    assert native and kvd["restartPolicy"] == "Always"
    assert kvd["readinessProbe"]["grpc"]["port"] == K.tcp_port(s.listen_tcp)
    assert {v["name"] for v in spec["volumes"]} == {"kvd-config", "kvd-tmp", "kvd-run", "kvd-shm"}
    assert spec["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert _mounts(spec["containers"][0]) == {"kvd-run": "/run/kvd", "kvd-shm": "/dev/shm"}


DAEMONSET = {
    "mode": "daemonset",
    "daemonset": {"kvdConfig": {"arena_bytes": "4GiB", "tp": 2, "model": "/models/gemma/config.json"},
                  "nodeSelector": {"nvidia.com/gpu.present": "true"}},
    "metrics": {"serviceMonitor": {"enabled": True}},
}


@helm_only
def test_daemonset_mode_one_kvd_per_node_over_a_hostpath_socket(tmp_path):
    assert helm("lint", "--strict", values=DAEMONSET, tmp=tmp_path).returncode == 0
    objs = render(DAEMONSET, tmp_path)
    assert "StatefulSet" not in objs, "daemonset mode brings no engine pods"
    (ds,) = objs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    kvd = next(c for c in spec["containers"] if c["name"] == "kvd")
    (cm,) = objs["ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["kvd.yaml"])
    values = merged_values(DAEMONSET)
    expect = {**values["kvd"]["config"], **DAEMONSET["daemonset"]["kvdConfig"]}
    del expect["layout"]  # the model's config.json replaces it
    assert cfg == expect
    env = {e["name"]: e.get("value", "") for e in kvd["env"] if e["name"].startswith("KVD_")}
    s = K.settings_from(cfg, tmp_path, {k: v.replace("$(POD_IP)", "10.1.2.3") for k, v in env.items()})
    assert (s.model, s.tp) == ("/models/gemma/config.json", 2)
    # The socket's directory and the arena's are the node's, at the paths the settings name.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = _mounts(kvd)
    assert volumes["kvd-run"]["hostPath"]["path"] == "/run/kvd" and mounts["kvd-run"] == os.path.dirname(s.listen_unix)
    assert volumes["kvd-shm"]["hostPath"]["path"] == "/dev/shm/kvd" and mounts["kvd-shm"] == s.arena_dir
    init = next(c for c in spec["initContainers"] if c["name"] == "kvd-hostpath")
    assert "chown 10001:10001" in init["command"][-1]
    assert kvd["securityContext"]["runAsNonRoot"] is True
    # Probes on kvd's gRPC health, at the port it listens on.
    port = int(s.listen_tcp.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kvd[probe]["grpc"]["port"] == port, probe
    assert kvd["readinessProbe"]["grpc"]["service"] == "kvd.v1.Kvd"
    # The ServiceMonitor scrapes the node daemons' Service.
    (svc,) = objs["Service"]
    (sm,) = objs["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["metrics"] == s.metrics_port
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    bad = helm("template", "t1", values={**DAEMONSET, "daemonset": {"kvdConfig": {"listen_unix": ""}}}, tmp=tmp_path)
    assert bad.returncode != 0 and "listen_unix must be set" in bad.stderr


def _proxy_config(objs: dict[str, list[dict]]):
    """The proxy Deployment's container and the configuration kvd's own CLI makes of its command."""
    import argparse

    from kvd import cli
    from kvd.connectors.vllm_proxy import ProxyConfig

    (dep,) = [d for d in objs["Deployment"] if d["metadata"]["labels"]["app.kubernetes.io/component"] == "proxy"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    cli._proxy_parser(parser.add_subparsers(dest="cmd"))
    assert c["command"][:2] == ["kvd", "proxy"]
    args = parser.parse_args(c["command"][1:] + c["args"])
    return dep, c, args, ProxyConfig(args.prefill, args.decode, args.tickets, prefill_timeout_s=args.prefill_timeout)


@helm_only
def test_the_proxy_is_given_every_pod_of_both_roles(tmp_path):
    """proxy.enabled: a Deployment whose command kvd's CLI parses, naming each pod of both roles by
    its stable DNS name (StatefulSet pod <sts>-<i> under the role's headless Service), each decode
    pod with its ticket URL; a Service in front and its metrics port for the ServiceMonitor."""
    pytest.importorskip("aiohttp")
    objs = render({"proxy": {"enabled": True, "ticketPort": 8301}, "roles": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}},
                   "metrics": {"serviceMonitor": {"enabled": True}}}, tmp_path)
    dep, c, args, cfg = _proxy_config(objs)
    sts = {s["metadata"]["labels"]["app.kubernetes.io/component"]: s for s in objs["StatefulSet"]}
    for role, urls, n in (("prefill", cfg.prefill, 2), ("decode", cfg.decode, 3)):
        name, svc = sts[role]["metadata"]["name"], sts[role]["spec"]["serviceName"]
        assert urls == [f"http://{name}-{i}.{svc}.serving.svc:8000" for i in range(n)]
    assert cfg.tickets == [u.replace(":8000", ":8301") for u in cfg.decode]
    assert args.listen == "0.0.0.0:8000" and c["ports"] == [{"name": "http", "containerPort": 8000}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["securityContext"]["readOnlyRootFilesystem"] is True
    (svc,) = [s for s in objs["Service"] if s["metadata"]["labels"]["app.kubernetes.io/component"] == "proxy"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 80, "metrics": 8000}
    (sm,) = objs["ServiceMonitor"]
    assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    # no role's pods are selected by the proxy's Service, and the proxy's by no role's
    for s in objs["Service"]:
        if s is not svc:
            assert s["spec"]["selector"]["app.kubernetes.io/component"] != "proxy"


@helm_only
def test_the_proxy_takes_given_urls_and_refuses_half_of_them(tmp_path):
    pytest.importorskip("aiohttp")
    given = {"proxy": {"enabled": True, "prefill": ["http://p0:8000"],
                       "decode": [{"url": "http://d0:8000", "tickets": "http://d0:8201"}, {"url": "http://d1:8000", "tickets": "http://d1:8201"}]},
             "mode": "daemonset"}
    _, _, _, cfg = _proxy_config(render(given, tmp_path))
    assert (list(cfg.prefill), list(cfg.decode), list(cfg.tickets)) == (["http://p0:8000"], ["http://d0:8000", "http://d1:8000"],
                                                                        ["http://d0:8201", "http://d1:8201"])
    for values, phrase in (({"proxy": {"enabled": True, "prefill": ["http://p0:8000"]}}, "give both proxy.prefill and proxy.decode"),
                           ({"proxy": {"enabled": True}, "mode": "daemonset"}, "mode daemonset runs no engines"),
                           ({"proxy": {"enabled": True}, "roles": {"decode": {"enabled": False}}}, "it needs prefill and decode pods"),
                           ({"proxy": {"enabled": True, "prefill": ["p0:8000"], "decode": []}}, "does not match")):
        r = helm("template", "t1", values=values, tmp=tmp_path)
        assert r.returncode != 0 and phrase in r.stderr, (phrase, r.stderr)


@helm_only
def test_a_network_policy_that_names_the_engines_callers_lets_the_proxy_in(tmp_path):
    values = {"proxy": {"enabled": True}, "engine": {"image": {"repository": "e", "tag": "1"}, "ports": [{"name": "http", "containerPort": 8000},
                                                                                             {"name": "tickets", "containerPort": 8201}]},
              "networkPolicy": {"enabled": True, "engineFrom": [{"podSelector": {"matchLabels": {"app": "router"}}}]}}
    objs = render(values, tmp_path)
    for np in objs["NetworkPolicy"]:
        (rule,) = [r for r in np["spec"]["ingress"] if {p["port"] for p in r.get("ports", [])} == {8000, 8201}]
        selectors = [f["podSelector"]["matchLabels"] for f in rule["from"]]
        assert {"app": "router"} in selectors
        assert any(s.get("app.kubernetes.io/component") == "proxy" for s in selectors)
