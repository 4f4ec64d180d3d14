"""The embedding-table workload bench/sparse.py measures and bench/torchrec_baseline.py runs through TorchRec: the
click log of examples/ctr.py with Zipf or flat ids, each worker's batches, the optimizers, and single-process
training on the workers' joint batches that every configuration is checked against.

`--ids zipf`: examples/ctr.py's Zipf ids (exponent 1.5: a batch of 512 touches ~90 distinct rows per table);
`--ids flat`: uniform over the table's rows (a batch touches ~500 distinct rows per table from 10^5 rows on).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import gradsync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from ctr import PLANTED_BIAS, ClickLog, CTRModel  # noqa: E402

DIM, BATCH, LR = 32, 512, 0.05
BATCHES = 4  # distinct batches per worker, cycled
IDS = ("zipf", "flat")
TOLERANCE = {"sgd": 1e-5, "adagrad": 1e-3}
"""Parity with single-process training, max |difference| of any parameter after 5 steps: SGD's float rounding;
Adagrad divides each gradient by its own running norm, so an element whose gradient nearly cancels carries
rounding into its step (sparse allreduce with torch's Adagrad: 8.0e-5 with Zipf ids, in one hidden unit's
weights; 4.9e-5 flat), while a wrong update moves a parameter by about lr = 0.05 a step."""


class FlatClickLog(ClickLog):
    """The click log with ids uniform over each table's rows (the planted clicks unchanged)."""

    def batch(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.rows, (size, self.fields), generator=g)
        logits = PLANTED_BIAS + self.planted(ids).sum(1)
        clicks = (torch.rand(size, generator=g) < torch.sigmoid(logits)).float()
        return ids, clicks, logits


def worker_batches(fields: int, table_rows: int, ids: str, worker: int, workers: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids (BATCH, fields), clicks) of `worker`'s BATCHES distinct batches, seeded by worker and step."""
    log = (FlatClickLog if ids == "flat" else ClickLog)(fields, table_rows)
    return [log.batch(BATCH, seed=1 + i * workers + worker)[:2] for i in range(BATCHES)]


def optimizers(name: str):
    """(dense optimizer class, row optimizer of the tables that are trained row by row) for `--optimizer`: SGD
    and RowSGD are the same math, torch's Adagrad keeps one sum per element and RowAdagrad one per row."""
    if name == "sgd":
        return torch.optim.SGD, gradsync.RowSGD(lr=LR)
    return torch.optim.Adagrad, gradsync.RowAdagrad(lr=LR)


def reference(fields: int, rows: int, ids: str, workers: int, steps: int, optimizer: str, row_wise: bool
              ) -> dict[str, torch.Tensor]:
    """The state after `steps` steps of one process on the W workers' batches joined (step i: every worker's
    batch i mod BATCHES), from CTRModel's initial values: the dense optimizer on the MLP and, with `row_wise`,
    the row optimizer on the rows of each table the joint batch looked up (ps, hybrid, sharded, TorchRec), else
    the dense optimizer on the tables too (allreduce: torch's optimizers move no row whose gradient is zero)."""
    model = CTRModel(fields, rows // fields, DIM)
    dense_cls, row_optimizer = optimizers(optimizer)
    tables = {id(t.weight) for t in model.tables}
    dense = dense_cls([p for p in model.parameters() if not row_wise or id(p) not in tables], lr=LR)
    states = [row_optimizer.new_state(t.num_embeddings, DIM, torch.float32) for t in model.tables]
    every = [worker_batches(fields, rows // fields, ids, w, workers) for w in range(workers)]
    for step in range(steps):
        batch, clicks = (torch.cat(parts) for parts in zip(*(b[step % BATCHES] for b in every)))
        dense.zero_grad()
        for table in model.tables:
            table.weight.grad = None
        F.binary_cross_entropy_with_logits(model(batch), clicks).backward()
        dense.step()
        if row_wise:
            for f, (table, state) in enumerate(zip(model.tables, states)):
                looked_up = batch[:, f].unique()
                row_optimizer.step(table.weight.data, state, looked_up, table.weight.grad[looked_up])
    return model.state_dict()
