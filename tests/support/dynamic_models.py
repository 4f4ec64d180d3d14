"""A click model with three dynamic tables (one unbounded in effect, one LRU bag and one LFU table with TTL,
both small and admitting on the second sighting), its training loop on every worker (with a `trainer.join()`
block, workers running out of data at different steps; sharded: without), and single-process references: the same model
trained on the active workers' batches joined (`table.step` per dynamic table), and the unbounded table as an
nn.Embedding holding init(id) for each id in order of first sight."""
from __future__ import annotations

import dataclasses
import os
import random

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.core import settings
from gradsync.tables.row_init import HashedUniform
from jobs import run_loop

DIM, BATCH, LR = 3, 5, 0.2
_RNG = random.Random(11)
IDS = torch.tensor([_RNG.randrange(-2**63, 2**63) for _ in range(24)])
TABLES = ("big", "lru", "lfu")
OPTIMIZERS = {"sgd": gradsync.RowSGD(lr=LR), "adagrad": gradsync.RowAdagrad(lr=LR)}


class DynNet(nn.Module):
    def __init__(self, big: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.big = big or gradsync.DynamicEmbedding(DIM, capacity=1000)
        self.lru = gradsync.DynamicEmbedding(DIM, capacity=6, admit_after=2, evict="lru", mode="sum")
        self.lfu = gradsync.DynamicEmbedding(DIM, capacity=5, admit_after=2, evict="lfu", ttl_steps=3)
        self.head = nn.Linear(3 * DIM, 1)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.big(ids), self.lru(bags), self.lfu(other)], 1)).squeeze(1)


def dyn_batch(step: int, worker: int) -> tuple[torch.Tensor, ...]:
    """Worker `worker`'s batch at `step`: (ids (B,), bags (B, 2), other (B,), clicks (B,)), skewed to low ids."""
    g = torch.Generator().manual_seed(100 * step + worker)
    skewed = lambda *shape: IDS[(torch.rand(*shape, generator=g) ** 2 * len(IDS)).long()]  # noqa: E731
    return skewed(BATCH), skewed(BATCH, 2), skewed(BATCH), torch.randint(0, 2, (BATCH,), generator=g).float()


def schedule(steps: int, extra: list[int]) -> list[list[int]]:
    """The workers that train in each step: all of them for `steps` steps, then worker w for `extra[w]` more
    in a `trainer.join()` block, then all of them for one step after it."""
    workers = list(range(len(extra)))
    return [workers] * steps + [[w for w, n in enumerate(extra) if n > t] for t in range(max(extra))] + [workers]


def train_dynamic(optimizer: str, steps: int, extra: list[int]) -> dict:
    """Train DynNet by `schedule` (the step after the join block looks its ids up at the step the servers are
    at, on the worker that joined first too); returns the trainer's state, the module's own state_dict, each
    table's resident rows and counters as the module answers them, the servers' table stats and each step's pull
    seconds."""
    model = DynNet()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                               table_optimizer=OPTIMIZERS[optimizer])
    me = gradsync.worker_rank()
    run_loop(trainer, steps, data=dyn_batch, loss_fn=F.binary_cross_entropy_with_logits)
    with trainer.join():
        run_loop(trainer, extra[me], data=lambda t, w: dyn_batch(steps + t, w),
                 loss_fn=F.binary_cross_entropy_with_logits)
    last = steps + max(extra)
    run_loop(trainer, 1, data=lambda t, w: dyn_batch(last, w), loss_fn=F.binary_cross_entropy_with_logits)
    tables = {n: (getattr(model, n).resident_rows, getattr(model, n).counters) for n in TABLES}
    stats = {s: st["tables"] for s, st in trainer.server_stats().items()}
    return {"trainer": trainer.state_dict(), "module": model.state_dict(), "tables": tables, "stats": stats,
            "pull_s": [r.pull_s for r in trainer.metrics.records]}


def train_sharded(optimizer: str, steps: int) -> dict:
    """Train DynNet for `steps` steps on every worker (no join block: the sharded strategy refuses it); returns
    the trainer's state, the module's own state_dict, each table's resident rows and counters as the module
    answers them, each step's record and timeline, and on worker 0 an evaluation forward (no gradients) of worker 1's batch of step `steps`, which
    it runs alone."""
    os.environ[settings.TIMELINE.env] = "1"  # this rank's own environment: it ends with the job
    model = DynNet()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                               table_optimizer=OPTIMIZERS[optimizer])
    run_loop(trainer, steps, data=dyn_batch, loss_fn=F.binary_cross_entropy_with_logits)
    tables = {n: (getattr(model, n).resident_rows, getattr(model, n).counters) for n in TABLES}
    out = {"trainer": trainer.state_dict(), "module": model.state_dict(), "tables": tables,
           "timeline": list(trainer.metrics.timeline.steps),
           "records": [dataclasses.asdict(r) for r in trainer.metrics.records]}
    if gradsync.worker_rank() == 0:
        with torch.no_grad():
            out["evaluated"] = trainer.model(*dyn_batch(steps, 1)[:3])
    return out


def _joint(step: int, active: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat(t) for t in zip(*(dyn_batch(step, w) for w in active)))


def reference_dynamic(optimizer: str, steps: int, extra: list[int]) -> DynNet:
    """DynNet trained in one process on the active workers' batches joined (`schedule`): SGD for the head,
    `table.step` for each dynamic table."""
    model = DynNet()
    opt = torch.optim.SGD(model.head.parameters(), lr=LR)
    for step, active in enumerate(schedule(steps, extra)):
        *inputs, y = _joint(step, active)
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(*inputs), y).backward()
        opt.step()
        for name in TABLES:
            getattr(model, name).step(OPTIMIZERS[optimizer])
    return model


class _FirstSight(nn.Module):
    """An nn.Embedding holding init(id) for each id of the steps in order of first sight."""

    def __init__(self, batches: list[torch.Tensor]):
        super().__init__()
        self.order = torch.tensor(list(dict.fromkeys(torch.cat(batches).tolist())))
        self.embedding = nn.Embedding.from_pretrained(HashedUniform(DIM)(self.order), freeze=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        position = {i: p for p, i in enumerate(self.order.tolist())}
        return self.embedding(torch.tensor([position[i] for i in ids.tolist()]))


def reference_first_sight(steps: int, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The `big` table trained as an nn.Embedding (plain SGD) in one process by `schedule`: (ids ascending,
    their rows)."""
    joint = [_joint(step, active) for step, active in enumerate(schedule(steps, extra))]
    big = _FirstSight([j[0] for j in joint])
    model = DynNet(big)
    opt = torch.optim.SGD([*model.head.parameters(), big.embedding.weight], lr=LR)
    for *inputs, y in joint:
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(*inputs), y).backward()
        opt.step()
        for name in ("lru", "lfu"):
            getattr(model, name).step(OPTIMIZERS["sgd"])
    ids, order = big.order.sort()
    return ids, big.embedding.weight.detach()[order]


def train_resumable(steps: int, optimizer: str = "adagrad") -> dict:
    """Train DynNet from `trainer.start_step` (a resume's) to `steps`; returns that step, the trainer's state as
    it starts (lookups of the other worker's first step may be in it already) and at the end."""
    model = DynNet()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                               table_optimizer=OPTIMIZERS[optimizer])
    out = {"first": trainer.start_step, "start": trainer.state_dict()}
    for step in range(trainer.start_step, steps):
        *inputs, clicks = dyn_batch(step, gradsync.worker_rank())
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.binary_cross_entropy_with_logits(trainer.model(*inputs), clicks)])
            trainer.step(cid)
    return {**out, "end": trainer.state_dict()}
