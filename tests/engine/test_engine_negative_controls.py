"""Negative controls: the accuracy check must catch a broken handoff.

Each fault is a buggy prefill daemon: ``kvd.engine.faults.install`` sets the sending daemon's
test-only hook so it plans its writes from edited destination vectors, after the genuine sealed
ticket passed every check -- the KV lands, in the wrong pages. Each test first shows the same
pair and workload pass without the fault (so a failure under the fault is the fault's doing),
then that the check flags the faulty run. A buggy *ticket* (the same edit made to the ticket's
bytes, through the prefill engine's test-only ``ticket_rewrite``) never gets that far: the decode
daemon refuses its seal and not a byte moves.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_kit import WINDOW, Pair, pd_pair, requests, run_pd

from kvd.engine.records import EngineConfig
from kvd.engine.faults import Fault, draft_scrambled, install, rewrite_vectors, swa_kernel_ids, swa_through_full_ids
from kvd.engine.reference import compare
from kvd.pool.layout import GroupKind

CFG = EngineConfig(chunk=16, spec_k=3)
LENGTHS = (20, 33, 36, 65, 100, 150)


def _run(models, reqs, fault: Callable[[Pair], Fault] | None = None):
    """``reqs`` through a fresh pair whose prefill daemon, given ``fault(pair)``, misplaces the KV."""
    with pd_pair(models) as pair:
        if fault is not None:
            install(pair.prefill.daemon, fault(pair))
        return run_pd(pair, models, reqs, CFG)[0]


def test_control_the_unfaulted_pair_passes(models, reference):
    reqs = requests(LENGTHS, prefix="nc")
    assert compare(_run(models, reqs), reference(reqs, CFG)) == []


def test_swa_translated_through_the_full_id_space_is_caught(models, reference):
    """Seed 004's family: SWA pages named in the wrong id space (the full group's physical ids)."""
    reqs = requests(LENGTHS, prefix="nc")
    ref = reference(reqs, CFG)
    got = _run(models, reqs, lambda pair: swa_through_full_ids)
    bad = compare(got, ref)
    assert bad == sorted(ref), f"only {bad} flagged"
    # not only traces: the greedy tokens themselves go wrong
    assert sum(got[r].tokens != ref[r].tokens for r in ref) >= len(ref) // 2


def test_kernel_facing_swa_ids_on_the_wire_are_caught(models, reference):
    """Virtual (kernel-facing) ids sent where physical SWA page ids belong."""
    reqs = requests(LENGTHS, prefix="nc")
    ref = reference(reqs, CFG)

    def fault(pair):
        p2v = pair.decode.daemon.node.pool.groups[GroupKind.FULL].p2v  # read-only: what the kernels would index with
        return swa_kernel_ids(lambda phys: p2v[phys.long()])

    got = _run(models, reqs, fault)
    bad = compare(got, ref)
    assert bad == sorted(ref), f"only {bad} flagged"
    failed = [r for r in ref if not got[r].ok]
    wrong = [r for r in ref if got[r].ok and got[r].tokens != ref[r].tokens]
    assert wrong, f"every faulty request was refused ({failed}); none decoded silently wrong"


def test_the_draft_vector_carries_the_draft_kv(models, reference):
    """Scramble the draft vector: greedy verification keeps the output tokens right, but the
    draft's proposals (its trace, its acceptance) change -- the check flags it."""
    reqs = requests(LENGTHS, prefix="nc")
    ref = reference(reqs, CFG)
    got = _run(models, reqs, lambda pair: draft_scrambled)
    assert all(got[r].tokens == ref[r].tokens for r in ref), "the target's output must not depend on the draft"
    multi_page = sorted(r.rid for r in reqs if len(r.prompt) > 8)  # one draft page: a rotation is a no-op
    assert compare(got, ref) == multi_page
    assert any(got[r].accepted != ref[r].accepted for r in multi_page)


def test_the_same_faults_in_the_ticket_are_refused_at_the_seal_and_land_nothing(models):
    """The ticket's destination vectors rewritten (what the faults above would look like if a
    node on the path edited the ticket instead): the decode daemon refuses the seal, PermissionDenied,
    at BeginSend; every request fails without a byte sent, and both pools end clean (pd_pair)."""
    reqs = requests(LENGTHS, prefix="nc")
    for fault in (swa_through_full_ids, draft_scrambled):
        with pd_pair(models) as pair:
            got = run_pd(pair, models, reqs, CFG, ticket_rewrite=rewrite_vectors(fault))[0]
            assert sorted(got) == sorted(r.rid for r in reqs)
            for rid, c in got.items():
                assert not c.ok and "PermissionDenied" in c.error and "seal" in c.error, (fault.__name__, rid, c.error)
            assert pair.prefill.daemon.outbox.bytes_total == 0, fault.__name__
            assert pair.decode.daemon.node.stats().transfer_in_bytes_total == 0, fault.__name__


def test_prompts_cross_the_window():
    assert min(LENGTHS) < WINDOW < max(LENGTHS) and max(LENGTHS) > 4 * WINDOW
