"""A model with an EmbeddingBag (sum, 1-D ids with offsets), an Embedding and dense layers, its loop under the
sharded strategy (`Case`: SGD with a schedule or AdamW + RowAdagrad, clipping, a GradScaler's skipped step,
accumulation, a table on the meta device, refused lookups), and the single-process reference on the joint
batch (the row optimizer written out on the rows the joint batch looked up, clipping by the joint norm)."""
from __future__ import annotations

import contextlib
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
ROW_OPTIMIZERS = {"adagrad": gradsync.RowAdagrad(lr=ROW_LR)}


class BagNet(nn.Module):
    """`meta`: the Embedding on the meta device. A forward given no bag ids (no ids) skips the EmbeddingBag (the
    Embedding): zeros instead."""

    def __init__(self, meta: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(ROWS_BAG, DIM, mode="sum")
        self.emb = nn.Embedding(ROWS_EMB, DIM, device="meta" if meta else None)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + DENSE, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, bag_ids, offsets, ids, dense):
        bags = self.bag(bag_ids, offsets) if bag_ids is not None else dense.new_zeros(len(dense), DIM)
        rows = self.emb(ids) if ids is not None else dense.new_zeros(len(dense), DIM)
        return self.mlp(torch.cat([bags, rows, dense], 1)).squeeze(1)


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


@dataclasses.dataclass(frozen=True)
class Case:
    """What a parity job trains with. optimizer 'sgd': torch SGD, the dense layers with momentum, the tables in
    a group of plain SGD (served by its exact row form, whose learning rate follows the group's schedule),
    every group's lr times 0.8 ** step (LambdaLR); 'adagrad': AdamW on the dense layers, RowAdagrad on the
    tables. `skip_at`: a GradScaler (scale 16), and worker 1's loss is Inf at that step: the scaler skips
    it and halves its scale. `accumulate_at`: that step is two half-batches, the first inside
    `trainer.no_sync()`. `meta`: the Embedding is built on the meta device (its owners initialise it).
    At `bad_at`, before the step, worker 1 looks up an id past the Embedding's end, then skips the
    EmbeddingBag, then the Embedding: each is refused by every worker at once, nothing applied."""

    optimizer: str
    max_norm: float | None = None
    skip_at: int | None = None
    accumulate_at: int | None = None
    meta: bool = False
    bad_at: int = 3


def _optimizer(case: Case, model: BagNet) -> tuple[torch.optim.Optimizer, dict]:
    """The case's optimizer over `model` (of `Case.optimizer`), and the Trainer's table_optimizer keyword."""
    tables = [model.bag.weight, model.emb.weight]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    if case.optimizer == "sgd":
        return torch.optim.SGD([{"params": dense, "momentum": 0.9}, {"params": tables, "lr": ROW_LR}], lr=LR), {}
    return torch.optim.AdamW(model.parameters(), lr=LR), {"table_optimizer": ROW_OPTIMIZERS[case.optimizer]}


def _schedule(case: Case, optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8 ** step) if case.optimizer == "sgd" else None


def _halves(bag, offsets, ids, x, y) -> list[tuple[torch.Tensor, ...]]:
    """A batch of BATCH samples as two batches of half as many."""
    half, cut = BATCH // 2, int(offsets[BATCH // 2])
    return [(bag[:cut], offsets[:half], ids[:half], x[:half], y[:half]),
            (bag[cut:], offsets[half:] - cut, ids[half:], x[half:], y[half:])]


def _refusals(trainer, batch: tuple[torch.Tensor, ...], me: int) -> tuple[list[str], bool]:
    """Worker 1 looks up an id past the Embedding's end, then skips the EmbeddingBag, then the Embedding (the
    last table looked up); returns what each attempt raised here and whether the state is unchanged."""
    bag, offsets, ids, x, _ = batch
    before, refused = trainer.state_dict(), []
    wrong = ids.clone()
    if me == 1:
        wrong[1] = ROWS_EMB + 3
    for args in ((bag, offsets, wrong, x), (None if me == 1 else bag, offsets, ids, x),
                 (bag, offsets, None if me == 1 else ids, x)):
        try:
            with dist_autograd.context():
                trainer.model(*args)
        except (IndexError, RuntimeError) as e:
            refused.append(str(e))
    return refused, all(torch.equal(v, trainer.state_dict()[k]) for k, v in before.items())


def train_bags(case: Case, steps: int) -> dict:
    """Train BagNet under the job's strategy as `case` says, the step timeline on. Returns the state before
    the first step and the trained state (the trainer's and the user's module's), the refusals' texts,
    whether the state was unchanged by them, the scaler's scale after each step, each step's record and
    timeline, and worker 0's evaluation of the next batch, run after the others returned."""
    os.environ[settings.TIMELINE.env] = "1"  # this rank's own environment: it ends with the job
    model = BagNet(case.meta)
    optimizer, keywords = _optimizer(case, model)
    trainer = gradsync.Trainer(model, optimizer, max_grad_norm=case.max_norm, **keywords)
    schedule = _schedule(case, trainer.optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0) if case.skip_at is not None else None
    me, refused, unchanged, scales = gradsync.worker_rank(), None, None, []
    initial = trainer.state_dict()
    for step in range(steps):
        batch = bag_batch(step, me)
        if step == case.bad_at:
            refused, unchanged = _refusals(trainer, batch, me)
        with dist_autograd.context() as cid:
            parts = _halves(*batch) if step == case.accumulate_at else [batch]
            for i, (bag, offsets, ids, x, y) in enumerate(parts):
                with trainer.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                    loss = F.mse_loss(trainer.model(bag, offsets, ids, x), y) / len(parts)
                    if step == case.skip_at and me == 1:
                        loss = loss * float("inf")
                    dist_autograd.backward(cid, [scaler.scale(loss) if scaler is not None else loss])
            trainer.step(cid, scaler=scaler)
        if schedule is not None:
            schedule.step()
        scales.append(scaler.get_scale() if scaler is not None else None)
    evaluated = None
    if me == 0:  # worker 0 alone, the others done: a forward without gradients needs no collective
        with torch.no_grad():
            evaluated = trainer.model(*bag_batch(steps, 0)[:4])
    return dict(initial=initial, state=trainer.state_dict(), module=model.state_dict(), refused=refused,
                unchanged=unchanged, scales=scales, sizes=trainer._strategy.model_sizes(0), evaluated=evaluated,
                timeline=list(trainer.metrics.timeline.steps),
                records=[dataclasses.asdict(r) for r in trainer.metrics.records])


def reference_bags(case: Case, steps: int, workers: int, initial: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """Single-process training on the joint batch of `workers` workers from the state `initial`: the case's
    optimizer (RowAdagrad written out on the rows the joint batch looked up), clipping by the joint norm,
    the step the scaler skips left out."""
    model = BagNet()
    model.load_state_dict(initial)
    tables = [model.bag.weight, model.emb.weight]
    opt, _ = _optimizer(case, model)
    if case.optimizer == "adagrad":  # the tables are the row optimizer's, below
        opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if all(p is not t for t in tables)]
    schedule = _schedule(case, opt)
    acc = [torch.zeros(t.shape[0]) for t in tables]
    for step in range(steps):
        bag, offsets, ids, x, y = _joint(step, workers)
        for p in model.parameters():
            p.grad = None
        F.mse_loss(model(bag, offsets, ids, x), y).backward()
        if case.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), case.max_norm)
        if step != case.skip_at:
            opt.step()
            if case.optimizer == "adagrad":
                with torch.no_grad():
                    for table, rows, a in zip(tables, (bag.unique(), ids.unique()), acc):
                        g = table.grad[rows]
                        a[rows] += (g * g).mean(1)
                        table[rows] -= ROW_LR * g / (a[rows].sqrt() + ROW_OPTIMIZERS["adagrad"].eps).unsqueeze(1)
        if schedule is not None:
            schedule.step()
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


class SeenNet(BagNet):
    """BagNet whose Embedding's ids mod 12, as 64-bit ids, also look up a dynamic table `seen` (4 rows, LRU,
    admitted at the second sighting: on `global_batch_part`, ids admitted, filtered and evicted at steps 3 and 4),
    each sample's row summed into its prediction."""

    HASHED = torch.tensor([0x5DEECE66D * (r + 1) ** 3 - 2**62 for r in range(12)])

    def __init__(self):
        super().__init__()
        self.seen = gradsync.DynamicEmbedding(DIM, capacity=4, admit_after=2, evict="lru")

    def forward(self, bag_ids, offsets, ids, dense):
        return super().forward(bag_ids, offsets, ids, dense) + self.seen(self.HASHED[ids % 12]).sum(1)


def train_resumed(steps: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Train SeenNet (dense AdamW, tables under RowSGD with momentum: state per row) from `trainer.start_step`
    (a resumed job's step) to `steps` on `global_batch_part`; returns the start step and the trained state."""
    model = SeenNet()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR),
                               table_optimizer=gradsync.RowSGD(lr=ROW_LR, momentum=0.9))
    for step in range(trainer.start_step, steps):
        bag, offsets, ids, x, y = global_batch_part(step, gradsync.worker_rank(), gradsync.num_workers())
        with dist_autograd.context() as cid:
            loss = F.mse_loss(trainer.model(bag, offsets, ids, x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.start_step, trainer.state_dict()
