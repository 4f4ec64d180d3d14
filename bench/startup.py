"""What a job costs to start and end: `gradsync run` forking its ranks from one fork server (the default,
GRADSYNC_RANK_START=fork) against starting each as a new process (exec), and torchrun on the DDP twin.

Every configuration runs a script that does one training step on a small MLP and ends (so each rank imports
what a real loop imports, torch._dynamo included, through its optimizer):
- `torchrun`: `torchrun --standalone --nproc-per-node W` of a plain DDP script (gloo): THE BASELINE, what a
  DDP user starts a job with;
- `allreduce_fork`, `allreduce_exec`: `gradsync run --strategy allreduce --workers W` (W ranks);
- `ps_fork`, `ps_exec`: `gradsync run --strategy ps --workers W` (W + 1 ranks: one server).
Per run: the wall seconds from the command's start to its exit, and the CPU-seconds the whole machine spent
meanwhile (/proc/stat: the fork server is no child the launcher waits for, so its CPU is in no rusage; run it
on an otherwise idle machine). torch's own teardown sometimes aborts a DDP rank after its work is done
("terminate called without an active exception", SIGABRT in a gloo destructor): a torchrun run whose every rank
printed that it finished counts all the same, and the aborts are counted (`teardown_aborts`) and said. Repeats
are interleaved; medians, and each median's ratio to torchrun's.
Writes bench/results/startup.json (or --out) and prints a markdown table.

    .venv/bin/python bench/startup.py [--workers 2] [--repeats 5] [--configs allreduce_fork ...]
        [--out bench/results/startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from gradsync.launcher import procfs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import machine  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "startup.json")
BIN = os.path.dirname(sys.executable)
CONFIGS = ["allreduce_fork", "allreduce_exec", "ps_fork", "ps_exec"]
"""gradsync's configurations: STRATEGY_RANKSTART."""

_MODEL = """import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
"""

GRADSYNC_SCRIPT = _MODEL + """import torch.distributed.autograd as dist_autograd
import gradsync
gradsync.init()
trainer = gradsync.Trainer(model, torch.optim.SGD, lr=0.1)
with dist_autograd.context() as cid:
    dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
    trainer.step(cid)
gradsync.shutdown()
"""

FINISHED = "finished"
"""What each rank of the DDP twin prints once its work is done, before torch's teardown."""
DDP_SCRIPT = _MODEL + f"FINISHED = {FINISHED!r}\n" + """import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
F.cross_entropy(ddp(x), y).backward()
opt.step()
print(FINISHED, flush=True)  # the work is done: torch's known abort comes in the teardown, destroy included
dist.destroy_process_group()
"""


def busy_s() -> float:
    """CPU-seconds every core of this machine has been busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / procfs.TICK


def commands(workers: int, folder: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each configuration's command line and environment."""
    gradsync_script, ddp_script = os.path.join(folder, "job.py"), os.path.join(folder, "ddp.py")
    with open(gradsync_script, "w") as f:
        f.write(GRADSYNC_SCRIPT)
    with open(ddp_script, "w") as f:
        f.write(DDP_SCRIPT)
    run = [sys.executable, "-m", "gradsync.cli", "run", "--workers", str(workers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # what gradsync gives its ranks; torchrun gives 1 too
    return {
        "torchrun": ([os.path.join(BIN, "torchrun"), "--standalone", f"--nproc-per-node={workers}", ddp_script], env),
        **{f"{strategy}_{start}": ([*run, "--strategy", strategy, gradsync_script],
                                   {**env, "GRADSYNC_RANK_START": start})
           for strategy, start in (name.split("_") for name in CONFIGS)},
    }


def measure(argv: list[str], env: dict[str, str], workers: int) -> tuple[float, float, bool]:
    """(wall seconds, machine CPU-seconds, whether torch's teardown aborted a rank) of one run of `argv`, which must
    succeed, or have had every one of its `workers` ranks print FINISHED before torch's known teardown abort."""
    cpu, start = busy_s(), time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - start
    time.sleep(0.5)  # a fork server outlives its launcher by a moment: its last CPU counts too
    aborted = (done.returncode != 0 and done.stdout.split().count(FINISHED) == workers
               and "terminate called without an active exception" in done.stderr)
    if done.returncode != 0 and not aborted:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr}")
    return wall, busy_s() - cpu, aborted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS,
                        help="gradsync configurations to run (torchrun, the baseline, always runs)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gradsync-startup-") as folder:
        configs = {name: c for name, c in commands(args.workers, folder).items() if name in ["torchrun", *args.configs]}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        aborts = dict.fromkeys(configs, 0)
        for repeat in range(args.repeats):
            for name, (command, env) in configs.items():
                wall_s, cpu_s, aborted = measure(command, env, args.workers)
                runs[name].append((wall_s, cpu_s))
                aborts[name] += aborted
                said = " (torch's teardown aborted a rank after its work: counted)" if aborted else ""
                print(f"repeat {repeat} {name}: {wall_s:.2f} s, {cpu_s:.2f} CPU-s{said}", flush=True)
    wall = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r) for name, r in runs.items()}
    rows = {name: dict(wall_s=wall[name], cpu_s=cpu[name], wall_vs_torchrun=wall[name] / wall["torchrun"],
                       cpu_vs_torchrun=cpu[name] / cpu["torchrun"], runs=runs[name], teardown_aborts=aborts[name])
            for name in configs}
    print(f"\nW = {args.workers}, median of {args.repeats} interleaved repeats\n")
    print("| configuration | wall s | x torchrun | CPU-s | x torchrun |\n|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['wall_s']:.2f} | {row['wall_vs_torchrun']:.2f} | {row['cpu_s']:.2f} | "
              f"{row['cpu_vs_torchrun']:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(["bench/startup.py", *(sys.argv[1:] if argv is None else argv)]),
                       workers=args.workers, repeats=args.repeats, machine=machine(load), configs=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
