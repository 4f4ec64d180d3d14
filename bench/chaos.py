"""Chaos soak: an elastic async ps job whose workers are killed and joined, and whose servers are paused, at random.

One job (`gradsync run --strategy ps --mode async`, W workers, S servers, loopback) trains a small MLP
(256 -> 256 -> 256 -> 10 by default, SGD momentum 0.9, a seeded batch per worker) for `--minutes` after every
worker took its first step. Meanwhile, every `--event-every` seconds on average, a random worker that has
taken a step is killed with SIGKILL or a new worker joins the running job (`gradsync run --join RUN_DIR`),
keeping between `--min-workers` and `--max-workers` workers (the first event is a join and the second a
kill, so that even a short run has both); every `--stop-every` seconds on average a random server is
SIGSTOPped for up to `--stop-seconds` (less than step_timeout), then SIGCONTed. With `--checkpoint-every N`
the job writes checkpoints, when this gradsync takes them for async jobs (if its settings refuse them, the
bench says so and runs without).

Then every worker is told to stop (a file), the job ends, and the bench checks:

- Pushes: each worker appends a line to a file of its own after every `trainer.step` returns, that is, once
  every server acknowledged its push (one small write(2) per step, so a SIGKILLed worker's count survives it);
  each server's final counters (`stats-<shard>.json`) say how many pushes of each worker it applied. For each
  worker and server, acknowledged <= applied <= acknowledged + (1 if the bench killed that worker, else 0):
  a worker killed after a server applied its push but before the reply arrived (or before it wrote its line)
  is the only allowed gap, one push at most, since a worker has one step in flight. No push is rejected.
- Leftovers: within a grace period after the launchers exit, no process of the job is left (each carries a
  tag in its environment; the bench scans /proc for it), and no network namespace any of them ran in is left.
- Memory: every process of the job sampled (VmRSS from /proc every `--interval` seconds) for at least
  `--judge-after` seconds once ready (the launcher and servers: from the chaos's start; a worker and its join
  launcher: from the worker's first step) ends within 5% of its RSS after warm-up, as bench/soak.py measures
  it (medians of the samples in the tenth of that span after max(`--warmup` s, its first tenth), and in its
  last tenth). Workers killed early live too briefly to be judged, and are counted as such.
- The job's launcher exits 0, and each `gradsync run --join` exits 0, or 1 when the bench killed its worker.
- Checkpoints (when on): every step folder the job wrote has its manifest, but maybe the newest.

Exits 1 when a check fails; writes bench/results/chaos.json with every event (kill, join, stop, cont: seconds
since the chaos began), the counts and the checks. Every process it starts is killed when it ends, however.

    .venv/bin/python bench/chaos.py [--minutes 3] [--workers 4] [--servers 2] [--event-every 4]
        [--stop-every 20] [--stop-seconds 3] [--step-timeout 20] [--checkpoint-every N] [--seed 0]
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TAG = "GRADSYNC_CHAOS_TAG"
"""In the environment of every process of the job: how the bench finds them, and what is left of them."""
SIZES = (256, 256, 256, 10)
BATCH, LR, MOMENTUM = 32, 0.01, 0.9
TARGET = 0.05  # memory growth allowed, as bench/soak.py
LEFTOVER_GRACE_S = 15.0
JOIN_LAUNCHER_CODES = (0, 1)  # 1: it reports the worker the bench killed


# --- the job's side: every rank and every joining worker runs this file with --rank FOLDER ---


def rank_main(folder: str, sizes: tuple[int, ...]) -> None:
    """A rank of the job: a server serves until the job ends (in gradsync.init); a worker trains until
    `folder`/stop exists, appending a line to `folder`/acks-<worker> after each acknowledged step."""
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch import nn

    import gradsync

    torch.set_num_threads(1)
    if "RANK" in os.environ:  # a rank the job's launcher started (a joining worker has none)
        write(os.path.join(folder, f"rank-{os.environ['RANK']}.pid"), os.getpid())
    gradsync.init()
    me = gradsync.worker_rank()
    write(os.path.join(folder, f"worker-{me}.pid"), os.getpid())
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    trainer = gradsync.Trainer(nn.Sequential(*layers), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(1 + me)
    x, y = torch.randn(BATCH, sizes[0], generator=g), torch.randn(BATCH, sizes[-1], generator=g)
    acks = os.open(os.path.join(folder, f"acks-{me}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    step, stop = 0, os.path.join(folder, "stop")
    while not os.path.exists(stop):
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(trainer.model(x), y)])
            trainer.step(cid)
        step += 1
        os.write(acks, b"%d\n" % step)  # one write(2): in the kernel before the next step, whatever kills us
    os.close(acks)
    gradsync.shutdown()


def write(path: str, value) -> None:
    """Replace `path` with `value`, so that a reader never sees a torn write."""
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


# --- the bench's side ---


def read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def count_acks(folder: str, worker: int) -> int:
    try:
        with open(os.path.join(folder, f"acks-{worker}"), "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def alive(pid: int) -> bool:
    from gradsync.launcher import procfs

    return procfs.state(pid) not in (None, "Z")


def tagged(tag: str) -> list[int]:
    """Pids of the live processes whose environment carries `tag` (zombies have no environment)."""
    needle = f"{TAG}={tag}".encode()
    pids = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(path.split("/")[2]))
        except OSError:
            pass
    return pids


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def net_namespace(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def namespaces_left(inodes: set[int]) -> list[str]:
    """Which of the network namespaces `inodes` still exist: a name under /run/netns, or a process in it."""
    left = []
    for path in glob.glob("/run/netns/*"):
        try:
            if os.stat(path).st_ino in inodes:
                left.append(path)
        except OSError:
            pass
    for path in glob.glob("/proc/[0-9]*"):
        if net_namespace(path.split("/")[2]) in inodes:
            left.append(f"{path} ({command_line(int(path.split('/')[2]))})")
    return left


class Chaos:
    """One chaos job: its processes, the events it caused, the memory it sampled."""

    def __init__(self, args: argparse.Namespace, folder: str, checkpoint_dir: str | None):
        self.args, self.folder = args, folder
        self.run_dir = os.path.join(folder, "run")
        self.checkpoint_dir = checkpoint_dir
        self.tag = secrets.token_hex(8)
        self.env = {**os.environ, TAG: self.tag, "PYTHONUNBUFFERED": "1"}
        self.rng = random.Random(args.seed)
        self.launcher: subprocess.Popen | None = None
        self.joins: list[dict] = []  # {"proc": Popen, "event": its join event}
        self.events: list[dict] = []
        self.killed: dict[int, int] = {}  # worker -> pid, killed by the bench
        self.parents: dict[int, int] = {}  # worker -> its parent: its launcher, or the fork server its launcher started
        self.samples: dict[int, dict] = {}  # pid -> {"name", "t": [time.monotonic()...], "rss": [...]}
        self.first_steps: dict[int, float] = {}  # worker -> when the bench saw its first step
        self.namespaces: set[int] = set()
        self.own_namespace = net_namespace("self")
        self.start = time.monotonic()  # reset when every worker has stepped
        self.start_time = time.time()  # the same moment, by the clock

    def now(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        with open(os.path.join(self.folder, log), "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "gradsync.cli", "run", *argv], env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def rank_args(self) -> list[str]:
        return [os.path.abspath(__file__), "--rank", self.folder, "--sizes", *map(str, self.args.sizes)]

    def start_job(self) -> None:
        a = self.args
        argv = ["--strategy", "ps", "--mode", "async", "--workers", str(a.workers), "--servers", str(a.servers),
                "--run-dir", self.run_dir, "--step-timeout", str(a.step_timeout), "--timeout", str(a.job_timeout)]
        if self.checkpoint_dir is not None:
            argv += ["--checkpoint-dir", self.checkpoint_dir, "--checkpoint-every", str(a.checkpoint_every)]
        self.launcher = self.spawn(argv + self.rank_args(), "launcher.log")

    def workers(self) -> dict[int, int]:
        """pid by worker index, of every worker that reached gradsync.init()."""
        found = {}
        for path in glob.glob(os.path.join(self.folder, "worker-*.pid")):
            pid = read_int(path)
            if pid is not None:
                found[int(path.rsplit("-", 1)[1].split(".")[0])] = pid
        return found

    def servers(self) -> dict[int, int]:
        """pid by shard."""
        pids = {s: read_int(os.path.join(self.folder, f"rank-{s}.pid")) for s in range(self.args.servers)}
        return {s: pid for s, pid in pids.items() if pid is not None}

    def refresh(self) -> dict[int, int]:
        """pid by worker index (`workers`), noting each new worker's parent and which join, if any, started it."""
        from gradsync.launcher.procfs import parent

        workers = self.workers()
        for worker, pid in workers.items():
            if worker not in self.first_steps and count_acks(self.folder, worker):
                self.first_steps[worker] = time.monotonic()
            if worker not in self.parents and (ppid := parent(pid)) is not None:
                self.parents[worker] = ppid
                ancestors = {ppid, parent(ppid)}  # a forked worker's parent is the fork server its launcher started
                for join in self.joins:
                    if join["proc"].pid in ancestors:
                        join["event"]["worker"] = worker
        return workers

    def established(self) -> dict[int, int]:
        """pid by worker, of the workers alive now that have taken a step and were not killed."""
        return {w: pid for w, pid in sorted(self.refresh().items())
                if w not in self.killed and alive(pid) and count_acks(self.folder, w)}

    def pending(self) -> int:
        """Joins on their way in: their launcher runs, their worker has not taken a step."""
        return sum(j["proc"].poll() is None and not count_acks(self.folder, j["event"].get("worker", -1))
                   for j in self.joins)

    def wait_for_first_steps(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(count_acks(self.folder, w) for w in range(self.args.workers)):
            if self.launcher.poll() is not None:
                raise RuntimeError(f"the job ended before every worker took a step (exit code "
                                   f"{self.launcher.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every worker took a step within {timeout:.0f} s")
            self.sample()
            time.sleep(0.2)
        self.start, self.start_time = time.monotonic(), time.time()

    def kill(self, choices: dict[int, int]) -> None:
        """SIGKILL a random worker of `choices` (pid by worker)."""
        worker = self.rng.choice(sorted(choices))
        os.kill(choices[worker], signal.SIGKILL)
        self.killed[worker] = choices[worker]
        self.events.append(dict(t=self.now(), kind="kill", worker=worker, pid=choices[worker],
                                acknowledged=count_acks(self.folder, worker)))

    def join(self) -> None:
        proc = self.spawn(["--join", self.run_dir] + self.rank_args(), f"join-{len(self.joins)}.log")
        event = dict(t=self.now(), kind="join", launcher_pid=proc.pid)
        self.joins.append(dict(proc=proc, event=event))
        self.events.append(event)

    def chaos_event(self) -> None:
        """The next kill or join. A kill leaves at least --min-workers workers that have taken a step (a job
        whose every worker left fails, joins on their way in or not); a join keeps the workers, those on their
        way in counted, within --max-workers. The first event is a join and the second a kill, when they
        may be; then each is drawn."""
        a = self.args
        established = self.established()
        may = dict(kill=len(established) > a.min_workers, join=len(established) + self.pending() < a.max_workers)
        done = [e["kind"] for e in self.events if e["kind"] in ("kill", "join")]
        wanted = "join" if not done else "kill" if done == ["join"] else \
            "kill" if self.rng.random() < a.kill_share else "join"
        if not may[wanted]:
            wanted = "join" if wanted == "kill" else "kill"
        if wanted == "kill" and may["kill"]:
            self.kill(established)
        elif wanted == "join" and may["join"]:
            self.join()

    def stop_server(self) -> tuple[int, int, float] | None:
        servers = self.servers()
        if not servers:
            return None
        shard = self.rng.choice(sorted(servers))
        seconds = round(self.rng.uniform(0.5, 1.0) * self.args.stop_seconds, 2)
        try:
            os.kill(servers[shard], signal.SIGSTOP)
        except ProcessLookupError:  # the server is gone: the job fails, and the checks say so
            return None
        self.events.append(dict(t=self.now(), kind="stop", server=shard, pid=servers[shard], seconds=seconds))
        return shard, servers[shard], time.monotonic() + seconds

    def cont_server(self, stopped: tuple[int, int, float]) -> None:
        shard, pid, _ = stopped
        os.kill(pid, signal.SIGCONT)
        self.events.append(dict(t=self.now(), kind="cont", server=shard, pid=pid))

    def name(self, pid: int) -> str:
        if self.launcher is not None and pid == self.launcher.pid:
            return "launcher"
        for join in self.joins:
            if pid == join["proc"].pid:
                return f"join launcher {self.joins.index(join)}"
        for shard, p in self.servers().items():
            if p == pid:
                return f"server {shard}"
        for worker, p in self.workers().items():
            if p == pid:
                return f"worker {worker}"
        return command_line(pid)[:80]

    def sample(self) -> None:
        """VmRSS of every process of the job; the network namespace of each."""
        from gradsync.launcher import procfs

        t = time.monotonic()
        self.refresh()
        for pid in tagged(self.tag):
            rss = procfs.memory(pid, "VmRSS")
            ns = net_namespace(pid)
            if ns is not None and ns != self.own_namespace:
                self.namespaces.add(ns)
            if rss is None:
                continue
            s = self.samples.setdefault(pid, dict(name=None, t=[], rss=[]))
            if s["name"] is None or s["name"].startswith(("/", sys.executable)):
                s["name"] = self.name(pid)
            s["t"].append(t)
            s["rss"].append(rss)

    def memory_samples(self) -> dict[int, dict]:
        """The samples of each process from when it was ready (seconds since the chaos began): the launcher and
        the servers from then, a worker and its join launcher from the worker's first step; a process that
        never was ready has none."""
        ready = {pid: self.start for pid in [self.launcher.pid, *self.servers().values()]}
        for worker, pid in self.workers().items():
            if worker in self.first_steps:
                ready[pid] = self.first_steps[worker]
                for join in self.joins:
                    if join["event"].get("worker") == worker:
                        ready[join["proc"].pid] = self.first_steps[worker]
        out = {}
        for pid, s in self.samples.items():
            kept = [(round(t - self.start, 2), r) for t, r in zip(s["t"], s["rss"]) if pid in ready and t >= ready[pid]]
            if kept:
                out[pid] = dict(name=s["name"], t=[t for t, _ in kept], rss=[r for _, r in kept])
        return out

    def run(self) -> None:
        """Start the job, cause events for the run's length, then stop the workers and wait for the end."""
        a = self.args
        self.start_job()
        self.wait_for_first_steps(a.startup_timeout)
        end = self.start + a.minutes * 60
        gap = lambda mean: self.rng.uniform(0.5, 1.5) * mean  # noqa: E731
        next_event, next_stop, next_sample = self.start + gap(a.event_every), self.start + gap(a.stop_every), 0.0
        stopped = None
        while time.monotonic() < end or stopped is not None:
            if self.launcher.poll() is not None:
                break  # the job ended early: a failure, which the checks report
            now = time.monotonic()
            if stopped is not None and now >= stopped[2]:
                self.cont_server(stopped)
                stopped, next_stop = None, now + gap(a.stop_every)
            if now < end and now >= next_event:
                self.chaos_event()
                next_event = now + gap(a.event_every)
            if now < end and stopped is None and now >= next_stop:
                stopped = self.stop_server()
            if now >= next_sample:
                self.sample()
                next_sample = now + a.interval
            time.sleep(0.05)
        self.settle()
        write(os.path.join(self.folder, "stop"), self.now())
        self.events.append(dict(t=self.now(), kind="stop workers"))
        self.wait_for_end()

    def settle(self) -> None:
        """Before the stop: let joins on their way in take a step (or end), so that none is cut off while it
        joins (a job whose workers all left ends, and its store with it)."""
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline and self.launcher.poll() is None:
            self.refresh()
            waiting = [j for j in self.joins if j["proc"].poll() is None
                       and not count_acks(self.folder, j["event"].get("worker", -1))]
            if not waiting:
                return
            self.sample()
            time.sleep(0.2)

    def wait_for_end(self) -> None:
        """Wait (bounded) for the launcher and every join to exit, sampling memory."""
        deadline = time.monotonic() + self.args.step_timeout + 90
        procs = [self.launcher] + [j["proc"] for j in self.joins]
        next_sample = 0.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if time.monotonic() >= next_sample:
                self.sample()
                next_sample = time.monotonic() + self.args.interval
            time.sleep(0.1)
        for join in self.joins:
            join["event"]["code"] = join["proc"].poll()

    def leftovers(self) -> list[str]:
        """The job's processes still alive once a grace period after its launchers' exit has passed."""
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [f"{pid} ({command_line(pid)[:200]})" for pid in tagged(self.tag)]

    def cleanup(self) -> None:
        """SIGCONT and SIGKILL every process of the job that is left, and the launchers' process groups."""
        for pid in tagged(self.tag):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for proc in [self.launcher] + [j["proc"] for j in self.joins]:
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def pushes(folder: str, run_dir: str, killed: dict[int, int], seen: list[int]) -> dict:
    """Pushes acknowledged (the workers' files) against applied (each server's final counters), per worker and
    server, and whether acknowledged <= applied <= acknowledged + 1 for a killed worker (+ 0 for the others)."""
    servers = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "stats-*.json"))):
        with open(path) as f:
            servers[int(path.rsplit("-", 1)[1].split(".")[0])] = json.load(f)
    workers = sorted(set(seen) | {int(k) for s in servers.values() for k in s["pushes_by_worker"]})
    acknowledged = {w: count_acks(folder, w) for w in workers}
    problems = []
    if not servers:
        problems.append("no server wrote its final counters (stats-<shard>.json): the job did not end cleanly")
    for shard, stats in sorted(servers.items()):
        by_worker = {int(k): v for k, v in stats["pushes_by_worker"].items()}
        for w in workers:
            applied, acked, gap = by_worker.get(w, 0), acknowledged[w], int(w in killed)
            if not acked <= applied <= acked + gap:
                problems.append(f"server {shard}, worker {w}{' (killed)' if gap else ''}: applied {applied}, "
                                f"acknowledged {acked}")
        if stats["pushes_applied"] != sum(by_worker.values()):
            problems.append(f"server {shard}: pushes_applied {stats['pushes_applied']} != the sum by worker "
                            f"{sum(by_worker.values())}")
        if stats["pushes_rejected"]:
            problems.append(f"server {shard} rejected {stats['pushes_rejected']} pushes")
    total = sum(acknowledged.values())
    return dict(acknowledged=total, acknowledged_by_worker=acknowledged, killed=len(killed),
                applied={s: v["pushes_applied"] for s, v in servers.items()},
                applied_by_worker={s: v["pushes_by_worker"] for s, v in servers.items()},
                rejected={s: v["pushes_rejected"] for s, v in servers.items()},
                version={s: v["version"] for s, v in servers.items()}, problems=problems)


def memory(samples: dict[int, dict], judge_after: float, warmup: float) -> dict:
    """Per process: RSS after warm-up and at the end (medians of the samples in the tenth of its sampled life
    after max(`warmup` s, a tenth of it), and in its last tenth), growth; judged (within TARGET) when sampled
    for `judge_after` s or more. `samples`: from when each process was ready (`Chaos.memory_samples`)."""
    out = {}
    for pid, s in samples.items():
        t, rss = s["t"], s["rss"]
        life = t[-1] - t[0]
        row = dict(name=s["name"], pid=pid, seconds=round(life, 1), samples=len(t), peak_rss=max(rss))
        if life >= judge_after and len(t) >= 10:
            warm_start = t[0] + max(warmup, 0.1 * life)
            after = [(x, r) for x, r in zip(t, rss) if x >= warm_start]  # the first one, when the window is empty
            warm = statistics.median([r for x, r in after if x <= warm_start + 0.1 * life] or [after[0][1]])
            end = statistics.median(r for x, r in zip(t, rss) if x >= t[0] + 0.9 * life)
            row.update(warm_rss=warm, end_rss=end, growth=(end - warm) / warm, flat=abs(end - warm) <= TARGET * warm)
        out[str(pid)] = row
    return out


def checks(result: dict) -> dict[str, dict]:
    """Each check: ok and what it found."""
    p, mem = result["pushes"], result["memory"].values()
    judged = [m for m in mem if "flat" in m]
    grown = [f"{m['name']} {100 * m['growth']:+.1f}%" for m in judged if not m["flat"]]
    joins = [e for e in result["events"] if e["kind"] == "join"]
    bad_joins = [f"join launcher {e['launcher_pid']} exited {e.get('code')}" for e in joins
                 if e.get("code") not in JOIN_LAUNCHER_CODES or (e.get("code") == 1 and e.get("worker") not in
                                                                 result["killed"])]
    return {
        "job ended": dict(ok=result["launcher_code"] == 0 and not bad_joins,
                          found=f"launcher exit code {result['launcher_code']}" + "".join(f"; {b}" for b in bad_joins)),
        "pushes accounted": dict(ok=not p["problems"], found="; ".join(p["problems"]) or
                                 f"acknowledged {p['acknowledged']} <= applied {p['applied']} <= acknowledged + "
                                 f"{p['killed']} killed, per worker and server"),
        "no process left": dict(ok=not result["processes_left"], found="; ".join(result["processes_left"]) or "none"),
        "no namespace left": dict(ok=not result["namespaces_left"],
                                  found="; ".join(result["namespaces_left"]) or
                                  f"none (the job's processes ran in {len(result['namespaces'])} namespaces of "
                                  "their own)"),
        "checkpoints complete": checkpoints_check(result["checkpoints"]),
        "memory flat": dict(ok=not grown, found="; ".join(grown) or
                            f"{len(judged)} processes judged within {100 * TARGET:.0f}%, "
                            f"{len(mem) - len(judged)} lived under {result['settings']['judge_after']:.0f} s"),
    }


def checkpoints_check(c: dict) -> dict:
    """With checkpoints on: every step folder has its manifest but maybe the newest (in flight at the end), and
    at least one has. A folder without one is a checkpoint begun and never finished."""
    if not c["every"] or c["refused"]:
        return dict(ok=True, found="refused by this gradsync for async jobs" if c["refused"] else "off")
    torn = len(c["written"]) - c["complete"]
    return dict(ok=c["complete"] >= 1 and torn <= 1,
                found=f"{c['complete']} of {len(c['written'])} step folders have their manifest, the newest "
                      f"written {c['last_at']} s into the chaos")


def checkpoint_support(args: argparse.Namespace, path: str) -> tuple[str | None, str | None]:
    """(the checkpoint folder to use, or None; why not, when asked and refused by this gradsync's settings)."""
    if not args.checkpoint_every:
        return None, None
    from gradsync.config import ConfigError, JobConfig

    try:
        JobConfig(strategy="ps", mode="async", servers=args.servers, world_size=args.servers + args.workers,
                  checkpoint_every=args.checkpoint_every, checkpoint_dir=path)
    except ConfigError as e:
        return None, str(e)
    return path, None


def checkpoints_written(every: int, refused: str | None, path: str | None, start: float) -> dict:
    """The step folders the job wrote into `path`, how many have their manifest (written last), and when
    the newest manifest was written (seconds since `start`, a time.time())."""
    written = sorted(os.listdir(path)) if path and os.path.isdir(path) else []
    manifests = [os.path.join(path, f, "MANIFEST.json") for f in written]
    times = [os.path.getmtime(m) - start for m in manifests if os.path.exists(m)]
    return dict(every=every, refused=refused, written=written, complete=len(times),
                last_at=round(max(times), 1) if times else None)


def table(result: dict) -> str:
    lines = ["| process | sampled s | RSS after warm-up MB | RSS at end MB | growth |", "|---|---|---|---|---|"]
    for m in sorted(result["memory"].values(), key=lambda m: (-m["seconds"], m["name"])):
        if "flat" in m:
            lines.append(f"| {m['name']} | {m['seconds']:.0f} | {m['warm_rss'] / 2**20:.1f} | "
                         f"{m['end_rss'] / 2**20:.1f} | {100 * m['growth']:+.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="of chaos, after every worker took a step")
    parser.add_argument("--workers", type=int, default=4, help="workers at the start (W)")
    parser.add_argument("--servers", type=int, default=2, help="servers (S)")
    parser.add_argument("--min-workers", type=int, default=2,
                        help="workers that have taken a step and are left after any kill")
    parser.add_argument("--max-workers", type=int, default=6, help="workers after any join, joins on their way counted")
    parser.add_argument("--event-every", type=float, default=4.0, help="mean seconds between kills and joins")
    parser.add_argument("--kill-share", type=float, default=0.5, help="chance that an event is a kill")
    parser.add_argument("--stop-every", type=float, default=20.0, help="mean seconds between server stops")
    parser.add_argument("--stop-seconds", type=float, default=3.0, help="longest server stop (< step timeout)")
    parser.add_argument("--step-timeout", type=float, default=20.0, help="the job's step_timeout")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for the first steps")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between memory samples")
    parser.add_argument("--judge-after", type=float, default=60.0,
                        help="memory is judged for processes sampled at least this long")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds after a process is ready (a worker: its first step) before its warm-up RSS")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="layer widths, input first")
    parser.add_argument("--seed", type=int, default=0, help="of the bench's choices")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "chaos.json"))
    parser.add_argument("--rank", metavar="FOLDER", help=argparse.SUPPRESS)  # the job's processes
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args.rank, tuple(args.sizes))
        return 0
    if not 0 < args.stop_seconds < args.step_timeout:
        parser.error(f"--stop-seconds {args.stop_seconds}: a stop must be shorter than --step-timeout "
                     f"{args.step_timeout}, or the job fails naming the server (as it should)")
    if not 1 <= args.min_workers < args.workers <= args.max_workers:
        parser.error("need 1 <= --min-workers < --workers <= --max-workers")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # cleans up on the way out
    args.job_timeout = args.minutes * 60 + 2 * args.startup_timeout + args.step_timeout + 120
    folder = tempfile.mkdtemp(prefix="gradsync-chaos-")
    ckpt, refused = checkpoint_support(args, os.path.join(folder, "checkpoints"))
    if refused:
        print(f"chaos: --checkpoint-every {args.checkpoint_every} refused for async jobs by this gradsync, running "
              f"without checkpoints: {refused}", flush=True)
    chaos = Chaos(args, folder, ckpt)
    error = None
    try:
        try:
            chaos.run()
        except Exception as e:  # reported, with the job's logs, after the checks of what is left
            error = f"{type(e).__name__}: {e}"
        launcher_code = chaos.launcher.poll() if chaos.launcher else None
        left = chaos.leftovers()
        result = dict(
            launcher_code=launcher_code, error=error, events=chaos.events, killed=sorted(chaos.killed),
            seconds=chaos.now(),  # since the chaos began, to the checks: the stop and the job's end included
            pushes=pushes(folder, chaos.run_dir, chaos.killed, sorted(chaos.workers())),
            processes_left=left, namespaces=sorted(chaos.namespaces),
            namespaces_left=namespaces_left(chaos.namespaces),
            memory=memory(chaos.memory_samples(), args.judge_after, args.warmup),
            checkpoints=checkpoints_written(args.checkpoint_every, refused, ckpt, chaos.start_time),
            launcher_log=tail(os.path.join(folder, "launcher.log")),
        )
    finally:
        chaos.cleanup()
    result["settings"] = {k: v for k, v in vars(args).items() if k != "rank"}
    result["checks"] = checks(result)
    if error or not all(c["ok"] for c in result["checks"].values()):
        result["logs"] = {os.path.basename(p): tail(p) for p in sorted(glob.glob(os.path.join(folder, "*.log")))}
    shutil.rmtree(folder, ignore_errors=True)
    report(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    import torch

    with open(args.out, "w") as f:
        json.dump(dict(command="bench/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=os.cpu_count(), torch=torch.__version__, **result), f, indent=1)
    return 0 if all(c["ok"] for c in result["checks"].values()) and not error else 1


def tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def report(result: dict) -> None:
    kinds = [e["kind"] for e in result["events"]]
    p, c = result["pushes"], result["checkpoints"]
    print(f"chaos: {result['seconds']:.0f} s, {kinds.count('kill')} kills, {kinds.count('join')} joins, "
          f"{kinds.count('stop')} server stops; pushes acknowledged {p['acknowledged']}, applied by server "
          f"{p['applied']}, workers killed {p['killed']}; checkpoints: "
          + (f"refused ({c['refused'][:80]}...)" if c["refused"]
             else f"{len(c['written'])} written, {c['complete']} with a manifest, the last at {c['last_at']} s"
             if c["every"] else "off"))
    if result["error"]:
        print(f"chaos: error: {result['error']}")
    for name, c in result["checks"].items():
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: {c['found']}")
    print(table(result))


if __name__ == "__main__":
    sys.exit(main())
