"""The deployment files against the code they deploy (no Docker, Prometheus or Grafana needed):

* every kvd_* series, label and label value that the Grafana dashboard and the Prometheus rules
  select exists in the /metrics scrape of real daemons after a handoff (Send and SendMany), or
  of a real ``kvd proxy`` (its kvd_proxy_* series);
* the Dockerfile runs real CLI commands, EXPOSEs the ports its settings listen on, and its
  HEALTHCHECK answers 0 against a serving daemon and 1 once it stopped;
* the image's settings file and compose's KVD_* variables load through kvd's own loader, and
  compose's Prometheus scrapes the ports the daemons serve metrics on;
* with promtool installed (Debian's prometheus package): the rules and Prometheus config check,
  and the rules' unit tests pass.

The Helm chart: ``test_helm_chart.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import deploy_kit as K
import pytest

import daemon_kit as dk  # noqa: E402
from handoff_kit import free_port  # noqa: E402

from kvd.cli import main as cli_main  # noqa: E402
from kvd.client import Client

# ---- the series the dashboard and the rules select ------------------------------------------


def _proxy_metrics(tmp: Path) -> str:
    """The /metrics of a ``kvd proxy`` just started (its instances' URLs lead nowhere: it exports
    every label value of its series from the start, and no request is needed for that)."""
    pytest.importorskip("aiohttp", reason="kvd proxy needs the proxy extra (aiohttp)")
    port, dead = free_port(), free_port()
    argv = [sys.executable, "-m", "kvd.cli", "proxy", "--listen", f"127.0.0.1:{port}", "--prefill", f"http://127.0.0.1:{dead}",
            "--decode", f"http://127.0.0.1:{dead}", "--tickets", f"http://127.0.0.1:{dead}"]
    with open(tmp / "proxy.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                return dk.scrape(port)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"kvd proxy did not answer /metrics: {(tmp / 'proxy.log').read_text()}") from None
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)


def _waits_over_grpc(t: dk.Target) -> None:
    """One more WaitReady over gRPC than the daemon blocks for (its series with code OK and
    UNAVAILABLE), and a WaitEnded while they block (refused too, then answered without a wait):
    the waits end as their transfers are aborted here."""
    import threading

    from kvd.handoff.inbox import inbox_of
    from kvd.server.service import GRPC_WAIT_SLOTS

    c = Client.connect(t.tcp, name="deploy-grpc-waits", transport="grpc")
    rids = [f"grpc-wait-{i}" for i in range(GRPC_WAIT_SLOTS + 1)]
    try:
        for r in rids:
            c.allocate_recv(r, 8)
        ths = [threading.Thread(target=c.wait_ready, args=(r, 10.0)) for r in rids]
        for th in ths:
            th.start()
        refused = 'kvd_rpc_duration_seconds_count{code="UNAVAILABLE",method="WaitReady"}'
        dk.wait_for(lambda: refused in dk.scrape(t.metrics_port), 10, "a WaitReady over gRPC refused")
        assert c.wait_ended(c.wait_ended(0, 0).cursor, 0.5).transfers == []  # refused for want of a slot, sent again
        refused = 'kvd_rpc_duration_seconds_count{code="UNAVAILABLE",method="WaitEnded"}'
        dk.wait_for(lambda: refused in dk.scrape(t.metrics_port), 10, "a WaitEnded over gRPC refused")
        for r in rids:
            inbox_of(t.node).abort_local(r, "the deploy test is done waiting")
        for th in ths:
            th.join(10)
    finally:
        c.close()


@pytest.fixture(scope="module")
def scrape(tmp_path_factory) -> K.Scrape:
    """A prefill and a decode daemon (in this process, backend local, metrics on) after one Send
    and one SendMany between them, and more waits over gRPC than the decode daemon blocks for,
    both scraped over HTTP; and a ``kvd proxy``."""
    root = tmp_path_factory.mktemp("deploy-metrics")
    sides = []
    try:
        for role in ("prefill", "decode"):
            (root / role).mkdir()
            sides.append(dk.start_inproc(root / role, backend="local", metrics_port=0))
        p, d = (Client.connect(t.unix, name=f"deploy-{t.kind}") for t in sides)
        try:
            tickets = {}
            for rid in ("one", "many"):
                p.allocate(rid, 40)
                d.allocate(rid, 40, receive=True)
                tickets[rid] = d.acquire_lease(rid, "recv").ticket
            assert p.send("one", tickets["one"]).nbytes > 0
            assert d.wait_ready("one", 5).nbytes > 0
            assert p.send_many([("many", tickets["many"])])[0].nbytes > 0
            assert d.wait_ready("many", 5).nbytes > 0
            _waits_over_grpc(sides[1])
            texts = [dk.scrape(t.metrics_port) for t in sides] + [_proxy_metrics(root)]
        finally:
            p.close()
            d.close()
    finally:
        for t in sides:
            dk.stop_inproc(t)
    return K.Scrape(texts)


@pytest.mark.parametrize("source,name,expr", K.exprs(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_every_selected_series_exists(scrape, source, name, expr):
    used = list(K.selectors(expr))
    assert used or "up{" in expr or K.recorded_names(expr) or any(K.vllm_selectors(expr)), f"{source} {name}: no kvd series in {expr!r}"
    K.check_selected(scrape, f"{source} {name}", expr, used, "kvd/server/metrics.py")


def test_recorded_series_are_recorded_before_use():
    recorded = {r["record"] for g in K.read_yaml(K.RULES)["groups"] for r in g["rules"] if "record" in r}
    for name, expr in K.rule_exprs():
        assert K.recorded_names(expr) <= recorded, f"{name} uses series no rule records: {K.recorded_names(expr) - recorded}"
    for title, expr in K.dashboard_exprs():
        assert not K.recorded_names(expr), f"dashboard panel {title!r} needs the recording rules loaded: use raw series"


def test_alerts_say_what_and_how_bad():
    alerts = [r for g in K.read_yaml(K.RULES)["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"KvdDown", "KvdPoolNearlyFull", "KvdTransferFailures", "KvdLeasesExpiring",
                                            "KvdLeasesStuck", "KvdSendLatencyHigh", "KvdProxyDown", "KvdProxyHandoffsFailing",
                                            "KvdProxyDecodeErrors", "KvdVllmHandoffsMissed", "KvdVllmReconnects", "KvdVllmLoadFailures"}
    for a in alerts:
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]


def test_dashboard_panels_filter_by_role_and_instance():
    dash = K.read_json(K.DASHBOARD)
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "role", "instance"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for metric, matchers in K.selectors(target["expr"]):
                got = {(label, value) for label, _, value in matchers}
                if metric.startswith("kvd_proxy_"):  # every proxy pod: $role and $instance list the daemons
                    assert ("role", "proxy") in got, f"{panel['title']}: {metric} does not select role=\"proxy\""
                    continue
                assert {("role", "$role"), ("instance", "$instance")} <= got, f"{panel['title']}: {metric} ignores $role/$instance"
            for metric, matchers in K.vllm_selectors(target["expr"]):  # engines: $instance lists the daemons
                assert ("role", "$role") in {(label, value) for label, _, value in matchers}, f"{panel['title']}: {metric} ignores $role"


# ---- the image --------------------------------------------------------------------------------


def _instructions() -> dict[str, list[str]]:
    """Dockerfile instruction -> arguments of each occurrence (continuation lines joined)."""
    out: dict[str, list[str]] = defaultdict(list)
    for line in K.DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out[word.upper()].append(rest.strip())
    return out


def _image_env() -> dict[str, str]:
    """ENV of the runtime stage (the last FROM), as ``KEY=value`` pairs."""
    text = K.DOCKERFILE.read_text().replace("\\\n", " ")
    last = text[text.rindex("\nFROM "):]
    env = {}
    for line in last.splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                k, _, v = pair.partition("=")
                env[k] = v
    return env


def test_image_runs_real_cli_commands(capsys):
    ins = _instructions()
    entry, cmd = json.loads(ins["ENTRYPOINT"][-1]), json.loads(ins["CMD"][-1])
    assert entry == ["kvd"]
    pyproject = (K.REPO / "pyproject.toml").read_text()
    assert 'kvd = "kvd.cli:main"' in pyproject, "the kvd console script moved"
    with pytest.raises(SystemExit) as info:
        cli_main([*cmd, "--help"])
    assert info.value.code == 0
    assert "Run a kvd daemon" in capsys.readouterr().out


def test_image_exposes_the_ports_its_settings_serve(tmp_path):
    env = _image_env()
    assert env["KVD_CONFIG_FILE"] == "/etc/kvd/kvd.yaml"
    assert "COPY deploy/docker/kvd.yaml /etc/kvd/kvd.yaml" in K.DOCKERFILE.read_text()
    s = K.settings_from(K.read_yaml(K.IMAGE_CONFIG), tmp_path)
    mooncake = range(int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]) + 1)
    exposed = set()
    for arg in _instructions()["EXPOSE"][-1].split():
        lo, _, hi = arg.partition("-")
        exposed |= set(range(int(lo), int(hi or lo) + 1))
    assert exposed == {K.tcp_port(s.listen_tcp), s.metrics_port, *mooncake}
    assert len(mooncake) >= 2, "Mooncake draws a handshake and a data port from the range"
    assert s.listen_tcp.startswith("0.0.0.0:") and s.metrics_host == "0.0.0.0", "a container must listen beyond its loopback"
    assert s.listen_unix and s.listen_unix.startswith("/run/kvd/")
    assert K.not_settings(K.kvd_vars(K.DOCKERFILE.read_text())) == set(), "the Dockerfile names KVD_* variables kvd does not read"


def test_image_context_holds_what_the_dockerfile_copies():
    allowed = [ln for ln in (K.REPO / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    for arg in _instructions()["COPY"]:
        if arg.startswith("--from="):
            continue
        for src in arg.split()[:-1]:
            assert any(src.rstrip("/") == a[1:].rstrip("/") for a in allowed), f"COPY {src}: excluded by .dockerignore"


def test_image_healthcheck_answers_for_a_serving_daemon(tmp_path):
    """The HEALTHCHECK's own command, run against a real daemon: 0 while it serves, 1 once stopped.
    It runs every 10 s in the container, so it must stay cheap: it never imports torch (seconds
    of CPU each time; a sidecar held to one CPU spent a quarter of it on its health checks)."""
    hc = _instructions()["HEALTHCHECK"][-1]
    argv = json.loads(hc[hc.index("CMD ") + 4:])
    assert argv[:2] == ["python", "-c"]
    t = dk.start_inproc(tmp_path)
    config = tmp_path / "image.yaml"
    config.write_text(f"listen_unix: {t.unix.removeprefix('unix:')}\nlisten_tcp: {t.tcp}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env["KVD_CONFIG_FILE"] = str(config)

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-X", "importtime", "-c", argv[2]], env=env, capture_output=True, text=True,
                              timeout=60, cwd=K.REPO)

    try:
        ok = check()
        assert ok.returncode == 0, ok.stderr[-2000:]
        imported = {line.rsplit("|", 1)[1].strip() for line in ok.stderr.splitlines() if line.startswith("import time:")}
        assert "kvd.config" in imported and "torch" not in imported, "the health check imports torch"
    finally:
        dk.stop_inproc(t)
    down = check()
    assert down.returncode != 0


# ---- compose and its Prometheus ---------------------------------------------------------------


def _daemons() -> dict[str, dict]:
    services = K.read_yaml(K.COMPOSE)["services"]
    return {name: svc for name, svc in services.items() if svc.get("image") == "kvd:local"}


def test_compose_daemons_load_and_do_not_collide(tmp_path):
    daemons = _daemons()
    assert set(daemons) == {"kvd-prefill", "kvd-decode"}
    image_config = K.read_yaml(K.IMAGE_CONFIG)
    taken: dict[int, str] = {}
    for name, svc in daemons.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert K.not_settings(set(env)) == set(), f"{name} sets KVD_* variables kvd does not read"
        s = K.settings_from(image_config, tmp_path, {k: v for k, v in env.items() if k.startswith("KVD_")})
        assert s.backend == "mooncake" and s.arena == "shm"
        assert s.peer_socket == "", f"{name}: the containers share no socket directory (peer socket off)"
        assert s.listen_tcp.startswith("127.0.0.1:") and s.metrics_host == "127.0.0.1", f"{name}: host network, loopback only"
        ports = [K.tcp_port(s.listen_tcp), s.metrics_port, *range(int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]) + 1)]
        for port in ports:
            assert port not in taken, f"{name} and {taken.get(port)} both use port {port}"
            taken[port] = name


def test_compose_prometheus_scrapes_both_daemons_as_job_kvd(tmp_path):
    prom = K.read_yaml(K.PROMETHEUS)
    (job,) = prom["scrape_configs"]
    assert job["job_name"] == "kvd", "kvd-rules.yaml selects job=\"kvd\""
    scraped = {(c["labels"]["role"], t) for c in job["static_configs"] for t in c["targets"]}
    served = set()
    for name, svc in _daemons().items():
        s = K.settings_from(K.read_yaml(K.IMAGE_CONFIG), tmp_path, {k: str(v) for k, v in svc["environment"].items() if k.startswith("KVD_")})
        served.add((name.removeprefix("kvd-"), f"127.0.0.1:{s.metrics_port}"))
    assert scraped == served
    assert prom["rule_files"] == ["/etc/prometheus/kvd-rules.yaml"]
    mounts = K.read_yaml(K.COMPOSE)["services"]["prometheus"]["volumes"]
    assert "./prometheus/kvd-rules.yaml:/etc/prometheus/kvd-rules.yaml:ro" in mounts


# ---- promtool (Debian's prometheus package), where installed ----------------------------------

promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")


@promtool
def test_promtool_checks_rules_and_config(tmp_path):
    r = subprocess.run(["promtool", "check", "rules", str(K.RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    config = tmp_path / "prometheus.yml"
    config.write_text(K.PROMETHEUS.read_text().replace("/etc/prometheus/kvd-rules.yaml", str(K.RULES)))
    r = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@promtool
def test_promtool_rule_unit_tests_pass():
    r = subprocess.run(["promtool", "test", "rules", K.RULES_TESTS.name], capture_output=True, text=True, timeout=120,
                       cwd=K.RULES_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr
