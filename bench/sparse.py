"""Where a parameter server wins: a click model whose embedding tables grow, under allreduce, ps and hybrid.

The model and data are examples/ctr.py's: 4 fields (`--fields`), one `nn.Embedding` of R / 4 rows x 32 per field
(R = all rows, fp32), an MLP, Zipf-distributed ids (exponent 1.5), batch 512 per worker, Adagrad
(row-wise on the servers), one thread per process. Under ps and hybrid the tables are built on the meta
device, so no worker ever holds a whole table (the servers initialise them); under allreduce every
worker holds and averages every table, as DDP does.

For each R (`--rows`) and W (`--workers`), each configuration is one job (gradsync.launch, loopback),
in order allreduce, ps (S = 1), hybrid (S = 1), repeated `--repeats` times interleaved. Per job:
worker 0's median step time (after `--warmup` steps), its bytes sent + received per step (gradsync's
metrics; allreduce: a ring's 2 (W - 1) / W of the gradients), CPU-seconds per step of all processes
(/proc), and the peak resident memory (VmHWM) of the largest worker and of the largest server; for
workers also the model's part of it: the peak minus the resident memory before the model was built
(torch, RPC and gloo alone take ~390 MB per process here, whatever the model).
Allreduce is skipped where its workers would not fit this machine's memory (`--memory-gb`).
Writes bench/results/sparse.json and prints a markdown table and the targets (at R >= 10^6: hybrid
>= 3x faster than allreduce, per-worker peak memory >= 10x smaller).

    .venv/bin/python bench/sparse.py [--rows 10000 100000 1000000 10000000] [--workers 2 4]
                                     [--fields 4] [--configs allreduce ps hybrid] [--steps 10] [--warmup 2]
                                     [--repeats 1] [--memory-gb 16] [--out bench/results/sparse.json]
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

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from gradsync.procfs import memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from ctr import ClickLog, CTRModel  # noqa: E402
from overhead import cpu_per_step, cpu_snapshot, job_pids  # noqa: E402

DIM, BATCH, LR = 32, 512, 0.05
CONFIGS = {"allreduce": 0, "ps": 1, "hybrid": 1}
BATCHES = 4  # distinct batches per worker, cycled


def peak_rss() -> dict[int, int]:
    """VmHWM of every process of the job."""
    return {pid: peak for pid in job_pids() if (peak := memory(pid)) is not None}


def worker(strategy: str, rows: int, fields: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    before_model = memory("self", "VmRSS")  # the process with torch, RPC and gloo started: no model yet
    log = ClickLog(fields, rows // fields)
    batches = [log.batch(BATCH, seed=1 + i * workers + me)[:2] for i in range(BATCHES)]
    model = CTRModel(fields, rows // fields, DIM, tables_on=None if strategy == "allreduce" else "meta")
    trainer = gradsync.Trainer(model, torch.optim.Adagrad, lr=LR, table_optimizer=gradsync.RowAdagrad(lr=LR))
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
              "model_rss": memory("self") - before_model}
    if me == 0:
        result.update(cpu_per_step(before, cpu_snapshot(), steps))
        result["rss"] = peak_rss()
        result["metrics"] = trainer.metrics.summary(skip=warmup)
    return result


def allreduce_bytes(rows: int, fields: int, workers: int) -> int:
    """A worker's ring allreduce sends and receives 2 (W - 1) / W of every gradient byte."""
    model = CTRModel(fields, 1, DIM)
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables"))
    return int(2 * 2 * (workers - 1) / workers * 4 * (rows * DIM + dense))


def fits(rows: int, workers: int, memory_gb: float) -> bool:
    """Whether W allreduce workers fit: each holds the tables, their gradients, Adagrad's state and DDP's
    buckets (4 copies), plus 0.5 GB."""
    return workers * (4 * rows * DIM * 4 + 0.5 * 2**30) < memory_gb * 2**30


def run(config: str, rows: int, fields: int, workers: int, steps: int, warmup: int) -> dict:
    results = gradsync.launch(worker, strategy=config, workers=workers, servers=CONFIGS[config],
                              args=(config, rows, fields, steps, warmup), timeout=1800, step_timeout=600,
                              startup_timeout=600)
    first = results[0]
    worker_pids = {r["pid"] for r in results}
    rss = {int(pid): value for pid, value in first["rss"].items()}
    servers = [v for pid, v in rss.items() if pid not in worker_pids]
    metrics = first["metrics"]
    moved = (allreduce_bytes(rows, fields, workers) if config == "allreduce"
             else metrics["bytes_sent"] + metrics["bytes_received"])
    return dict(step_s=first["step_s"], bytes_per_step=moved, cpu_s_per_step=first["cpu_s_per_step"],
                worker_peak_rss=max(v for pid, v in rss.items() if pid in worker_pids),
                worker_model_rss=max(r["model_rss"] for r in results),
                server_peak_rss=max(servers) if servers else 0)


def summarize(runs: dict) -> list[dict]:
    rows_out = []
    for (rows, workers, config), reps in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], list(CONFIGS).index(kv[0][2]))):
        row = dict(rows=rows, workers=workers, config=config,
                   **{k: statistics.median(r[k] for r in reps) for k in reps[0]})
        base = runs.get((rows, workers, "allreduce"))
        if base and config != "allreduce":
            row["speedup_vs_allreduce"] = statistics.median(b["step_s"] / r["step_s"] for r, b in zip(reps, base))
            row["worker_memory_vs_allreduce"] = (statistics.median(b["worker_peak_rss"] for b in base)
                                                 / row["worker_peak_rss"])
            row["model_memory_vs_allreduce"] = (statistics.median(b["worker_model_rss"] for b in base)
                                                / max(row["worker_model_rss"], 2**20))
        rows_out.append(row)
    return rows_out


def table(rows: list[dict]) -> str:
    lines = ["| rows | W | config | ms/step | x faster than allreduce | MB moved/step/worker | CPU-s/step "
             "| worker peak MB (model) | x less worker memory (model) | server peak MB |", "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['rows']:.0e} | {r['workers']} | {r['config']} | {1000 * r['step_s']:.1f} "
            f"| {r.get('speedup_vs_allreduce', float('nan')):.2f} | {r['bytes_per_step'] / 2**20:.2f} "
            f"| {r['cpu_s_per_step']:.3f} | {r['worker_peak_rss'] / 2**20:.0f} ({r['worker_model_rss'] / 2**20:.0f}) "
            f"| {r.get('worker_memory_vs_allreduce', float('nan')):.1f} "
            f"({r.get('model_memory_vs_allreduce', float('nan')):.0f}) | {r['server_peak_rss'] / 2**20:.0f} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["config"] == "hybrid" and r["rows"] >= 10**6 and "speedup_vs_allreduce" in r:
            ok = r["speedup_vs_allreduce"] >= 3 and r["worker_memory_vs_allreduce"] >= 10
            out.append(f"{'PASS' if ok else 'FAIL'} R={r['rows']:.0e} W={r['workers']}: hybrid "
                       f"{r['speedup_vs_allreduce']:.1f}x faster (>= 3), {r['worker_memory_vs_allreduce']:.1f}x "
                       f"less worker peak memory (>= 10; model memory alone: "
                       f"{r['model_memory_vs_allreduce']:.0f}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10**4, 10**5, 10**6, 10**7])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--fields", type=int, default=4, help="tables (one per field), rows / fields rows each")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-gb", type=float, default=16.0, help="memory the allreduce workers may use")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sparse.json"))
    args = parser.parse_args(argv)
    runs: dict = {}
    for _ in range(args.repeats):
        for rows in args.rows:
            for workers in args.workers:
                for config in args.configs:
                    if config == "allreduce" and not fits(rows, workers, args.memory_gb):
                        print(f"skip allreduce R={rows:.0e} W={workers}: does not fit {args.memory_gb} GB", flush=True)
                        continue
                    result = run(config, rows, args.fields, workers, args.steps, args.warmup)
                    print(f"R={rows:.0e} W={workers} {config}: {1000 * result['step_s']:.1f} ms/step", flush=True)
                    runs.setdefault((rows, workers, config), []).append(result)
    summary = summarize(runs)
    print(table(summary))
    for line in targets(summary):
        print(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="bench/sparse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=os.cpu_count(), fields=args.fields, dim=DIM, batch=BATCH, results=summary,
                       targets=targets(summary)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
