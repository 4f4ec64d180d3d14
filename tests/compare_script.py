"""A tiny training script for `gradsync compare` tests: 10 SGD steps of the jobs.py MLP, logged."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
from jobs import make_mlp, run_loop  # noqa: E402

if __name__ == "__main__":
    gradsync.init()
    run_loop(gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1), 10, log=True)
    gradsync.log(acc=0.5 + gradsync.worker_rank())
    gradsync.shutdown()
