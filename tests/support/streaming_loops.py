"""A sync ps loop whose steps change shape (one backward, two, two under no_sync, a skipped step, a
GradScaler), so that the pieces a worker sends during the backward (`gradsync.worker.pipeline.streaming`) are sometimes
right, sometimes superseded, sometimes void; and the same steps on one process."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from jobs import batch, make_mlp

PATTERN = ["one", "one", "two", "one", "one", "skip", "one", "scaler", "one", "one", "nosync", "one", "one"]
"""Each step's shape: `one` backward; `two` micro-batches, two backwards into the context; `nosync` the same
with the first inside trainer.no_sync(); `skip` a forward and backward every worker then leaves without a
step; `scaler` one backward of a GradScaler-scaled loss."""
LR, MOMENTUM = 0.1, 0.9


def _losses(model, step: int, worker: int, shape: str) -> list[torch.Tensor]:
    """The losses this step's backwards run on: the batch whole, or in two halves weighing half each."""
    x, y = batch(step, worker)
    if shape in ("two", "nosync"):
        half = len(y) // 2
        return [F.cross_entropy(model(x[:half]), y[:half]) / 2, F.cross_entropy(model(x[half:]), y[half:]) / 2]
    return [F.cross_entropy(model(x), y)]


def train_shapes(steps: int) -> dict:
    """PATTERN's first `steps` steps with the step timeline on; returns the state, per step taken which lanes
    left before the step's first head (the pieces that left during the backward), and the number of buckets."""
    from gradsync.core import settings

    os.environ[settings.TIMELINE.env] = "1"  # this rank's own environment: it ends with the job
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    me = gradsync.worker_rank()
    for step, shape in enumerate(PATTERN[:steps]):
        with dist_autograd.context() as cid:
            for i, loss in enumerate(_losses(trainer.model, step, me, shape)):
                quiet = shape == "nosync" and i == 0
                with trainer.no_sync() if quiet else contextlib.nullcontext():
                    dist_autograd.backward(cid, [scaler.scale(loss) if shape == "scaler" else loss])
            if shape != "skip":
                trainer.step(cid, scaler=scaler if shape == "scaler" else None)
    early = []
    for record in trainer.metrics.timeline.steps:
        pieces = record["pieces"]
        first_head = min((p["left"] for p in pieces if p["bucket"] is None), default=None)  # None: travelled whole
        early.append(None if first_head is None else
                     sorted(p["lane"] for p in pieces if p["bucket"] is not None and p["left"] < first_head))
    buckets = sum(p["bucket"] is not None for p in trainer.metrics.timeline.steps[0]["pieces"])  # every server's
    return {"state": trainer.state_dict(), "early": early, "buckets": buckets}


def reference_shapes(steps: int, workers: int) -> dict[str, torch.Tensor]:
    """The same steps on one process: each step's gradient is the mean over the workers of the sum of their
    backwards' gradients; a skipped step changes nothing."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step, shape in enumerate(PATTERN[:steps]):
        if shape == "skip":
            continue
        opt.zero_grad()
        total = sum(loss for w in range(workers) for loss in _losses(model, step, w, shape)) / workers
        total.backward()
        opt.step()
    return model.state_dict()
