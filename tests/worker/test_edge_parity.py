"""Parity on the models people train (frozen layers, unused and conditional branches, Adam, tied
weights) for both strategies, and the refusals of misused steps."""
import pytest
import torch
from torch import nn

import gradsync
from edge_models import CASES, check_parity, step_twice, step_without_backward, train_edge

STEPS = 10
STRATEGIES = [("allreduce", 0), ("ps", 1), ("ps", 2)]
EDGE_STRATEGIES = STRATEGIES[:2]
"""Every edge case under allreduce and ps S = 1 here; ps S = 2 (parameters spread over servers) runs them in pieces
smaller than a parameter (tests/ps/test_pipeline.py: every case but even_steps) and over the gRPC pipeline (below,
even_steps included): pairwise, each case meets each way a step travels without the full cross-product."""


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", EDGE_STRATEGIES)
@pytest.mark.parametrize("case", list(CASES))
def test_edge_model_matches_single_process(launch, case, strategy, servers):
    states = launch(train_edge, strategy=strategy, workers=2, servers=servers, args=(case, STEPS),
                    step_timeout=30, timeout=100)
    check_parity(case, states, 2, STEPS)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["frozen", "even_steps", "adam_unused", "tied"])
def test_edge_model_matches_single_process_through_the_grpc_pipeline_in_small_pieces(launch, case):
    """A sync step as a pipeline of pieces over gRPC (on, as between machines: on one it goes whole by
    default); 256-byte pieces cut every weight of these models."""
    states = launch(train_edge, strategy="ps", workers=2, servers=2, args=(case, STEPS), transport="grpc",
                    pipeline="on", bucket_cap_mb=256 / 2**20, step_timeout=30, timeout=100)
    check_parity(case, states, 2, STEPS)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", STRATEGIES)
def test_branch_on_even_steps_with_one_worker(launch, strategy, servers):
    states = launch(train_edge, strategy=strategy, workers=1, servers=servers, args=("even_steps", STEPS),
                    step_timeout=30, timeout=100)
    check_parity("even_steps", states, 1, STEPS)


def test_model_without_trainable_parameters_is_refused_before_any_strategy():
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters .* unfreeze at least one"):
        gradsync.Trainer(frozen, torch.optim.SGD, lr=0.1)  # no job running: refused before the strategy is picked


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers", STRATEGIES[:2])
@pytest.mark.parametrize("fn,match", [
    (step_without_backward, r"no gradients in that context: call dist_autograd.backward"),
    (step_twice, r"already called for this context"),
])
def test_misused_step_is_refused(launch, fn, match, strategy, servers):
    with pytest.raises(gradsync.JobFailed, match=match):
        launch(fn, strategy=strategy, workers=2, servers=servers, step_timeout=20, timeout=80)
