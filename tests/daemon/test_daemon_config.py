"""Configuration: file (YAML/TOML), ``KVD_*`` environment, flags; refusals that say what to change."""

from __future__ import annotations

import os
import re
import socket
import threading

import pytest
from daemon_kit import rid

from kvd.cli import main as cli_main
from kvd.config import Settings, load_settings
from kvd.errors import FailedPrecondition, InvalidArgument
from kvd.server.app import Daemon, validate

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("KVD_"):
            monkeypatch.delenv(k)


def test_defaults():
    s = load_settings()
    assert (s.layout, s.arena_bytes, s.reserved, s.listen_unix, s.listen_tcp, s.metrics_port) == (
        "tiny-hybrid", 64 * MiB, 64 * MiB, "/tmp/kvd.sock", None, None,
    )


def test_environment_is_honoured_and_flags_win(monkeypatch):
    monkeypatch.setenv("KVD_ARENA_BYTES", "2MiB")
    monkeypatch.setenv("KVD_SESSION_TTL_S", "7.5")
    monkeypatch.setenv("KVD_POST_CAPTURE", "true")
    monkeypatch.setenv("KVD_LISTEN_TCP", "127.0.0.1:0")
    s = load_settings()
    assert (s.arena_bytes, s.session_ttl_s, s.post_capture, s.listen_tcp) == (2 * MiB, 7.5, True, "127.0.0.1:0")
    assert s.reserved == 8 * MiB  # post-capture reserves 4x by default
    assert load_settings(arena_bytes=3 * MiB, post_capture=False).arena_bytes == 3 * MiB


def test_env_value_that_does_not_parse_is_refused(monkeypatch):
    monkeypatch.setenv("KVD_ARENA_BYTES", "lots")
    with pytest.raises(InvalidArgument, match=r"byte size 'lots' is not understood; write e\.g\. 4GiB"):
        load_settings()


def test_a_kvd_variable_that_is_no_setting_is_refused_naming_the_closest(monkeypatch, capsys):
    """pydantic-settings ignores unknown prefixed variables: a typo would leave the default in
    force unseen. kvd refuses them, at load and at `kvd serve` (exit 2), before anything starts."""
    monkeypatch.setenv("KVD_LISTEN_TPC", "127.0.0.1:0")
    monkeypatch.setenv("kvd_arena_byte", "2MiB")  # names are case-insensitive, as pydantic reads them
    with pytest.raises(InvalidArgument) as exc:
        load_settings()
    msg = str(exc.value)
    assert "KVD_LISTEN_TPC (did you mean KVD_LISTEN_TCP?)" in msg and "kvd_arena_byte (did you mean KVD_ARENA_BYTES?)" in msg
    assert cli_main(["serve"]) == 2
    assert "KVD_LISTEN_TPC" in capsys.readouterr().err
    monkeypatch.delenv("KVD_LISTEN_TPC")
    monkeypatch.delenv("kvd_arena_byte")
    monkeypatch.setenv("KVD_CONFIG_FILE", "")  # the one KVD_* variable that is not a setting
    assert load_settings().arena_bytes == 64 * MiB


@pytest.mark.parametrize(
    ("given", "advertised"),
    [
        ("fd00::5:50051", "[fd00::5]:50051"),  # the chart's $(POD_IP):<port> on an IPv6 pod
        ("2001:db8::1:1:9000", "[2001:db8::1:1]:9000"),  # the last colon is the port's
        ("[fd00::5]:50051", "[fd00::5]:50051"),
        ("10.1.2.3:50051", "10.1.2.3:50051"),
        ("kvd-0.kvd.ns.svc:50051", "kvd-0.kvd.ns.svc:50051"),
        ("dns:///kvd.ns.svc:50051", "dns:///kvd.ns.svc:50051"),  # a gRPC target, not an address
        ("unix:/run/kvd/kvd.sock", "unix:/run/kvd/kvd.sock"),
    ],
)
def test_an_ipv6_pod_ip_is_advertised_in_brackets(monkeypatch, given, advertised):
    monkeypatch.setenv("KVD_ADVERTISE", given)
    assert load_settings().advertise == advertised


@pytest.mark.parametrize("suffix", ["yaml", "toml"])
def test_config_file(tmp_path, monkeypatch, suffix):
    f = tmp_path / f"kvd.{suffix}"
    if suffix == "yaml":
        f.write_text("arena_bytes: 3MiB\nlisten_tcp: '127.0.0.1:0'\nlease_ttl_s: 2\nlayout: qwen3.5-0.8b\nbackend: local\n")
    else:
        f.write_text('arena_bytes = "3MiB"\nlisten_tcp = "127.0.0.1:0"\nlease_ttl_s = 2\nlayout = "qwen3.5-0.8b"\nbackend = "local"\n')
    s = load_settings(str(f))
    assert (s.arena_bytes, s.listen_tcp, s.lease_ttl_s, s.layout, s.backend) == (3 * MiB, "127.0.0.1:0", 2.0, "qwen3.5-0.8b", "local")
    assert s.session_ttl_s == Settings.model_fields["session_ttl_s"].default  # untouched fields keep defaults
    monkeypatch.setenv("KVD_LEASE_TTL_S", "4")  # env beats the file...
    assert load_settings(str(f)).lease_ttl_s == 4.0
    assert load_settings(str(f), lease_ttl_s=5).lease_ttl_s == 5.0  # ...and flags beat env
    monkeypatch.setenv("KVD_CONFIG_FILE", str(f))  # the file named by the environment
    assert load_settings().arena_bytes == 3 * MiB
    monkeypatch.delenv("KVD_CONFIG_FILE")
    assert load_settings().arena_bytes == 64 * MiB  # a file never leaks into the next call


def test_config_file_refusals(tmp_path):
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_settings(str(tmp_path / "missing.yaml"))
    ini = tmp_path / "kvd.ini"
    ini.write_text("[kvd]\n")
    with pytest.raises(InvalidArgument, match=r"use a \.yaml, \.yml or \.toml file"):
        load_settings(str(ini))
    typo = tmp_path / "typo.yaml"
    typo.write_text("arena_byts: 3MiB\n")
    with pytest.raises(InvalidArgument, match="arena_byts"):
        load_settings(str(typo))


@pytest.mark.parametrize(
    "overrides,phrases",
    [
        (dict(listen_unix="", listen_tcp=""), ["no listener", "set listen_unix", "or listen_tcp"]),
        (dict(arena_bytes="4MiB", reserve_bytes="1MiB"), ["reserve_bytes (1,048,576) is below arena_bytes (4,194,304)", "reserve at least"]),
        (dict(arena_bytes=0), ["arena_bytes must be positive"]),
        (dict(arena_bytes="4 gigs"), ["is not understood; write e.g. 4GiB"]),
        (dict(listen_tcp="localhost"), ["must be host:port, e.g. 127.0.0.1:50051"]),
        (dict(backend="rdma"), ["backend", "'none', 'local', 'mooncake' or 'nixl'"]),
        (dict(session_ttl_s=0), ["session_ttl_s", "greater than 0"]),
    ],
    ids=["no-listener", "reserve-below-arena", "zero-arena", "bad-size", "tcp-without-port", "unknown-backend", "zero-ttl"],
)
def test_invalid_settings_refused_with_what_to_change(overrides, phrases):
    with pytest.raises(InvalidArgument) as info:
        load_settings(**overrides)
    msg = str(info.value)
    assert msg.startswith("invalid configuration")
    for phrase in phrases:
        assert phrase in msg, msg


@pytest.mark.parametrize(
    "overrides,phrase",
    [
        (dict(speculative=True, backend="none"), "cannot: set backend, or turn speculative off"),
        (dict(speculative=True, backend="local", layout="qwen3.5-0.8b"), "has no draft group; use a layout with a draft group"),
    ],
    ids=["backend-without-draft-vectors", "layout-without-draft-group"],
)
def test_speculative_combinations_refused_at_start(tmp_path, overrides, phrase):
    s = load_settings(listen_unix=str(tmp_path / "kvd.sock"), arena_dir=str(tmp_path), **overrides)
    with pytest.raises(InvalidArgument, match=re.escape(phrase)):
        validate(s)
    with pytest.raises(InvalidArgument, match=re.escape(phrase)):
        Daemon.start(s)
    assert sorted(os.listdir(tmp_path)) == []  # refused before the arena or the socket was made


def test_speculative_asks_the_backend_class_whether_it_carries_draft_vectors(tmp_path, monkeypatch):
    """The draft-vector refusal reads the class's capability (kvd.backends.registry), not a list of names."""
    from kvd.backends.local import LocalBackend

    s = load_settings(listen_unix=str(tmp_path / "kvd.sock"), arena_dir=str(tmp_path), speculative=True, backend="local")
    validate(s)
    monkeypatch.setattr(LocalBackend, "draft_vectors", False)
    with pytest.raises(InvalidArgument, match=r"draft vectors \(\['mooncake', 'nixl'\]\); backend='local' cannot"):
        validate(s)


def test_speculative_with_a_draft_capable_backend_starts(tmp_path):
    s = load_settings(listen_unix=str(tmp_path / "kvd.sock"), arena_bytes=MiB, speculative=True, backend="local")
    validate(s)
    d = Daemon.start(s)
    try:
        from kvd.client import Client

        with Client.connect(d.address) as c:
            info = c.info()
            v = c.allocate(rid(), 16)
        assert info.backend == "local" and "draft-vectors" in info.capabilities and v.draft.numel() == 2
    finally:
        d.stop(0)
    assert not os.path.exists(f"/dev/shm/{d.node.pool.arena.region_id}")


def test_serve_help_mentions_every_setting(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's wrapping
    for name, field in Settings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in text, name
        assert f"KVD_{name.upper()}" in text, name
        assert field.description and field.description.split(";")[0][:40] in text, name
    assert "--config FILE" in text


def test_serve_refuses_bad_flags_with_exit_status_2(capsys):
    assert cli_main(["serve", "--listen-unix", "", "--listen-tcp", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvd serve: InvalidArgument: invalid configuration") and "no listener" in err
    assert cli_main(["serve", "--arena-bytes", "4MiB", "--reserve-bytes", "1MiB", "--listen-unix", "/tmp/x.sock"]) == 2
    assert "reserve at least the arena size" in capsys.readouterr().err


# ---- arena=cuda (issue 6): refused on a host that cannot run it, saying what to change ----------


def test_cuda_arena_settings_and_their_refusals(tmp_path):
    s = load_settings(arena="cuda", cuda_device=1, listen_unix=str(tmp_path / "k.sock"))
    assert (s.arena, s.cuda_device, s.handle_socket) == ("cuda", 1, None)
    from kvd.server.app import handle_socket_path

    assert handle_socket_path(s) == str(tmp_path / "k.sock") + ".handles"
    assert handle_socket_path(load_settings(arena="cuda", handle_socket="/tmp/h.sock")) == "/tmp/h.sock"
    # arena=cuda with backend=mooncake is a valid configuration; whether the installed Mooncake
    # can carry it is decided at start-up (below).
    assert load_settings(arena="cuda", backend="mooncake").backend == "mooncake"
    tcp_only = handle_socket_path(load_settings(arena="cuda", listen_unix="", listen_tcp="127.0.0.1:0"))
    assert re.fullmatch(rf".*/kvd-{os.getpid()}-[0-9a-f]{{8}}\.handles", tcp_only)
    for overrides, phrase in [
        (dict(handle_socket="/tmp/h.sock"), "handle_socket passes CUDA arena fds"),
        (dict(arena="gpu"), "'shm' or 'cuda'"),
        (dict(arena="cuda", cuda_device=-1), "cuda_device"),
    ]:
        with pytest.raises(InvalidArgument, match=re.escape(phrase)):
            load_settings(**overrides)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_arena_without_cuda_is_refused_at_start_leaving_nothing(tmp_path):
    from kvd.errors import Unavailable

    s = load_settings(arena="cuda", listen_unix=str(tmp_path / "kvd.sock"), backend="local")
    with pytest.raises(Unavailable, match=r"arena=cuda needs a CUDA device, but torch.cuda.is_available\(\) is false.*set arena=shm"):
        Daemon.start(s)
    assert sorted(os.listdir(tmp_path)) == []  # no socket, no handle socket


def _pretend_cuda(monkeypatch, devices: int = 1) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


def test_cuda_arena_refusals_name_the_device_and_the_package(tmp_path, monkeypatch):
    import sys

    from kvd.memory import cuda as arena_cuda
    from kvd.errors import Unavailable

    _pretend_cuda(monkeypatch, devices=2)
    with pytest.raises(InvalidArgument, match=r"cuda_device=2 does not exist: this process sees 2 CUDA device\(s\).*set cuda_device below 2"):
        validate(load_settings(arena="cuda", cuda_device=2, listen_unix=str(tmp_path / "k.sock")))
    monkeypatch.setattr(arena_cuda, "_DRIVER", None)
    for mod in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, mod, None)  # cuda-python not installed
    with pytest.raises(Unavailable, match="needs the `cuda-python` package"):
        validate(load_settings(arena="cuda", listen_unix=str(tmp_path / "k.sock")))
    monkeypatch.setattr(arena_cuda, "driver", lambda: None)
    long_sock = str(tmp_path / ("x" * 110))
    with pytest.raises(InvalidArgument, match="set handle_socket \\(or listen_unix\\) to a shorter path"):
        validate(load_settings(arena="cuda", listen_unix=str(tmp_path / "k.sock"), handle_socket=long_sock))


# ---- backend=mooncake: the installed build and the transport variables, checked at start-up -------


def _mooncake_build():
    from kvd.backends.mooncake import build_info
    from kvd.errors import Unavailable

    try:
        return build_info()
    except Unavailable as exc:
        pytest.skip(f"mooncake is not installed here: {exc}")


def _no_mc_transport_env(monkeypatch) -> None:
    for k in ("MC_INTRANODE_NVLINK", "MC_TCP_PROTO"):
        monkeypatch.delenv(k, raising=False)


def test_arena_cuda_with_the_cpu_mooncake_build_is_refused_at_start_naming_the_cuda_build(tmp_path, monkeypatch):
    """The CPU-only wheel (what CI installs) would read device pointers as host memory: refused
    before the arena or a socket exists, with the command that installs the CUDA build."""
    from kvd.errors import Unavailable

    if _mooncake_build().cuda:
        pytest.skip("the installed Mooncake is the CUDA build: tests/gpu/test_mooncake_gpu.py runs it")
    _no_mc_transport_env(monkeypatch)
    s = load_settings(arena="cuda", backend="mooncake", listen_unix=str(tmp_path / "kvd.sock"))
    msg = (r"arena=cuda with backend=mooncake needs Mooncake's CUDA build, but this is the CPU-only build "
           r"\(mooncake.engine.SUPPORT_CUDA is False\).*pip uninstall -y mooncake-transfer-engine-non-cuda && "
           r"pip install mooncake-transfer-engine.*backend=local")
    with pytest.raises(Unavailable, match=msg):
        validate(s)
    with pytest.raises(Unavailable, match=msg):
        Daemon.start(s)
    assert sorted(os.listdir(tmp_path)) == []


def test_mooncake_transport_variables_kvd_cannot_run_with_are_refused_at_start(tmp_path, monkeypatch, capsys):
    """MC_INTRANODE_NVLINK (Mooncake's intra-node NVLink transport cannot register a VMM arena)
    with arena=cuda, whatever the build; MC_TCP_PROTO=1 (writes reported done before they
    landed) with any arena. ``kvd serve`` exits 2 with the message."""
    _mooncake_build()
    _no_mc_transport_env(monkeypatch)
    cuda = load_settings(arena="cuda", backend="mooncake", listen_unix=str(tmp_path / "kvd.sock"))
    shm = load_settings(backend="mooncake", listen_unix=str(tmp_path / "kvd.sock"), arena_dir=str(tmp_path))
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    with pytest.raises(InvalidArgument, match=r"MC_INTRANODE_NVLINK is set: .*cudaIpcGetMemHandle, which refuses CUDA "
                                              r"virtual memory.*unset MC_INTRANODE_NVLINK.*use backend=local"):
        Daemon.start(cuda)
    monkeypatch.delenv("MC_INTRANODE_NVLINK")
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    for s in (shm, cuda):
        with pytest.raises(InvalidArgument, match=r"MC_TCP_PROTO=1 .*legacy TCP framing.*unset MC_TCP_PROTO"):
            Daemon.start(s)
    assert cli_main(["serve", "--backend", "mooncake", "--listen-unix", str(tmp_path / "kvd.sock"),
                     "--arena-dir", str(tmp_path)]) == 2
    assert "MC_TCP_PROTO=1" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []


def test_attaching_a_cuda_arena_without_cuda_says_why():
    import torch

    from kvd.client.attach import _attach
    from kvd.errors import Unavailable
    from kvd.pool.presets import preset
    from kvd.v1 import kvd_pb2 as pb

    r = pb.AttachResponse(kind="cuda-vmm", path="/nonexistent.handles", backed_bytes=MiB, region_id="kvd-vmm-x",
                          layout_json=preset("tiny-hybrid").model_dump_json())
    if not torch.cuda.is_available():
        with pytest.raises(Unavailable, match=r"in GPU memory \(cuda-vmm\), but this process has no CUDA device"):
            _attach(r, "sid")
    r.kind = "nvme"
    with pytest.raises(InvalidArgument, match="arena kind 'nvme' is unknown to this client"):
        _attach(r, "sid")


# ---- the peer socket: where it lives, how it is turned off, refused when it cannot be -------------


def test_peer_socket_path_is_derived_set_or_off(tmp_path):
    from kvd.server.app import peer_socket_path

    s = load_settings(listen_unix=str(tmp_path / "k.sock"), backend="local")
    assert s.peer_socket is None and peer_socket_path(s) == str(tmp_path / "k.sock") + ".peer"
    assert peer_socket_path(load_settings(backend="local", peer_socket="/tmp/p.sock")) == "/tmp/p.sock"
    tcp_only = peer_socket_path(load_settings(backend="local", listen_unix="", listen_tcp="127.0.0.1:0"))
    assert re.fullmatch(rf".*/kvd-{os.getpid()}-[0-9a-f]{{8}}\.peer", tcp_only or "")
    assert peer_socket_path(load_settings(backend="local", peer_socket="")) is None  # off
    assert peer_socket_path(load_settings(backend="none")) is None  # receives no handoffs
    with pytest.raises(InvalidArgument, match="peer_socket 'off' must be an absolute path .* or '' to turn the peer socket off"):
        load_settings(backend="local", peer_socket="off")


def test_peer_socket_path_too_long_is_refused_at_start(tmp_path):
    long_sock = str(tmp_path / ("x" * 110))
    s = load_settings(listen_unix=str(tmp_path / "k.sock"), arena_dir=str(tmp_path), backend="local", peer_socket=long_sock)
    for start in (validate, Daemon.start):
        with pytest.raises(InvalidArgument, match=r"peer socket path .* set peer_socket \(or listen_unix\) to a shorter path"):
            start(s)
    assert sorted(os.listdir(tmp_path)) == []  # refused before the arena or any socket was made


def test_a_daemon_serves_its_peer_socket_until_it_stops(tmp_path):
    s = load_settings(listen_unix=str(tmp_path / "k.sock"), arena_bytes=MiB, backend="local")
    d = Daemon.start(s)
    path = str(tmp_path / "k.sock.peer")
    try:
        assert d.peer_socket is not None and d.peer_socket.path == path and os.path.exists(path)
    finally:
        d.stop(0)
    assert not os.path.exists(path)


# ---- a start-up that fails late undoes every step before it --------------------------------------


@pytest.fixture
def busy_port():
    """A loopback port that a listening socket of this test holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(family: socket.AddressFamily, address) -> bool:
    with socket.socket(family) as s:
        try:
            s.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            return True
    return False


class _Made:
    """The arenas and backends Daemon.start made (``arena=cuda``: a memfd arena stands in for the
    CUDA one, so the daemon serves its handle socket on the CPU too)."""

    def __init__(self, monkeypatch, arena: str) -> None:
        from memfd_kit import MemfdArena

        from kvd.server import app

        self.arenas: list = []
        self.backends: list = []
        make_arena, make_backend = app._make_arena, app.make_backend

        def arena_of(settings):
            a = MemfdArena(settings.reserved, settings.arena_bytes) if arena == "cuda" else make_arena(settings)
            self.arenas.append(a)
            return a

        def backend_of(*args, **kw):
            self.backends.append(make_backend(*args, **kw))
            return self.backends[-1]

        monkeypatch.setattr(app, "_make_arena", arena_of)
        monkeypatch.setattr(app, "make_backend", backend_of)
        if arena == "cuda":
            monkeypatch.setattr(app, "_check_cuda", lambda settings, handle_path: None)

    def arena_closed(self, a) -> bool:
        return a._fd < 0 if hasattr(a, "_fd") else not os.path.exists(a.path)


@pytest.mark.parametrize("busy", ["metrics_port", "listen_tcp"])
@pytest.mark.parametrize("arena", ["shm", "cuda"])
def test_a_start_that_fails_late_undoes_every_step_and_the_same_paths_start_again(tmp_path, monkeypatch, busy_port, arena, busy):
    """The metrics port in use fails the last step that can fail (after the arena, the handle
    socket, the gRPC listeners, the backend, the peer socket and the gRPC server started); the
    TCP port in use fails early. Either way the error names the port and the setting to change,
    nothing started stays (no socket file, nothing to connect to, the backend and the arena
    closed, no server thread), and the same paths start a daemon once the port is free."""
    from kvd.errors import FailedPrecondition, Unavailable

    made = _Made(monkeypatch, arena)
    unix = str(tmp_path / "k.sock")
    paths = [unix, unix + ".peer", *([unix + ".handles"] if arena == "cuda" else [])]
    tcp = _free_port()
    opts = dict(listen_unix=unix, listen_tcp=f"127.0.0.1:{tcp}", metrics_port=0, arena=arena, arena_bytes=MiB, backend="local")
    if busy == "metrics_port":
        opts["metrics_port"] = busy_port
        phrase = f"cannot serve metrics on 127.0.0.1:{busy_port}: Address already in use; set metrics_port to a free port"
    else:
        opts["listen_tcp"] = f"127.0.0.1:{busy_port}"
        phrase = f"could not bind listen_tcp=127.0.0.1:{busy_port}: address in use or not permitted; set listen_tcp to a free address"
    threads = set(threading.enumerate())
    with pytest.raises(Unavailable, match=re.escape(phrase)):
        Daemon.start(load_settings(**opts))

    left = [p for p in paths if os.path.exists(p) or not _refused(socket.AF_UNIX, p)]
    assert left == [], f"still there after the failed start: {left}"
    if busy == "metrics_port":  # the gRPC TCP listener was bound, then released
        assert _refused(socket.AF_INET, ("127.0.0.1", tcp))
        assert len(made.backends) == 1  # started, so closed again
    else:
        assert made.backends == []  # the TCP port is bound before the backend is made
    for b in made.backends:
        with pytest.raises(FailedPrecondition, match="backend is closed"):
            b.register(made.arenas[0])
    assert len(made.arenas) == 1 and made.arena_closed(made.arenas[0])
    servers = {"kvd-peer", "kvd-handle", "kvd-sweeper", "kvd-heartbeat"}
    assert [t.name for t in set(threading.enumerate()) - threads if t.name in servers] == []

    opts[busy] = 0 if busy == "metrics_port" else "127.0.0.1:0"
    d = Daemon.start(load_settings(**opts))
    try:
        assert all(os.path.exists(p) for p in paths) and d.metrics.port
        assert [(p, _refused(socket.AF_UNIX, p)) for p in paths] == [(p, False) for p in paths]
    finally:
        d.stop(0)
    assert not any(os.path.exists(p) for p in paths)
    assert all(made.arena_closed(a) for a in made.arenas)


def test_an_arena_its_tmpfs_cannot_hold_is_refused_at_start_leaving_nothing(tmp_path, kvd_shm_dir):
    # arena_bytes above what arena_dir's tmpfs has free: the start fails naming the directory, the
    # settings to change and the ways to give the tmpfs room; no socket, no arena file left.
    st = os.statvfs(kvd_shm_dir)
    too_much = 2 * st.f_bavail * st.f_frsize + (1 << 30)
    s = load_settings(arena_bytes=too_much, arena_dir=kvd_shm_dir, listen_unix=str(tmp_path / "kvd.sock"), backend="local")
    where = re.escape(kvd_shm_dir)
    with pytest.raises(FailedPrecondition, match=rf"arena_dir '{where}' cannot hold .*--shm-size.*arena_bytes"):
        Daemon.start(s)
    assert sorted(os.listdir(tmp_path)) == []
    assert os.listdir(kvd_shm_dir) == []
