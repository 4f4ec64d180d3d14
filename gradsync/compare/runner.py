"""Run one configuration of `gradsync compare` and measure it: the workers' step lines and the script's own
log, plus CPU and memory.

The job runs as `gradsync run` would (`scripts.run_script`) with GRADSYNC_LOG_DIR
set in its ranks, so each worker's lines (`metrics.scalars`: the Trainer's line per step, the script's
`gradsync.log` calls) land in the run's directory, and its ranks
start in the run's own copy of the working directory (`compare.workdir`). A failed run is measured
too, up to its failure, which goes to `FAILURE` in the run's directory.
A sampler thread reads /proc every `SAMPLE_S` for every rank (`run_script` says
which they are): how long its threads ran on a CPU and waited for one (schedstat)
and its peak resident memory (VmHWM). The first
`warmup` steps of each worker (first calls, lazy imports, buffers allocated) are
left out of every per-step figure: the medians, samples/s and CPU per step count
from the end of the warm-up to the last step. A hybrid run whose model has
no table to serve (`NoTablesToServe`) is skipped, not failed; so is a sharded run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import statistics
import threading
import time

import numpy

from gradsync.compare import workdir
from gradsync.compare.grid import Config
from gradsync.core import settings
from gradsync.core.errors import JobFailed, NoTablesToServe
from gradsync.core.job_names import server_name, worker_name
from gradsync.core.strategies import names
from gradsync.core.waiting import THREAD_STOP_S
from gradsync.launcher import procfs
from gradsync.launcher.scripts import run_script
from gradsync.launcher.supervision import RankProcess
from gradsync.metrics.step_metrics import STEP_PARTS

SAMPLE_S = 0.1
NO_TABLES = "no tables"
"""A hybrid or sharded run's `skipped` reason: the model has no embedding table they would serve."""
TABLE_STRATEGIES = names(lambda t: t.needs_tables)
"""The strategies that exist for a model's embedding tables (they refuse a model without: `NoTablesToServe`)."""
WORKDIR = "workdir"
"""A run's working directory in its run folder: a copy of compare's at its start (`compare.workdir`)."""
FAILURE = "failure.txt"
"""A failed run's file in its run folder: the failure the job raised, with the failing rank's traceback."""


class Sampler(threading.Thread):
    """The nanoseconds threads ran on a CPU and waited for one (all ranks together, over time; schedstat, to the
    nanosecond: a few ms of steps between two samples still count, where utime's 10 ms ticks often do not) and
    peak memory of each rank, from /proc; `role`: 'server' or 'worker' by pid, of the ranks `started` gave (the
    first `servers` are the servers). A thread that ended keeps what it was last seen to use."""

    def __init__(self, servers: int, on_sample=None):
        super().__init__(daemon=True)
        self.ran: list[tuple[float, int]] = []  # (wall time, ns every rank's threads have run so far)
        self.waits: list[tuple[float, int]] = []  # (wall time, ns every rank's threads have waited so far)
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, tid) -> its last (run, wait) ns
        self.peak: dict[int, int] = {}  # pid -> VmHWM bytes
        self.role: dict[int, str] = {}
        self.unseen_after: float | None = None  # the last sample before every rank had ended
        self._servers = servers
        self._on_sample = on_sample
        self._finished = threading.Event()

    def run(self) -> None:
        while not self._finished.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._finished.set()
        self.join(timeout=THREAD_STOP_S)

    def started(self, ranks: list[RankProcess]) -> None:
        """The job's rank processes (`run_script`'s `started`)."""
        self.role = {r.proc.pid: "server" if r.rank < self._servers else "worker" for r in ranks}

    def sample(self) -> None:
        alive = False
        for pid in list(self.role):
            peak = procfs.memory(pid)
            if peak is None:  # the process has ended
                continue
            alive = True
            self.peak[pid] = max(self.peak.get(pid, 0), peak)
            self._seen.update({(pid, tid): ns for tid, ns in procfs.schedstats_ns(pid).items()})
        if self.role and not alive:  # every rank has ended: what they ran since the last sample went unseen
            if self.unseen_after is None and self.ran:
                self.unseen_after = self.ran[-1][0]
            return
        now = time.time()
        self.ran.append((now, sum(run for run, _ in self._seen.values())))
        self.waits.append((now, sum(wait for _, wait in self._seen.values())))
        if self._on_sample is not None:
            self._on_sample()

    def peak_mb(self, role: str) -> float:
        """The largest peak resident memory of the ranks of `role` ('server' or 'worker'), in MB; 0 with none."""
        return max((v for p, v in self.peak.items() if self.role.get(p) == role), default=0) / 2**20

    def cpu_between(self, start: float, end: float) -> float:
        """CPU-seconds of every rank between two wall times (interpolated between samples); NaN for a span that
        ends after the ranks' last sample, when they ended before another (not measured, rather than 0)."""
        return self._measured(end) * _between(self.ran, start, end) / 1e9

    def wait_between(self, start: float, end: float) -> float:
        """Seconds every rank's threads waited, runnable, for a CPU between two wall times (summed over
        threads, interpolated between samples): the time-slicing of more busy threads than cores."""
        return self._measured(end) * _between(self.waits, start, end) / 1e9

    def _measured(self, end: float) -> float:
        """1, or NaN when the span up to `end` reaches past the sample before every rank ended."""
        return float("nan") if self.unseen_after is not None and end > self.unseen_after else 1.0


def _between(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """How much a cumulative count sampled as (wall time, count) grew between two wall times; NaN with fewer
    than two samples."""
    if len(samples) < 2:
        return float("nan")
    times, counts = zip(*samples)
    return float(numpy.interp(end, times, counts) - numpy.interp(start, times, counts))


def headline(failure: str) -> str:
    """The exception line of a failed job's text (its first line when there is none)."""
    lines = failure.strip().splitlines() or ["the job failed"]
    return next(
        (line.strip() for line in reversed(lines) if re.match(r"^\s*[\w.]+(Error|Exception|Failed): ", line)), lines[0]
    )


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_log(path: str) -> list[dict]:
    """The JSON lines one worker logged (none when it logged nothing); a last line without its newline (being
    written, or cut short by a rank's end) is left out."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def run(
    config: Config,
    script: str,
    script_args: list[str],
    workers: int,
    out_dir: str,
    timeout: float,
    warmup: int,
    progress=None,
    board_dir: str | None = None,
    network: dict | None = None,
    straggler: str | None = None,
    timeline: bool = False,
    start: str | None = None,
    pristine: str | None = None,
) -> dict:
    """Run `config` and return its measurements (a failed run also its `error`, `failed_rank` and `failure`
    file; `skipped`: NO_TABLES for a hybrid or sharded run on a model without tables). `warmup`: steps left out of the
    per-step figures; `board_dir`: where the workers also write TensorBoard scalars, one subdirectory per run;
    `network`: `link` and `server_link` of `run_script`; `straggler`: GRADSYNC_STRAGGLER of every rank;
    `timeline`: every rank records the step timeline (GRADSYNC_TIMELINE); `pristine`: the copy of directory
    `start` the run's own working directory is copied from (`compare.workdir`; None: this process's)."""
    log_dir = os.path.join(out_dir, "runs", config.slug)
    job_dir = os.path.join(log_dir, "job")  # the job's run directory: the servers leave their final counters there
    shutil.rmtree(job_dir, ignore_errors=True)
    os.makedirs(log_dir, exist_ok=True)
    for old in glob.glob(os.path.join(log_dir, "worker-*.jsonl")):
        os.remove(old)
    cwd = None
    if pristine is not None:
        cwd = os.path.join(log_dir, WORKDIR)
        workdir.fresh(pristine, cwd)
        assert start is not None  # `pristine` is a copy of it
        script = workdir.script_in(script, start, cwd)
    sampler = Sampler(
        config.servers,
        on_sample=(
            lambda: progress(sum("record" in line for line in read_log(os.path.join(log_dir, "worker-0.jsonl"))))
        )
        if progress
        else None,
    )
    variables: dict[settings.Setting, str] = {settings.LOG_DIR: log_dir}
    if board_dir:
        variables[settings.TENSORBOARD_DIR] = os.path.join(board_dir, config.slug)
    if straggler:
        variables[settings.STRAGGLER] = straggler
    if timeline:
        variables[settings.TIMELINE] = "1"
    sampler.start()
    started = time.time()
    failed = None
    try:
        run_script(
            script,
            script_args,
            workers=workers,
            timeout=timeout,
            run_dir=job_dir,
            environment=variables,
            started=sampler.started,
            cwd=cwd,
            **(network or {}),
            **config.settings(),
        )
    except JobFailed as e:
        failed = e
    finally:
        sampler.stop()
    result = {"name": config.name, **config.settings(), "workers": workers, "wall_s": time.time() - started}
    if failed is not None and NoTablesToServe.__name__ in str(failed):
        return {**result, "skipped": NO_TABLES}
    logs = [read_log(os.path.join(log_dir, f"worker-{w}.jsonl")) for w in range(workers)]
    stats = [read_json(p) for p in sorted(glob.glob(os.path.join(job_dir, "stats-*.json")))]
    shutil.rmtree(job_dir, ignore_errors=True)  # tokens and endpoint files of a job that has ended
    result.update(measure(logs, sampler, warmup), staleness=staleness(stats))
    if failed is not None:
        failure = os.path.join(log_dir, FAILURE)
        with open(failure, "w") as f:
            f.write(f"{failed}\n")
        rank = failed.rank
        result.update(
            error=headline(str(failed)),
            failure=os.path.relpath(failure, out_dir),
            failed_rank=None if rank is None else f"rank {rank} ({role(rank, config.servers)})",
        )
    return result


def role(rank: int, servers: int) -> str:
    """The name of global rank `rank` of a job with `servers` servers first ('ps0', 'worker1')."""
    return server_name(rank) if rank < servers else worker_name(rank - servers)


def measure(logs: list[list[dict]], sampler: Sampler, warmup: int) -> dict:
    """Per-run metrics from the workers' logs (worker 0's for the curves and step split) and the sampler,
    leaving each worker's first `warmup` steps out of the per-step figures. The step figures come from the
    Trainer's step lines, whether or not the script calls `gradsync.log`; loss, accuracy and samples from what
    it logged (`logged`: the names worker 0 logged, [] when it never called it). `batch` (worker 0's median
    `samples` per step, None when the script logs none) and `model` (the Trainer's trainable elements, dense
    and in tables) are what `compare --predict` fits on. `worker_steps`: the steps each worker committed;
    `first_step`: worker 0's first logged loss's step, else its first committed step (None: neither)."""
    lines = logs[0]
    trained, scalars = _steps(lines), _scalars(lines)
    records = [line["record"] for line in trained[warmup:]]
    losses = [(line["t"], line["step"], line["loss"]) for line in scalars if "loss" in line]
    median = lambda key: statistics.median(r[key] for r in records) if records else float("nan")  # noqa: E731
    samples = [line["samples"] for line in scalars if "samples" in line]
    out = {
        "logged": sorted({name for line in scalars for name in line} - {"t", "wall", "step"}),
        "steps": len(trained),
        "worker_steps": [len(_steps(log)) for log in logs],
        "first_step": losses[0][1] if losses else trained[0]["step"] if trained else None,
        "warmup_steps": warmup,
        "warmup_t": trained[warmup - 1]["t"] if len(trained) >= warmup else None,
        "curve": losses,
        "final_loss": statistics.fmean(v for _, _, v in losses[-max(1, len(losses) // 10) :]) if losses else None,
        "accuracy": next((line["acc"] for line in reversed(lines) if "acc" in line), None),
        "step_s": sum(median(part) for part in STEP_PARTS),
        **{part: median(part) for part in STEP_PARTS},
        "bytes_per_step": median("bytes_sent") + median("bytes_received"),
        "bytes_sent": median("bytes_sent"),
        "bytes_received": median("bytes_received"),
        "batch": statistics.median(samples) if samples else None,
        "model": next((line["model"] for line in lines if "model" in line), None),
        "worker_peak_mb": sampler.peak_mb("worker"),
        "server_peak_mb": sampler.peak_mb("server"),
        "samples_per_s": samples_per_s([_scalars(log) for log in logs], warmup),
        "timeline": median_timeline(trained[warmup:]),
    }
    if len(trained) > warmup:
        start, end = trained[warmup - 1], trained[-1]
        steps = end["step"] - start["step"]
        cpu = sampler.cpu_between(start["wall"], end["wall"])
        seen = 1.0 if cpu > 0 else float("nan")  # steps ran, so no CPU seen means the samples missed them
        out["cpu_s_per_step"] = seen * cpu / steps
        out["cpu_wait_s_per_step"] = seen * sampler.wait_between(start["wall"], end["wall"]) / steps
    return out


def median_timeline(steps: list[dict]) -> dict | None:
    """The timeline (`metrics.timeline`: {"step", "pieces"}) of the step of median time among `steps` (worker 0's
    after the warm-up, merged lines) that have one; None when none has (GRADSYNC_TIMELINE off)."""
    timed = sorted((s for s in steps if "timeline" in s), key=lambda s: sum(s["record"][part] for part in STEP_PARTS))
    return timed[len(timed) // 2]["timeline"] if timed else None


def _steps(lines: list[dict]) -> list[dict]:
    """A worker's step lines: the Trainer's line of each step it committed, in order."""
    return [line for line in lines if "record" in line]


def _scalars(lines: list[dict]) -> list[dict]:
    """A worker's `gradsync.log` lines, those of one step merged (the first line's time), in order."""
    steps: dict[int, dict] = {}
    for line in lines:
        if "step" in line and "record" not in line:
            steps[line["step"]] = {**line, **steps.get(line["step"], {})}
    return list(steps.values())


def samples_per_s(steps: list[list[dict]], warmup: int) -> float | None:
    """Samples per second of all workers together after the warm-up: each worker's logged samples of its steps
    (`_scalars`) after the first `warmup`, over its own time from the end of its warm-up to its last step, summed
    over the workers. None when a worker logs no samples or has no step after its warm-up."""
    total = 0.0
    for lines in steps:
        after = lines[warmup:]
        if not after or any("samples" not in line for line in after) or after[-1]["t"] <= lines[warmup - 1]["t"]:
            return None
        total += sum(line["samples"] for line in after) / (after[-1]["t"] - lines[warmup - 1]["t"])
    return total or None


def staleness(stats: list[dict]) -> dict[int, int]:
    """Applied pushes by staleness (version - pulled version), summed over the servers' final counters;
    {} for sync runs and runs without servers."""
    out: dict[int, int] = {}
    for server in stats:
        for stale, count in server.get("staleness_histogram", {}).items():
            out[int(stale)] = out.get(int(stale), 0) + count
    return dict(sorted(out.items()))
