"""Stale synchronous parallel (--mode ssp): lock step at staleness 0, bounded lead at staleness K."""
import pytest

import gradsync
from jobs import reference_mlp, train_mlp_and_stats
from helpers import max_diff

STEPS = 8


@pytest.mark.timeout(120)
def test_ssp_with_staleness_0_ends_at_the_parameters_of_sync_training():
    results = gradsync.launch(train_mlp_and_stats, strategy="ps", mode="ssp", workers=2, servers=2, args=(STEPS,),
                              staleness=0, step_timeout=30, timeout=110)
    reference = reference_mlp(STEPS, 2, momentum=0.0)
    for state, stats in results:
        assert max_diff(state, reference) <= 1e-5
        assert all(s["max_lead"] == 0 for s in stats.values())


@pytest.mark.timeout(120)
def test_ssp_never_lets_a_worker_run_more_than_k_steps_ahead():
    results = gradsync.launch(train_mlp_and_stats, strategy="ps", mode="ssp", workers=3, servers=1, args=(STEPS,),
                              staleness=2, step_timeout=30, timeout=110)
    stats = results[0][1][0]  # read by worker 0 when it finished: the others may still be pushing
    assert stats["max_lead"] <= 2
    assert sum(stats["staleness_histogram"].values()) == stats["pushes_applied"]
    assert STEPS <= stats["pushes_applied"] <= 3 * STEPS
