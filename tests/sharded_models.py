"""A model with an EmbeddingBag (sum, 1-D ids with offsets), an Embedding and dense layers under AdamW, its
loop under the sharded strategy, and the single-process reference on the joint batch (AdamW on the dense
layers, the row optimizer written out on the rows the joint batch looked up, clipping by the joint norm)."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.core import settings

ROWS_BAG, ROWS_EMB, DIM, DENSE, BATCH = 37, 23, 4, 3, 4
LR, ROW_LR = 0.01, 0.1
ROW_OPTIMIZERS = {"sgd": gradsync.RowSGD(lr=ROW_LR), "adagrad": gradsync.RowAdagrad(lr=ROW_LR)}


class BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(ROWS_BAG, DIM, mode="sum")
        self.emb = nn.Embedding(ROWS_EMB, DIM)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + DENSE, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, bag_ids, offsets, ids, dense):
        return self.mlp(torch.cat([self.bag(bag_ids, offsets), self.emb(ids), dense], 1)).squeeze(1)


def bag_batch(step: int, worker: int) -> tuple[torch.Tensor, ...]:
    """Worker `worker`'s batch at `step`: (bag ids, offsets, ids, dense, targets). Uneven on purpose: at step
    1 worker 1's bags are all empty (no bag id at all), at step 2 every id of worker 0 is one id (one owner)."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    sizes = torch.randint(0, 4, (BATCH,), generator=g)
    if step == 1 and worker == 1:
        sizes.zero_()
    bag = torch.randint(0, ROWS_BAG, (int(sizes.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    ids = torch.randint(0, ROWS_EMB, (BATCH,), generator=g)
    if step == 2 and worker == 0:
        bag.fill_(5)
        ids.fill_(7)
    return bag, offsets, ids, torch.randn(BATCH, DENSE, generator=g), torch.randn(BATCH, generator=g)


def _joint(step: int, workers: int) -> tuple[torch.Tensor, ...]:
    parts = [bag_batch(step, w) for w in range(workers)]
    bags, starts, done = [], [], 0
    for bag, offsets, *_ in parts:
        bags.append(bag)
        starts.append(offsets + done)
        done += bag.numel()
    return (torch.cat(bags), torch.cat(starts), *(torch.cat(t) for t in list(zip(*parts))[2:]))


def train_bags(optimizer: str, steps: int, max_norm: float | None, bad_at: int | None) -> dict:
    """Train BagNet under the job's strategy, the step timeline on; at step `bad_at` worker 1 looks up an id past
    the Embedding's end, which every worker must refuse with one error and nothing applied, and the loop goes
    on. Returns the trained state (the trainer's and the user's module's), the refusal's text, whether the
    state was unchanged by it, and each step's record and timeline."""
    os.environ[settings.TIMELINE.env] = "1"  # this rank's own environment: it ends with the job
    model = BagNet()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR), max_grad_norm=max_norm,
                               table_optimizer=ROW_OPTIMIZERS[optimizer])
    me, refused, unchanged = gradsync.worker_rank(), None, None
    for step in range(steps):
        bag, offsets, ids, x, y = bag_batch(step, me)
        if step == bad_at:
            before = trainer.state_dict()
            wrong = ids.clone()
            if me == 1:
                wrong[1] = ROWS_EMB + 3
            try:
                with dist_autograd.context() as cid:
                    trainer.model(bag, offsets, wrong, x)
            except IndexError as e:
                refused = str(e)
            unchanged = all(torch.equal(v, trainer.state_dict()[k]) for k, v in before.items())
        with dist_autograd.context() as cid:
            loss = F.mse_loss(trainer.model(bag, offsets, ids, x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return dict(state=trainer.state_dict(), module=model.state_dict(), refused=refused, unchanged=unchanged,
                sizes=trainer._strategy.model_sizes(0), timeline=list(trainer.metrics.timeline.steps),
                records=[dataclasses.asdict(r) for r in trainer.metrics.records])


def reference_bags(optimizer: str, steps: int, workers: int, max_norm: float | None) -> dict[str, torch.Tensor]:
    """Single-process training on the joint batch of `workers` workers."""
    model = BagNet()
    tables = [model.bag.weight, model.emb.weight]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    opt = torch.optim.AdamW(dense, lr=LR)
    acc = [torch.zeros(t.shape[0]) for t in tables]
    for step in range(steps):
        bag, offsets, ids, x, y = _joint(step, workers)
        for p in model.parameters():
            p.grad = None
        F.mse_loss(model(bag, offsets, ids, x), y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        opt.step()
        with torch.no_grad():
            for table, rows, a in zip(tables, (bag.unique(), ids.unique()), acc):
                g = table.grad[rows]
                if optimizer == "adagrad":
                    a[rows] += (g * g).mean(1)
                    g = g / (a[rows].sqrt() + ROW_OPTIMIZERS["adagrad"].eps).unsqueeze(1)
                table[rows] -= ROW_LR * g
    return model.state_dict()


GLOBAL_BATCH = 12
"""Samples of a step of `train_resumed`: divisible by 2, 3 and 4, so every number of workers trains on equal
parts of the same global batch (the mean of their mean losses is the global mean)."""


def global_batch_part(step: int, worker: int, workers: int) -> tuple[torch.Tensor, ...]:
    """Worker `worker`'s part of step `step`'s global batch (bag ids, offsets, ids, dense, targets): the same
    samples, split in `workers` equal runs, whatever the number of workers."""
    g = torch.Generator().manual_seed(step)
    sizes = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    bag = torch.randint(0, ROWS_BAG, (int(sizes.sum()),), generator=g)
    ids = torch.randint(0, ROWS_EMB, (GLOBAL_BATCH,), generator=g)
    x, y = torch.randn(GLOBAL_BATCH, DENSE, generator=g), torch.randn(GLOBAL_BATCH, generator=g)
    lo, hi = worker * GLOBAL_BATCH // workers, (worker + 1) * GLOBAL_BATCH // workers
    starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    return bag[starts[lo]:starts[hi]], starts[lo:hi] - starts[lo], ids[lo:hi], x[lo:hi], y[lo:hi]


def train_resumed(steps: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Train BagNet (dense AdamW, tables under RowSGD with momentum: state per row) from `trainer.start_step`
    (a resumed job's step) to `steps` on `global_batch_part`; returns the start step and the trained state."""
    model = BagNet()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR),
                               table_optimizer=gradsync.RowSGD(lr=ROW_LR, momentum=0.9))
    for step in range(trainer.start_step, steps):
        bag, offsets, ids, x, y = global_batch_part(step, gradsync.worker_rank(), gradsync.num_workers())
        with dist_autograd.context() as cid:
            loss = F.mse_loss(trainer.model(bag, offsets, ids, x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.start_step, trainer.state_dict()
