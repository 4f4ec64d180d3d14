"""Stale synchronous parallel (--mode ssp): lock step at staleness 0, bounded lead at staleness K."""
import pytest

import gradsync
from jobs import reference_mlp, train_mlp_and_stats
from helpers import max_diff

pytestmark = pytest.mark.job  # every test here starts processes

STEPS = 8
SLOW_S = 0.3  # seconds each of workers 1 and 2 sleeps before a step: far longer than a step of worker 0


@pytest.mark.timeout(120)
def test_ssp_with_staleness_0_ends_at_the_parameters_of_sync_training(launch):
    results = launch(train_mlp_and_stats, strategy="ps", mode="ssp", workers=2, servers=2, args=(STEPS,),
                     staleness=0, step_timeout=30, timeout=110)
    reference = reference_mlp(STEPS, 2, momentum=0.0)
    for state, stats in results:
        assert max_diff(state, reference) <= 1e-5
        assert all(s["max_lead"] == 0 for s in stats.values())


@pytest.mark.timeout(120)
def test_ssp_never_lets_a_worker_run_more_than_k_steps_ahead(launch):
    """Workers 1 and 2 sleep before each step, so worker 0 would run ahead of them at once: the bound holds it
    exactly K steps ahead (unbounded, it would lead by up to STEPS - 1)."""
    results = launch(train_mlp_and_stats, strategy="ps", mode="ssp", workers=3, servers=1,
                     args=(STEPS, 0.1, 0.0, SLOW_S), staleness=2, step_timeout=30, timeout=110)
    stats = results[0][1][0]  # read by worker 0 when it finished: the others may still be pushing
    assert stats["max_lead"] == 2
    assert sum(stats["staleness_histogram"].values()) == stats["pushes_applied"]
    # worker 0's last reply waited until the slowest worker had pushed STEPS - 2 times
    assert STEPS + 2 * (STEPS - 2) <= stats["pushes_applied"] <= 3 * STEPS
