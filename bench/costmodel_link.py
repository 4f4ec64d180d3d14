"""Checks `gradsync compare --predict`'s cost model under emulated links: fit on W = 2, predict W = 3 and 4.

For each link rate, `gradsync compare --link RATE` runs a workload's strategies at W = 2, 3 and 4:
- `--workload mlp` (the default): allreduce, ps sync S=1 and ps sync S=2; this file is also the training
  script: a 2.1M-parameter MLP, 1024 -> 1024 -> 1024 -> 10, batch 32, SGD, so 8.4 MB of fp32 gradients per
  step and 100mbit is dominated by the link;
- `--workload tables`: allreduce with sparse table gradients, ps sync S=1 and sharded, on examples/ctr.py
  (`TABLES_ARGS`: 4 tables of 10^5 rows of 32, Zipf ids, batch 512 per worker, row-wise Adagrad), where the
  tables' rows are what crosses the link.
The model is fitted on the W = 2 runs alone (`gradsync.compare.predict.fitted`, as --predict does) and predicts W = 3 and 4: for
separate machines (what --predict reports), for this machine, where the workers' compute is time-sliced on
its cores (`cores=`), and with the runs' fixed cost taken as a latency per message instead of per step.
Each run appends a session (when it ran, the load average, every run's measurements) to
bench/results/costmodel_link.json (or `--out`) and prints each session's table; `--refit` analyses the stored
sessions again with the current model, without running a job. `--steps N` trains every job N steps instead of
the link's default. The machine is shared: compare sessions only with their load in mind.

    PYTHONPATH=$PWD .venv/bin/python bench/costmodel_link.py [--links 1gbit 100mbit] [--workers 2 3 4]
                                                             [--workload mlp|tables]
    PYTHONPATH=$PWD .venv/bin/python bench/costmodel_link.py --refit

Needs root and iproute2 (--link). 8 to 15 minutes on a 2-core machine, by its load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "costmodel_link.json")
SIZES, BATCH = (1024, 1024, 1024, 10), 32
TABLES_ARGS = ["--fields", "4", "--rows", "100000", "--dim", "32", "--batch-size", "512", "--test-size", "1000",
               "--sparse-grad"]
"""examples/ctr.py's arguments in the tables workload (`--steps` is added per link)."""
STEPS = {"1gbit": 12, "100mbit": 7}


def train(steps: int) -> None:
    """The training script each rank runs (`--train`): the MLP on deterministic random batches."""
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch import nn

    import gradsync

    gradsync.init()
    torch.manual_seed(0)
    layers = [m for i, o in zip(SIZES, SIZES[1:]) for m in (nn.Linear(i, o), nn.ReLU())][:-1]
    trainer = gradsync.Trainer(nn.Sequential(*layers), torch.optim.SGD, lr=0.01)
    g = torch.Generator().manual_seed(gradsync.worker_rank())
    for _ in range(steps):
        x, y = torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(x), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        gradsync.log(loss=loss.item(), samples=BATCH)
    gradsync.shutdown()


def measure(workload: str, link: str, workers: int, steps: int, out: str) -> list[dict]:
    """The compare's runs of `workload` (module docstring) at this link and W, each `steps` steps."""
    from gradsync.compare import CompareOptions, compare

    if workload == "tables":
        script, args = os.path.join(ROOT, "examples", "ctr.py"), [*TABLES_ARGS, "--steps", str(steps)]
        strategies, servers = ["allreduce", "ps", "sharded"], [1]
    else:
        script, args = os.path.abspath(__file__), ["--train", str(steps)]
        strategies, servers = ["allreduce", "ps"], [1, 2]
    compare(CompareOptions(script=script, script_args=args, workers=workers, out_dir=out, strategies=strategies,
                           servers=servers, modes=["sync"], compressions=["none"], timeout=300, warmup=1, link=link,
                           command=f"bench/costmodel_link.py: compare --link {link} --workers {workers} ({workload})",
                           flag_values={"--link": link, "--workers": str(workers)}))
    with open(os.path.join(out, "report.json")) as f:
        return [{k: v for k, v in r.items() if k != "curve"} for r in json.load(f)["runs"]]


def check(link: str, by_workers: dict[int, list[dict]], cores: int) -> dict:
    """Fit on W = 2, predict every run: for separate machines, for the measuring machine's `cores`, and with
    a latency per message."""
    from gradsync.compare.predict import fitted

    fit, configs, sizes, per_message = fitted(by_workers[2], 2, cores)
    rows = []
    for workers, runs in sorted(by_workers.items()):
        for r in runs:
            if "error" in r:
                rows.append({"workers": workers, "name": r["name"], "error": r["error"]})
                continue
            config = configs[r["name"]]
            rows.append({"workers": workers, "name": r["name"], "measured_s": r["step_s"],
                         **{k: r.get(k) for k in ("pull_s", "compute_s", "commit_s", "bytes_per_step",
                                                  "cpu_s_per_step", "steps")},
                         "predicted_s": fit.step_s(config, workers),
                         "predicted_here_s": fit.step_s(config, workers, cores=cores),
                         "predicted_per_message_s": per_message.step_s(config, workers)})
    return {"link": link, "fit": {"compute_s_per_sample": fit.compute_s_per_sample, "s_per_byte": fit.s_per_byte,
                                  "latency_s": fit.latency_s, "step_overhead_s": fit.step_overhead_s,
                                  "latency_per_message_s": per_message.latency_s, "pinned_at_zero": list(fit.pinned),
                                  "residuals": list(fit.residuals)},
            "sizes": sizes, "rows": rows}


def session(workload: str, links: list[str], workers: list[int], steps: int | None) -> dict:
    """Measure `workload` at every link and W (`steps` per job; None: the link's STEPS); returns the session as
    stored (no analysis)."""
    started, load = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="costmodel-link-") as scratch:
        for link in links:
            runs[link] = {str(w): measure(workload, link, w, steps or STEPS.get(link, 10),
                                          os.path.join(scratch, f"{link}-w{w}")) for w in workers}
    return {"started": started, "workload": workload, "cores": os.cpu_count(), "load_average": {"start": load, "end": os.getloadavg()},
            "runs": runs}


def analysed(stored: dict) -> dict:
    """The session with its analysis ("results": the fit and predicted vs measured, per link)."""
    return {**stored, "results": [check(link, {int(w): runs for w, runs in by_workers.items()}, stored["cores"])
                                  for link, by_workers in stored["runs"].items()]}


def table(result: dict) -> str:
    fitted = result["fit"]
    rate = (f"{8 / fitted['s_per_byte'] / 1e9:.3g} Gbit/s effective" if fitted["s_per_byte"] > 0 else
            "no time per byte fitted (the bytes' time within the runs' noise)")
    lines = [f"{result['link']}: fit on W = 2: {1e6 * fitted['compute_s_per_sample']:.3g} us per sample, "
             f"{rate}, {1e3 * fitted['step_overhead_s']:.3g} ms "
             f"fixed per step ({1e3 * fitted['latency_per_message_s']:.3g} ms per message if taken per message)",
             "", "| link | W | run | measured ms | predicted ms | ratio | this machine's cores: predicted ms "
             "| ratio | latency per message: predicted ms | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {result['link']} | {r['workers']} | {r['name']} | failed: {r['error'][:80]} |"
                         + " |" * 6)
            continue
        m, *predicted = (1e3 * r[k] for k in ("measured_s", "predicted_s", "predicted_here_s",
                                              "predicted_per_message_s"))
        lines.append(f"| {result['link']} | {r['workers']} | {r['name']} | {m:.1f} | "
                     + " | ".join(f"{p:.1f} | {p / m:.2f}" for p in predicted) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 3, 4])
    parser.add_argument("--refit", action="store_true", help="analyse the stored sessions again, run nothing")
    parser.add_argument("--workload", choices=["mlp", "tables"], default="mlp",
                        help="the MLP of this file, or examples/ctr.py's tables (module docstring)")
    parser.add_argument("--steps", type=int, help="steps per job (default: by link, 12 at 1gbit, 7 at 100mbit)")
    parser.add_argument("--out", default=RESULTS, help=f"the sessions file read, appended to and written "
                                                       f"(default: {RESULTS})")
    parser.add_argument("--train", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train is not None:
        train(args.train)
        return 0
    if 2 not in args.workers:
        parser.error("--workers must include 2: the fit is made on W = 2")
    stored = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            stored = [{k: v for k, v in s.items() if k != "results"} for s in json.load(f)["sessions"]]
    elif args.refit:
        parser.error(f"--refit: no {args.out} to analyse; run the bench first")
    if not args.refit:
        stored.append(session(args.workload, args.links, args.workers, args.steps))
    sessions = [analysed(s) for s in stored]
    for s in sessions:
        print(f"## session {s['started']}, {s.get('workload', 'mlp')} (load average {s['load_average']})\n")
        print("\n\n".join(table(result) for result in s["results"]), "\n", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "bench/costmodel_link.py", "model": {"sizes": SIZES, "batch": BATCH},
                   "tables_args": TABLES_ARGS, "steps": STEPS,
                   "sessions": sessions}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
