"""Transport benchmark: torch RPC (TensorPipe) echo vs the gRPC transport's step, on loopback.

For each tensor size (4 KB .. 64 MB, float32) it measures, as medians of repeated runs:
- torch RPC: a round trip `rpc_sync(echo, t)` between two processes (the tensor goes out and comes back),
  with the TensorPipe options gradsync uses, `_transports=["uv"]` (the shm transport's reactor busy-polls
  a core), and with TensorPipe's default transports, for reference;
- gRPC, the job's data path (`GrpcTransport`): a step, one JobPush of a one-bucket gradient of that size
  whose reply is the server's snapshot after the step (the gradient goes out, the parameters come back:
  the same bytes as an echo), and a JobPull alone, against a 1-shard async ParameterServer in another
  process (the push includes the server's SGD step, as in training);
- gRPC, the named calls of clients outside the job (`Client.pull` then `Client.push`), for reference;
- the parameter server's own work in a step, without any transport: `ParameterServer.push` (gradient
  checks and the SGD step) plus `pull` (the published snapshot), timed in the server process;
- a local `clone()` of the same size, the copy reference.
Throughput counts bytes read plus bytes written: 2 x size per round trip (out and back: an echo, a step,
a named pull and push), 2 x size per copy; a pull alone moves 1 x size. Latency: a small round trip (RPC
echo of one float, gRPC Health).

Every figure is the median over `--repeat` interleaved rounds (default 3) of per-round medians.

Run from the repository root: `python bench/transport.py` (about 2 minutes; gradsync must be importable:
the project's virtualenv, or `PYTHONPATH=$PWD`); writes bench/results/transport.json and prints a table.
`--sizes 16 64` measures only those sizes (MB) and writes nothing unless `--out` is given.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
LATENCY_REPS = 200
TOKEN = "bench-token"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "transport.json")


RPC_TRANSPORTS = {"uv": ["uv"], "default": None}  # TensorPipeRpcBackendOptions(_transports=...)


def _reps(size: int) -> int:
    return 30 if size <= 1 << 20 else (10 if size <= 16 << 20 else 7)


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _echo(t):
    return t


def _rpc_rank(rank: int, port: int, transports: list[str] | None, sizes: list[int], queue) -> None:
    import torch.distributed.rpc as rpc

    os.environ["TP_SOCKET_IFNAME"] = "lo"
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)  # torch's own
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8,
                                              rpc_timeout=120, _transports=transports)
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        results = {"latency_s": _median_time(lambda: rpc.rpc_sync("rank1", _echo, (torch.ones(1),)), LATENCY_REPS)}
        for size in sizes:
            t = torch.ones(size // 4)
            results[size] = _median_time(lambda: rpc.rpc_sync("rank1", _echo, (t,)), _reps(size))
        queue.put(results)
    rpc.shutdown(graceful=True, timeout=60)


def bench_rpc(transports: list[str] | None, sizes: list[int]) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    ranks = [ctx.Process(target=_rpc_rank, args=(r, port, transports, sizes, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = queue.get(timeout=300)
    for p in ranks:
        p.join(60)
    return results


def _plan(size: int):
    """(params, spec, buckets) of a model of one float32 parameter of `size` bytes: one bucket."""
    from gradsync.core.buckets import ModelSpec, plan_buckets

    params = {"w": torch.zeros(size // 4, requires_grad=True)}
    spec = ModelSpec.of(params, {})
    return params, spec, plan_buckets(spec.params, 1, 1 << 30)


def _grpc_servers(run_dirs: dict[int, str], ready, stop, queue) -> None:
    """One 1-shard ParameterServer (one float32 parameter) per size, each on its own endpoint.

    Once stopped, it times the servers' own work per step (no transport) and puts it on `queue`.
    """
    from gradsync.transport.grpc.endpoint_files import write_endpoints
    from gradsync.transport.grpc.server import serve_grpc
    from gradsync.ps.messages import Push, Setup
    from gradsync.ps.server import ParameterServer
    from gradsync.core.optimizer_spec import OptimizerSpec

    torch.set_num_threads(1)
    endpoints, servers = [], {}
    for size, run_dir in run_dirs.items():
        params, spec, buckets = _plan(size)
        setup = Setup.of(buckets, params, {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 0.0}))
        server = ParameterServer(0, 1, "async", "raise")
        server.register(0, spec, setup).wait()
        endpoint = serve_grpc(server, token=TOKEN)
        write_endpoints(run_dir, 0, endpoint.address, TOKEN)
        endpoints.append(endpoint)
        servers[size] = server
    ready.set()
    stop.wait(600)
    for endpoint in endpoints:
        endpoint.stop(1.0)
    work = {}
    for size, server in servers.items():
        grad = [torch.ones(size // 4)]

        def step():  # what the servicer asks of the server per JobPush, as it asks it
            server.push(0, server.shard.version, Push(grad, [()])).wait()
            server.pull()

        work[size] = _median_time(step, _reps(size))
    queue.put(work)


def _job_transport(address: str, size: int):
    """Worker 0's GrpcTransport to the one-server job at `address` (the store holds only its address and token)."""
    import torch.distributed as dist

    from gradsync.config import JobConfig
    from gradsync.core.job_names import StoreKeys
    from gradsync.transport.grpc.job_calls import GrpcTransport

    store = dist.HashStore()
    store.set(StoreKeys.GRPC_ADDRESS.format(0), address)
    store.set(StoreKeys.TOKEN, TOKEN)
    config = JobConfig(strategy="ps", servers=1, rank=1, world_size=2, transport="grpc", step_timeout=60.0)
    return GrpcTransport(config, store, {0: _plan(size)[2]})


def bench_grpc(sizes: list[int]) -> dict:
    from gradsync.ps.messages import Push
    from gradsync.transport.grpc.client import Client

    ctx = mp.get_context("spawn")
    ready, stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {size: os.path.join(tmp, str(size)) for size in sizes}
        server = ctx.Process(target=_grpc_servers, args=(run_dirs, ready, stop, queue))
        server.start()
        try:
            if not ready.wait(120):
                raise TimeoutError("bench: the gRPC server process did not start within 120 s")
            results = {}
            for size, run_dir in run_dirs.items():
                with Client(run_dir, timeout=60) as client:
                    transport = _job_transport(client.addresses[0], size)
                    if size == sizes[0]:
                        results["latency_s"] = _median_time(client.health, LATENCY_REPS)
                    grad = [torch.ones(size // 4)]
                    version = [0]

                    def step():  # one JobPush: the gradient out, the snapshot after the step back
                        version[0] = transport.push({0: version[0]}, {0: Push(grad, [()])})[0].version

                    def named():  # an outside client's pull, then push, by name
                        _, versions = client.pull_versioned(["w"])
                        client.push({"w": grad[0]}, versions[0], worker=0)

                    reps = _reps(size)
                    results[size] = {
                        "job_step_s": _median_time(step, reps),
                        "job_pull_s": _median_time(transport.pull, reps),
                        "named_pull_push_s": _median_time(named, reps),
                    }
                    transport.close()
            stop.set()
            for size, seconds in queue.get(timeout=300).items():
                results[size]["ps_work_s"] = seconds
        finally:
            stop.set()
            server.join(30)
    return results


def bench_copy(sizes: list[int]) -> dict:
    out = {}
    for size in sizes:
        t = torch.ones(size // 4)
        out[size] = _median_time(t.clone, _reps(size) * 3)
    return out


def _median_of(runs: list):
    """The median of each number across runs of the same nested dict."""
    if isinstance(runs[0], dict):
        return {k: _median_of([r[k] for r in runs]) for k in runs[0]}
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of every measurement, interleaved; the report takes the median round by round")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="MB",
                        help="measure only these sizes, in MB (default: 4 KB .. 64 MB); writes no JSON unless --out")
    parser.add_argument("--out", default=None, help=f"where to write the JSON report (default: {RESULTS})")
    args = parser.parse_args()
    sizes = SIZES if args.sizes is None else [mb << 20 for mb in args.sizes]
    out = args.out or (RESULTS if args.sizes is None else None)
    torch.set_num_threads(1)
    started = time.time()
    rounds = []
    for _ in range(args.repeat):  # interleaved, so that a busy spell on a shared machine hits every side
        rounds.append({
            "copy": bench_copy(sizes),
            "rpc": {name: bench_rpc(transports, sizes) for name, transports in RPC_TRANSPORTS.items()},
            "grpc": bench_grpc(sizes),
        })
    medians = _median_of(rounds)
    copy, grpc_results = medians["copy"], medians["grpc"]
    rpc, rpc_default = medians["rpc"]["uv"], medians["rpc"]["default"]
    mbps = lambda size, seconds: 2 * size / seconds / 1e6  # noqa: E731  (bytes read + written)
    rows = []
    for size in sizes:
        g = grpc_results[size]
        rows.append({
            "bytes": size,
            "copy_MBps": mbps(size, copy[size]),
            "rpc_echo_MBps": mbps(size, rpc[size]),
            "rpc_default_echo_MBps": mbps(size, rpc_default[size]),
            "grpc_step_MBps": mbps(size, g["job_step_s"]),
            "grpc_pull_MBps": size / g["job_pull_s"] / 1e6,
            "grpc_named_pull_push_MBps": mbps(size, g["named_pull_push_s"]),
            "grpc_over_rpc": rpc[size] / g["job_step_s"],
            "grpc_over_rpc_default": rpc_default[size] / g["job_step_s"],
            "ps_work_share": g["ps_work_s"] / g["job_step_s"],
            # approximate: the two medians come from separate loops
            "grpc_transport_over_rpc": rpc[size] / max(g["job_step_s"] - g["ps_work_s"], 1e-9),
            "median_s": {"copy": copy[size], "rpc_echo": rpc[size], "rpc_default_echo": rpc_default[size], **g},
        })
    report = {
        "command": " ".join(["python", "bench/transport.py", *sys.argv[1:]]),
        "repeat": args.repeat,
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, no GPU",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "notes": "loopback only; MB/s counts bytes read + written (2 x size per round trip, 1 x size for a pull "
                 "alone); medians; rpc = TensorPipe with _transports=['uv'], rpc_default = TensorPipe's default "
                 "transports; grpc step = one JobPush of the transport (gradient out, snapshot after the step "
                 "back, the server's SGD step included); grpc_over_rpc = RPC echo time / gRPC step time (same "
                 "bytes); grpc named pull+push = an outside Client's Pull then Push; ps_work_share = the server's "
                 "own push + pull time (no transport) / gRPC step time; grpc_transport_over_rpc = RPC echo time "
                 "/ (gRPC step time - the server's own work), approximate; gRPC latency = Health, RPC latency = "
                 "echo of one float",
        "latency_us": {"rpc": rpc["latency_s"] * 1e6, "rpc_default": rpc_default["latency_s"] * 1e6,
                       "grpc": grpc_results["latency_s"] * 1e6},
        "rows": rows,
        "wall_s": time.time() - started,
    }
    if out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    print("| size | copy MB/s | RPC uv echo MB/s | RPC default echo MB/s | gRPC step MB/s | gRPC pull MB/s "
          "| gRPC named pull+push MB/s | gRPC / RPC uv | gRPC / RPC default | ps work share "
          "| gRPC w/o ps work / RPC uv |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        size = f"{r['bytes'] >> 20} MB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KB"
        print(f"| {size} | {r['copy_MBps']:.0f} | {r['rpc_echo_MBps']:.0f} | {r['rpc_default_echo_MBps']:.0f} | "
              f"{r['grpc_step_MBps']:.0f} | {r['grpc_pull_MBps']:.0f} | {r['grpc_named_pull_push_MBps']:.0f} | "
              f"{r['grpc_over_rpc']:.2f} | {r['grpc_over_rpc_default']:.2f} | {r['ps_work_share']:.2f} | "
              f"{r['grpc_transport_over_rpc']:.2f} |")
    lat = report["latency_us"]
    print(f"\nsmall round trip: torch RPC uv {lat['rpc']:.0f} us, default {lat['rpc_default']:.0f} us, "
          f"gRPC {lat['grpc']:.0f} us; wall {report['wall_s']:.0f} s" + (f"; wrote {out}" if out else ""))


if __name__ == "__main__":
    main()
