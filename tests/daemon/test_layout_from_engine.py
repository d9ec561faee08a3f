"""A daemon started with ``layout_from_engine`` takes its layout from the first engine that
proposes one (ProposeLayout; kvd's vLLM connector does when it registers its KV caches) and
refuses an engine whose layout differs, naming both; a daemon started with a layout refuses a
different proposal the same way. Nothing is allocated or attached before a layout is set."""

from __future__ import annotations

import grpc
import pytest
from daemon_kit import expect, rid, start_inproc, stop_inproc

from kvd import errors as E
from kvd.pool.presets import preset

TINY = preset("tiny-hybrid")
OTHER = TINY.model_copy(update={"name": "tiny-hybrid-p32", "page_size": TINY.page_size * 2})


@pytest.fixture
def adopting(tmp_path):
    t = start_inproc(tmp_path, layout_from_engine=True)
    yield t
    stop_inproc(t)


def test_first_engine_sets_the_layout_and_a_different_one_is_refused_naming_both(adopting):
    first, second = adopting.connect(name="engine-1"), adopting.connect(name="engine-2")
    with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "ProposeLayout first"):
        first.allocate(rid(), 16)
    with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "layout_from_engine"):
        first.attach()
    with expect(E.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "layout_from_engine"):
        first.info()
    boot = adopting.node.pool.boot_id
    assert first.stats().layout_name == "(from the first engine)"  # not the placeholder's name

    info = first.propose_layout(OTHER)
    assert info.layout == OTHER and info.boot_id == boot
    assert first.info().layout.fingerprint == OTHER.fingerprint
    first.allocate(rid(), 16)  # allocations are served now, in the engine's layout
    assert first.stats().layout_name == "tiny-hybrid-p32"
    assert adopting.node.pool.layout.page_size == OTHER.page_size

    stats = adopting.node.stats()
    with expect(E.LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT, "page_size") as info:
        second.propose_layout(TINY)
    msg = str(info.value)
    assert "tiny-hybrid-p32" in msg and f"fp={TINY.fingerprint}" in msg and f"fp={OTHER.fingerprint}" in msg, msg
    assert adopting.node.pool.layout == OTHER and adopting.node.stats().pool == stats.pool  # the pool as it was
    assert second.propose_layout(OTHER).layout == OTHER  # the same layout again: accepted
    adopting.check()


def test_a_daemon_with_a_layout_refuses_another_naming_both(inproc):
    c = inproc.connect(name="engine")
    assert c.propose_layout(TINY).layout == TINY
    with expect(E.LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT, "the engine:") as info:
        c.propose_layout(OTHER)
    assert "tiny-hybrid-p32" in str(info.value) and "layout tiny-hybrid " in str(info.value)
    assert inproc.node.pool.layout == TINY


def test_a_proposal_that_is_no_layout_is_refused(adopting):
    from kvd.v1 import kvd_pb2 as pb

    c = adopting.connect(name="engine")
    with expect(E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "send Layout.model_dump_json()"):
        c._call("ProposeLayout", pb.ProposeLayoutRequest(layout_json='{"name": "x"}'), lambda r: r)
    assert adopting.node.layout_pending
