"""What gradsync costs over the outside baselines it wraps, measured in one run.

Two workloads:
- `reference`: MLP 12288 -> 512 -> 512 -> 30 (6.57M parameters), batch 20 per worker, MSE on one-hot
  labels, W = 2 workers;
- `10m`: the 10M-parameter MLP of bench/step_time.py, batch 32, MSE on random targets, W = 4.
Both: SGD lr 0.001 momentum 0.9, one thread per process, the same seeded batch every step.

Configurations, each a separate job on this machine (loopback only):
- `ddp`: plain DistributedDataParallel (gloo), `loss.backward()` + `opt.step()`;
- `ddp_context`: the same DDP inside a dist_autograd context (torch RPC on the uv transport),
  gradients read with `get_gradients` (THE FLOOR for allreduce);
- `gradsync_allreduce`, `gradsync_ps_sync_s1`, `gradsync_ps_sync_s2`, `gradsync_ps_async`: gradsync.launch
  with the README's loop; `gradsync_ps_sync_s1_grpc` over gRPC (on one machine its steps go whole), and
  `gradsync_ps_sync_s1_grpc_pipelined` with `pipeline="on"` (reference workload);
- `naive_ps`: a whole-model parameter server written here, the design of PyTorch's batch-RPC parameter-server
  tutorial (one RPC per step carrying all gradients; the server waits for all W, averages, steps, and returns
  the whole model), 1 server (THE BASELINE for ps).
- `naive_ps_shm` (reference workload): the same naive server on TensorPipe's default transports, whose shm
  reactor busy-polls, as a user's first naive PS runs (the issue's 134-168 ms measurement).
Repeats are interleaved: repeat r runs every configuration once, in order, then repeat r+1.

Per configuration, on worker 0: the median step time (forward + backward + step, after `--warmup` steps);
its ratio to the floor, computed per repeat and reported as the median of those ratios; CPU-seconds per step
summed over all processes of the job (utime + stime from /proc, over the timed window); and apart from it the
CPU of TensorPipe's threads: `busy-poll` counts its reactors (`TP_*_reactor`: TP_SHM_reactor, the shm
transport's, polls and yields, so it takes whatever CPU is free, 0.5-0.6 core per process in an idle
2-process RPC job here), `TensorPipe` all its threads (the reactors plus the loops that do real work:
TP_UV_loop socket I/O, TP_CMA_loop cross-process copies; idle they use nothing), with a per-thread-name
breakdown in the JSON; and the seconds per step the job's threads waited, runnable, for a CPU (schedstat,
summed over threads: the time-slicing of more threads than cores). Async ps does not run in lock step, so
its CPU window is worker 0's view.
Writes bench/results/overhead.json and prints a markdown table and the project's targets as PASS/FAIL lines.

    .venv/bin/python bench/overhead.py [--workloads reference 10m] [--configs ...] [--repeats 3] [--steps 20]
                                       [--warmup 3] [--out bench/results/overhead.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.launcher.local_job import host_store

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import (LR, MOMENTUM, Workload, build_model, gradsync_worker_setup, machine, make_batch,  # noqa: E402
                     timed_loop)
from step_time import BATCH, make_mlp  # noqa: E402

STEP_TIMEOUT_S = 300

def _sizes_of(million: float) -> tuple[int, ...]:
    linears = [m for m in make_mlp(million) if isinstance(m, nn.Linear)]
    return (linears[0].in_features, *(m.out_features for m in linears))


def workloads(tiny: bool) -> dict[str, Workload]:
    """The workloads; `tiny` shrinks the models for the smoke test."""
    reference = (4096, 256, 256, 30) if tiny else (12288, 512, 512, 30)
    ten_m = _sizes_of(0.1 if tiny else 10)
    allreduce = {"ddp": 0, "ddp_context": 0, "gradsync_allreduce": 0}
    return {
        "reference": Workload(reference, 20, True, 2, {**allreduce, "gradsync_ps_sync_s1": 1, "gradsync_ps_sync_s2": 2,
                                                       "gradsync_ps_async": 1, "naive_ps": 1, "naive_ps_shm": 1,
                                                       "gradsync_ps_sync_s1_grpc": 1,
                                                       "gradsync_ps_sync_s1_grpc_pipelined": 1}),
        # no ps_sync_s1 on 10m: 4 workers on one server is slow on 2 cores, and no target needs it
        "10m": Workload(ten_m, BATCH, False, 4, {**allreduce, "gradsync_ps_sync_s2": 2, "gradsync_ps_async": 2,
                                                 "naive_ps": 1}),
    }


ALLREDUCE_FLOOR, PS_FLOORS = "ddp_context", ("naive_ps", "naive_ps_shm", "gradsync_allreduce")


def floors_of(config: str) -> tuple[str, ...]:
    if config.startswith("naive_ps") or config == ALLREDUCE_FLOOR:
        return ()
    return PS_FLOORS if config.startswith("gradsync_ps") else (ALLREDUCE_FLOOR,)


# ---- gradsync configurations (gradsync.launch) ----

def gradsync_worker(w: Workload, steps: int, warmup: int) -> dict:
    trainer, x, y = gradsync_worker_setup(w)

    def step():
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(trainer.model(x), y)])
            trainer.step(cid)

    result = timed_loop(step, steps, warmup, gradsync.worker_rank())
    result["metrics"] = trainer.metrics.summary(skip=warmup)
    return result


def run_gradsync(config: str, w: Workload, servers: int, steps: int, warmup: int, timeout: float) -> dict:
    """A gradsync job: `_grpc` in the name runs it over gRPC, `_pipelined` with its steps as pipelines (on one
    machine gRPC sends them whole by default)."""
    strategy = "allreduce" if config == "gradsync_allreduce" else "ps"
    mode = "async" if config.endswith("async") else "sync"
    return gradsync.launch(gradsync_worker, strategy=strategy, mode=mode, workers=w.workers, servers=servers,
                           transport="grpc" if "_grpc" in config else "rpc",
                           pipeline="on" if config.endswith("_pipelined") else "auto",
                           args=(w, steps, warmup), timeout=timeout, step_timeout=STEP_TIMEOUT_S)[0]


# ---- the outside baselines: processes of our own ----

def _start_rpc(name: str, rank: int, world: int, store: dist.Store, shm: bool = False) -> None:
    """RPC on TensorPipe's uv transport, or with its default transports (shm first) when `shm`."""
    def handler(url, **kwargs):
        yield dist.PrefixStore("rpc", store), rank, world

    register_rendezvous_handler("overhead", handler)
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)  # torch's own
    transports = {} if shm else {"_transports": ["uv"]}
    options = rpc.TensorPipeRpcBackendOptions(init_method="overhead://", rpc_timeout=STEP_TIMEOUT_S, **transports)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)


def _stop_rpc() -> None:
    rpc.shutdown(graceful=True, timeout=STEP_TIMEOUT_S)


def ddp_rank(rank: int, store: dist.Store, w: Workload, steps: int, warmup: int, context: bool) -> dict:
    if context:
        _start_rpc(f"worker{rank}", rank, w.workers, store)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=w.workers,
                            timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    model = DDP(build_model(w))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = list(model.parameters())
    x, y = make_batch(w, rank)

    def plain_step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    def context_step():
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(model(x), y)])
            grads = dist_autograd.get_gradients(cid)
            for p in params:
                p.grad = grads[p]
            opt.step()

    result = timed_loop(context_step if context else plain_step, steps, warmup, rank)
    dist.destroy_process_group()
    if context:
        _stop_rpc()
    return result


class NaiveServer:
    """The whole model and its optimizer; a step is applied when all W workers' gradients arrived."""

    def __init__(self, w: Workload):
        self.params = list(build_model(w).parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.SGD(self.params, lr=LR, momentum=MOMENTUM)
        self.workers, self.arrived = w.workers, 0
        self.lock = threading.Lock()
        self.future = torch.futures.Future()


_SERVER: NaiveServer | None = None


@rpc.functions.async_execution
def naive_push(grads: list[torch.Tensor]) -> torch.futures.Future:
    """A worker's gradients in; once all W are in: average, step, and answer everyone with the new parameters."""
    s = _SERVER
    with s.lock:
        for p, g in zip(s.params, grads):
            p.grad.add_(g)
        s.arrived += 1
        future = s.future
        if s.arrived == s.workers:
            for p in s.params:
                p.grad.div_(s.workers)
            s.opt.step()
            for p in s.params:
                p.grad.zero_()
            s.arrived, s.future = 0, torch.futures.Future()
            # no copy: the next step can only change them after every worker has received this answer
            future.set_result([p.detach() for p in s.params])
    return future


def naive_ps_rank(rank: int, store: dist.Store, w: Workload, steps: int, warmup: int, shm: bool) -> dict | None:
    global _SERVER
    if rank == 0:
        _SERVER = NaiveServer(w)
        _start_rpc("ps", 0, w.workers + 1, store, shm)
        _stop_rpc()  # serves until every worker shut down too
        return None
    worker = rank - 1
    _start_rpc(f"worker{worker}", rank, w.workers + 1, store, shm)
    model = build_model(w)
    params = list(model.parameters())
    x, y = make_batch(w, worker)

    def step():
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.mse_loss(model(x), y)])
            grads = dist_autograd.get_gradients(cid)
            new = rpc.rpc_sync("ps", naive_push, args=([grads[p] for p in params],), timeout=STEP_TIMEOUT_S)
        with torch.no_grad():
            for p, value in zip(params, new):
                p.copy_(value)

    result = timed_loop(step, steps, warmup, worker)
    _stop_rpc()
    return result


def _rank_main(target, rank: int, port: int, args: tuple, result_path: str) -> None:
    os.environ.update(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    result = target(rank, store, *args)
    if result is not None and "cpu_s_per_step" in result:  # worker 0's
        with open(result_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(result_path + ".tmp", result_path)


def spawn_job(target, world: int, args: tuple, timeout: float) -> dict:
    """Run target(rank, store, *args) on `world` spawned ranks; any failure or the timeout kills them all."""
    store = host_store(0)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        path = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=_rank_main, args=(target, r, store.port, args, path)) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.start()
            while True:
                codes = [p.exitcode for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    raise RuntimeError(f"rank {failed[0][0]} of {target.__name__} exited with {failed[0][1]}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target.__name__} timed out after {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        with open(path) as f:
            return json.load(f)


def run_config(config: str, w: Workload, steps: int, warmup: int, timeout: float) -> dict:
    servers = w.configs[config]
    if config.startswith("gradsync"):
        return run_gradsync(config, w, servers, steps, warmup, timeout)
    if config.startswith("naive_ps"):
        return spawn_job(naive_ps_rank, w.workers + servers, (w, steps, warmup, config == "naive_ps_shm"), timeout)
    return spawn_job(ddp_rank, w.workers, (w, steps, warmup, config == "ddp_context"), timeout)


# ---- summary, table, targets ----

def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: medians over repeats, and ratios to its floors paired by repeat."""
    summary = {}
    for config, reps in runs.items():
        names = sorted({n for r in reps for n in r["threads"]})
        row = dict(median_ms=1000 * statistics.median(r["step_s"] for r in reps),
                   cpu_s_per_step=statistics.median(r["cpu_s_per_step"] for r in reps),
                   busy_poll_cpu_s_per_step=statistics.median(r["busy_poll_cpu_s_per_step"] for r in reps),
                   tensorpipe_cpu_s_per_step=statistics.median(r["tensorpipe_cpu_s_per_step"] for r in reps),
                   runqueue_wait_s_per_step=statistics.median(r["runqueue_wait_s_per_step"] for r in reps),
                   threads={n: statistics.median(r["threads"].get(n, 0.0) for r in reps) for n in names},
                   ratios={})
        for floor in floors_of(config):
            if floor in runs:
                per_repeat = [r["step_s"] / f["step_s"] for r, f in zip(reps, runs[floor])]
                row["ratios"][floor] = dict(median=statistics.median(per_repeat), per_repeat=per_repeat)
        summary[config] = row
    return summary


def table(summary: dict[str, dict[str, dict]]) -> str:
    lines = ["| workload | config | median ms/step | ratio to floor | CPU-s/step (all processes) "
             "| busy-poll CPU-s/step | TensorPipe CPU-s/step | waited for a CPU, s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, rows in summary.items():
        for config, row in rows.items():
            ratio = "; ".join(f"{r['median']:.2f}x {floor}" for floor, r in row["ratios"].items()) or "floor"
            lines.append(f"| {workload} | {config} | {row['median_ms']:.1f} | {ratio} | {row['cpu_s_per_step']:.3f} "
                         f"| {row['busy_poll_cpu_s_per_step']:.3f} | {row['tensorpipe_cpu_s_per_step']:.3f} "
                         f"| {row['runqueue_wait_s_per_step']:.3f} |")
    return "\n".join(lines)


def targets(summary: dict[str, dict[str, dict]]) -> list[str]:
    """The project's targets, PASS/FAIL from this run's data (SKIP where a configuration was not run)."""
    def ratio(workload, config, floor):
        return summary.get(workload, {}).get(config, {}).get("ratios", {}).get(floor, {}).get("median")

    def check(text, value, limit):
        verdict = "SKIP (not measured)" if value is None else ("PASS" if value <= limit else "FAIL")
        shown = "" if value is None else f": {value:.2f}"
        return f"{verdict}  {text} <= {limit}{shown}"

    lines = [check(f"{wl} gradsync_allreduce / ddp_context", ratio(wl, "gradsync_allreduce", ALLREDUCE_FLOOR), 1.05)
             for wl in summary]
    for naive in ("naive_ps", "naive_ps_shm"):
        lines.append(check(f"reference gradsync_ps_sync_s1 / {naive}",
                           ratio("reference", "gradsync_ps_sync_s1", naive), 0.5))
    lines.append(check("reference gradsync_ps_sync_s1 / gradsync_allreduce",
                       ratio("reference", "gradsync_ps_sync_s1", "gradsync_allreduce"), 1.3))
    lines.append(check("10m gradsync_ps_sync_s2 / gradsync_allreduce",
                       ratio("10m", "gradsync_ps_sync_s2", "gradsync_allreduce"), 1.0))
    rows = summary.get("10m", {})
    cpu = None
    if "gradsync_ps_sync_s2" in rows and "gradsync_allreduce" in rows:
        cpu = rows["gradsync_ps_sync_s2"]["cpu_s_per_step"] / rows["gradsync_allreduce"]["cpu_s_per_step"]
    lines.append(check("10m gradsync_ps_sync_s2 CPU-s/step / gradsync_allreduce CPU-s/step", cpu, 1.0))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["reference", "10m"], choices=["reference", "10m"])
    parser.add_argument("--configs", nargs="+", help="only these configurations (default: each workload's list)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every configuration")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "overhead.json"))
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # small models, for the smoke test
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the baselines' ranks (gradsync.launch sets it too)
    all_workloads = workloads(args.tiny)
    plan = {wl: [c for c in all_workloads[wl].configs if not args.configs or c in args.configs]
            for wl in args.workloads}
    runs = {wl: {c: [] for c in configs} for wl, configs in plan.items()}
    load_before = os.getloadavg()
    for repeat in range(args.repeats):
        for wl, configs in plan.items():
            for config in configs:
                result = run_config(config, all_workloads[wl], args.steps, args.warmup, args.timeout)
                runs[wl][config].append(result)
                print(f"repeat {repeat + 1}/{args.repeats} {wl:9} {config:20} {1000 * result['step_s']:8.1f} ms/step  "
                      f"CPU {result['cpu_s_per_step']:.3f} s/step ({result['processes']} processes, busy-poll "
                      f"{result['busy_poll_cpu_s_per_step']:.3f})", flush=True)
    summary = {wl: summarize(per_config) for wl, per_config in runs.items()}
    result = dict(
        command=" ".join([os.path.relpath(sys.argv[0])] + (sys.argv[1:] if argv is None else argv)),
        machine=machine(load_before),
        settings=dict(repeats=args.repeats, steps=args.steps, warmup=args.warmup, tiny=args.tiny,
                      workloads={wl: dataclasses.asdict(all_workloads[wl]) for wl in plan}),
        summary=summary, targets=targets(summary), runs=runs,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(summary))
    print("\n".join(result["targets"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
