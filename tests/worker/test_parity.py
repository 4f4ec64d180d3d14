"""Parity: PS-sync (over either transport) and allreduce end where single-process training on the global batch
ends."""
import pytest

from helpers import max_diff
from jobs import reference_bn, train_bn, train_mlp

STEPS = 20
JOBS = [("ps", 1, "rpc"), ("ps", 2, "rpc"), ("ps", 2, "grpc"), ("allreduce", 0, "rpc")]
"""(strategy, servers, transport): the grpc transport serves the ps strategy only."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("strategy,servers,transport", JOBS)
def test_sync_training_matches_single_process(launch, reference, strategy, servers, transport, workers):
    states = launch(train_mlp, strategy=strategy, workers=workers, servers=servers, transport=transport,
                    args=(STEPS,))
    for state in states:  # every worker sees the same final state
        assert max_diff(state, reference(STEPS, workers)) <= 1e-5
    assert max_diff(states[0], reference(0, workers)) > 1e-2  # training moved the weights


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers,transport", [("ps", 2, "rpc"), ("ps", 2, "grpc"), ("allreduce", 0, "rpc")])
def test_batchnorm_buffers_and_adam_match_single_process(launch, strategy, servers, transport):
    state = launch(train_bn, strategy=strategy, workers=2, servers=servers, transport=transport, args=(8,))[0]
    assert max_diff(state, reference_bn(8, 2)) <= 1e-5
    if strategy == "ps":  # the servers carry the buffers: every worker's batches counted, the statistics moved
        assert state["1.num_batches_tracked"].item() == 8
        assert state["1.running_mean"].abs().max() > 1e-3
