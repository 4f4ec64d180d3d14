"""Functions the multi-process tests run on each worker (module level, so spawn can pickle them)."""
from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 6


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: worker w's batch at `step` (the reference concatenates all workers')."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def train_mlp(steps: int, lr: float = 0.1, momentum: float = 0.9) -> dict[str, torch.Tensor]:
    """The user loop of the README, on every worker; returns the final state dict."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=lr, momentum=momentum)
    me = gradsync.worker_rank()
    for step in range(steps):
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.state_dict()


def reference_mlp(steps: int, workers: int, lr: float = 0.1, momentum: float = 0.9) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of the workers' batches."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        xs, ys = zip(*(batch(step, w) for w in range(workers)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model.state_dict()
