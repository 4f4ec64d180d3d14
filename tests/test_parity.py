"""Parity: PS-sync and allreduce end where single-process training on the global batch ends."""
import pytest

import gradsync
from helpers import max_diff
from jobs import reference_bn, reference_mlp, train_bn, train_mlp

STEPS = 20


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("ps", 2), ("allreduce", 0)])
def test_sync_training_matches_single_process(strategy, servers, workers):
    states = gradsync.launch(train_mlp, strategy=strategy, workers=workers, servers=servers, args=(STEPS,), timeout=170)
    reference = reference_mlp(STEPS, workers)
    for state in states:  # every worker sees the same final state
        assert max_diff(state, reference) <= 1e-5
    assert max_diff(states[0], reference_mlp(0, workers)) > 1e-2  # training moved the weights


@pytest.mark.timeout(180)
def test_batchnorm_buffers_and_adam_match_between_strategies():
    ps = gradsync.launch(train_bn, strategy="ps", workers=2, servers=2, args=(8,), timeout=170)[0]
    allreduce = gradsync.launch(train_bn, strategy="allreduce", workers=2, args=(8,), timeout=170)[0]
    reference = reference_bn(8, 2)
    assert ps["1.num_batches_tracked"].item() == 8
    assert max_diff(ps, reference) <= 1e-5
    assert max_diff(allreduce, reference) <= 1e-5
    assert ps["1.running_mean"].abs().max() > 1e-3
