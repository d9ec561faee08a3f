"""The backends kvd knows, by name: each names its classes as ``"module:Class"``, imported only
when asked for, so this module (and :mod:`kvd.config`, which checks names against it) never
imports an implementation.

Adding a backend is one module -- a :class:`~kvd.backends.base.Backend` subclass that declares
its capabilities as class attributes (``name``, ``arena_kinds``, ``draft_vectors``,
``missing()``, ``startup_check()``, ``create()``) -- and one line in :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from kvd.backends.base import Backend

__all__ = ["BACKENDS", "NAMES", "backend_class", "backend_classes", "draft_capable", "make_backend"]

#: Backend names and their classes, one per kind of arena they register (the first: the
#: backend's class when no arena kind is given).
BACKENDS: dict[str, tuple[str, ...]] = {
    "local": ("kvd.backends.local:LocalBackend", "kvd.backends.local_cuda:CudaLocalBackend"),
    "mooncake": ("kvd.backends.mooncake:MooncakeBackend",),
    "nixl": ("kvd.backends.nixl:NixlBackend",),
}

#: The names, in the registry's order (what the ``backend`` setting accepts besides "none").
NAMES: tuple[str, ...] = tuple(BACKENDS)


def _choices(names: list[str]) -> str:
    """``'a', 'b' or 'c'``."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def backend_classes(name: str) -> list[type[Backend]]:
    """The classes of backend ``name`` (importing their modules needs none of their transports);
    Unavailable naming the choices for an unknown name."""
    if name not in BACKENDS:
        raise Unavailable(f"no transfer backend named {name!r}; choose {_choices(list(NAMES))}; docs/backends.md says which to pick")
    out = []
    for spec in BACKENDS[name]:
        module, _, cls = spec.partition(":")
        out.append(getattr(importlib.import_module(module), cls))
    return out


def backend_class(name: str, arena_kind: str | None = None) -> type[Backend]:
    """The class of backend ``name`` that registers arenas of ``arena_kind``
    (``Arena.handle().kind``; None: the backend's first class). Unavailable for an unknown name,
    InvalidArgument when no class of it registers that kind of arena."""
    classes = backend_classes(name)
    if arena_kind is None:
        return classes[0]
    for cls in classes:
        if arena_kind in cls.arena_kinds:
            return cls
    kinds = [k for cls in classes for k in sorted(cls.arena_kinds)]
    raise InvalidArgument(f"the {name} backend copies between {' or '.join(kinds)} arenas, not {arena_kind!r}")


def draft_capable() -> list[str]:
    """The names of the backends that carry a separate draft index vector (every class of them), sorted."""
    return sorted(n for n in NAMES if all(cls.draft_vectors for cls in backend_classes(n)))


def make_backend(
    name: str,
    *,
    host: str = "127.0.0.1",
    arena_kind: str = "shm",
    handle_endpoint: str = "",
    peer_token: str | None = None,
    locator: str = "",
    fetch_metadata: Callable[[str, str], bytes] | None = None,
) -> Backend:
    """A backend by name, for an arena of ``arena_kind`` (``Arena.handle().kind``): the class
    :func:`backend_class` picks, made by its :meth:`~kvd.backends.base.Backend.create` from what
    the daemon offers every backend (:class:`~kvd.backends.base.Wiring`); each takes what it needs.

    ``host`` is the address peers use to reach a mooncake backend. ``local`` depends on the kind
    of arena: ``"shm"`` maps peers' arena files; ``"cuda-vmm"`` imports peers' CUDA arenas over
    their handle sockets, advertising ``handle_endpoint`` (this daemon's handle socket) and
    presenting ``peer_token``. ``nixl`` advertises ``locator`` (this daemon's peer address) and
    fetches peers' agent metadata with ``fetch_metadata(locator, agent)`` (the daemon's peer link).
    Raises Unavailable for an unknown name or when the backend's packages are missing,
    InvalidArgument for an arena kind the backend does not register."""
    from kvd.backends.base import Wiring

    cls = backend_class(name, arena_kind)
    return cls.create(Wiring(host=host, handle_endpoint=handle_endpoint, peer_token=peer_token, locator=locator, fetch_metadata=fetch_metadata))
