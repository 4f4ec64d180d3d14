"""Click prediction on a stream of 64-bit feature ids: the workload of tables with ids from an unbounded space.

Each sample has `--fields` categorical fields. A field's ids are 64-bit hashes (any int64 value) of a
popularity rank drawn Zipf(`--zipf`) over `--vocab` ranks, and the ranking drifts: every `--drift-every` steps
`--drift` new ids take the head and every older id falls that many places, so ids come, stay hot for a while
and fade, as users and items do. Clicks come from a planted logistic teacher with a latent vector per id (a
function of the id's hash), so the best achievable AUC is known: the teacher's own, printed beside the
model's. Everything is generated here, deterministically.

The model is one table per field and an MLP. `--table dynamic` (the default) is a `gradsync.DynamicEmbedding`
of at most `--capacity` rows (`--evict lru|lfu`, `--ttl-steps`, `--admit-after`); `--table hashed` is what a
user without one runs: an `nn.Embedding` of `--capacity` rows fed `id mod capacity` (colliding ids share a
row); `--table unbounded` is a DynamicEmbedding that never evicts. Tables train with row-wise Adagrad.

    python examples/ctr_stream.py --compare-tables        # every table, one process, the same stream
    gradsync run --strategy ps --workers 2 --servers 2 examples/ctr_stream.py
    gradsync run --strategy hybrid --workers 2 --servers 1 examples/ctr_stream.py
    gradsync run --strategy allreduce --workers 2 examples/ctr_stream.py
    gradsync run --strategy sharded --workers 2 examples/ctr_stream.py
    gradsync compare --workers 2 --servers 1 examples/ctr_stream.py

Without a job (`python examples/ctr_stream.py`: no WORLD_SIZE in the environment) it trains in this process: a
DynamicEmbedding is then a local table, stepped by `table.step(row_optimizer)`.

The defaults (300 steps of 1024 samples, lr 0.2, 20 new ids at the head every 50 steps) are where the model
learns within a minute: AUC about 0.69 against the teacher's 0.84 with `--compare-tables`, LRU and LFU at half
the distinct ids within 0.003 of unbounded and 0.015 above hashed (bench/dynamic.py `--parts quality`). The gap
to the teacher is the drift: the hottest ids are the newest, seen a few dozen times each. With 200 new ids every
20 steps (10x the drift) the model reaches about 0.59 at lr 0.05 and 0.61 at lr 0.2 (300 steps of 512).
"""
import argparse
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from ctr import auc  # examples/ctr.py, beside this script

TEACHER_DIM = 4
TEACHER_SCALE = 0.9
TEACHER_BIAS = -1.2
MASK = (1 << 63) - 1


def mix(x: torch.Tensor, salt: int) -> torch.Tensor:
    """A 64-bit integer hash of int64 keys (splitmix64's finaliser; int64 arithmetic wraps), any int64 value."""
    x = x + (0x9E3779B97F4A7C15 + salt * 0x632BE59BD9B4E5 & MASK)
    x = (x ^ (x >> 30) & (MASK >> 29)) * (0xBF58476D1CE4E5B9 - (1 << 64))
    x = (x ^ (x >> 27) & (MASK >> 26)) * (0x94D049BB133111EB - (1 << 64))
    return x ^ (x >> 31) & (MASK >> 30)


def unit(key: torch.Tensor, salt: int) -> torch.Tensor:
    """A uniform in (0, 1) per int64 key."""
    return ((mix(key, salt) >> 11 & ((1 << 52) - 1)).double() + 0.5) / 2 ** 52


class Stream:
    """The synthetic stream: drifting Zipf ranks per field, their 64-bit ids, clicks from the planted teacher."""

    def __init__(self, fields: int, vocab: int, zipf: float, drift: int, drift_every: int):
        self.fields, self.drift, self.drift_every = fields, drift, drift_every
        weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
        self.cdf = (weights.cumsum(0) / weights.sum()).float()
        self.vocab = vocab

    def ids_of(self, ranks: torch.Tensor, step: int) -> torch.Tensor:
        """The 64-bit ids of popularity ranks at `step`: rank r is item (head - r), the head moving on."""
        head = (step // self.drift_every) * self.drift + self.vocab
        items = head - ranks + torch.arange(self.fields) * (1 << 40)
        return mix(items, 7)

    def teacher(self, ids: torch.Tensor) -> torch.Tensor:
        """The planted click logit of each sample: bias + sum over fields of <v(id), u>, v(id) ~ N(0, I) from
        the id's hash, u a fixed unit vector per field scaled by TEACHER_SCALE."""
        k = torch.arange(TEACHER_DIM)
        u1, u2 = unit(ids.unsqueeze(-1) + k, 1), unit(ids.unsqueeze(-1) + k, 2)
        latent = (-2 * u1.log()).sqrt() * torch.cos(2 * torch.pi * u2)  # (..., fields, TEACHER_DIM)
        g = torch.Generator().manual_seed(0)
        u = torch.randn(self.fields, TEACHER_DIM, generator=g, dtype=torch.float64)
        u = TEACHER_SCALE * u / u.norm(dim=1, keepdim=True)
        return TEACHER_BIAS + (latent * u).sum((-1, -2))

    def batch(self, size: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (size, fields) int64, clicks (size,), the teacher's logits (size,)) of a batch at `step`."""
        g = torch.Generator().manual_seed(seed)
        ranks = torch.searchsorted(self.cdf, torch.rand(size, self.fields, generator=g)).clamp_(max=self.vocab - 1)
        ids = self.ids_of(ranks, step)
        logits = self.teacher(ids)
        clicks = (torch.rand(size, generator=g, dtype=torch.float64) < torch.sigmoid(logits)).float()
        return ids, clicks, logits


class HashedTable(nn.Module):
    """The collision baseline: `nn.Embedding(rows)` fed `id mod rows`."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.rows = rows
        self.embedding = nn.Embedding(rows, dim)
        nn.init.uniform_(self.embedding.weight, -0.05, 0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(torch.remainder(ids, self.rows))


class ClickModel(nn.Module):
    """One table per field, then an MLP to one click logit."""

    def __init__(self, fields: int, dim: int, table: str, capacity: int, evict: str, ttl_steps: int | None,
                 admit_after: int):
        super().__init__()
        torch.manual_seed(0)
        if table == "hashed":
            self.tables = nn.ModuleList(HashedTable(capacity, dim) for _ in range(fields))
        else:
            rows = capacity if table == "dynamic" else 2 ** 62
            self.tables = nn.ModuleList(gradsync.DynamicEmbedding(
                dim, capacity=rows, evict=evict, ttl_steps=ttl_steps if table == "dynamic" else None,
                admit_after=admit_after, seed=f) for f in range(fields))
        self.mlp = nn.Sequential(nn.Linear(fields * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([t(ids[:, f]) for f, t in enumerate(self.tables)], 1)).squeeze(1)


class LocalStep:
    """Training in this process, no job: the dense layers by Adagrad, every table by the same row-wise Adagrad
    (a DynamicEmbedding's own `step`; the hashed table's touched rows through the same row optimizer)."""

    def __init__(self, model: ClickModel, lr: float):
        self.model, self.rows = model, gradsync.RowAdagrad(lr=lr)
        dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
        self.dense = torch.optim.Adagrad(dense, lr=lr)
        self.states = {t: self.rows.new_state(t.rows, 0, torch.float32)
                       for t in model.tables if isinstance(t, HashedTable)}

    def __call__(self, loss: torch.Tensor) -> None:
        self.dense.zero_grad()
        for t in self.states:
            t.embedding.weight.grad = None
        loss.backward()
        self.dense.step()
        for t in self.model.tables:
            if isinstance(t, HashedTable):
                grad = t.embedding.weight.grad
                touched = grad.abs().sum(1).nonzero().squeeze(1)
                self.rows.step(t.embedding.weight.data, self.states[t], touched, grad[touched])
            else:
                t.step(self.rows)


def train(args, table: str, capacity: int, in_job: bool, model: ClickModel | None = None) -> dict:
    """Every worker's loop (or the only process's); returns the summary (AUCs on worker 0). `model`: one built
    elsewhere (another kind of table) to train instead of `ClickModel(..., table, capacity, ...)`."""
    me, workers = (gradsync.worker_rank(), gradsync.num_workers()) if in_job else (0, 1)
    stream = Stream(args.fields, args.vocab, args.zipf, args.drift, args.drift_every)
    if model is None:
        model = ClickModel(args.fields, args.dim, table, capacity, args.evict, args.ttl_steps, args.admit_after)
    if in_job:
        trainer = gradsync.Trainer(model, torch.optim.Adagrad(model.parameters(), lr=args.lr),
                                   table_optimizer=gradsync.RowAdagrad(lr=args.lr))
        net = trainer.model
    else:
        local, net = LocalStep(model, args.lr), model
    start = time.perf_counter()
    for step in range(args.steps):
        ids, clicks, _ = stream.batch(args.batch_size, step, seed=1 + step * workers + me)
        if in_job:
            with dist_autograd.context() as cid:
                loss = F.binary_cross_entropy_with_logits(net(ids), clicks)
                dist_autograd.backward(cid, [loss])
                trainer.step(cid)
            gradsync.log(loss=loss.item(), samples=args.batch_size)
        else:
            local(F.binary_cross_entropy_with_logits(net(ids), clicks))
    summary = {"table": table, "capacity": capacity,
               "samples_per_s": workers * args.steps * args.batch_size / (time.perf_counter() - start)}
    if me == 0:
        ids, clicks, teacher = stream.batch(args.test_size, args.steps, seed=0)  # the stream's present
        model.eval()
        with torch.no_grad():
            summary["auc"] = auc(net(ids), clicks)
        summary["teacher_auc"] = auc(teacher, clicks)
        if all(isinstance(t, gradsync.DynamicEmbedding) for t in model.tables):
            summary["resident_rows"] = sum(t.resident_rows for t in model.tables)
        if in_job:
            gradsync.log(acc=summary["auc"])
    return summary


def distinct_ids(args) -> int:
    """Distinct ids per field over the whole stream (all workers), averaged over the fields."""
    stream = Stream(args.fields, args.vocab, args.zipf, args.drift, args.drift_every)
    seen = [set() for _ in range(args.fields)]
    for step in range(args.steps):
        for worker in range(args.workers_of_stream):
            ids, _, _ = stream.batch(args.batch_size, step, seed=1 + step * args.workers_of_stream + worker)
            for f in range(args.fields):
                seen[f].update(ids[:, f].tolist())
    return sum(len(s) for s in seen) // args.fields


TABLES = [("unbounded", "lru"), ("dynamic", "lru"), ("dynamic", "lfu"), ("hashed", "lru")]
"""What `--compare-tables` trains: (table, eviction rule)."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fields", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=200_000, help="popularity ranks per field")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--drift", type=int, default=20, help="new ids taking the head at each drift")
    parser.add_argument("--drift-every", type=int, default=50, help="steps between drifts")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--table", choices=["dynamic", "hashed", "unbounded"], default="dynamic")
    parser.add_argument("--capacity", type=int, default=0,
                        help="rows per table (dynamic: at most; hashed: exactly); 0: half the stream's distinct ids")
    parser.add_argument("--evict", choices=["lru", "lfu"], default="lru")
    parser.add_argument("--ttl-steps", type=int, default=None)
    parser.add_argument("--admit-after", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1024, help="per worker")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument("--compare-tables", action="store_true",
                        help="one process: train every table (unbounded, dynamic lru and lfu, hashed) on the same "
                             "stream and print their AUCs")
    return parser


def compare_tables(args) -> dict:
    """Every table of TABLES trained in this process on the same stream, capacity `args.capacity` (0: half the
    stream's distinct ids per field): the capacity, the distinct ids and each table's summary by name."""
    args.workers_of_stream = 1
    distinct = distinct_ids(args)
    capacity = args.capacity or distinct // 2
    print(f"{distinct} distinct ids per field; capacity {capacity} rows per table")
    out = {"distinct_ids": distinct, "capacity": capacity, "tables": {}}
    for table, evict in TABLES:
        args.evict = evict
        s = train(args, table, capacity, in_job=False)
        name = f"{table} {evict}" if table == "dynamic" else table
        out["tables"][name] = s
        rows = f", {s['resident_rows']} rows resident" if "resident_rows" in s else ""
        print(f"{name:12s} AUC {s['auc']:.4f} (teacher {s['teacher_auc']:.4f}){rows}, "
              f"{s['samples_per_s']:.0f} samples/s")
    return out


def main() -> None:
    args = parser().parse_args()
    if args.compare_tables:
        compare_tables(args)
        return
    in_job = "WORLD_SIZE" in os.environ  # gradsync run (or torchrun) started this process as a rank
    if in_job:
        gradsync.init()
    args.workers_of_stream = gradsync.num_workers() if in_job else 1
    capacity = args.capacity or distinct_ids(args) // 2
    summary = train(args, args.table, capacity, in_job)
    if not in_job or gradsync.worker_rank() == 0:
        rows = f", {summary['resident_rows']} rows resident" if "resident_rows" in summary else ""
        print(f"{args.table} table of {capacity} rows: AUC {summary['auc']:.4f} "
              f"(teacher {summary['teacher_auc']:.4f}){rows}, {summary['samples_per_s']:.0f} samples/s")
    if in_job:
        gradsync.shutdown()


if __name__ == "__main__":
    main()
