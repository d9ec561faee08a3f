"""Daemon configuration: one validated model, read from a YAML/TOML file and ``KVD_*`` variables.

Precedence (highest first): explicit overrides (the CLI's flags), ``KVD_*`` environment
variables, the config file, the defaults below. Values computed at start-up (page counts,
capacities) live in the pool, never written back here.

Byte sizes accept ints or strings with binary units: ``"4GiB"``, ``"512MiB"``, ``"1048576"``.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from kvd.backends.registry import NAMES as BACKEND_NAMES

if TYPE_CHECKING:
    BackendName = str
else:
    #: "none" or a name of the backend registry: a Literal, so a wrong name is refused naming the
    #: choices and the JSON schema (the Helm chart's values schema) lists them as an enum.
    # (The choices are built first: a star inside the subscript is 3.11 syntax.)
    _BACKEND_CHOICES = ("none", *BACKEND_NAMES)
    BackendName = Literal[_BACKEND_CHOICES]

__all__ = ["Settings", "parse_bytes", "load_settings", "unknown_env"]

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(v: Any) -> int:
    """``4GiB`` -> 4294967296. Ints pass through. Refuses what it cannot read, saying why."""
    if isinstance(v, bool):
        raise ValueError(f"byte size must be a number or a string like '4GiB', got {v!r}")
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"byte size {v!r} is not understood; write e.g. 4GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class Settings(BaseSettings):
    """Everything ``kvd serve`` needs. Every field is documented; ``kvd serve --help`` prints them."""

    model_config = SettingsConfigDict(env_prefix="KVD_", extra="forbid", validate_default=True)

    layout: str = Field("tiny-hybrid", description="layout preset name or path to a layout YAML/JSON file")
    model: str | None = Field(
        None,
        description="path of a Hugging Face config.json (or its directory): the layout is derived from it "
        "(kvd.pool.models: full, sliding-window, Mamba2 / linear-attention state, MLA); replaces layout",
    )
    tp: int = Field(1, ge=1, le=1024, description="tensor-parallel degree of the engine rank this daemon serves (with model)")
    draft: str | None = Field(None, description="path of the draft model's config.json: its KV becomes the draft group (with model)")
    layout_from_engine: bool = Field(
        False,
        description="take the layout from the first engine that proposes one (ProposeLayout; kvd's vLLM connector "
        "does when it registers its KV caches) instead of `layout`, which is then only a placeholder: until then "
        "Allocate, Attach and GetInfo are FAILED_PRECONDITION; an engine proposing another layout is refused, naming both",
    )
    arena_bytes: int = Field(64 << 20, description="KV pool size in bytes (the backed size; with post_capture, the final size may be set later)")
    reserve_bytes: int | None = Field(None, description="address space to reserve (default: arena_bytes; post_capture: 4x arena_bytes)")
    post_capture: bool = Field(False, description="start with only the sink backed; the engine calls Finalize(bytes) after capturing its graphs")
    arena: Literal["shm", "cuda"] = Field(
        "shm",
        description="where the pool lives: shm (a shared-memory file, any host) or cuda (CUDA virtual memory on "
        "cuda_device, shared with engines as fds over handle_socket; needs a GPU and cuda-python)",
    )
    arena_dir: str = Field("/dev/shm", description="tmpfs directory holding the shared arena file (engines map it from here; arena=shm only)")
    arena_fallocate: bool = Field(
        True,
        description="arena=shm: take the backed pages from the tmpfs when backing them (at start, at Finalize), so a tmpfs "
        "without room for arena_bytes fails that with a clear error instead of a later write with SIGBUS -- in this "
        "daemon, its engine, or a sender daemon writing into it (about a second per GiB on a small VM); false: a "
        "sparse file, pages taken as they are first written",
    )
    group_access: bool = Field(
        False,
        description="let an engine running as another user of this daemon's group in: the arena file mode 0660 and "
        "the engine's Unix sockets (listen_unix, handle_socket) group-writable; else the arena file is 0600 and the "
        "sockets follow the umask (the engine runs as kvd's user or root)",
    )
    cuda_device: int = Field(0, ge=0, description="CUDA device index of the arena (arena=cuda; as this process numbers devices)")
    handle_socket: str | None = Field(
        None,
        description="Unix socket that passes the CUDA arena's fds to engines and peer daemons (arena=cuda only); "
        "default: <listen_unix>.handles, or <tmpdir>/kvd-<pid>-<random>.handles without a Unix listener",
    )
    peer_socket: str | None = Field(
        None,
        description="absolute path of the Unix socket on which a sending daemon of this host makes its calls of a "
        "handoff (CheckTicket, Commit, Heartbeat, AbortReceive) without gRPC (named in tickets; served when backend "
        "is not none); "
        "default: <listen_unix>.peer, or <tmpdir>/kvd-<pid>-<random>.peer without a Unix listener; '' turns it off "
        "(peers then call over gRPC only)",
    )
    listen_unix: str | None = Field("/tmp/kvd.sock", description="Unix socket path for engines ('' to disable)")
    fast_socket: bool = Field(
        True,
        description="also serve the engine-facing calls on <listen_unix>.fast: the same messages framed on a held Unix "
        "socket, several times cheaper per call than gRPC; clients connecting to unix:<listen_unix> use it when present "
        "(kvd.server.engine_socket). Needs listen_unix",
    )
    listen_tcp: str | None = Field(None, description="host:port for TCP (engines and peer daemons); port 0 picks one")
    advertise: str | None = Field(None, description="address peers use to reach this daemon (default: the TCP address, else the Unix socket)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 picks one; unset disables)")
    metrics_host: str = Field("127.0.0.1", description="interface for the metrics endpoint")
    backend: BackendName = Field(
        "none",
        description="data-plane backend for transfers: local (same host: maps the peer's arena, shm or cuda), "
        "mooncake (Mooncake Transfer Engine: RDMA where it finds HCAs, else TCP; arena=cuda needs its CUDA build "
        "`mooncake-transfer-engine`, checked at start-up, and MC_INTRANODE_NVLINK unset) or "
        "nixl (NIXL over UCX: cma on one host, tcp or RDMA across hosts; `pip install --no-deps nixl-cu12 nixl`); "
        "docs/backends.md says which to pick",
    )
    speculative: bool = Field(False, description="the engine runs speculative decoding: draft vectors must travel separately")
    transfer_host: str = Field("127.0.0.1", description="host the data-plane backend binds and advertises (mooncake)")
    peer_timeout_s: float = Field(1.0, gt=0, le=60, description="a sender silent this long fails its transfer; the decode engine learns at once")
    fence_s: float = Field(1.0, ge=0, le=60, description="after a sender goes silent, its pages stay pinned this long in case writes are still in flight")
    torch_threads: int | None = Field(
        1, ge=1, le=256,
        description="torch intra-op threads in the daemon (unset: torch's default). One keeps latency steady on shared "
        "hosts: measured on 2 cores with another process busy, 2 threads made 1M-id translation 22x slower",
    )
    session_ttl_s: float = Field(10.0, gt=0, le=3600, description="a client silent this long is dead: its leases are released and requests freed")
    lease_ttl_s: float = Field(10.0, gt=0, le=600, description="default lease TTL; holders renew before it runs out")
    sweep_interval_s: float = Field(0.2, gt=0, le=10, description="how often expired leases and dead sessions are reclaimed")
    grpc_keepalive_s: float = Field(
        10.0, gt=0, le=3600,
        description="the gRPC server pings each connection with calls in flight this often and drops one that does not "
        "answer within as long: a stopped or vanished client's calls end and free their threads (gRPC's default: 2 hours)",
    )
    max_request_bytes: int = Field(
        4 << 20, ge=2 << 20, le=64 << 20,
        description="the largest request the daemon reads, over gRPC and its sockets (more: RESOURCE_EXHAUSTED, unread). "
        "It bounds what a flood of calls can make the daemon hold (about six times this per call being read). Raise it "
        "for tickets of very long requests in small pages: a ticket names ~4 bytes per page of each group",
    )
    grace_s: float = Field(5.0, ge=0, le=300, description="on SIGTERM: seconds to drain in-flight calls before stopping")
    peer_token: str | None = Field(None, description="shared secret peer daemons must present (metadata kvd-token)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log verbosity")

    _size = field_validator("arena_bytes", "reserve_bytes", "max_request_bytes", mode="before")(lambda cls, v: None if v is None else parse_bytes(v))

    @field_validator("listen_unix", "listen_tcp", "handle_socket", mode="after")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None

    @field_validator("advertise", mode="after")
    @classmethod
    def _bracket_ipv6(cls, v: str | None) -> str | None:
        """A bare IPv6 address before the port gets its brackets: the Helm chart advertises
        ``$(POD_IP):<port>``, which on an IPv6 pod reads ``fd00::5:50051`` (the last colon is
        the port's); gRPC needs ``[fd00::5]:50051``. Anything else (a host name, IPv4, a
        bracketed address, ``unix:``/``dns:`` targets) is left as given."""
        if not v or v.startswith("[") or v.count(":") < 2:
            return v
        host, _, port = v.rpartition(":")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return v
        return f"[{host}]:{port}" if port.isdigit() else v

    @model_validator(mode="after")
    def _combinations(self) -> Settings:
        if not self.listen_unix and not self.listen_tcp:
            raise ValueError("no listener: set listen_unix (a socket path) or listen_tcp (host:port)")
        if self.model and "layout" in self.model_fields_set:
            raise ValueError(f"both model ({self.model!r}) and layout ({self.layout!r}) are set; give one of them")
        if not self.model and (self.tp != 1 or self.draft):
            raise ValueError("tp and draft describe a model config: set model (a config.json path) too, or drop them")
        if self.arena_bytes <= 0:
            raise ValueError("arena_bytes must be positive (e.g. 4GiB)")
        if self.reserve_bytes is not None and self.reserve_bytes < self.arena_bytes:
            raise ValueError(
                f"reserve_bytes ({self.reserve_bytes:,d}) is below arena_bytes ({self.arena_bytes:,d}); reserve at least the arena size"
            )
        if self.arena == "shm" and self.handle_socket:
            raise ValueError(
                "handle_socket passes CUDA arena fds; a shm arena is mapped by its file path: drop handle_socket "
                "or set arena=cuda"
            )
        if self.peer_socket and not self.peer_socket.startswith("/"):
            raise ValueError(
                f"peer_socket {self.peer_socket!r} must be an absolute path (it travels in tickets to another daemon, "
                "whose working directory differs), or '' to turn the peer socket off"
            )
        if self.listen_tcp and not re.fullmatch(r"\[?[\w.:-]*\]?:\d+", self.listen_tcp):
            raise ValueError(f"listen_tcp {self.listen_tcp!r} must be host:port, e.g. 127.0.0.1:50051")
        return self

    @property
    def reserved(self) -> int:
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        return self.arena_bytes * 4 if self.post_capture else self.arena_bytes

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_FILE.get("path")
        if path:
            if path.suffix in (".toml",):
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


_CONFIG_FILE: dict[str, Path] = {}


#: ``KVD_*`` variables that are not settings but are read here.
_ENV_EXTRA = frozenset({"KVD_CONFIG_FILE"})


def _known_env() -> frozenset[str]:
    return frozenset(f"KVD_{name.upper()}" for name in Settings.model_fields) | _ENV_EXTRA


def unknown_env(names: Iterable[str]) -> list[str]:
    """The ``KVD_*`` names (any case, as pydantic-settings reads them) among ``names`` that kvd
    does not read; other names are not kvd's business."""
    known = _known_env()
    return sorted(k for k in names if k.upper().startswith("KVD_") and k.upper() not in known)


def _refuse_unknown_env(environ: Mapping[str, str]) -> None:
    """InvalidArgument naming every ``KVD_*`` variable that is no setting (pydantic-settings
    ignores them: a typo such as ``KVD_LISTEN_TPC`` would leave the default in force unseen)."""
    import difflib

    from kvd.errors import InvalidArgument

    known = _known_env()
    unknown = unknown_env(environ)
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k.upper(), sorted(known), n=1)
        hints.append(f"{k} (did you mean {close[0]}?)" if close else k)
    raise InvalidArgument(
        f"unknown setting(s) in the environment: {', '.join(hints)}; every KVD_* variable must name a setting "
        "(`kvd serve --help` lists them) -- rename or unset it"
    )


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_file`` (YAML or TOML), ``KVD_*`` env and ``overrides`` (highest).
    ``KVD_CONFIG_FILE`` names a file when ``config_file`` is None."""
    import os

    from kvd.errors import InvalidArgument

    _refuse_unknown_env(os.environ)
    config_file = config_file or os.environ.get("KVD_CONFIG_FILE")
    if config_file:
        p = Path(config_file)
        if not p.is_file():
            raise InvalidArgument(f"config file {config_file!r} does not exist")
        if p.suffix not in (".yaml", ".yml", ".toml"):
            raise InvalidArgument(f"config file {config_file!r}: use a .yaml, .yml or .toml file")
        _CONFIG_FILE["path"] = p
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except Exception as exc:  # pydantic.ValidationError: reword as ours, keep pydantic's detail
        raise InvalidArgument(f"invalid configuration: {exc}") from exc
    finally:
        _CONFIG_FILE.clear()
