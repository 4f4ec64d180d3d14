"""Each paradigm's step time behind an emulated link against that link's floor, measured in one run.

The floor of a step is the time its busiest link needs, in one direction, for the bytes the paradigm must
move (P: the model's fp32 parameter bytes, R: the link's rate in bytes/s, W workers, S servers):
- allreduce (a ring): every worker link carries 2 (W - 1) / W x P each way: floor = 2 (W - 1) / W x P / R;
- ps: every worker link carries P each way (gradients up, values down) and every server link W x P / S
  each way: floor = max(P / R_worker, W x P / S / R_server) (`--server-link`: the servers' slower rate).
Each configuration is a `gradsync.launch` job with `link=` (every rank in its own network namespace, `tc tbf`
links; root and iproute2). Repeats are interleaved: repeat r runs every configuration once, then r + 1.
Per run, on worker 0: the median step (forward + backward + trainer.step) over the timed steps, the median
of each part of it, the CPU-seconds per step of all the job's processes (/proc) and the seconds their
threads waited, runnable, for a CPU (schedstat, summed over threads: the time-slicing on this machine's
cores), the bytes every rank's link carried per step in each direction (its namespace's /proc/PID/net/dev:
frames on the wire, headers included), whose largest is "the busiest link", and the TCP retransmissions,
timeouts and tail-loss probes of all its namespaces per step. The table reports medians over repeats, and
each run's ratio to the floor. Writes bench/results/linkfloor.json (or --out).

    PYTHONPATH=$PWD .venv/bin/python bench/linkfloor.py                  # 100mbit, W=2, issue workload (~3 min)
    PYTHONPATH=$PWD .venv/bin/python bench/linkfloor.py --links 1gbit --workloads reference --workers 2 4
    PYTHONPATH=$PWD .venv/bin/python bench/linkfloor.py --links 1gbit --server-link 100mbit --configs ps_s2
    PYTHONPATH=$PWD .venv/bin/python bench/linkfloor.py --transport grpc --configs ps_s1 ps_s2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from gradsync.launcher.netem import DEVICE, Link

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Workload, gradsync_worker_setup, job_pids, machine, timed_loop  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "linkfloor.json")
WORKLOADS = {  # layer widths, batch: MSE on one-hot labels, SGD momentum (bench/overhead.py's loop)
    "issue": ((12288, 128, 128, 30), 20),  # issue 17's table: 1.59M parameters, 6.4 MB
    "reference": ((12288, 512, 512, 30), 20),  # DESIGN.md's reference workload: 6.57M parameters
}
CONFIGS = {"allreduce": ("allreduce", 0), "ps_s1": ("ps", 1), "ps_s2": ("ps", 2)}  # name -> strategy, S


def link_bytes() -> dict[int, tuple[int, int]]:
    """(sent, received) bytes of every job process's link device, read in its own network namespace."""
    out = {}
    for pid in job_pids():
        try:
            with open(f"/proc/{pid}/net/dev") as f:
                for line in f:
                    name, _, fields = line.partition(":")
                    if name.strip() == DEVICE:
                        values = fields.split()
                        out[pid] = (int(values[8]), int(values[0]))
        except OSError:
            pass
    return out


TCP_COUNTERS = {"snmp": ("Tcp", ("RetransSegs",)), "netstat": ("TcpExt", ("TCPTimeouts", "TCPLossProbes"))}


def tcp_counters() -> dict[str, int]:
    """TCP retransmitted segments, retransmission timeouts and tail-loss probes, summed over the job's
    namespaces (/proc/PID/net/snmp and netstat: per network namespace)."""
    out = {name: 0 for _, names in TCP_COUNTERS.values() for name in names}
    for pid in job_pids():
        for table, (prefix, names) in TCP_COUNTERS.items():
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    lines = [line.split() for line in f if line.startswith(prefix + ":")]
            except OSError:
                continue
            for header, values in zip(lines[::2], lines[1::2]):
                for name in names:
                    if name in header:
                        out[name] += int(values[header.index(name)])
    return out


def worker(w: Workload, steps: int, warmup: int) -> dict:
    """One rank's loop: forward, backward, step, each timed; worker 0 also reads the job's CPU and link counters."""
    trainer, x, y = gradsync_worker_setup(w)
    me = gradsync.worker_rank()
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    before: dict = {}

    def step():
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = F.mse_loss(trainer.model(x), y)
            t1 = time.perf_counter()
            dist_autograd.backward(cid, [loss])
            t2 = time.perf_counter()
            trainer.step(cid)
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            parts[name].append(seconds)

    def on_window():
        before.update(net=link_bytes(), tcp=tcp_counters())

    result = timed_loop(step, steps, warmup, me, on_window)
    result["parts_s"] = {n: statistics.median(v[warmup:]) for n, v in parts.items()}
    if me == 0:
        per = [((a[0] - before["net"][p][0]) / steps, (a[1] - before["net"][p][1]) / steps)
               for p, a in link_bytes().items() if p in before["net"]]
        result["link_bytes_per_step"] = per  # (sent, received) per process
        result["busiest_link_bytes"] = max((max(s, r) for s, r in per), default=0.0)
        result["tcp_per_step"] = {n: (v - before["tcp"][n]) / steps for n, v in tcp_counters().items()}
    return result


def floor_of(config: str, w: Workload, workers: int, link: Link, server_link: Link | None) -> tuple[float, float]:
    """(payload bytes on the busiest link per step, floor seconds) of `config`, as the module docstring says."""
    strategy, servers = CONFIGS[config]
    params = sum(a * b + b for a, b in zip(w.sizes, w.sizes[1:])) * 4
    rate, server_rate = link.bits_per_s / 8, (server_link or link).bits_per_s / 8
    if strategy == "allreduce":
        nbytes = 2 * (workers - 1) / workers * params
        return nbytes, nbytes / rate
    on_server = workers * params / servers
    return max(params, on_server), max(params / rate, on_server / server_rate)


def run(config: str, w: Workload, workers: int, link: str, server_link: str | None, cap: float | None, steps: int,
        warmup: int, timeout: float, transport: str) -> dict:
    strategy, servers = CONFIGS[config]
    settings = {} if cap is None else {"bucket_cap_mb": cap}
    if strategy == "ps":
        settings["transport"] = transport
    return gradsync.launch(worker, strategy=strategy, workers=workers, servers=servers, args=(w, steps, warmup),
                           timeout=timeout, link=link, server_link=server_link, step_timeout=120, **settings)[0]


def _piece(cap: float | None) -> str:
    return "" if cap is None else f" piece {cap:g} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", nargs="+", default=["100mbit"], help="worker link rates (tc syntax)")
    parser.add_argument("--server-link", help="the servers' link rate (default: the same as the workers')")
    parser.add_argument("--workloads", nargs="+", default=["issue"], choices=sorted(WORKLOADS))
    parser.add_argument("--workers", nargs="+", type=int, default=[2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--piece-mb", nargs="+", type=float, default=[None],
                        help="ps only: bucket_cap_mb values to compare, the largest bucket and piece (default: the "
                             "job's default)")
    parser.add_argument("--transport", default="rpc", choices=["rpc", "grpc"], help="the ps configurations' transport")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every configuration")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    server_link = Link.parse(args.server_link, "--server-link") if args.server_link else None
    grid = [(link, wl, workers, config, cap) for link in args.links for wl in args.workloads
            for workers in args.workers for config in args.configs
            for cap in (args.piece_mb if config.startswith("ps") else [None])]
    runs: dict[tuple, list[dict]] = {key: [] for key in grid}
    load_before = os.getloadavg()
    for repeat in range(args.repeats):
        for key in grid:
            link, wl, workers, config, cap = key
            w = Workload(WORKLOADS[wl][0], WORKLOADS[wl][1], True, workers, {})
            nbytes, floor = floor_of(config, w, workers, Link.parse(link), server_link)
            r = run(config, w, workers, link, args.server_link, cap, args.steps, args.warmup, args.timeout,
                    args.transport)
            r.update(floor_s=floor, floor_bytes=nbytes, ratio=r["step_s"] / floor)
            runs[key].append(r)
            parts = " ".join(f"{n} {1000 * s:.0f}" for n, s in r["parts_s"].items())
            print(f"repeat {repeat + 1}/{args.repeats} {link} {wl} W={workers} {config + _piece(cap):9} "
                  f"{1000 * r['step_s']:7.0f} ms/step ({parts} ms), floor {1000 * floor:.0f} ms "
                  f"({nbytes / 1e6:.2f} MB), ratio {r['ratio']:.2f}x; "
                  f"busiest link {r['busiest_link_bytes'] / 1e6:.2f} MB/step; "
                  f"CPU {r['cpu_s_per_step']:.3f} s/step, waited for a CPU {r['runqueue_wait_s_per_step']:.3f} "
                  f"s/step; TCP per step: {r['tcp_per_step']}", flush=True)
    rows = []
    for (link, wl, workers, config, cap), reps in runs.items():
        rows.append(dict(link=link, server_link=args.server_link, workload=wl, workers=workers,
                         config=config + _piece(cap), piece_mb=cap,
                         step_ms=1000 * statistics.median(r["step_s"] for r in reps),
                         floor_ms=1000 * reps[0]["floor_s"], floor_mb=reps[0]["floor_bytes"] / 1e6,
                         ratio=statistics.median(r["ratio"] for r in reps), ratios=[r["ratio"] for r in reps],
                         busiest_link_mb=statistics.median(r["busiest_link_bytes"] for r in reps) / 1e6,
                         cpu_s_per_step=statistics.median(r["cpu_s_per_step"] for r in reps),
                         runqueue_wait_s_per_step=statistics.median(r["runqueue_wait_s_per_step"] for r in reps),
                         parts_ms={n: 1000 * statistics.median(r["parts_s"][n] for r in reps)
                                   for n in reps[0]["parts_s"]}))
    print("| link | workload | W | config | ms/step | floor ms (MB) | ratio (each run) | busiest link MB/step "
          "| CPU-s/step | waited for a CPU, s/step |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"| {r['link']}{' / server ' + r['server_link'] if r['server_link'] else ''} | {r['workload']} | "
              f"{r['workers']} | {r['config']} | {r['step_ms']:.0f} | {r['floor_ms']:.0f} ({r['floor_mb']:.2f}) | "
              f"{r['ratio']:.2f}x ({each}) | {r['busiest_link_mb']:.2f} | {r['cpu_s_per_step']:.3f} | "
              f"{r['runqueue_wait_s_per_step']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(["bench/linkfloor.py", *(sys.argv[1:] if argv is None else argv)]),
                       when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       machine=machine(load_before),
                       settings=dict(transport=args.transport, repeats=args.repeats, steps=args.steps,
                                     warmup=args.warmup, workloads={wl: WORKLOADS[wl] for wl in args.workloads}),
                       rows=rows, runs=[dict(zip(("link", "workload", "workers", "config", "piece_mb"), k), runs=v)
                                        for k, v in runs.items()]), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
