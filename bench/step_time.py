"""PS-sync vs allreduce step time on this machine, in one run.

For MLPs of about 1M, 10M and 50M parameters, W workers and S servers, runs a
few training steps under each strategy, alternating them `--repeats` times, and
reports the median per-step time on worker 0 and the median PS/allreduce ratio.
Writes bench/results/step_time.json.

    .venv/bin/python bench/step_time.py [--sizes 1 10 50] [--workers 2 4] [--servers 1 2] [--steps 8] [--repeats 3]
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

DEPTH, FEATURES, BATCH = 4, 256, 32


def make_mlp(million: float) -> nn.Module:
    """An MLP of DEPTH layers whose width is chosen so it has about `million` M parameters."""
    # DEPTH-2 square layers of width w plus two FEATURES x w edge layers: (DEPTH-2) w^2 + 2 FEATURES w = N
    a, b = DEPTH - 2, 2 * FEATURES
    width = int((-b + math.sqrt(b * b + 4 * a * million * 1e6)) / (2 * a))
    layers = [nn.Linear(FEATURES, width), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, FEATURES))
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def run_steps(million: float, steps: int) -> dict:
    trainer = gradsync.Trainer(make_mlp(million), torch.optim.SGD, lr=1e-3, momentum=0.9)
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, FEATURES)
    for _ in range(steps):
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(trainer.model(x), y)])
            trainer.step(cid)
    return trainer.metrics.summary(skip=2)


def _median_step(strategy: str, workers: int, servers: int, million: float, steps: int) -> float:
    summary = gradsync.launch(run_steps, strategy=strategy, workers=workers, servers=servers, args=(million, steps),
                              timeout=900, step_timeout=600)[0]
    return summary["step_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 50], help="millions of parameters")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating ps/allreduce runs per configuration")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step_time.json"))
    args = parser.parse_args()
    rows = []
    for million in args.sizes:
        params = sum(p.numel() for p in make_mlp(million).parameters())
        for workers in args.workers:
            for servers in args.servers:
                ps_times, allreduce_times, ratios = [], [], []
                for _ in range(args.repeats):  # A and B alternate, so drift on a shared machine hits both
                    allreduce = _median_step("allreduce", workers, 0, million, args.steps)
                    ps = _median_step("ps", workers, servers, million, args.steps)
                    allreduce_times.append(allreduce)
                    ps_times.append(ps)
                    ratios.append(ps / allreduce)
                row = dict(params=params, workers=workers, servers=servers, ps_step_s=ps_times,
                           allreduce_step_s=allreduce_times, ratios=ratios, ratio=statistics.median(ratios))
                rows.append(row)
                print(f"{params / 1e6:5.1f}M W={workers} S={servers}: ps {1000 * statistics.median(ps_times):8.1f} ms "
                      f"allreduce {1000 * statistics.median(allreduce_times):8.1f} ms  "
                      f"ratio {row['ratio']:.2f} (per repeat {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    result = dict(
        command=" ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU, loopback",
        steps=args.steps,
        repeats=args.repeats,
        median_ratio=statistics.median(r["ratio"] for r in rows),
        rows=rows,
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
