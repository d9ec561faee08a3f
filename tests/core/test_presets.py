"""Presets: every named layout validates, has a stable fingerprint, and reproduces seed 004."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvd.errors import InvalidArgument, LayoutMismatch
from kvd.pool.layout import GroupKind, Layout
from kvd.pool.presets import PRESETS, load_layout, preset, preset_names

REPO = Path(__file__).resolve().parents[2]

# Seed 004: v2p lengths SGLang's unified pool reported (num_pages + 1 entries each).
SEED_004_V2P = {
    "gemma-4-31b-it-tp2": (2_065_601, 206_561),
    "gemma-4-e2b-it": (7_576_246, 3_788_123),
}


def _ratio(layout: Layout) -> float:
    """e_swa / e_full: per-token bytes of the swa group over the full group's."""
    return layout.entry_bytes(layout.group("swa")) / layout.entry_bytes(layout.group("full"))


def _with_group_field(layout: Layout, kind: str, **update: object) -> Layout:
    """A validated copy of ``layout`` with fields of the ``kind`` group replaced."""
    data = layout.model_dump(mode="json")
    for g in data["groups"]:
        if g["kind"] == kind:
            g.update(update)
    return Layout.model_validate(data)


# ---- every preset --------------------------------------------------------------------------


def test_expected_presets_exist() -> None:
    assert set(PRESETS) == {
        "tiny-hybrid",
        "gemma-4-31b-it-tp2",
        "gemma-4-e2b-it",
        "gpt-oss-20b",
        "qwen3.5-0.8b",
    }
    assert preset_names() == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_and_is_keyed_by_its_name(name: str) -> None:
    layout = preset(name)
    assert layout.name == name
    # Re-validating the dumped form gives an equal layout: nothing is lost or defaulted away.
    again = Layout.model_validate(layout.model_dump(mode="json"))
    assert again == layout
    assert again.fingerprint == layout.fingerprint
    assert layout.has(GroupKind.FULL)
    for g in layout.groups:
        assert layout.page_bytes(g) > 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_cites_a_source(name: str) -> None:
    src = preset(name).source
    assert src, f"{name} has no source"
    if name != "tiny-hybrid":
        assert "huggingface.co/" in src and "config.json" in src


def test_fingerprints_are_stable_and_distinct() -> None:
    fps = {name: layout.fingerprint for name, layout in PRESETS.items()}
    assert {name: layout.fingerprint for name, layout in PRESETS.items()} == fps
    assert all(len(fp) == 16 and int(fp, 16) >= 0 for fp in fps.values())
    assert len(set(fps.values())) == len(fps), f"two presets share a fingerprint: {fps}"


def test_derived_values_follow_each_layout_object() -> None:
    """Fingerprint and arena order are kept per layout object: a copy with another field gets
    its own, an equal copy the same, and they stay right past the cache's bound."""
    base = preset("tiny-hybrid")
    fp, order = base.fingerprint, base.arena_order()
    changed = base.model_copy(update={"page_size": 8})
    assert changed.fingerprint != fp and base.fingerprint == fp
    fewer = base.model_copy(update={"groups": tuple(g for g in base.groups if g.kind is not GroupKind.DRAFT)})
    assert [g.kind for g in fewer.arena_order()] == [GroupKind.STATE, GroupKind.SWA, GroupKind.FULL]
    assert base.arena_order() == order and len(order) == 4
    assert base.model_copy().fingerprint == fp
    many = [base.model_copy(update={"page_size": 4 + i}) for i in range(300)]
    assert len({x.fingerprint for x in many}) == 300
    assert base.fingerprint == fp and base.arena_order() == order
    assert Layout.model_validate(changed.model_dump(mode="json")).fingerprint == changed.fingerprint


def test_fingerprints_are_stable_across_processes() -> None:
    """The fingerprint goes on the wire: another interpreter (other hash seed) must agree."""
    code = (
        "import json; from kvd.pool.presets import PRESETS; "
        "print(json.dumps({n: l.fingerprint for n, l in PRESETS.items()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout) == {n: l.fingerprint for n, l in PRESETS.items()}


def test_name_and_source_are_not_part_of_the_fingerprint() -> None:
    base = preset("gpt-oss-20b")
    relabelled = base.model_copy(update={"name": "other", "source": "elsewhere"})
    assert relabelled.fingerprint == base.fingerprint
    base.require_compatible(relabelled)  # does not raise


def test_a_changed_copy_gets_its_own_fingerprint() -> None:
    # The digest is computed once per distinct layout; a copy with a changed field is another
    # layout, even when the original's digest was asked for first.
    base = preset("gpt-oss-20b")
    fp = base.fingerprint
    wider = base.model_copy(update={"page_size": base.page_size * 2})
    assert wider.fingerprint != fp and base.fingerprint == fp
    assert [g.kind for g in wider.arena_order()] == [g.kind for g in base.arena_order()]


# ---- tiny-hybrid: exact bytes ----------------------------------------------------------------


def test_tiny_hybrid_exact_bytes() -> None:
    t = preset("tiny-hybrid")
    assert t.dtype == "float32" and t.page_size == 4
    assert [g.name for g in t.arena_order()] == ["state", "swa", "draft", "full"]
    expect = {  # kind: (entry bytes, page size, page bytes)
        "full": (2 * 2 * (16 + 16) * 4, 4, 2048),
        "swa": (2 * 2 * (16 + 16) * 4, 4, 2048),
        "state": (1 * 64 * 4, 1, 256),
        "draft": (1 * 1 * (16 + 16) * 4, 8, 1024),
    }
    for kind, (entry, ps, page) in expect.items():
        g = t.group(kind)
        assert (t.entry_bytes(g), t.page_size_of(g), t.page_bytes(g)) == (entry, ps, page), kind
    assert t.group("swa").window == 32
    assert t.max_page_bytes == 2048


# ---- seed 004 checks -------------------------------------------------------------------------


def _sglang_pages_fit(layout: Layout, full_len: int, swa_len: int) -> bool:
    """Whether some byte budget T gives exactly the seed's page counts under SGLang's sizing.

    SGLang sizes each sub-pool as ``T // entry_bytes`` and its v2p table has one more entry.
    """
    e_full = layout.entry_bytes(layout.group("full"))
    e_swa = layout.entry_bytes(layout.group("swa"))
    n_full, n_swa = full_len - 1, swa_len - 1
    lo = max(n_full * e_full, n_swa * e_swa)
    hi = min((n_full + 1) * e_full, (n_swa + 1) * e_swa)  # exclusive
    return lo < hi


def test_gemma4_31b_tp2_is_ten_to_one() -> None:
    g = preset("gemma-4-31b-it-tp2")
    full_len, swa_len = SEED_004_V2P["gemma-4-31b-it-tp2"]
    assert _ratio(g) == pytest.approx(full_len / swa_len, rel=0.01)
    assert _ratio(g) == 10
    assert _sglang_pages_fit(g, full_len, swa_len)
    # The shape behind it: 10 full / 50 sliding layers, per-rank heads after TP2.
    full, swa = g.group("full"), g.group("swa")
    assert (full.num_layers, full.num_kv_heads, full.head_dim) == (10, 2, 512)
    assert (swa.num_layers, swa.num_kv_heads, swa.head_dim, swa.window) == (50, 8, 256, 1024)


def test_gemma4_31b_k_eq_v_stored_once_would_break_the_seed() -> None:
    """Guard the derivation: caching K only on the k_eq_v layers gives 20:1, not seed 004's 10:1."""
    g = preset("gemma-4-31b-it-tp2")
    k_only = _with_group_field(g, "full", v_head_dim=0)
    assert _ratio(k_only) == 20
    assert not _sglang_pages_fit(k_only, *SEED_004_V2P["gemma-4-31b-it-tp2"])


def test_gemma4_e2b_is_two_to_one() -> None:
    g = preset("gemma-4-e2b-it")
    full_len, swa_len = SEED_004_V2P["gemma-4-e2b-it"]
    assert _ratio(g) == 2
    assert full_len == 2 * swa_len
    assert _sglang_pages_fit(g, full_len, swa_len)
    assert (g.group("full").num_layers, g.group("swa").num_layers) == (7, 28)


def test_gpt_oss_20b_full_and_swa_are_equal() -> None:
    g = preset("gpt-oss-20b")
    full, swa = g.group("full"), g.group("swa")
    assert g.entry_bytes(full) == g.entry_bytes(swa) == 12 * 8 * (64 + 64) * 2
    assert g.page_bytes(full) == g.page_bytes(swa)
    assert swa.window == 128


def test_qwen35_state_slot_matches_gated_deltanet_bytes() -> None:
    q = preset("qwen3.5-0.8b")
    state, full = q.group("state"), q.group("full")
    temporal = 16 * 128 * 128 * 4  # float32 recurrent state per layer
    conv = (2 * 16 * 128 + 16 * 128) * (4 - 1) * 2  # bfloat16 conv state per layer
    assert q.entry_bytes(state) == 18 * (temporal + conv) == 19_537_920
    assert q.page_size_of(state) == 1
    assert q.entry_bytes(full) == 6 * 2 * (256 + 256) * 2
    assert not q.has("swa")


# ---- lookup errors ---------------------------------------------------------------------------


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(InvalidArgument) as exc:
        preset("nope")
    msg = str(exc.value)
    assert "'nope'" in msg
    for name in PRESETS:
        assert name in msg


def test_load_layout_unknown_name_and_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(InvalidArgument) as exc:
        load_layout(str(missing))
    msg = str(exc.value)
    assert str(missing) in msg and "gpt-oss-20b" in msg


# ---- load_layout -----------------------------------------------------------------------------


def test_load_layout_by_name_returns_the_preset() -> None:
    assert load_layout("gemma-4-e2b-it") is preset("gemma-4-e2b-it")


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3.5-0.8b"])
def test_load_layout_round_trips_yaml(tmp_path: Path, name: str) -> None:
    layout = preset(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(layout.model_dump(mode="json"), sort_keys=False))
    loaded = load_layout(str(path))
    assert loaded == layout
    assert loaded.fingerprint == layout.fingerprint
    assert loaded.source == layout.source


def test_load_layout_round_trips_json_and_pathlike(tmp_path: Path) -> None:
    layout = preset("gemma-4-31b-it-tp2")
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout.model_dump(mode="json")))
    loaded = load_layout(path)
    assert loaded == layout and loaded.fingerprint == layout.fingerprint


def test_load_layout_unparsable_yaml_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ngroups: [unclosed\n")
    with pytest.raises(InvalidArgument) as exc:
        load_layout(str(path))
    assert str(path) in str(exc.value)
    assert "YAML" in str(exc.value)


def test_load_layout_invalid_layout_carries_pydantic_message_and_path(tmp_path: Path) -> None:
    data = preset("tiny-hybrid").model_dump(mode="json")
    for g in data["groups"]:
        if g["kind"] == "swa":
            g["window"] = None  # a swa group must name its window
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InvalidArgument) as exc:
        load_layout(str(path))
    msg = str(exc.value)
    assert str(path) in msg
    assert "set window" in msg  # the validator's own words, passed through pydantic


def test_load_layout_rejects_unknown_fields_and_non_mappings(tmp_path: Path) -> None:
    data = preset("gpt-oss-20b").model_dump(mode="json")
    data["pagesize"] = 16  # typo: extra fields are forbidden
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps(data))
    with pytest.raises(InvalidArgument, match="pagesize") as exc:
        load_layout(str(typo))
    assert str(typo) in str(exc.value)

    listing = tmp_path / "list.yaml"
    listing.write_text("- full\n- swa\n")
    with pytest.raises(InvalidArgument, match="mapping") as exc:
        load_layout(str(listing))
    assert str(listing) in str(exc.value)


# ---- compatibility ---------------------------------------------------------------------------


def test_require_compatible_names_the_differing_head_dim() -> None:
    base = preset("tiny-hybrid")
    other = _with_group_field(base, "swa", head_dim=32)
    assert other.fingerprint != base.fingerprint
    with pytest.raises(LayoutMismatch) as exc:
        base.require_compatible(other)
    msg = str(exc.value)
    assert "swa" in msg and "head_dim" in msg and "16" in msg and "32" in msg


def test_distinct_presets_are_incompatible() -> None:
    with pytest.raises(LayoutMismatch):
        preset("gemma-4-31b-it-tp2").require_compatible(preset("gemma-4-e2b-it"))
