"""A tiny training script for `gradsync compare` tests: 10 SGD steps of the jobs.py MLP, logged."""
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
from jobs import BATCH, batch, make_mlp  # noqa: E402

STEPS = 10

if __name__ == "__main__":
    gradsync.init()
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1)
    me = gradsync.worker_rank()
    for step in range(STEPS):
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        gradsync.log(loss=loss.item(), samples=BATCH)
    gradsync.log(acc=0.5 + me)
    gradsync.shutdown()
