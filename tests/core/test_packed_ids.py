"""IndexVectors on the wire in both forms (repeated int32, or little-endian bytes): the same
record back, and a message that is neither refused in words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvd.errors import InvalidArgument
from kvd.records import IndexVectors
from kvd.rpc.convert import vectors_from_pb, vectors_to_pb
from kvd.v1 import kvd_pb2 as pb


def _vec(n_full: int, n_swa: int, n_draft: int, state: int | None = 3) -> IndexVectors:
    r = np.random.default_rng(n_full * 7 + n_swa)
    t = lambda n: torch.from_numpy(r.integers(0, 2**31 - 1, n).astype(np.int32))  # noqa: E731
    return IndexVectors("r", "boot", 5, 4096, t(n_full), 17, t(n_swa), state, t(n_draft))


def _same(a: IndexVectors, b: IndexVectors) -> bool:
    return (a.rid, a.boot_id, a.epoch, a.tokens, a.swa_first_page, a.state) == (b.rid, b.boot_id, b.epoch, b.tokens, b.swa_first_page, b.state) and all(
        torch.equal(getattr(a, g), getattr(b, g)) and getattr(b, g).dtype == torch.int32 for g in ("full", "swa", "draft")
    )


@pytest.mark.parametrize("shape", [(0, 0, 0), (1, 1, 1), (32, 8, 0), (33, 64, 5), (512, 256, 128)])
@pytest.mark.parametrize("state", [None, 0, 9])
def test_both_forms_read_back_as_the_record(shape, state):
    v = _vec(*shape, state=state)
    packed, plain = vectors_to_pb(v, packed=True), vectors_to_pb(v)
    assert not (packed.full or packed.swa or packed.draft) and len(packed.full_le) == 4 * shape[0]
    assert not (plain.full_le or plain.swa_le or plain.draft_le) and list(plain.full) == v.full.tolist()
    for m in (packed, plain):
        back = vectors_from_pb(pb.IndexVectors.FromString(m.SerializeToString()))
        assert _same(v, back)
        back.full.add_(1)  # the record owns writable memory
    # little-endian on the wire whatever the host: the bytes are the ids' int32 LE encoding
    assert packed.full_le == b"".join(int(x).to_bytes(4, "little", signed=True) for x in v.full.tolist())


def test_negative_ids_survive_packing():
    v = IndexVectors("r", "b", 0, 1, torch.tensor([-1, 0, 2**31 - 1], dtype=torch.int32), 0,
                     torch.tensor([], dtype=torch.int32), None, torch.tensor([-(2**31)], dtype=torch.int32))
    assert _same(v, vectors_from_pb(vectors_to_pb(v, packed=True)))


def test_a_vector_in_both_forms_is_refused():
    m = vectors_to_pb(_vec(4, 2, 1), packed=True)
    m.swa.extend([1, 2])
    with pytest.raises(InvalidArgument, match="both swa and swa_le are set; send one"):
        vectors_from_pb(m)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_bytes_that_are_no_whole_ids_are_refused(cut):
    m = vectors_to_pb(_vec(4, 2, 1), packed=True)
    m.draft_le = m.draft_le + b"\x00" * cut
    with pytest.raises(InvalidArgument, match=rf"draft_le holds {4 + cut} bytes, not a whole number of int32 ids"):
        vectors_from_pb(m)
