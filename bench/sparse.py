"""Embedding tables under every paradigm: sparse-gradient allreduce beside dense-gradient allreduce, ps, hybrid,
sharded tables, and TorchRec's own sharded tables as the outside baseline.

The model and data are examples/ctr.py's: 4 fields (`--fields`), one `nn.Embedding` of R / 4 rows x 32 per
field (R = all rows, fp32), an MLP (128 -> 64 -> 1), batch 512 per worker, one thread per process; `--ids zipf`
(exponent 1.5, the default) or `flat` (uniform over each table's rows: ~5x the distinct rows per batch;
bench/sparse_workload.py). Eight configurations, each one job (loopback):

- `allreduce-sparse`: the tables built with `nn.Embedding(..., sparse=True)`, what a DDP user with large
  tables runs: DDP exchanges each table's gradient as a sparse tensor (gloo: an allgather of every worker's
  touched rows, index and row), and the optimizer (torch's Adagrad or SGD, both take sparse gradients)
  updates only the rows touched. Every worker holds every table (and Adagrad's dense sums).
- `allreduce-dense`: the same tables with dense gradients: DDP averages every row of every table each step.
- `ps` (S = 1), `ps-s2` (S = 2, each server holding the rows whose id hashes to it): tables and MLP on the
  servers; `hybrid` (S = 1): tables on the server, MLP in DDP.
- `sharded`: each table split by row over the W workers (all-to-alls of ids, rows and row gradients), the
  MLP in DDP, no server.
- `torchrec-tw`, `torchrec-rw`: TorchRec's DistributedModelParallel over an EmbeddingBagCollection, a
  table-wise and a row-wise plan, its fused row-wise optimizer, the MLP in DDP (bench/torchrec_baseline.py).
  Optional: they run where torchrec imports (`pip install --no-deps -r bench/requirements-torchrec.txt` beside
  torch 2.13.0 and gradsync), else their rows say "not installed" and the bench goes on.
ps, hybrid, sharded and TorchRec build their tables on the meta device, so no worker holds a whole table (the
server, or each owner, initialises its rows); their table optimizer is the row-wise twin (RowAdagrad, TorchRec's
RowWiseAdagrad: one accumulator per row, the mean of the row's squared gradient; torch's Adagrad keeps one per
element; RowSGD and SGD are the same math).

`--optimizer adagrad` (default) or `sgd` (lr 0.05). Every job sees the same batches (seeded per worker and
step; 4 distinct batches per worker, cycled). Before measuring, `--check` (on by default) runs 5 steps of a
10^4-row model at W = 2 under every configuration to measure, tables starting from the same values, and
compares every parameter (TorchRec: each worker's shards) with single-process training on the workers' joint
batches (bench/sparse_workload.py's `reference`: torch's optimizer on everything for allreduce, the row
optimizer on the tables for the rest); a configuration that parts from it by more than 1e-5 (SGD) or 1e-3
(Adagrad's float noise, `sparse_workload.TOLERANCE`) is not measured.

For each R (`--rows`) and W (`--workers`), the configurations run one after another; the whole grid is
repeated `--repeats` times, interleaved (the order of the configurations reversed on every other repeat),
so that load from other jobs on the machine falls on all of them alike. Per job: worker 0's median step
time (after `--warmup` steps), CPU-seconds per step of all processes (/proc, over worker 0's measured
steps), the peak resident memory (VmHWM) of the largest worker and of the largest server, and bytes per step,
sent + received: per worker (worker 0) and through the busiest link (the process whose link carries most).
ps and hybrid: gradsync's counters (ps's server link carries every worker's bytes, 1 / S of them with S servers;
hybrid's carries their row bytes, their counters less the MLP's ring); allreduce-dense: a ring's 2 (W - 1) / W
of every gradient byte; allreduce-sparse: the ring allgather of the rows each worker's batch touched, 8 + 4 x 32 bytes per row and
table, counted from the batches, plus the MLP's ring; sharded: gradsync's counters (each worker's link carries
its own: the all-to-alls' bytes to and from the other workers, their padding included, and the MLP's ring);
TorchRec: not counted. Each cell is the median over repeats; "vs sparse allreduce" is sparse allreduce's
median divided by the configuration's median, both from the same run (above 1: faster than sparse allreduce;
the same for CPU-seconds). Beside each sharded row, the cost model's prediction (gradsync.compare.costmodel,
`Fit.step_s` with the machine's cores): fitted, per R, on that R's W = 2 runs of the gradsync configurations,
so its W = 4 and 8 predictions use nothing measured there.

A configuration is skipped where its processes would not fit `--memory-gb` (estimated: allreduce-dense 4
copies of the tables per worker, allreduce-sparse 2 with Adagrad and 1 with SGD, the server or the owners
together 1 plus the row state; 0.75 GB per process besides, 1 GB for TorchRec's), and allreduce-dense beyond
`--dense-max-rows` rows or outside `--dense-workers` (its step grows linearly with R: 12 s per step at 10^7
rows, W = 2, in the run before). Runs with more processes than cores are marked time-sliced. A repeat of a
gradsync configuration that fails is left out of its cell's medians and listed in the cell (`failed_repeats`);
the grid goes on, and the bench exits 1 after writing its file.

    .venv/bin/python bench/sparse.py [--rows 100000 1000000 10000000 30000000] [--workers 2 4 8]
        [--configs allreduce-sparse allreduce-dense ps ps-s2 hybrid sharded torchrec-tw torchrec-rw] [--ids zipf]
        [--optimizer adagrad] [--steps 10] [--warmup 2] [--repeats 3] [--memory-gb 16]
        [--out bench/results/sparse_tables_zipf.json]
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
from gradsync.compare import costmodel
from gradsync.launcher.procfs import memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from measure import cpu_per_step, cpu_snapshot, job_pids  # noqa: E402
from sparse_workload import (BATCH, BATCHES, DIM, IDS, LR, TOLERANCE, CTRModel, optimizers,  # noqa: E402
                             reference, worker_batches)

CONFIGS = {"allreduce-sparse": 0, "allreduce-dense": 0, "ps": 1, "ps-s2": 2, "hybrid": 1, "sharded": 0,
           "torchrec-tw": 0, "torchrec-rw": 0}  # -> servers
TORCHREC = ("torchrec-tw", "torchrec-rw")
ROW_WISE = ("ps", "ps-s2", "hybrid", "sharded", *TORCHREC)  # tables trained by a row optimizer, built on the meta device
BASELINE = "allreduce-sparse"
ROW_WIRE = 8 + 4 * DIM  # one row of a sparse gradient on the wire: its int64 index and its fp32 values
GB = 2**30


def peak_rss() -> dict[int, int]:
    """VmHWM of every process of the job."""
    return {pid: peak for pid in job_pids() if (peak := memory(pid)) is not None}


def build(config: str, rows: int, fields: int, optimizer: str, tables_on_cpu: bool = False):
    """The Trainer of `config`; its tables on the meta device where a row optimizer trains them, unless
    `tables_on_cpu` (the check: every configuration starts from the same values)."""
    # torch's sparse Adagrad warns once per process that it builds sparse tensors without invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    model = CTRModel(fields, rows // fields, DIM, tables_on=None if tables_on_cpu or config not in ROW_WISE else "meta",
                     sparse=config == "allreduce-sparse")
    dense, row = optimizers(optimizer)
    return gradsync.Trainer(model, dense, lr=LR, table_optimizer=row)


def train_step(trainer, ids: torch.Tensor, clicks: torch.Tensor) -> None:
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [F.binary_cross_entropy_with_logits(trainer.model(ids), clicks)])
        trainer.step(cid)


def worker(config: str, rows: int, fields: int, steps: int, warmup: int, optimizer: str, ids: str) -> dict:
    torch.set_num_threads(1)
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    before_model = memory("self", "VmRSS")  # the process with torch, RPC and gloo started: no model yet
    batches = worker_batches(fields, rows // fields, ids, me, workers)
    touched = [sum(int(batch[:, f].unique().numel()) for f in range(fields)) for batch, _ in batches]
    trainer = build(config, rows, fields, optimizer)
    times, before = [], {}
    for i in range(warmup + steps):
        if i == warmup and me == 0:
            before = cpu_snapshot()
        t0 = time.perf_counter()
        train_step(trainer, *batches[i % BATCHES])
        times.append(time.perf_counter() - t0)
    metrics = trainer.metrics.summary(skip=warmup)
    result = {"pid": os.getpid(), "step_s": statistics.median(times[warmup:]),
              "model_rss": memory("self") - before_model,
              "touched_rows": statistics.fmean(touched[i % BATCHES] for i in range(warmup, warmup + steps)),
              "counted_bytes": metrics["bytes_sent"] + metrics["bytes_received"]}
    if me == 0:
        result.update(cpu_per_step(before, cpu_snapshot(), steps))
        result["rss"] = peak_rss()
        result["metrics"] = metrics
    return result


def dense_elements(fields: int) -> int:
    model = CTRModel(fields, 1, DIM, tables_on="meta")
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables"))


def ring_bytes(elements: int, workers: int) -> float:
    """Bytes a worker sends + receives in a ring allreduce of `elements` fp32 values."""
    return 2 * costmodel.traffic(costmodel.Config("allreduce", 1, elements), workers)[0]


def allreduce_bytes(config: str, rows: int, fields: int, touched: list[float]) -> float:
    """Bytes worker 0 sends + receives per step under allreduce. Dense: a ring moves 2 (W - 1) / W of every
    gradient byte each way. Sparse: the MLP as dense, and each table's rows as a ring allgather (gloo's
    sparse allreduce): worker 0 receives every other worker's touched rows and sends on all but its right
    neighbour's. `touched`: each worker's rows touched per step, all tables."""
    workers = len(touched)
    if config == "allreduce-dense":
        return ring_bytes(rows * DIM + dense_elements(fields), workers)
    if workers == 1:
        return 0.0
    received = sum(touched[1:]) * ROW_WIRE
    sent = (sum(touched) - touched[1]) * ROW_WIRE
    return ring_bytes(dense_elements(fields), workers) + received + sent


def link_bytes(config: str, results: list[dict], rows: int, fields: int) -> tuple[float, float] | tuple[None, None]:
    """(bytes worker 0 sends + receives per step, the same through the busiest link) of a finished job (module
    docstring); (None, None) for TorchRec."""
    workers = len(results)
    if config.startswith("allreduce"):
        moved = allreduce_bytes(config, rows, fields, [r["touched_rows"] for r in results])
        return moved, moved
    if config == "sharded":
        return results[0]["counted_bytes"], max(r["counted_bytes"] for r in results)
    if strategy(config) == "ps":  # the rows spread over the servers by the id hash: evenly
        return results[0]["counted_bytes"], sum(r["counted_bytes"] for r in results) / CONFIGS[config]
    if config == "hybrid":
        ring = ring_bytes(dense_elements(fields), workers)
        server = sum(max(0.0, r["counted_bytes"] - ring) for r in results)
        return results[0]["counted_bytes"], max(server, *(r["counted_bytes"] for r in results))
    return None, None


def memory_needed(config: str, rows: int, workers: int, optimizer: str) -> float:
    """Bytes the job's processes are estimated to need (0.75 GB per process besides the tables, 1 GB under
    TorchRec)."""
    table = rows * DIM * 4
    if config == "allreduce-dense":
        return workers * (4 * table + 0.75 * GB)
    if config == "allreduce-sparse":
        return workers * ((2 if optimizer == "adagrad" else 1) * table + 0.75 * GB)
    row_state = rows * 4 if optimizer == "adagrad" else 0
    if config in TORCHREC:
        return workers * GB + table + row_state
    if config == "sharded":  # each owner also keeps its rows' ids
        return workers * 0.75 * GB + table + row_state + 8 * rows
    return workers * 0.75 * GB + table + row_state + CONFIGS[config] * 0.75 * GB


def strategy(config: str) -> str:
    """The gradsync strategy of a configuration ("ps-s2": ps)."""
    return config.split("-")[0]


def launch(fn, config: str, workers: int, args: tuple, timeout: float) -> list:
    return gradsync.launch(fn, strategy=strategy(config), workers=workers, servers=CONFIGS[config], args=args,
                           timeout=timeout, step_timeout=timeout / 3, startup_timeout=timeout / 3)


def run(config: str, rows: int, fields: int, workers: int, steps: int, warmup: int, optimizer: str, ids: str,
        timeout: float) -> dict:
    started = time.perf_counter()
    if config in TORCHREC:
        import torchrec_baseline

        results = torchrec_baseline.run(config, rows, fields, workers, steps, warmup, optimizer, ids, timeout)
        for r in results:
            r["touched_rows"] = None
    else:
        results = launch(worker, config, workers, (config, rows, fields, steps, warmup, optimizer, ids), timeout)
    first = results[0]
    worker_pids = {r["pid"] for r in results}
    rss = {int(pid): value for pid, value in first["rss"].items()}
    server_rss = [v for pid, v in rss.items() if pid not in worker_pids]
    moved, busiest = link_bytes(config, results, rows, fields)
    return dict(step_s=first["step_s"], bytes_per_step=moved, busiest_link_bytes_per_step=busiest,
                cpu_s_per_step=first["cpu_s_per_step"],
                worker_peak_rss=max(v for pid, v in rss.items() if pid in worker_pids),
                worker_model_rss=max(r["model_rss"] for r in results),
                server_peak_rss=max(server_rss) if server_rss else 0,
                touched_rows=None if config in TORCHREC else statistics.fmean(r["touched_rows"] for r in results),
                job_s=time.perf_counter() - started)


CHECK_ROWS, CHECK_STEPS, CHECK_WORKERS = 10**4, 5, 2


def check_worker(config: str, optimizer: str, ids: str) -> dict:
    torch.set_num_threads(1)
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    fields = 4
    trainer = build(config, CHECK_ROWS, fields, optimizer, tables_on_cpu=True)
    batches = worker_batches(fields, CHECK_ROWS // fields, ids, me, workers)
    for i in range(CHECK_STEPS):
        train_step(trainer, *batches[i % BATCHES])
    return {k: v.clone() for k, v in trainer.state_dict().items()} if me == 0 else {}


def check(configs: list[str], optimizer: str, ids: str, timeout: float) -> dict[str, float | str]:
    """Max |difference| of every parameter from single-process training on the joint batches, per
    configuration (5 steps, W = 2, 10^4 rows; TorchRec: over every worker's shards); TorchRec's configurations
    say why they did not run where torchrec does not import or fails."""
    references = {row_wise: reference(4, CHECK_ROWS, ids, CHECK_WORKERS, CHECK_STEPS, optimizer, row_wise)
                  for row_wise in (False, True)}
    out = {}
    for config in configs:
        if config in TORCHREC:
            out[config] = torchrec_missing() or torchrec_check(config, optimizer, ids, timeout)
        else:
            state = launch(check_worker, config, CHECK_WORKERS, (config, optimizer, ids), timeout)[0]
            expected = references[config in ROW_WISE]
            out[config] = max(float((state[k] - expected[k]).abs().max()) for k in expected)
        said = out[config] if isinstance(out[config], str) else f"max |difference| {out[config]:.2e}"
        print(f"check, {CHECK_STEPS} steps, W = {CHECK_WORKERS}, 10^4 rows, {ids} ids, {optimizer}: {config} against "
              f"single-process training: {said}", flush=True)
    return out


def torchrec_missing() -> str | None:
    """Why TorchRec's configurations do not run here (not installed), or None."""
    import torchrec_baseline

    return torchrec_baseline.missing()


def torchrec_check(config: str, optimizer: str, ids: str, timeout: float) -> float | str:
    import torchrec_baseline

    try:
        return torchrec_baseline.check(config, optimizer, ids, timeout)
    except Exception as e:  # a plan DMP cannot run here: said in its row, the other plans go on
        return failure(e)


def failure(e: Exception) -> str:
    """A TorchRec configuration's row when it failed: the exception's type and last line (a rank's
    exception ends with the error itself)."""
    lines = str(e).strip().splitlines()
    return f"failed: {type(e).__name__}: {lines[-1] if lines else ''}"


def costmodel_config(row: dict, fields: int) -> costmodel.Config:
    """The cost model's config of a measured gradsync row: a worker's rows per step at ROW_WIRE bytes each."""
    config, dense = row["config"], dense_elements(fields)
    row_bytes = round(row["touched_rows"] * ROW_WIRE)
    if config == "allreduce-dense":
        return costmodel.Config("allreduce", BATCH, dense, tables=row["rows"] * DIM)
    if config == "allreduce-sparse":
        return costmodel.Config("allreduce", BATCH, dense, sparse_tables=fields, row_bytes=row_bytes)
    if config == "sharded":
        return costmodel.Config("sharded", BATCH, dense, row_bytes=row_bytes, sharded_tables=fields)
    return costmodel.Config(strategy(config), BATCH, dense, row_bytes=row_bytes, servers=CONFIGS[config])


def predict(rows_out: list[dict], fields: int, cores: int) -> None:
    """Add to each measured sharded row the cost model's step time, fitted on the W = 2 runs of the gradsync
    configurations at its R (`predicted_step_s`, `predicted_vs_measured`), or why there is no fit."""
    for rows in sorted({r["rows"] for r in rows_out}):
        measured = [r for r in rows_out if r["rows"] == rows and "step_s" in r and r["config"] not in TORCHREC]
        fitted = [costmodel.Run(costmodel_config(r, fields), r["workers"], r["step_s"], cores=cores)
                  for r in measured if r["workers"] == 2]
        try:
            fit = costmodel.fit(fitted)
        except ValueError as e:
            fit, why = None, f"no fit: {e}"
        for r in measured:
            if r["config"] != "sharded":
                continue
            if fit is None:
                r["predicted"] = why
                continue
            r["predicted_step_s"] = fit.step_s(costmodel_config(r, fields), r["workers"], cores=cores)
            r["predicted_vs_measured"] = r["predicted_step_s"] / r["step_s"]
            r["predicted"] = "fitted here" if r["workers"] == 2 else "predicted from W = 2"


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
                   **{k: None if reps[0][k] is None else statistics.median(r[k] for r in reps) for k in reps[0]})
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
         "ps": "ps S=1", "ps-s2": "ps S=2", "hybrid": "hybrid S=1", "sharded": "sharded", "torchrec-tw": "TorchRec table-wise",
         "torchrec-rw": "TorchRec row-wise"}
COLUMNS = 12


def table(rows: list[dict], optimizer: str) -> str:
    opt = {"adagrad": ("Adagrad", "RowAdagrad", "fused RowWiseAdagrad"),
           "sgd": ("SGD", "RowSGD", "fused SGD")}[optimizer]
    lines = ["| rows R | W | config (optimizer of the tables) | ms/step | x vs sparse allreduce (step) "
             "| CPU-s/step, all processes | x vs sparse allreduce (CPU) | MB moved/step/worker "
             "| MB/step, busiest link | worker peak MB (model) | server peak MB | cost model ms (/ measured) |",
             "|" + "---|" * COLUMNS]
    mb = lambda value: "" if value is None else f"{value / 2**20:.2f}"  # noqa: E731
    for r in rows:
        name = f"{LABEL[r['config']]} ({opt[(r['config'] in ROW_WISE) + (r['config'] in TORCHREC)]})"
        if "skipped" in r:
            lines.append(f"| {r['rows']:.0e} | {r['workers']} | {name} | skipped: {r['skipped']} |"
                         + " |" * (COLUMNS - 4))
            continue
        sliced = f" (time-sliced: {r['processes']} processes)" if r["time_sliced"] else ""
        ratio = lambda key: f"{r[key]:.2f}" if key in r else ""  # noqa: E731
        predicted = (f"{1000 * r['predicted_step_s']:.1f} ({r['predicted_vs_measured']:.2f}, {r['predicted']})"
                     if "predicted_step_s" in r else r.get("predicted", ""))
        lines.append(
            f"| {r['rows']:.0e} | {r['workers']}{sliced} | {name} | {1000 * r['step_s']:.1f} "
            f"| {ratio('vs_sparse_allreduce')} | {r['cpu_s_per_step']:.3f} | {ratio('cpu_vs_sparse_allreduce')} "
            f"| {mb(r['bytes_per_step'])} | {mb(r['busiest_link_bytes_per_step'])} "
            f"| {r['worker_peak_rss'] / 2**20:.0f} ({r['worker_model_rss'] / 2**20:.0f}) "
            f"| {r['server_peak_rss'] / 2**20:.0f} | {predicted} |")
    return "\n".join(lines)


def skip_reason(config: str, rows: int, workers: int, args, parity: dict) -> str | None:
    """Why `config` is not run at R = rows, W = workers, or None."""
    if isinstance(parity.get(config), str):
        return parity[config]
    tolerance = TOLERANCE[args.optimizer]
    if parity.get(config, 0.0) > tolerance:
        return f"failed the parity check (max |difference| {parity[config]:.1e} > {tolerance:g})"
    if config in TORCHREC and (missing := torchrec_missing()):
        return missing
    if config == "allreduce-dense" and (rows > args.dense_max_rows or workers not in args.dense_workers):
        return "not run (dense-gradient step grows with R)"
    need = memory_needed(config, rows, workers, args.optimizer)
    if need > args.memory_gb * GB:
        return f"needs ~{need / GB:.0f} GB, over {args.memory_gb:g} GB"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="TorchRec rows: pip install --no-deps -r bench/requirements-torchrec.txt "
                                            "(torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0 beside torch 2.13.0); without "
                                            "it they say 'not installed'")
    parser.add_argument("--rows", type=int, nargs="+", default=[10**5, 10**6, 10**7, 3 * 10**7])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--fields", type=int, default=4, help="tables (one per field), rows / fields rows each")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--ids", choices=IDS, default="zipf", help="Zipf ids (exponent 1.5) or uniform ones")
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gb", type=float, default=16.0, help="memory one job's processes may use")
    parser.add_argument("--dense-max-rows", type=int, default=10**6, help="allreduce-dense up to these rows")
    parser.add_argument("--dense-workers", type=int, nargs="+", default=[2, 4], help="allreduce-dense at these W")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one job may take")
    parser.add_argument("--no-check", action="store_true", help="skip the parity check before measuring")
    parser.add_argument("--out", help="result file (default bench/results/sparse_tables_IDS.json)")
    args = parser.parse_args(argv)
    out_path = args.out or os.path.join(HERE, "results", f"sparse_tables_{args.ids}.json")
    started = time.perf_counter()
    parity = {} if args.no_check else check(args.configs, args.optimizer, args.ids, args.timeout)
    runs: dict = {}
    failed: dict = {}  # (rows, workers, config): each failed repeat's `failure`, of gradsync's configurations
    for repeat in range(args.repeats):
        for rows in args.rows:
            for workers in args.workers:
                configs = args.configs if repeat % 2 == 0 else args.configs[::-1]
                for config in configs:
                    if reason := skip_reason(config, rows, workers, args, parity):
                        runs[(rows, workers, config)] = {"skipped": reason}
                        continue
                    try:
                        result = run(config, rows, args.fields, workers, args.steps, args.warmup, args.optimizer,
                                     args.ids, args.timeout)
                    except Exception as e:
                        if config in TORCHREC:
                            runs[(rows, workers, config)] = {"skipped": failure(e)}
                            continue
                        failed.setdefault((rows, workers, config), []).append(failure(e))
                        print(f"[{time.perf_counter() - started:.0f}s] repeat {repeat} R={rows:.0e} W={workers} "
                              f"{config}: FAILED, {failure(e)}", flush=True)
                        continue
                    print(f"[{time.perf_counter() - started:.0f}s] repeat {repeat} R={rows:.0e} W={workers} "
                          f"{config}: {1000 * result['step_s']:.1f} ms/step, job {result['job_s']:.0f} s",
                          flush=True)
                    runs.setdefault((rows, workers, config), []).append(result)
    for key, failures in failed.items():  # a repeat that failed is kept out of the medians, and said
        runs[key] = runs[key] if key in runs else {"skipped": f"failed in every repeat: {failures[0]}"}
    cores = os.cpu_count()
    summary = summarize(runs, cores)
    for row in summary:
        row["failed_repeats"] = failed.get((row["rows"], row["workers"], row["config"]), [])
    predict(summary, args.fields, cores)
    print(table(summary, args.optimizer))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(dict(command="bench/sparse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=cores, memory_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1),
                       torch=torch.__version__, fields=args.fields, dim=DIM, batch=BATCH, lr=LR, ids=args.ids,
                       optimizer=args.optimizer, parity_check=parity, wall_s=time.perf_counter() - started,
                       results=summary, table=table(summary, args.optimizer)), f, indent=1)
    for (rows, workers, config), failures in failed.items():
        print(f"FAILED: R={rows:.0e} W={workers} {config}, {len(failures)} of {args.repeats} repeats: {failures[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
