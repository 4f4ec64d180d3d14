"""Memory under load: every process's resident memory over a long ps job (async and sync), and allreduce.

One job per mode (gradsync.launch, loopback): a small MLP (256 -> 256 -> 256 -> 10, 134k parameters; `--sizes`),
batch 32 per worker, SGD lr 0.01 momentum 0.9, one thread per process, W = 4 workers and (ps) S = 2
servers, the same seeded batch every step. Workers run until the bench tells them to stop, `--minutes`
after every worker took its first step. Every `--interval` seconds the bench reads each rank's VmRSS from
/proc and the steps each worker has taken (each writes its pid and step count to a file every 10 steps;
the servers are the job's other processes, rank 0 the first started).

Per process: RSS after warm-up (the median of the samples in the tenth of the run after `--warmup` of it),
at the end (the median of the last tenth's), growth in %, and bytes per step: the slope of a least-squares
line of RSS against job steps (the workers' steps averaged: a sync step, or one push per worker in async)
over the samples after warm-up; and its CPU-seconds per job step over them (/proc). Target (issue 10):
every process within 5% of its warm-up RSS at the end. Writes bench/results/soak.json (every sample too)
and prints a markdown table.

    .venv/bin/python bench/soak.py [--minutes 10] [--modes async,sync] [--interval 5] [--warmup 0.1]
                                   [--sizes 256 256 256 10] [--out bench/results/soak.json]

`--modes` takes async, sync (ps) and allreduce.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.launcher import procfs
from gradsync.launcher.forked import rank_starter

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (256, 256, 256, 10)
WORKERS, SERVERS, BATCH, LR, MOMENTUM = 4, 2, 32, 0.01, 0.9
PROGRESS_EVERY = 10  # steps between a worker's progress writes
STOP_MARGIN = 200  # steps past the most any worker reported, where lock-step workers stop together
TARGET = 0.05


def make_model(sizes: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def worker(folder: str, lock_step: bool, sizes: tuple[int, ...]) -> int:
    """Train until `folder`/stop names a step (lock-step modes stop at it, async at once); returns the steps."""
    torch.set_num_threads(1)
    me = gradsync.worker_rank()
    trainer = gradsync.Trainer(make_model(sizes), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(1 + me)
    x, y = torch.randn(BATCH, sizes[0], generator=g), torch.randn(BATCH, sizes[-1], generator=g)
    stop_path, steps, stop = os.path.join(folder, "stop"), 0, None
    while stop is None or steps < stop:
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(trainer.model(x), y)])
            trainer.step(cid)
        steps += 1
        if steps % PROGRESS_EVERY == 0:
            write(os.path.join(folder, f"steps-{me}"), os.getpid(), steps)
        if stop is None and os.path.exists(stop_path):
            with open(stop_path) as f:
                stop = int(f.read()) if lock_step else steps
    return steps


def write(path: str, *values: int) -> None:
    """Replace `path` with `values` so that a reader never sees a torn write (no fsync: a scratch file)."""
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, values)))
    os.replace(path + ".tmp", path)


class Sampler:
    """Reads the ranks' RSS and the workers' steps every `interval` seconds, and tells the workers to stop
    `seconds` after they all started."""

    def __init__(self, parent: int, folder: str, workers: int, servers: int, seconds: float, interval: float):
        self.parent, self.folder, self.workers, self.num_servers = parent, folder, workers, servers
        self.seconds, self.interval = seconds, interval
        self.samples: list[dict] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def progress(self) -> dict[int, tuple[int, int]]:
        """(pid, steps) by worker, from the files the workers write."""
        out = {}
        for w in range(self.workers):
            try:
                with open(os.path.join(self.folder, f"steps-{w}")) as f:
                    pid, steps = f.read().split()
                out[w] = int(pid), int(steps)
            except (OSError, ValueError):
                pass
        return out

    def ranks(self, progress: dict[int, tuple[int, int]]) -> dict[int, int]:
        """rank by pid: the workers' from their reports, the servers' from the order they were started in (the
        launcher starts rank 0 first; pids grow)."""
        servers = self.num_servers
        workers = {pid: servers + w for w, (pid, _) in progress.items()}
        others = sorted(set(procfs.children(self.parent)) - set(workers))
        return {**workers, **{pid: rank for rank, pid in enumerate(others[:servers])}}

    def _run(self) -> None:
        start = None
        while not self.done.wait(self.interval):
            progress = self.progress()
            if len(progress) < self.workers:
                continue
            steps = {w: n for w, (_, n) in progress.items()}
            now = time.monotonic()
            start = now if start is None else start
            ranks = self.ranks(progress)
            rss = {rank: procfs.memory(pid, "VmRSS") for pid, rank in ranks.items()}
            cpu = {rank: procfs.cpu_ticks(f"/proc/{pid}/stat") for pid, rank in ranks.items()}
            self.samples.append(dict(t=now - start, steps=steps, rss={r: v for r, v in rss.items() if v},
                                     cpu={r: v for r, v in cpu.items() if v is not None}))
            if now - start >= self.seconds:
                write(os.path.join(self.folder, "stop"), max(steps.values()) + STOP_MARGIN)
                return


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summarize(samples: list[dict], servers: int, warmup: float) -> dict:
    """Per rank: RSS after warm-up and at the end (medians over a tenth of the run each: a single sample
    lands anywhere in a step, whose live tensors come and go), growth, bytes per job step and per second
    (least-squares slopes), CPU-seconds per job step."""
    end_t = samples[-1]["t"]
    after = [s for s in samples if s["t"] >= warmup * end_t]
    warm_window = [s for s in after if s["t"] <= (warmup + 0.1) * end_t]
    end_window = [s for s in after if s["t"] >= 0.9 * end_t]
    job_steps = lambda s: sum(s["steps"].values()) / len(s["steps"])  # noqa: E731
    first, last = after[0], after[-1]
    ranks = {}
    for rank in sorted(last["rss"]):
        points = [(job_steps(s), s["t"], s["rss"][rank]) for s in after if rank in s["rss"]]
        warm = statistics.median(s["rss"][rank] for s in warm_window if rank in s["rss"])
        end = statistics.median(s["rss"][rank] for s in end_window if rank in s["rss"])
        ranks[rank] = dict(
            role="server" if rank < servers else "worker", name=f"server {rank}" if rank < servers
            else f"worker {rank - servers}", warm_rss=warm, end_rss=end, growth=(end - warm) / warm,
            peak_rss=max(p[2] for p in points),
            bytes_per_step=slope([p[0] for p in points], [p[2] for p in points]),
            bytes_per_s=slope([p[1] for p in points], [p[2] for p in points]),
            cpu_s_per_step=(last["cpu"][rank] - first["cpu"][rank]) / procfs.TICK
            / max(job_steps(last) - job_steps(first), 1))
    return dict(seconds=end_t, warm_t=first["t"], steps=job_steps(last), warm_steps=job_steps(first),
                steps_per_s=(job_steps(last) - job_steps(first)) / max(last["t"] - first["t"], 1e-9),
                ranks=ranks, met=all(abs(r["growth"]) <= TARGET for r in ranks.values()))


def run(mode: str, minutes: float, interval: float, warmup: float, sizes: tuple[int, ...]) -> dict:
    strategy, servers = ("allreduce", 0) if mode == "allreduce" else ("ps", SERVERS)
    _, parent = rank_starter()
    with tempfile.TemporaryDirectory(prefix="gradsync-soak-") as folder:
        sampler = Sampler(parent, folder, WORKERS, servers, minutes * 60, interval)
        sampler.thread.start()
        try:
            steps = gradsync.launch(worker, strategy=strategy, mode="sync" if mode == "allreduce" else mode,
                                    workers=WORKERS, servers=servers, args=(folder, mode != "async", sizes),
                                    timeout=minutes * 60 + 600)
        finally:
            sampler.done.set()
            sampler.thread.join(timeout=interval + 5)
    result = summarize(sampler.samples, servers, warmup)
    result.update(mode=mode, strategy=strategy, workers=WORKERS, servers=servers, worker_steps=steps,
                  samples=sampler.samples)
    return result


def table(results: dict) -> str:
    lines = ["| mode | process | RSS after warm-up MB | RSS at end MB | growth | bytes/step | KB/min | peak RSS MB "
             "| CPU-ms/step |", "|" + "---|" * 9]
    for mode, r in results.items():
        for rank in r["ranks"].values():
            lines.append(f"| {mode} | {rank['name']} | {rank['warm_rss'] / 2**20:.1f} | {rank['end_rss'] / 2**20:.1f} "
                         f"| {100 * rank['growth']:+.2f}% | {rank['bytes_per_step']:.0f} "
                         f"| {rank['bytes_per_s'] * 60 / 1024:.0f} | {rank['peak_rss'] / 2**20:.1f} "
                         f"| {1000 * rank['cpu_s_per_step']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="per mode, after every worker started")
    parser.add_argument("--modes", default="async,sync", help="comma-separated: async, sync, allreduce")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the run before the warm-up sample")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="layer widths, input first")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = set(modes) - {"async", "sync", "allreduce"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from async, sync, allreduce")
    results = {}
    for mode in modes:
        results[mode] = run(mode, args.minutes, args.interval, args.warmup, tuple(args.sizes))
        r = results[mode]
        print(f"{mode}: {r['steps']:.0f} steps in {r['seconds']:.0f} s, "
              f"{'met' if r['met'] else 'NOT met'}: RSS within {100 * TARGET:.0f}%", flush=True)
    print(table(results))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=os.cpu_count(), torch=torch.__version__, gradsync=os.path.dirname(gradsync.__file__),
                       malloc_arena_max=os.environ.get("MALLOC_ARENA_MAX"), sizes=args.sizes, batch=BATCH,
                       results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
