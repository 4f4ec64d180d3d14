"""The run-and-measure scaffolding the benchmarks share: the MLP workload (model, seeded batch), a gradsync
worker's Trainer, a job's processes and their CPU-seconds per step (/proc), a timed step loop, and the machine
a result was measured on.

bench/overhead.py and bench/linkfloor.py import it (`sys.path` holds bench/ when a script runs).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import platform
import re
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.launcher import procfs

LR, MOMENTUM = 1e-3, 0.9
BUSY_POLL_THREAD = re.compile(r"^TP_\w*reactor$")  # spins while idle
TENSORPIPE_THREAD = re.compile(r"^TP_")
SEED = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    sizes: tuple[int, ...]  # layer widths, input first
    batch: int
    onehot: bool  # MSE against one-hot labels (else against random targets)
    workers: int
    configs: dict[str, int]  # configuration -> server processes, in run order


def build_model(w: Workload) -> nn.Module:
    torch.manual_seed(SEED)
    layers = []
    for i, (a, b) in enumerate(zip(w.sizes, w.sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(w.sizes) - 2 else [])
    return nn.Sequential(*layers)


def make_batch(w: Workload, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + worker)
    x = torch.randn(w.batch, w.sizes[0], generator=g)
    if w.onehot:
        return x, F.one_hot(torch.randint(0, w.sizes[-1], (w.batch,), generator=g), w.sizes[-1]).float()
    return x, torch.randn(w.batch, w.sizes[-1], generator=g)

def gradsync_worker_setup(w: Workload) -> tuple[gradsync.Trainer, torch.Tensor, torch.Tensor]:
    """On a gradsync worker: one thread, the Trainer over the workload's model (SGD lr LR, momentum MOMENTUM),
    and this worker's batch."""
    torch.set_num_threads(1)
    trainer = gradsync.Trainer(build_model(w), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    return (trainer, *make_batch(w, gradsync.worker_rank()))


# ---- CPU of the job's processes, from /proc ----

def job_pids() -> list[int]:
    """The job's ranks, seen from one of them: its parent's children started by multiprocessing (spawned by
    the bench, or forked by gradsync.launch's fork server), not the bench's resource tracker."""
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        forked = b"forkserver" in f.read()  # then every child of the parent is a rank
    pids = []
    for pid in procfs.children(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if forked or b"spawn_main" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


def cpu_snapshot() -> dict:
    """Ticks per process, and (thread name, ticks, ns waited for a CPU) per thread."""
    snap = {}
    for pid in job_pids():
        try:
            threads = {}
            for task in glob.glob(f"/proc/{pid}/task/*"):
                with open(f"{task}/comm") as f:
                    name = f.read().strip()
                if (ticks := procfs.cpu_ticks(f"{task}/stat")) is not None:
                    threads[task] = (name, ticks, procfs.runqueue_wait_ns(task) or 0)
            if (ticks := procfs.cpu_ticks(f"/proc/{pid}/stat")) is not None:
                snap[pid] = (ticks, threads)
        except OSError:  # a thread or process ended while being read
            pass
    return snap


def cpu_per_step(before: dict, after: dict, steps: int) -> dict:
    """CPU-seconds per step over the window, all processes together and per thread name, and the seconds
    per step the job's threads waited, runnable, for a CPU (summed over threads, and per thread name: the
    time-slicing they met)."""
    total, by_name, waited = 0, {}, {}
    for pid, (ticks, threads) in after.items():
        ticks0, threads0 = before.get(pid, (0, {}))
        total += ticks - ticks0
        for task, (name, t, wait) in threads.items():
            _, t0, wait0 = threads0.get(task, (name, 0, 0))
            by_name[name] = by_name.get(name, 0) + t - t0
            waited[name] = waited.get(name, 0) + wait - wait0
    per_step = lambda t: t / procfs.TICK / steps  # noqa: E731
    threads = {name: per_step(t) for name, t in sorted(by_name.items())}
    return dict(processes=len(after), cpu_s_per_step=per_step(total), threads=threads,
                runqueue_wait_s_per_step=sum(waited.values()) / 1e9 / steps,
                threads_waited={name: w / 1e9 / steps for name, w in sorted(waited.items())},
                busy_poll_cpu_s_per_step=sum(c for n, c in threads.items() if BUSY_POLL_THREAD.match(n)),
                tensorpipe_cpu_s_per_step=sum(c for n, c in threads.items() if TENSORPIPE_THREAD.match(n)))

def timed_loop(step: Callable[[], None], steps: int, warmup: int, worker: int,
               on_window: Callable[[], None] | None = None) -> dict:
    """Run warmup + steps steps; worker 0 also reads the job's CPU over the timed ones, and calls `on_window`
    as their window opens (other counters to read over it)."""
    times, before = [], {}
    for i in range(warmup + steps):
        if i == warmup and worker == 0:
            before = cpu_snapshot()
            if on_window is not None:
                on_window()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result = dict(step_s=statistics.median(times[warmup:]), step_times_s=times[warmup:])
    if worker == 0:
        result.update(cpu_per_step(before, cpu_snapshot(), steps))
    return result


def machine(load_before: tuple[float, float, float]) -> dict:
    """Where and under what load a result was measured (`load_before`: os.getloadavg() before the runs)."""
    return dict(platform=platform.platform(), machine=platform.machine(), cores=os.cpu_count(),
                torch=torch.__version__, python=platform.python_version(), clock_ticks_per_s=procfs.TICK,
                load_average_before=load_before, load_average_after=os.getloadavg())
