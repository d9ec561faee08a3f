"""Layouts: a model's KV shape on one engine rank, validated, with derived byte sizes.

A :class:`Layout` is the one description both daemons of a handoff must agree on. It is a
frozen pydantic model; everything else (entry bytes, page bytes, the fingerprint) is derived
from it and never stored separately, so it can not drift.

Byte layout of one page of an attention group (page-major, every layer of the group)::

    page p of group g = arena[p * page_bytes : (p + 1) * page_bytes]
    ┌──────────┬──────────┬──────────┬──────────┬─────┐
    │ L0.K     │ L0.V     │ L1.K     │ L1.V     │ ... │   each block: page_size tokens
    │ ps*H*Dk  │ ps*H*Dv  │          │          │     │   x kv_heads x head_dim elements
    └──────────┴──────────┴──────────┴──────────┴─────┘

A state group holds one *slot* per request instead of pages: slot bytes are
``num_layers * state_elems * itemsize``, laid out layer after layer.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvd.errors import InvalidArgument, LayoutMismatch

__all__ = ["GroupKind", "GroupSpec", "Layout", "DTYPES", "ARENA_ORDER"]

#: dtypes a layout may name, with the torch dtype behind each.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


class GroupKind(str, enum.Enum):
    FULL = "full"  # full attention; the virtual-id owner
    SWA = "swa"  # sliding-window attention; binds the full group's virtual ids
    STATE = "state"  # Mamba / linear-attention state: one slot per request, not paged
    DRAFT = "draft"  # an independent draft model's KV, own ids and own page size


#: Order of the groups along the arena, low address to high. The first present group grows up
#: from the sink, the last grows down from the top, the ones between float (SGLang's tri-pool:
#: [mamba up | swa float | full down]). Full is last so that the id owner, usually the biggest
#: consumer, has the whole top end.
ARENA_ORDER: tuple[GroupKind, ...] = (GroupKind.STATE, GroupKind.SWA, GroupKind.DRAFT, GroupKind.FULL)

PositiveInt = Annotated[int, Field(gt=0)]


class GroupSpec(BaseModel):
    """One group of layers stored alike. Frozen; sizes are derived, never stored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GroupKind
    num_layers: PositiveInt = Field(description="layers stored in this group")
    num_kv_heads: int = Field(0, ge=0, description="KV heads per layer on this rank (attention groups)")
    head_dim: int = Field(0, ge=0, description="K head dim (attention groups)")
    v_head_dim: int | None = Field(None, ge=0, description="V head dim; defaults to head_dim")
    window: int | None = Field(None, gt=0, description="sliding window in tokens (swa only)")
    page_size: int | None = Field(None, gt=0, description="tokens per page; draft only, defaults to the layout's")
    state_elems: int = Field(0, ge=0, description="state elements per layer per slot (state only)")
    dtype: str | None = Field(None, description="element dtype; defaults to the layout's")

    @model_validator(mode="after")
    def _kind_fields(self) -> GroupSpec:
        k = self.kind
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"group {k.value}: dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if k is GroupKind.STATE:
            if self.state_elems <= 0:
                raise ValueError("group state: set state_elems (elements of state per layer per slot) > 0")
            if self.num_kv_heads or self.head_dim or self.window or self.page_size:
                raise ValueError("group state: is slot-granular; drop num_kv_heads/head_dim/window/page_size")
            return self
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"group {k.value}: set num_kv_heads > 0 and head_dim > 0")
        if self.state_elems:
            raise ValueError(f"group {k.value}: state_elems is for state groups only")
        if k is GroupKind.SWA and self.window is None:
            raise ValueError("group swa: set window (tokens each query attends back over)")
        if k is not GroupKind.SWA and self.window is not None:
            raise ValueError(f"group {k.value}: window is for swa groups only")
        if self.page_size is not None and k is not GroupKind.DRAFT:
            raise ValueError(f"group {k.value}: only the draft group may set its own page_size")
        return self

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def v_dim(self) -> int:
        """The V head dim in effect (``v_head_dim``, else ``head_dim``)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


class Layout(BaseModel):
    """A model's KV shape on one engine rank.

    ``groups`` holds at most one group of each kind and always a ``full`` group (the owner of
    virtual ids). Derived sizes: :meth:`entry_bytes`, :meth:`page_bytes`, :meth:`page_size_of`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="a label for humans; not part of the fingerprint")
    page_size: PositiveInt = Field(description="tokens per page of the target groups")
    dtype: str = Field("bfloat16", description=f"element dtype, one of {sorted(DTYPES)}")
    groups: tuple[GroupSpec, ...]
    source: str = Field("", description="where the shape comes from (public config URL, derivation)")

    @model_validator(mode="after")
    def _groups(self) -> Layout:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        kinds = [g.kind for g in self.groups]
        dup = {k.value for k in kinds if kinds.count(k) > 1}
        if dup:
            raise ValueError(f"groups: at most one group of each kind; {sorted(dup)} repeated")
        if GroupKind.FULL not in kinds:
            raise ValueError("groups: a full group is required (it owns the virtual page ids)")
        return self

    # ---- lookups -------------------------------------------------------------------------
    def group(self, kind: GroupKind | str) -> GroupSpec:
        kind = GroupKind(kind)
        for g in self.groups:
            if g.kind is kind:
                return g
        raise InvalidArgument(f"layout {self.name!r} has no {kind.value} group (it has {self.group_names})")

    def has(self, kind: GroupKind | str) -> bool:
        return any(g.kind is GroupKind(kind) for g in self.groups)

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def arena_order(self) -> list[GroupSpec]:
        """Groups in arena order (low address first); see :data:`ARENA_ORDER`."""
        return list(_arena_order(self))

    # ---- derived sizes -------------------------------------------------------------------
    def torch_dtype(self, g: GroupSpec) -> torch.dtype:
        return DTYPES[g.dtype or self.dtype]

    def itemsize(self, g: GroupSpec) -> int:
        return self.torch_dtype(g).itemsize

    def page_size_of(self, g: GroupSpec) -> int:
        """Tokens per page of ``g`` (1 for a state group: a slot is one "page")."""
        if g.kind is GroupKind.STATE:
            return 1
        return g.page_size or self.page_size

    def entry_bytes(self, g: GroupSpec) -> int:
        """Bytes one token occupies in ``g`` across all its layers (K row + V row per layer).

        For a state group: the bytes of one slot (all layers)."""
        it = self.itemsize(g)
        if g.kind is GroupKind.STATE:
            return g.num_layers * g.state_elems * it
        dv = g.v_dim
        return g.num_layers * g.num_kv_heads * (g.head_dim + dv) * it

    def page_bytes(self, g: GroupSpec) -> int:
        return self.page_size_of(g) * self.entry_bytes(g)

    @property
    def max_page_bytes(self) -> int:
        """Size of the sink: bytes ``[0, max_page_bytes)`` of the arena are never handed out."""
        return max(self.page_bytes(g) for g in self.groups)

    # ---- identity ------------------------------------------------------------------------
    def canonical(self) -> dict[str, Any]:
        """The fields that decide byte compatibility, with derived page bytes, in a stable form."""
        return {
            "page_size": self.page_size,
            "dtype": self.dtype,
            "groups": [
                {
                    **g.model_dump(mode="json", exclude_none=True),
                    # Spelled-out defaults must not change the fingerprint: normalise them.
                    "v_head_dim": g.v_dim,
                    "dtype": g.dtype or self.dtype,
                    "page_size": self.page_size_of(g),
                    "page_bytes": self.page_bytes(g),
                }
                for g in self.arena_order()
            ],
        }

    @property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of :meth:`canonical`; equal iff two ranks can swap KV bytes."""
        return _fingerprint(self)

    def require_compatible(self, other: Layout) -> None:
        """Raise :class:`LayoutMismatch` naming the first field that differs from ``other``."""
        a, b = self.canonical(), other.canonical()
        for key in ("page_size", "dtype"):
            if a[key] != b[key]:
                raise LayoutMismatch(f"layout mismatch: {key} {a[key]!r} here vs {b[key]!r} at the peer")
        ga = {g["kind"]: g for g in a["groups"]}
        gb = {g["kind"]: g for g in b["groups"]}
        if ga.keys() != gb.keys():
            raise LayoutMismatch(f"layout mismatch: groups {sorted(ga)} here vs {sorted(gb)} at the peer")
        for kind in ga:
            for field in sorted(set(ga[kind]) | set(gb[kind])):
                if ga[kind].get(field) != gb[kind].get(field):
                    raise LayoutMismatch(
                        f"layout mismatch: group {kind} {field} {ga[kind].get(field)!r} here vs "
                        f"{gb[kind].get(field)!r} at the peer"
                    )

    def describe(self) -> str:
        rows = [f"layout {self.name} page_size={self.page_size} dtype={self.dtype} fp={self.fingerprint}"]
        for g in self.arena_order():
            rows.append(
                f"  {g.name:6s} layers={g.num_layers:3d} entry={self.entry_bytes(g):>9,d} B "
                f"page={self.page_bytes(g):>11,d} B" + (f" window={g.window}" if g.window else "")
            )
        return "\n".join(rows)


# What a Send asks of a layout (its fingerprint, its groups in arena order), computed once per
# layout object: a frozen model's hash walks every field of every group (~1 us), too slow for a
# cache keyed by value on every call. Keyed by identity instead, the object itself kept in the
# entry so that its id can not be reused while the entry lives; a copy (``model_copy(update=...)``)
# is another object and computes its own. Bounded: a daemon sees a handful of layouts.
_DERIVED: dict[int, tuple[Layout, dict[str, Any]]] = {}
_DERIVED_MAX = 256


def _derived(layout: Layout) -> dict[str, Any]:
    hit = _DERIVED.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    if len(_DERIVED) >= _DERIVED_MAX:
        _DERIVED.clear()
    memo: dict[str, Any] = {}
    _DERIVED[id(layout)] = (layout, memo)
    return memo


def _fingerprint(layout: Layout) -> str:
    memo = _derived(layout)
    fp = memo.get("fingerprint")
    if fp is None:
        blob = json.dumps(layout.canonical(), sort_keys=True, separators=(",", ":")).encode()
        fp = memo["fingerprint"] = hashlib.sha256(blob).hexdigest()[:16]
    return str(fp)


def _arena_order(layout: Layout) -> tuple[GroupSpec, ...]:
    memo = _derived(layout)
    order = memo.get("order")
    if order is None:
        order = memo["order"] = tuple(layout.group(k) for k in ARENA_ORDER if layout.has(k))
    return tuple(order)
