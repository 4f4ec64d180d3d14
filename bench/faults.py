"""What a worker's or a server's death costs a sync job: gradsync ps with `--worker-loss wait` (a replacement takes
the dead worker's place, forked or started as a new process), `--worker-loss drop` (the job goes on without it;
with `--max-restarts`, until its replacement joins at a step boundary),
and `fail` with `--resume` from the last checkpoint (`--checkpoint-every`, 16), beside torchft DDP (its outside
baseline: run with `--torchft-python`, the python of the venv bench/requirements-torchft.txt builds); a server's
death (S = 2) with `--replicas 1` (its replica serves its shard) and without (the whole job again from its
checkpoint); an async job's worker death, the worker departing (as async jobs do without `wait`) or replaced
(`--worker-loss wait`); gradsync allreduce with `wait` (the survivors and the replacement form a new group) and
with `fail` and `--resume`; and what each policy costs a step without a death, and replicas at W = 4, S = 2.

The workload (bench/faults_job.py, bench/faults_torchft.py): a 1,055,242-parameter MLP with AdamW, W = 2 (ps: one
server), each worker's seeded batch of 64 per step, `--compute-s` of emulated compute before each step's forward
(0.15 s), `--steps` steps (150); worker 1 SIGKILLed at step `--kill-at` (60) as the step begins ('between') or inside
its backward ('mid'). Per configuration, the wall seconds of the job; time lost = that wall minus the same system's
wall without a death, medians of `--repeats` interleaved runs. Samples lost: the batches no step applied (drop: the
dead worker's from its death on; torchft: those its survivor committed alone, or discarded). Steps redone: steps a
resume trained again. Whether the final parameters equal the clean run's (sha256). A restart-from-checkpoint
starts the job again 1 s after its failure; torchft's replacement starts 1 s after the driver sees the death
(its bench script). Then, without a death and with `--compute-s 0`, the median trainer.step time of `fail`, `wait`
and `drop` jobs, interleaved: each policy's cost per step (trainer.step and the job's CPU-seconds per step); and
W = 4, S = 2 jobs without and with replicas, on loopback and behind each `--cost-links` rate (a fifth of the
steps there). `--configs` runs some configurations alone (each with its clean run). Run it alone. Writes bench/results/faults.json (or
--out) and prints a markdown table.

    .venv/bin/python bench/faults.py [--steps 150] [--kill-at 60] [--compute-s 0.15] [--repeats 2] [--checkpoint-every 16]
        [--torchft-python /work/ftvenv/bin/python] [--cost-steps 200] [--cost-links 100mbit] [--configs NAME ...]
        [--costs step replication] [--out bench/results/faults.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import machine  # noqa: E402

from gradsync.launcher import procfs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "faults.json")
JOB = os.path.join(HERE, "faults_job.py")
TORCHFT = os.path.join(HERE, "faults_torchft.py")
REPLICAS = ["--servers", "2", "--replicas", "1"]
ALLREDUCE = ["--strategy", "allreduce", "--servers", "0"]
WAIT = ["--worker-loss", "wait", "--max-restarts", "1"]
GRADSYNC = {  # configuration: (the death's point or None, gradsync run options, the ranks' start, the clean run)
    "ps, no death": (None, ["--worker-loss", "fail"], "fork", None),
    "ps wait, death between steps": ("forward", ["--worker-loss", "wait", "--max-restarts", "1"], "fork", "ps, no death"),
    "ps wait, death mid-step": ("backward", ["--worker-loss", "wait", "--max-restarts", "1"], "fork", "ps, no death"),
    "ps wait, new process, death mid-step": ("backward", ["--worker-loss", "wait", "--max-restarts", "1"], "exec",
                                             "ps, no death"),
    "ps drop, death mid-step": ("backward", ["--worker-loss", "drop"], "fork", "ps, no death"),
    "ps drop with restarts, death mid-step": ("backward", ["--worker-loss", "drop", "--max-restarts", "1"], "fork",
                                              "ps, no death"),
    "ps fail, then --resume": ("backward", ["--worker-loss", "fail"], "fork", "ps, no death"),
    "ps async, no death": (None, ["--mode", "async"], "fork", None),
    "ps async, death mid-step, the worker departs": ("backward", ["--mode", "async"], "fork", "ps async, no death"),
    "ps async wait, death mid-step": ("backward", ["--mode", "async", "--worker-loss", "wait", "--max-restarts", "1"],
                                      "fork", "ps async, no death"),
    "ps S=2, no death": (None, ["--servers", "2"], "fork", None),
    "ps S=2 replicas 1, no death": (None, REPLICAS, "fork", None),
    "ps S=2 replicas 1, server death mid-step": ("backward", REPLICAS, "fork", "ps S=2 replicas 1, no death"),
    "ps S=2, server death, whole job again from its checkpoint": ("backward", ["--servers", "2", "--max-restarts", "1"],
                                                                  "fork", "ps S=2, no death"),
    "allreduce, no death": (None, [*ALLREDUCE, "--worker-loss", "fail"], "fork", None),
    "allreduce wait, death between steps": ("forward", [*ALLREDUCE, *WAIT], "fork", "allreduce, no death"),
    "allreduce wait, death mid-step": ("backward", [*ALLREDUCE, *WAIT], "fork", "allreduce, no death"),
    "allreduce wait, new process, death mid-step": ("backward", [*ALLREDUCE, *WAIT], "exec", "allreduce, no death"),
    "allreduce fail, then --resume": ("backward", [*ALLREDUCE, "--worker-loss", "fail"], "fork", "allreduce, no death"),
}
"""A configuration whose name says "server death" kills server 1 (from worker 0), the others worker 1."""


def _gradsync(log: str, options: list[str], start: str, job: list[str], extra: list[str] = (), workers: int = 2,
              cpu: list | None = None) -> float:
    """One `gradsync run` of the job script; its wall seconds (it may fail: a death under fail). With `cpu`, the
    CPU-seconds every process of the job had used by then (its launcher's descendants), sampled every 0.1 s, are
    appended to it as (time.time(), seconds)."""
    env = {**os.environ, "GRADSYNC_RANK_START": start, "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gradsync.cli", "run", "--strategy", "ps", "--workers",
                                 str(workers), *options, *extra, JOB, "--log", log, *job], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        ticks: dict[int, int] = {}
        while proc.poll() is None and time.monotonic() - began < 900:
            if cpu is not None:
                for pid in _descendants(proc.pid):
                    ticks[pid] = max(ticks.get(pid, 0), procfs.cpu_ticks(f"/proc/{pid}/stat") or 0)
                cpu.append((time.time(), sum(ticks.values()) / procfs.TICK))
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        err.seek(0)
        if proc.wait() and ("--kill-at" not in job or "fail" not in options):
            raise RuntimeError(f"gradsync run {' '.join(options + list(extra))} failed:\n{err.read()[-3000:]}")
    return time.monotonic() - began


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = procfs.children(todo.pop())
        found += children
        todo += children
    return found


def _cpu_per_step(samples: list, lines: list[dict], workers: int) -> float:
    """CPU-seconds per step of the job between the steps its `workers`' log `lines` time at the 40th percentile
    and the last (start-up left out), from `_gradsync`'s samples."""
    times = sorted(ln["t"] for ln in lines)
    first, last = times[4 * len(times) // 10], times[-1]
    at = lambda t: min(samples, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
    return (at(last) - at(first)) / max(sum(first < t <= last for t in times) / workers, 1)


def _steps(log: str) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(f"{log}-[0-9].jsonl")):
        with open(path) as f:
            lines += [json.loads(line) for line in f]
    return lines


def run_gradsync(name: str, args, work: str) -> dict:
    """One run of configuration `name`: wall, samples lost, steps redone, final sha256."""
    point, options, start, _ = GRADSYNC[name]
    log = os.path.join(work, "log")
    job = ["--steps", str(args.steps), "--compute-s", str(args.compute_s)]
    if point is not None:
        job += ["--kill-at", str(args.kill_at), "--kill-in", point] + (["--kill-server"] if "server death" in name else [])
    saved = ["--checkpoint-dir", os.path.join(work, "ckpt"), "--checkpoint-every", str(args.checkpoint_every)]
    if "from its checkpoint" in name:
        wall = _gradsync(log, options, start, job, saved)
    elif "--resume" in name:
        wall = _gradsync(log, options, start, job, saved)
        time.sleep(1.0)
        wall += 1.0 + _gradsync(log, options, start, job[:4], [*saved, "--resume", saved[1]])
    else:
        wall = _gradsync(log, options, start, job)
    with open(f"{log}-final.json") as f:
        final = json.load(f)
    return {"wall_s": wall, "samples_lost": _samples_lost(log, args.steps), "steps_redone": _redone(log),
            "sha256": final["sha256"]}


def _samples_lost(log: str, steps: int) -> int:
    """The batches of 64 no worker's process committed (drop: the dead worker's from its death on)."""
    lost = 0
    for worker in (0, 1):
        with open(f"{log}-{worker}.jsonl") as f:
            lost += steps - len({json.loads(line)["step"] for line in f})
    return 64 * lost


def _redone(log: str) -> int:
    """Steps worker 0 committed more than once (a resume trains the steps since its checkpoint again)."""
    with open(f"{log}-0.jsonl") as f:
        done = [json.loads(line)["step"] for line in f]
    return len(done) - len(set(done))


def run_torchft(scenario: str, args, work: str) -> dict:
    out = os.path.join(work, "torchft.json")
    began = time.monotonic()
    subprocess.run([args.torchft_python, TORCHFT, "--scenario", scenario, "--steps", str(args.steps),
                    "--kill-at", str(args.kill_at), "--compute-s", str(args.compute_s), "--out", out],
                   capture_output=True, text=True, timeout=900)
    with open(out) as f:
        found = json.load(f)
    return {"wall_s": found.get("wall_s", time.monotonic() - began), "samples_lost": 64 * found.get("dropped", 0),
            "steps_redone": found.get("steps_redone", 0), "sha256": found.get("sha256", ""), "crashed": found.get("crashed", False),
            "restarts": found.get("restarts", 0)}


POLICIES = {  # a job without a death: its options
    "ps fail": ["--worker-loss", "fail"],
    "ps wait": ["--worker-loss", "wait"],
    "ps drop": ["--worker-loss", "drop"],
    "allreduce fail": [*ALLREDUCE, "--worker-loss", "fail"],
    "allreduce wait": [*ALLREDUCE, "--worker-loss", "wait"],
}


def step_cost(args) -> dict:
    """Per policy without a death and without compute, interleaved: the median trainer.step seconds, the median
    wall seconds a step (worker 0's steps' end to end: allreduce averages in the backward), that against the same
    strategy's `fail`, and the job's CPU-seconds per step."""
    runs: dict[str, list[tuple[float, float, float]]] = {p: [] for p in POLICIES}
    for _ in range(args.repeats):
        for policy, options in POLICIES.items():
            with tempfile.TemporaryDirectory() as work:
                log, samples = os.path.join(work, "log"), []
                _gradsync(log, options, "fork", ["--steps", str(args.cost_steps), "--compute-s", "0"], cpu=samples)
                lines = _steps(log)[20:]
                walls = [b["t"] - a["t"] for a, b in zip(lines, lines[1:])]
                runs[policy].append((statistics.median(ln["step_s"] for ln in lines), statistics.median(walls),
                                     _cpu_per_step(samples, _steps(log), 2)))
    out = {}
    for policy, rs in runs.items():
        wall = statistics.median(w for _, w, _ in rs)
        fail = statistics.median(w for _, w, _ in runs[policy.split()[0] + " fail"])
        out[policy] = {"step_ms": 1e3 * statistics.median(s for s, _, _ in rs), "wall_step_ms": 1e3 * wall,
                       "x_fail": wall / fail, "cpu_s_per_step": statistics.median(c for _, _, c in rs)}
    return out


def replication_cost(args) -> dict:
    """Median trainer.step seconds and CPU-seconds per step of W = 4, S = 2 jobs without and with replicas, on
    loopback and behind each of `--cost-links`, without a death or compute, interleaved."""
    out = {}
    for link in ["loopback", *args.cost_links]:
        runs: dict[str, list[tuple[float, float]]] = {"replicas 0": [], "replicas 1": []}
        steps = args.cost_steps if link == "loopback" else args.cost_steps // 5
        for _ in range(args.repeats):
            for name in runs:
                with tempfile.TemporaryDirectory() as work:
                    log, samples = os.path.join(work, "log"), []
                    options = ["--servers", "2", "--replicas", name[-1]] + ([] if link == "loopback" else ["--link", link])
                    _gradsync(log, options, "fork", ["--steps", str(steps), "--compute-s", "0"], workers=4, cpu=samples)
                    lines = _steps(log)
                    runs[name].append((statistics.median(ln["step_s"] for ln in lines[4 * len(lines) // 10:]),
                                       _cpu_per_step(samples, lines, 4)))
        none = statistics.median(s for s, _ in runs["replicas 0"])
        out[link] = {n: {"step_ms": 1e3 * statistics.median(s for s, _ in v), "x_none": statistics.median(
            s for s, _ in v) / none, "cpu_s_per_step": statistics.median(c for _, c in v)} for n, v in runs.items()}
    return out




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--compute-s", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=16)
    parser.add_argument("--cost-steps", type=int, default=200)
    parser.add_argument("--cost-links", nargs="*", default=[], help="also measure replication behind these links")
    parser.add_argument("--configs", nargs="*", default=list(GRADSYNC), choices=list(GRADSYNC),
                        help="the configurations to run (each with its clean run)")
    parser.add_argument("--costs", nargs="*", default=["step", "replication"], choices=["step", "replication"],
                        help="the costs without a death to measure")
    parser.add_argument("--torchft-python", default=None)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()
    runs: dict[str, list[dict]] = {}
    torchft = ["none", "between", "mid"] if args.torchft_python else []
    configs = list(dict.fromkeys(c for name in args.configs for c in (GRADSYNC[name][3], name) if c is not None))
    for _ in range(args.repeats):
        for name in configs:
            with tempfile.TemporaryDirectory() as work:
                runs.setdefault(name, []).append(run_gradsync(name, args, work))
        for scenario in torchft:
            with tempfile.TemporaryDirectory() as work:
                runs.setdefault(f"torchft DDP, {scenario}", []).append(run_torchft(scenario, args, work))
    table = {}
    for name, rs in runs.items():
        clean = "torchft DDP, none" if name.startswith("torchft") else GRADSYNC[name][3] or name
        base = statistics.median(r["wall_s"] for r in runs[clean])
        wall = statistics.median(r["wall_s"] for r in rs)
        clean_sha = runs[clean][0]["sha256"]
        table[name] = {"wall_s": wall, "time_lost_s": wall - base, "samples_lost": max(r["samples_lost"] for r in rs),
                       "steps_redone": max(r["steps_redone"] for r in rs),
                       "same_result": all(r["sha256"] == clean_sha for r in rs), "runs": rs}
    cost = step_cost(args) if "step" in args.costs else {}
    replication = replication_cost(args) if "replication" in args.costs else {}
    result = {"command": " ".join(["bench/faults.py", *sys.argv[1:]]), "machine": machine(load),
              "workload": {"parameters": 1055242, "workers": 2, "servers": 1, "batch": 64, "steps": args.steps,
                           "kill_at": args.kill_at, "compute_s": args.compute_s, "repeats": args.repeats,
                           "checkpoint_every": args.checkpoint_every},
              "deaths": table, "step_cost": cost, "replication_cost": replication}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("| configuration | wall s | time lost s | samples lost | steps redone | result as without the death |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['wall_s']:.1f} | {row['time_lost_s']:.1f} | {row['samples_lost']} | "
              f"{row['steps_redone']} | {'yes' if row['same_result'] else 'no'} |")
    print("\n| policy, no death | trainer.step ms | wall ms a step | x fail | CPU-s per step |\n|---|---|---|---|---|")
    for policy, row in cost.items():
        print(f"| {policy} | {row['step_ms']:.2f} | {row['wall_step_ms']:.2f} | {row['x_fail']:.3f} | "
              f"{row['cpu_s_per_step']:.3f} |")
    print("\n| W = 4, S = 2 | replicas | trainer.step ms | x none | CPU-s per step |\n|---|---|---|---|---|")
    for link, rows in replication.items():
        for name, row in rows.items():
            print(f"| {link} | {name[-1]} | {row['step_ms']:.2f} | {row['x_none']:.3f} | {row['cpu_s_per_step']:.3f} |")


if __name__ == "__main__":
    main()
