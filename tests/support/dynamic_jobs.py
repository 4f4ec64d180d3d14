"""A click model with three gradsync.DynamicEmbedding tables (one large enough for every id, two that admit and
evict) and a dense head under AdamW; its allreduce training on every worker and its single-process reference."""
from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.metrics.traffic import allreduce_bytes
from gradsync.tables.row_init import HashedUniform

DIM, BATCH, LR = 4, 4, 0.05
TABLE_OPTIMIZERS = {"sgd": gradsync.RowSGD(lr=0.3), "adagrad": gradsync.RowAdagrad(lr=0.3)}
_POOLS = torch.randint(-2**63, 2**63 - 1, (38,), generator=torch.Generator().manual_seed(7)).split([16, 12, 10])


class Net(nn.Module):
    """users: any table of DIM columns (a DynamicEmbedding holding every id, or the reference's nn.Embedding);
    items: a bag of 3 ids, LRU over 5 rows, admitted at the second sighting; tags: LFU over 4 rows, TTL 2 steps,
    admitted at the second sighting with probability 0.7; head: a linear layer over the three."""

    def __init__(self, users: nn.Module):
        super().__init__()
        self.users = users
        self.items = gradsync.DynamicEmbedding(DIM, capacity=5, admit_after=2, evict="lru", mode="sum")
        self.tags = gradsync.DynamicEmbedding(DIM, capacity=4, admit_after=2, admit_probability=0.7, evict="lfu",
                                              ttl_steps=2, seed=5)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.head = nn.Linear(3 * DIM, 1)

    def forward(self, users, items, tags):
        return self.head(torch.cat([self.users(users), self.items(items), self.tags(tags)], 1)).squeeze(1)


def dynamic_batch(step: int, worker: int) -> tuple[torch.Tensor, ...]:
    """Worker `worker`'s batch at `step`: user ids (B,), item bags (B, 3), tag ids (B,), clicks (B,)."""
    g = torch.Generator().manual_seed(100 * step + worker)
    users, items, tags = (pool[torch.randint(0, pool.numel(), shape, generator=g)]
                          for pool, shape in zip(_POOLS, [(BATCH,), (BATCH, 3), (BATCH,)]))
    return users, items, tags, torch.randint(0, 2, (BATCH,), generator=g).float()


def active_workers(steps: int, extra: list[int]) -> list[list[int]]:
    """The workers that train in each step: all of them for `steps` steps, then worker w for `extra[w]` more in
    a `trainer.join()` block."""
    return [list(range(len(extra)))] * steps + [[w for w, n in enumerate(extra) if n > t] for t in range(max(extra))]


def train_dynamic(optimizer: str, steps: int, extra: list[int], scaled: bool):
    """Train Net under the job's strategy (`active_workers`; `scaled`: the loss of the steps before the join block
    scaled by a GradScaler, whose power of two leaves the unscaled gradients exact); returns the trainer's state,
    the user's module's state, the bytes sent at each step, and the error of a forward with float ids and whether
    the state stayed the same."""
    model = Net(gradsync.DynamicEmbedding(DIM, capacity=1000))
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR),
                               table_optimizer=TABLE_OPTIMIZERS[optimizer])
    me = gradsync.worker_rank()

    def train(step, scaler=None):
        users, items, tags, clicks = dynamic_batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(users, items, tags), clicks)
            dist_autograd.backward(cid, [loss if scaler is None else scaler.scale(loss)])
            trainer.step(cid, scaler=scaler)
        return users, items, tags

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    for step in range(steps):
        users, items, tags = train(step, scaler)
    with trainer.join():  # no scaler: a worker that has joined steps unscaled
        for step in range(steps, steps + extra[me]):
            train(step)
    state, sent = trainer.state_dict(), [r.bytes_sent for r in trainer.metrics.records]
    with dist_autograd.context():
        try:
            trainer.model(users.double(), items, tags)
            error = "no error"
        except TypeError as e:
            error = str(e)
    after = trainer.state_dict()
    unchanged = list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    return state, trainer.model.module.state_dict(), sent, error, unchanged


def reference_dynamic(optimizer: str, steps: int, extra: list[int]):
    """Single process on the active workers' batches joined (`active_workers`): users in an nn.Embedding holding
    init(id) for each id in order of first sight, trained by the row optimizer; the other tables local. Returns
    the state, the user ids in that order, the expected bytes per worker of each of the first `steps` steps
    (`replicated.exchange` beside DDP's dense allreduce) and the eviction tables' counters."""
    workers = len(extra)
    batches = [[dynamic_batch(t, w) for w in active] for t, active in enumerate(active_workers(steps, extra))]
    users = list(dict.fromkeys(torch.cat([b[0] for step in batches for b in step]).tolist()))
    position = {i: k for k, i in enumerate(users)}
    table = nn.Embedding(len(users), DIM)
    table.weight.data.copy_(HashedUniform(DIM)(torch.tensor(users)))
    model = Net(table)
    dense, rows = torch.optim.AdamW(model.head.parameters(), lr=LR), TABLE_OPTIMIZERS[optimizer]
    row_state = rows.new_state(len(users), DIM, torch.float32)
    dense_bytes = int(allreduce_bytes(sum(p.numel() for p in model.head.parameters()), workers, "none")[0])
    sent = []
    for step in batches:
        ids, items, tags, clicks = (torch.cat(t) for t in zip(*step))
        slots = torch.tensor([position[i] for i in ids.tolist()])
        dense.zero_grad()
        table.weight.grad = None
        F.binary_cross_entropy_with_logits(model(slots, items, tags), clicks).backward()
        parts = []  # per worker: 8-byte ids and counts of each distinct id, 8-byte id and fp32 row of each resident
        for worker_ids in step:
            distinct = [worker_ids[0].unique(), worker_ids[1].unique(), worker_ids[2].unique()]
            resident = [distinct[0].numel()] + [int((t.table.find(d) >= 0).sum())
                                                for t, d in zip((model.items, model.tags), distinct[1:])]
            parts.append((sum(2 * d.numel() for d in distinct) + sum(resident), sum(resident)))
        ints, floats = max(p[0] for p in parts), max(p[1] for p in parts)
        sent.append(dense_bytes + (workers - 1) * (8 * (2 * 3 + ints) + 4 * DIM * floats))
        dense.step()
        touched = slots.unique()
        rows.step(table.weight.data, row_state, touched, table.weight.grad[touched])
        model.items.step(rows)
        model.tags.step(rows)
    return model.state_dict(), users, sent[:steps], {"items": model.items.counters, "tags": model.tags.counters}


def train_resumable(steps: int) -> dict:
    """Train Net (users unbounded, every table by RowAdagrad) from `trainer.start_step` (a resume's) to `steps`;
    returns that step, every table's checkpoint part as the job starts (rows, row optimizer state, admission
    and eviction state) and the trainer's state at the end."""
    model = Net(gradsync.DynamicEmbedding(DIM, capacity=1000))
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR),
                               table_optimizer=TABLE_OPTIMIZERS["adagrad"])
    start = {name: getattr(model, name).table.checkpoint() for name in ("users", "items", "tags")}
    for step in range(trainer.start_step, steps):
        users, items, tags, clicks = dynamic_batch(step, gradsync.worker_rank())
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(users, items, tags), clicks)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return {"first": trainer.start_step, "start": start, "end": trainer.state_dict()}
