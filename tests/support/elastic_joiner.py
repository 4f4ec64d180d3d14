"""A worker that joins a running async job (`gradsync run --join RUN_DIR elastic_joiner.py STEPS`): it trains
`Constant` for STEPS steps and prints its worker index and the loss of its first step."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gradsync  # noqa: E402
from elastic_jobs import Constant, LR, constant_step  # noqa: E402

gradsync.init()
trainer = gradsync.Trainer(Constant(), torch.optim.SGD, lr=LR)
losses = [constant_step(trainer) for _ in range(int(sys.argv[1]))]
print(f"joined as worker {gradsync.worker_rank()} of {gradsync.num_workers()}; first loss {losses[0]}", flush=True)
gradsync.shutdown()
