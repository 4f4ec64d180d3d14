"""Embedding tables against allreduce at its best: sparse-gradient allreduce beside dense-gradient allreduce, ps
and hybrid.

The model and data are examples/ctr.py's: 4 fields (`--fields`), one `nn.Embedding` of R / 4 rows x 32 per
field (R = all rows, fp32), an MLP (128 -> 64 -> 1), Zipf-distributed ids (exponent 1.5), batch 512 per
worker, one thread per process. Four configurations, each one job (gradsync.launch, loopback):

- `allreduce-sparse`: the tables built with `nn.Embedding(..., sparse=True)`, what a DDP user with large
  tables runs: DDP exchanges each table's gradient as a sparse tensor (gloo: an allgather of every worker's
  touched rows, index and row), and the optimizer (torch's Adagrad or SGD, both take sparse gradients)
  updates only the rows touched. Every worker holds every table (and Adagrad's dense sums).
- `allreduce-dense`: the same tables with dense gradients: DDP averages every row of every table each step.
- `ps` (S = 1): tables and MLP on the server; `hybrid` (S = 1): tables on the server, MLP in DDP. Their
  tables are built on the meta device, so no worker holds one (the server initialises it); the table
  optimizer is the row-wise twin (RowAdagrad: one accumulator per row, the mean of the row's squared
  gradient; torch's Adagrad keeps one per element; RowSGD and SGD are the same math).

`--optimizer adagrad` (default) or `sgd` (lr 0.05). Every job sees the same batches (seeded per worker and
step; 4 distinct batches per worker, cycled). Before measuring, `--check` (on by default) runs 5 steps of a
10^4-row model at W = 2 under allreduce-sparse with SGD and under hybrid with RowSGD and compares every
parameter (they must match to float rounding), and does the same with Adagrad / RowAdagrad to show how far
the two Adagrads part.

For each R (`--rows`) and W (`--workers`), the configurations run one after another; the whole grid is
repeated `--repeats` times, interleaved (the order of the configurations reversed on every other repeat),
so that load from other jobs on the machine falls on all of them alike. Per job: worker 0's median step
time (after `--warmup` steps), CPU-seconds per step of all processes (/proc, over worker 0's measured
steps), the peak resident memory (VmHWM) of the largest worker and of the largest server, and the bytes a
worker sends + receives per step (ps/hybrid: gradsync's counters; allreduce-dense: a ring's 2 (W - 1) / W
of every gradient byte; allreduce-sparse: the ring allgather of the rows each worker's batch touched, 8 + 4 x
32 bytes per row and table, counted from the batches, plus the MLP's ring allreduce). Each cell is the
median over repeats; "vs sparse allreduce" is sparse allreduce's median divided by the configuration's
median, both from the same run (above 1: faster than sparse allreduce; the same for CPU-seconds).

A configuration is skipped where its processes would not fit `--memory-gb` (estimated: allreduce-dense 4
copies of the tables per worker, allreduce-sparse 2 with Adagrad and 1 with SGD, the server 1 plus the row
state; 0.75 GB per process besides), and allreduce-dense beyond `--dense-max-rows` rows or outside
`--dense-workers` (its step grows linearly with R: 12 s per step at 10^7 rows, W = 2, in the run before).
Runs with more processes than cores are marked time-sliced.

    .venv/bin/python bench/sparse.py [--rows 100000 1000000 10000000 30000000] [--workers 2 4 8]
        [--configs allreduce-sparse allreduce-dense ps hybrid] [--optimizer adagrad] [--steps 10] [--warmup 2]
        [--repeats 3] [--memory-gb 16] [--out bench/results/sparse_allreduce.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from gradsync.launcher.procfs import memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from ctr import ClickLog, CTRModel  # noqa: E402
from measure import cpu_per_step, cpu_snapshot, job_pids  # noqa: E402

DIM, BATCH, LR = 32, 512, 0.05
CONFIGS = {"allreduce-sparse": 0, "allreduce-dense": 0, "ps": 1, "hybrid": 1}  # -> servers
BASELINE = "allreduce-sparse"
BATCHES = 4  # distinct batches per worker, cycled
ROW_WIRE = 8 + 4 * DIM  # one row of a sparse gradient on the wire: its int64 index and its fp32 values
GB = 2**30


def peak_rss() -> dict[int, int]:
    """VmHWM of every process of the job."""
    return {pid: peak for pid in job_pids() if (peak := memory(pid)) is not None}


def optimizers(name: str):
    """(dense optimizer class, row optimizer of the served tables) for `--optimizer`."""
    if name == "sgd":
        return torch.optim.SGD, gradsync.RowSGD(lr=LR)
    return torch.optim.Adagrad, gradsync.RowAdagrad(lr=LR)


def build(config: str, rows: int, fields: int, optimizer: str):
    # torch's sparse Adagrad warns once per process that it builds sparse tensors without invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    model = CTRModel(fields, rows // fields, DIM, tables_on="meta" if config in ("ps", "hybrid") else None,
                     sparse=config == "allreduce-sparse")
    dense, row = optimizers(optimizer)
    return gradsync.Trainer(model, dense, lr=LR, table_optimizer=row)


def worker(config: str, rows: int, fields: int, steps: int, warmup: int, optimizer: str) -> dict:
    torch.set_num_threads(1)
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    before_model = memory("self", "VmRSS")  # the process with torch, RPC and gloo started: no model yet
    log = ClickLog(fields, rows // fields)
    batches = [log.batch(BATCH, seed=1 + i * workers + me)[:2] for i in range(BATCHES)]
    touched = [sum(int(ids[:, f].unique().numel()) for f in range(fields)) for ids, _ in batches]
    trainer = build(config, rows, fields, optimizer)
    times, before = [], {}
    for i in range(warmup + steps):
        if i == warmup and me == 0:
            before = cpu_snapshot()
        ids, clicks = batches[i % BATCHES]
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.binary_cross_entropy_with_logits(trainer.model(ids), clicks)])
            trainer.step(cid)
        times.append(time.perf_counter() - t0)
    result = {"pid": os.getpid(), "step_s": statistics.median(times[warmup:]),
              "model_rss": memory("self") - before_model,
              "touched_rows": statistics.fmean(touched[i % BATCHES] for i in range(warmup, warmup + steps))}
    if me == 0:
        result.update(cpu_per_step(before, cpu_snapshot(), steps))
        result["rss"] = peak_rss()
        result["metrics"] = trainer.metrics.summary(skip=warmup)
    return result


def dense_elements(fields: int) -> int:
    model = CTRModel(fields, 1, DIM)
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables"))


def allreduce_bytes(config: str, rows: int, fields: int, touched: list[float]) -> float:
    """Bytes worker 0 sends + receives per step under allreduce. Dense: a ring moves 2 (W - 1) / W of every
    gradient byte each way. Sparse: the MLP as dense, and each table's rows as a ring allgather (gloo's
    sparse allreduce): worker 0 receives every other worker's touched rows and sends on all but its right
    neighbour's. `touched`: each worker's rows touched per step, all tables."""
    workers = len(touched)
    ring = 2 * 2 * (workers - 1) / workers * 4
    if config == "allreduce-dense":
        return ring * (rows * DIM + dense_elements(fields))
    if workers == 1:
        return 0.0
    received = sum(touched[1:]) * ROW_WIRE
    sent = (sum(touched) - touched[1]) * ROW_WIRE
    return ring * dense_elements(fields) + received + sent


def memory_needed(config: str, rows: int, workers: int, optimizer: str) -> float:
    """Bytes the job's processes are estimated to need (0.75 GB per process besides the tables)."""
    table = rows * DIM * 4
    if config == "allreduce-dense":
        return workers * (4 * table + 0.75 * GB)
    if config == "allreduce-sparse":
        return workers * ((2 if optimizer == "adagrad" else 1) * table + 0.75 * GB)
    row_state = rows * 4 if optimizer == "adagrad" else 0
    return workers * 0.75 * GB + CONFIGS[config] * (table + row_state + 0.75 * GB)


def servers(config: str) -> int:
    return 1 if config.startswith(("ps", "hybrid")) else 0


def run(config: str, rows: int, fields: int, workers: int, steps: int, warmup: int, optimizer: str) -> dict:
    started = time.perf_counter()
    results = gradsync.launch(worker, strategy=config.split("-")[0], workers=workers, servers=servers(config),
                              args=(config, rows, fields, steps, warmup, optimizer), timeout=1800,
                              step_timeout=600, startup_timeout=600)
    first = results[0]
    worker_pids = {r["pid"] for r in results}
    rss = {int(pid): value for pid, value in first["rss"].items()}
    server_rss = [v for pid, v in rss.items() if pid not in worker_pids]
    metrics = first["metrics"]
    moved = (allreduce_bytes(config, rows, fields, [r["touched_rows"] for r in results])
             if config.startswith("allreduce") else metrics["bytes_sent"] + metrics["bytes_received"])
    return dict(step_s=first["step_s"], bytes_per_step=moved, cpu_s_per_step=first["cpu_s_per_step"],
                worker_peak_rss=max(v for pid, v in rss.items() if pid in worker_pids),
                worker_model_rss=max(r["model_rss"] for r in results),
                server_peak_rss=max(server_rss) if server_rss else 0,
                touched_rows=statistics.fmean(r["touched_rows"] for r in results),
                job_s=time.perf_counter() - started)


def check_worker(config: str, optimizer: str) -> dict:
    torch.set_num_threads(1)
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    fields, rows = 4, 10**4
    log = ClickLog(fields, rows // fields)
    trainer = build(config, rows, fields, optimizer)
    for i in range(5):
        ids, clicks, _ = log.batch(BATCH, seed=1 + i * workers + me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.binary_cross_entropy_with_logits(trainer.model(ids), clicks)])
            trainer.step(cid)
    return {k: v.clone() for k, v in trainer.state_dict().items()} if me == 0 else {}


def check() -> dict:
    """Max |difference| of every parameter after 5 steps at W = 2: allreduce-sparse vs hybrid, SGD / RowSGD
    (must be float rounding) and Adagrad / RowAdagrad (different math). The hybrid tables here start from
    the same values as allreduce's (built on the CPU, not on the meta device)."""
    out = {}
    for optimizer in ("sgd", "adagrad"):
        states = {config: gradsync.launch(check_worker, strategy=config.split("-")[0], workers=2,
                                          servers=servers(config), args=(config, optimizer))[0]
                  for config in ("allreduce-sparse", "hybrid-cpu")}
        a, h = states["allreduce-sparse"], states["hybrid-cpu"]
        out[optimizer] = max(float((a[k] - h[k]).abs().max()) for k in a)
        print(f"check, 5 steps, W = 2, 10^4 rows: allreduce-sparse ({optimizer}) vs hybrid "
              f"({'RowSGD' if optimizer == 'sgd' else 'RowAdagrad'}): max |difference| {out[optimizer]:.2e}",
              flush=True)
    return out


def summarize(runs: dict, cores: int) -> list[dict]:
    order = list(CONFIGS)
    rows_out = []
    for (rows, workers, config), reps in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                            order.index(kv[0][2]))):
        if "skipped" in reps:
            rows_out.append(dict(rows=rows, workers=workers, config=config, skipped=reps["skipped"]))
            continue
        row = dict(rows=rows, workers=workers, config=config, repeats=len(reps),
                   processes=workers + CONFIGS[config], time_sliced=workers + CONFIGS[config] > cores,
                   **{k: statistics.median(r[k] for r in reps) for k in reps[0]})
        row["step_ms_repeats"] = [1000 * r["step_s"] for r in reps]
        base = runs.get((rows, workers, BASELINE))
        if isinstance(base, list) and config != BASELINE:
            ratios(row, {k: statistics.median(b[k] for b in base)
                         for k in ("step_s", "cpu_s_per_step", "worker_peak_rss")})
        rows_out.append(row)
    return rows_out


def ratios(row: dict, base: dict) -> None:
    """Ratios of medians against sparse allreduce's medians of the same run (above 1: row is better)."""
    row["vs_sparse_allreduce"] = base["step_s"] / row["step_s"]
    row["cpu_vs_sparse_allreduce"] = base["cpu_s_per_step"] / row["cpu_s_per_step"]
    row["worker_memory_vs_sparse_allreduce"] = base["worker_peak_rss"] / row["worker_peak_rss"]


LABEL = {"allreduce-sparse": "allreduce, sparse grads", "allreduce-dense": "allreduce, dense grads",
         "ps": "ps S=1", "hybrid": "hybrid S=1"}


def table(rows: list[dict], optimizer: str) -> str:
    opt = {"adagrad": ("Adagrad", "RowAdagrad"), "sgd": ("SGD", "RowSGD")}[optimizer]
    lines = ["| rows R | W | config (optimizer of the tables) | ms/step | x vs sparse allreduce (step) "
             "| CPU-s/step, all processes | x vs sparse allreduce (CPU) | MB moved/step/worker "
             "| worker peak MB (model) | server peak MB |", "|" + "---|" * 10]
    for r in rows:
        name = f"{LABEL[r['config']]} ({opt[r['config'] in ('ps', 'hybrid')]})"
        if "skipped" in r:
            lines.append(f"| {r['rows']:.0e} | {r['workers']} | {name} | skipped: {r['skipped']} |" + " |" * 6)
            continue
        sliced = f" (time-sliced: {r['processes']} processes)" if r["time_sliced"] else ""
        ratio = lambda key: f"{r[key]:.2f}" if key in r else ""  # noqa: E731
        lines.append(
            f"| {r['rows']:.0e} | {r['workers']}{sliced} | {name} | {1000 * r['step_s']:.1f} "
            f"| {ratio('vs_sparse_allreduce')} | {r['cpu_s_per_step']:.3f} | {ratio('cpu_vs_sparse_allreduce')} "
            f"| {r['bytes_per_step'] / 2**20:.2f} | {r['worker_peak_rss'] / 2**20:.0f} "
            f"({r['worker_model_rss'] / 2**20:.0f}) | {r['server_peak_rss'] / 2**20:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10**5, 10**6, 10**7, 3 * 10**7])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--fields", type=int, default=4, help="tables (one per field), rows / fields rows each")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gb", type=float, default=16.0, help="memory one job's processes may use")
    parser.add_argument("--dense-max-rows", type=int, default=10**6, help="allreduce-dense up to these rows")
    parser.add_argument("--dense-workers", type=int, nargs="+", default=[2, 4], help="allreduce-dense at these W")
    parser.add_argument("--no-check", action="store_true", help="skip the parity check before measuring")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sparse_allreduce.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    parity = {} if args.no_check else check()
    runs: dict = {}
    for repeat in range(args.repeats):
        for rows in args.rows:
            for workers in args.workers:
                configs = args.configs if repeat % 2 == 0 else args.configs[::-1]
                for config in configs:
                    need = memory_needed(config, rows, workers, args.optimizer)
                    if config == "allreduce-dense" and (rows > args.dense_max_rows
                                                        or workers not in args.dense_workers):
                        runs[(rows, workers, config)] = {"skipped": "not run (dense-gradient step grows with R)"}
                        continue
                    if need > args.memory_gb * GB:
                        runs[(rows, workers, config)] = {
                            "skipped": f"needs ~{need / GB:.0f} GB, over {args.memory_gb:g} GB"}
                        continue
                    result = run(config, rows, args.fields, workers, args.steps, args.warmup, args.optimizer)
                    print(f"[{time.perf_counter() - started:.0f}s] repeat {repeat} R={rows:.0e} W={workers} "
                          f"{config}: {1000 * result['step_s']:.1f} ms/step, job {result['job_s']:.0f} s",
                          flush=True)
                    runs.setdefault((rows, workers, config), []).append(result)
    cores = os.cpu_count()
    summary = summarize(runs, cores)
    print(table(summary, args.optimizer))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="bench/sparse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=cores, memory_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1),
                       fields=args.fields, dim=DIM, batch=BATCH, lr=LR, optimizer=args.optimizer,
                       parity_check=parity, wall_s=time.perf_counter() - started, results=summary,
                       table=table(summary, args.optimizer)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
