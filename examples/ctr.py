"""Click-through-rate prediction on a synthetic click log: the workload where a parameter server wins.

Each sample has `--fields` categorical fields; each field's ids follow a Zipf
law over `--rows` ids (a few hot ids, a long tail). Clicks come from a
planted logistic model (one hidden weight per field and id), so the best
achievable AUC is known: the planted model's own AUC on the test set, printed
next to the trained model's. Everything is generated here, deterministically.

The model is one `nn.Embedding` per field and an MLP. Under `--strategy ps`
or `hybrid` the tables live on the parameter servers and a worker pulls only
the rows of its batch; under `allreduce` every worker holds every table:

    gradsync run --strategy hybrid --workers 2 --servers 1 examples/ctr.py --rows 1000000
    gradsync run --strategy ps --workers 2 --servers 2 examples/ctr.py
    gradsync run --strategy allreduce --workers 2 examples/ctr.py
    gradsync run --strategy allreduce --workers 2 examples/ctr.py --sparse-grad

`--sparse-grad` builds the tables with `sparse=True`, as a DDP user with large
tables would: under allreduce DDP then exchanges only the rows a batch touched
(an allgather of each worker's rows) and Adagrad updates only those rows,
instead of averaging and updating every row of every table each step. Under ps
and hybrid the flag changes nothing (the servers apply row gradients anyway).
`gradsync compare` runs the script as given, so compare allreduce at its best
with tables by passing the flag:

    gradsync compare --workers 2 --servers 1 examples/ctr.py --sparse-grad
"""
import argparse
import resource
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

ZIPF = 1.5
PLANTED_SCALE = 0.8
PLANTED_BIAS = -1.0


class ClickLog:
    """The synthetic log: Zipf ids per field, clicks from the planted logistic model."""

    def __init__(self, fields: int, rows: int):
        self.fields, self.rows = fields, rows
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF)
        self.cdf = (weights.cumsum(0) / weights.sum()).float()

    def planted(self, ids: torch.Tensor) -> torch.Tensor:
        """The planted weight of each (field, id), N(0, PLANTED_SCALE^2) from a hash of both (no table)."""
        key = ids + torch.arange(self.fields) * self.rows
        u1, u2 = _uniform(key, 1), _uniform(key, 2)
        return PLANTED_SCALE * (-2 * u1.log()).sqrt() * torch.cos(2 * torch.pi * u2)

    def batch(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (size, fields), clicks (size,), the planted click logits (size,))."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.searchsorted(self.cdf, torch.rand(size, self.fields, generator=g)).clamp_(max=self.rows - 1)
        logits = PLANTED_BIAS + self.planted(ids).sum(1)
        clicks = (torch.rand(size, generator=g) < torch.sigmoid(logits)).float()
        return ids, clicks, logits


def _uniform(key: torch.Tensor, salt: int) -> torch.Tensor:
    """A uniform in (0, 1) per int64 key (a splitmix-style integer hash, kept to 31 bits)."""
    x = (key * 2654435761 + salt * 40503) % 2147483647
    x = (x ^ (x >> 13)) * 1274126177 % 2147483647
    return (x.double() + 0.5) / 2147483647


class CTRModel(nn.Module):
    """One embedding table per field, then an MLP to one click logit. Tables built on the meta device
    (`tables_on="meta"`) take no memory here: the parameter servers initialise them (N(0, 1)). `sparse`: the
    tables' gradients are sparse (`nn.Embedding(..., sparse=True)`), for allreduce with sparse gradients."""

    def __init__(self, fields: int, rows: int, dim: int, tables_on: str | None = None, sparse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.Embedding(rows, dim, device=tables_on, sparse=sparse) for _ in range(fields))
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.01)
        self.mlp = nn.Sequential(nn.Linear(fields * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([t(ids[:, f]) for f, t in enumerate(self.tables)], 1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney: the chance a random click outscores a random non-click)."""
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    positives = labels.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train(fields: int, rows: int, dim: int, steps: int, batch_size: int, lr: float, test_size: int,
          sparse_grad: bool = False) -> dict:
    """The loop every worker runs; returns this worker's summary (AUCs on worker 0). `sparse_grad`: tables
    built with `sparse=True` (torch's Adagrad takes sparse gradients)."""
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    log = ClickLog(fields, rows)
    model = CTRModel(fields, rows, dim, sparse=sparse_grad)
    trainer = gradsync.Trainer(model, torch.optim.Adagrad(model.parameters(), lr=lr),
                               table_optimizer=gradsync.RowAdagrad(lr=lr))
    start, losses = time.perf_counter(), []
    for step in range(steps):
        ids, clicks, _ = log.batch(batch_size, seed=1 + step * workers + me)
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(ids), clicks)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        losses.append(loss.item())
        gradsync.log(loss=loss.item(), samples=batch_size)
    elapsed = time.perf_counter() - start
    summary = {
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "samples_per_s": workers * steps * batch_size / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **trainer.metrics.summary(),
    }
    if me == 0:
        ids, clicks, planted = log.batch(test_size, seed=0)  # seed 0 is never a training batch
        with torch.no_grad():
            summary["auc"] = auc(trainer.model(ids), clicks)
        summary["planted_auc"] = auc(planted, clicks)
        gradsync.log(acc=summary["auc"])  # the AUC, in compare's accuracy column
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fields", type=int, default=8, help="categorical fields (one table each)")
    parser.add_argument("--rows", type=int, default=100_000, help="ids per field (rows per table)")
    parser.add_argument("--dim", type=int, default=8, help="embedding width")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=256, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument("--sparse-grad", action="store_true",
                        help="tables with sparse gradients (nn.Embedding(sparse=True)): allreduce then exchanges "
                             "and updates only the rows a batch touched")
    args = parser.parse_args()
    gradsync.init()
    summary = train(args.fields, args.rows, args.dim, args.steps, args.batch_size, args.lr, args.test_size,
                    args.sparse_grad)
    if gradsync.worker_rank() == 0:
        print(f"AUC {summary['auc']:.4f} (planted model: {summary['planted_auc']:.4f}), "
              f"final loss {summary['final_loss']:.4f}, {summary['samples_per_s']:.0f} samples/s, "
              f"peak memory {summary['peak_rss_mb']:.0f} MB on worker 0")
    gradsync.shutdown()


if __name__ == "__main__":
    main()
