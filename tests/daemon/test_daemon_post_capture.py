"""Post-capture sizing over the wire: Finalize(bytes) backs the pool in place, Resize changes an
empty finalized pool, and every out-of-order or out-of-range call is refused with nothing changed
(DESIGN §2 "Post-capture sizing")."""

from __future__ import annotations

import copy

import grpc
import pytest
from daemon_kit import expect, rid, start_inproc, stop_inproc

from kvd import errors as E

C = grpc.StatusCode
MiB = 1 << 20


@pytest.fixture
def late(tmp_path):
    t = start_inproc(tmp_path, post_capture=True, arena_bytes=MiB)  # reserves 4 MiB, backs the sink
    yield t
    stop_inproc(t)


def refused(t, c, call, cls, code, phrase):
    before = t.node.stats()
    with expect(cls, code, phrase):
        call()
    assert t.node.stats() == before
    t.node.check()


def test_finalize_and_resize_in_place(late):
    t, c = late, late.connect(name="engine")
    info = c.info()
    st = c.stats()
    assert not info.finalized and not st.pool.finalized
    assert info.reserved_bytes == 4 * MiB and st.pool.backed_bytes == st.pool.sink_bytes
    assert all(e.backed_bytes == st.pool.sink_bytes and e.last_page < e.first_page for e in info.envelopes)  # nothing to register yet
    base = info.envelopes[0].base
    floor = t.node.pool.floor_bytes()

    refused(t, c, lambda: c.allocate(rid(), 8), E.NotFinalized, C.FAILED_PRECONDITION, "call finalize(bytes) first")
    refused(t, c, lambda: c.resize(MiB), E.NotFinalized, C.FAILED_PRECONDITION, "resize before finalize")
    refused(t, c, lambda: c.finalize(None), E.InvalidArgument, C.INVALID_ARGUMENT, "no byte count given")
    refused(t, c, lambda: c.finalize(0), E.InvalidArgument, C.INVALID_ARGUMENT, "must be a positive int, got 0")
    refused(t, c, lambda: c.finalize(4 * MiB + 1), E.InvalidArgument, C.INVALID_ARGUMENT, "more than the 4,194,304 reserved")
    refused(t, c, lambda: c.finalize(floor - 1), E.InvalidArgument, C.INVALID_ARGUMENT, "below the one-request floor")

    done = c.finalize(2 * MiB)
    assert done.finalized and done.epoch == info.epoch + 1
    assert {e.backed_bytes for e in done.envelopes} == {2 * MiB}
    assert {e.base for e in done.envelopes} == {base}  # backed in place: the base did not move
    assert all((e.last_page + 1) * e.page_bytes <= 2 * MiB for e in done.envelopes)
    assert c.info() == done and c.stats().pool.backed_bytes == 2 * MiB
    t.node.check()
    refused(t, c, lambda: c.finalize(2 * MiB), E.FailedPrecondition, C.FAILED_PRECONDITION, "already finalized")

    r = rid()
    c.allocate(r, 64)
    refused(t, c, lambda: c.resize(3 * MiB), E.FailedPrecondition, C.FAILED_PRECONDITION, "with 1 live allocations")
    c.free(r)
    freed_epoch = c.info().epoch
    assert freed_epoch == done.epoch + 1  # a free bumps the epoch: its pages may be reused
    refused(t, c, lambda: c.resize(8 * MiB), E.InvalidArgument, C.INVALID_ARGUMENT, "more than the 4,194,304 reserved")
    grown = c.resize(3 * MiB)
    assert {e.backed_bytes for e in grown.envelopes} == {3 * MiB} and {e.base for e in grown.envelopes} == {base}
    assert grown.epoch == freed_epoch + 1
    shrunk = c.resize(MiB)
    assert {e.backed_bytes for e in shrunk.envelopes} == {MiB} and {e.base for e in shrunk.envelopes} == {base}
    att = c.attach()
    try:
        assert att.tensor.numel() == MiB  # a new attach maps exactly the backed prefix
    finally:
        att.close()
    v = c.allocate(r, 64)
    assert v.epoch == shrunk.epoch and v.full.numel() == 16
    t.node.check()


def test_finalize_on_an_eager_daemon_is_refused(inproc):
    c = inproc.connect()
    before = copy.deepcopy(inproc.node.stats())
    with expect(E.FailedPrecondition, C.FAILED_PRECONDITION, "built eagerly"):
        c.finalize(MiB)
    with expect(E.FailedPrecondition, C.FAILED_PRECONDITION, "build it with post_capture=True"):
        c.resize(MiB)
    assert inproc.node.stats() == before



def test_a_finalize_its_tmpfs_cannot_hold_is_refused_with_nothing_changed(late, monkeypatch):
    # The arena's pages are taken when they are backed (arena_fallocate, the default): a Finalize
    # larger than the tmpfs has room for is FAILED_PRECONDITION saying what to change -- not a
    # SIGBUS in whichever process later writes past the tmpfs's room -- and once there is room
    # the same Finalize works.
    import os
    from types import SimpleNamespace

    t, c = late, late.connect(name="engine")
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=256, f_frsize=4096))  # 1 MiB free
    refused(t, c, lambda: c.finalize(2 * MiB), E.FailedPrecondition, C.FAILED_PRECONDITION,
            "cannot hold the arena's 2,097,152 backed bytes (1,048,576 bytes free there")
    assert not c.info().finalized
    monkeypatch.setattr(os, "statvfs", real)
    assert c.finalize(2 * MiB).finalized
    r = rid()
    c.allocate(r, 8)
    c.free(r)
    t.node.check()
