"""A small click model with an EmbeddingBag, an Embedding and an MLP, its training loop on every worker,
and single-process references (dense SGD, and row-wise Adagrad / lazy-momentum SGD written out here)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from jobs import run_loop

ROWS_BAG, ROWS_EMB, DIM, DENSE, BATCH, HOT = 40, 30, 4, 3, 6, 3
LR = 0.1


class ClickNet(nn.Module):
    """Multi-hot field (EmbeddingBag, mean) + one-hot field (Embedding, padding row 0) + dense features -> MLP."""

    def __init__(self, sparse: bool = False, tables_on=None):
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(ROWS_BAG, DIM, mode="mean", sparse=sparse, device=tables_on)
        self.emb = nn.Embedding(ROWS_EMB, DIM, padding_idx=0, sparse=sparse, device=tables_on)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + DENSE, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, bag_ids: torch.Tensor, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.bag(bag_ids), self.emb(ids), dense], 1)).squeeze(1)


def click_batch(step: int, worker: int) -> tuple[torch.Tensor, ...]:
    """Worker `worker`'s batch at `step`: (bag ids (B, HOT), ids (B,), dense (B, DENSE), clicks (B,))."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    bag = torch.randint(0, ROWS_BAG, (BATCH, HOT), generator=g)
    ids = torch.randint(0, ROWS_EMB, (BATCH,), generator=g)  # id 0 is the padding row
    return bag, ids, torch.randn(BATCH, DENSE, generator=g), torch.randint(0, 2, (BATCH,), generator=g).float()


OPTIMIZERS = {
    "sgd": None,  # plain SGD: the default row optimizer, exact against torch.optim.SGD on the whole model
    "adagrad": gradsync.RowAdagrad(lr=LR),
    "momentum": gradsync.RowSGD(lr=LR, momentum=0.9, weight_decay=0.01),
}


def click_loop(trainer: gradsync.Trainer, steps: int, corrupt=None) -> None:
    """The README loop on this worker's click batches; `corrupt(step, worker, ids)` may edit the ids."""
    def data(step: int, worker: int):
        bag, ids, dense, y = click_batch(step, worker)
        if corrupt is not None:
            corrupt(step, worker, ids)
        return bag, ids, dense, y

    run_loop(trainer, steps, data=data, loss_fn=F.binary_cross_entropy_with_logits)


def train_clicks(optimizer: str, steps: int, sparse: bool = False) -> dict[str, torch.Tensor]:
    """Train the click model; returns the final state."""
    trainer = gradsync.Trainer(ClickNet(sparse), torch.optim.SGD, lr=LR, table_optimizer=OPTIMIZERS[optimizer])
    click_loop(trainer, steps)
    return trainer.state_dict()


TABLES = ("bag.weight", "emb.weight")


def reference_clicks(optimizer: str, steps: int, workers: int) -> dict[str, torch.Tensor]:
    """Single-process training on the workers' batches joined: dense SGD for the MLP; for the tables,
    dense SGD ('sgd') or the row rule applied to the rows the joint batch looked up."""
    model = ClickNet()
    tables = [model.bag.weight, model.emb.weight]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    opt = torch.optim.SGD(model.parameters() if optimizer == "sgd" else dense, lr=LR)
    state = [torch.zeros(t.shape[0]) for t in tables] if optimizer == "adagrad" else [{} for _ in tables]
    for step in range(steps):
        bag, ids, x, y = (torch.cat(t) for t in zip(*(click_batch(step, w) for w in range(workers))))
        opt.zero_grad()
        for t in tables:
            t.grad = None
        F.binary_cross_entropy_with_logits(model(bag, ids, x), y).backward()
        opt.step()
        if optimizer != "sgd":
            with torch.no_grad():
                for table, rows, st in zip(tables, (bag.unique(), ids.unique()), state):
                    _row_step(optimizer, table, rows, st)
    return model.state_dict()


def _row_step(optimizer: str, table: torch.Tensor, rows: torch.Tensor, state) -> None:
    """One reference step of a row optimizer on the looked-up `rows` of `table`."""
    opt = OPTIMIZERS[optimizer]
    for r in rows.tolist():
        g = table.grad[r] + opt.weight_decay * table[r]
        if optimizer == "adagrad":
            state[r] += (g * g).mean()
            table[r] -= opt.lr * g / (state[r].sqrt() + opt.eps)
        else:
            state[r] = opt.momentum * state.get(r, torch.zeros_like(g)) + g
            table[r] -= opt.lr * state[r]


def _past_the_end(step: int, worker: int, ids: torch.Tensor) -> None:
    if step == 1 and worker == 1:
        ids[2] = ROWS_EMB + 5


def lookup_out_of_range() -> None:
    """Worker 1 looks up a row past the end of the Embedding at step 1."""
    click_loop(gradsync.Trainer(ClickNet(), torch.optim.SGD, lr=LR), 2, corrupt=_past_the_end)


def huge_table() -> None:
    """A table built on the meta device, far larger than any server's memory."""
    model = nn.Sequential(nn.Embedding(10**12, 64, device="meta"), nn.Linear(64, 1))
    gradsync.Trainer(model, torch.optim.SGD, lr=LR)


def train_on_meta_tables(steps: int) -> tuple[dict, dict]:
    """Train `steps` steps with tables built on the meta device (the servers initialise them); returns
    every server's counters and the final state."""
    trainer = gradsync.Trainer(ClickNet(sparse=True, tables_on="meta"), torch.optim.SGD, lr=LR,
                               table_optimizer=OPTIMIZERS["adagrad"])
    click_loop(trainer, steps)
    return trainer.server_stats(), trainer.state_dict()


def train_then_read_tables_over_grpc(steps: int) -> dict:
    """Train the click model (async, so the servers stay up while we read), then read its tables from
    outside the RPC world: Client.pull_rows, Client.pull and `gradsync status`."""
    import os

    from gradsync.transport.grpc.client import Client
    from helpers import run_cli

    state = train_clicks("adagrad", steps)
    run_dir = os.environ["GRADSYNC_RUN_DIR"]
    ids = torch.tensor([5, 0, 5, ROWS_EMB - 1, 2])
    with Client(run_dir) as client:
        rows = client.pull_rows("emb.weight", ids)
        pulled, stats = client.pull(), client.stats()
        try:
            client.pull_rows("emb.weight", [ROWS_EMB])
            out_of_range = None
        except IndexError as e:
            out_of_range = str(e)
    status = run_cli("status", run_dir, timeout=60)
    return dict(state=state, ids=ids, rows=rows, pulled=pulled, stats=stats, out_of_range=out_of_range,
                status=status.stdout + status.stderr)


def train_clicks_dense_tables(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The click model with SGD and `tables="dense"` (which plain SGD would serve under "auto"): returns the
    final state and what the strategy reports of the model (no table served)."""
    trainer = gradsync.Trainer(ClickNet(), torch.optim.SGD, lr=LR, tables="dense")
    click_loop(trainer, steps)
    return trainer.state_dict(), trainer._strategy.model_sizes(0)
