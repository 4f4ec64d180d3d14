"""Allreduce with gradient accumulation: a worker that finished its steps and left is not taken for one that
left early by a worker still finishing the same last step (steps count contexts, not micro-batches)."""
import threading

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from gradsync.runtime import cluster

pytestmark = pytest.mark.job  # every test here starts processes

STEPS, MICRO = 3, 2


def accumulate_then_wait_for_the_other_to_leave() -> int:
    """STEPS steps of MICRO micro-batches; worker 0, after its last backward, waits until its heartbeat thread
    has told the Trainer that worker 1 left (a listener registered after the Trainer's is called after it)
    before its last trainer.step. Returns the steps taken."""
    torch.manual_seed(0)
    trainer = gradsync.Trainer(torch.nn.Linear(4, 2), torch.optim.SGD, lr=0.1)
    me, told = gradsync.worker_rank(), threading.Event()
    cluster.current().heartbeat.on_left(lambda worker, steps: worker == 1 and told.set())
    for step in range(STEPS):
        with dist_autograd.context() as cid:
            for micro in range(MICRO):
                x = torch.full((2, 4), float(step + micro + me))
                with trainer.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                    dist_autograd.backward(cid, [F.mse_loss(trainer.model(x), torch.zeros(2, 2))])
            if me == 0 and step == STEPS - 1:
                assert told.wait(60), "worker 0's heartbeat did not see worker 1 leave within 60 s"
            trainer.step(cid)
    return STEPS


@pytest.mark.timeout(120)
def test_a_worker_finishing_its_last_accumulated_step_is_not_told_the_other_left_early(launch):
    assert launch(accumulate_then_wait_for_the_other_to_leave, strategy="allreduce", workers=2,
                  step_timeout=10, timeout=110) == [STEPS, STEPS]
