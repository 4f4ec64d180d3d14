"""The step split of `gradsync compare`: under allreduce, the wait for DDP's exchange is commit, not compute."""
import statistics

import pytest
import torch

import gradsync
from jobs import make_mlp, run_loop

pytestmark = pytest.mark.job  # every test here starts processes

PEER_SLEEP_S = 1.0


def train_with_a_slow_peer(steps: int) -> dict:
    """Worker 1 sleeps before each forward; worker 0's backward then waits for its gradients in DDP's
    allreduce. Returns this worker's median compute and commit seconds after the first step."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1)
    run_loop(trainer, steps, pause_s=PEER_SLEEP_S if gradsync.worker_rank() == 1 else 0.0)
    records = list(trainer.metrics.records)[1:]
    return {key: statistics.median(getattr(r, key) for r in records) for key in ("compute_s", "commit_s")}


@pytest.mark.timeout(120)
def test_allreduce_counts_the_wait_for_a_slow_peer_as_commit_not_compute(launch):
    fast, _ = launch(train_with_a_slow_peer, strategy="allreduce", workers=2, args=(4,), timeout=100)
    # worker 0 cannot finish its allreduce before worker 1 has slept and computed: causality, not speed
    assert fast["commit_s"] >= PEER_SLEEP_S / 2 > fast["compute_s"], fast
