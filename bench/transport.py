"""Transport benchmark: torch RPC (TensorPipe) echo vs the gRPC Pull/Push service, on loopback.

For each tensor size (4 KB .. 64 MB, float32) it measures, as medians of repeated runs:
- torch RPC: a round trip `rpc_sync(echo, t)` between two processes (the tensor goes out and comes back),
  with the TensorPipe options gradsync uses, `_transports=["uv"]` (the shm transport's reactor busy-polls
  a core), and with TensorPipe's default transports, for reference;
- gRPC: `Client.pull` of one parameter of that size, `Client.push` of its gradient, and the two in a row,
  against a 1-shard async ParameterServer in another process (the push includes the server's SGD step,
  as in training);
- the parameter server's own work in those calls, without any transport: `ParameterServer.pull` (a
  published snapshot) plus `push_named` (gradient checks and the SGD step), timed in the server process;
- a local `clone()` of the same size, the copy reference.
Throughput counts bytes read plus bytes written: 2 x size per round trip (out and back, or pull and push),
2 x size per copy; a pull or a push alone moves 1 x size. Latency: a small round trip (RPC echo of one
float, gRPC Health).

Every figure is the median over `--repeat` interleaved rounds (default 3) of per-round medians.

Run from the repository root: `python bench/transport.py` (about 2 minutes; gradsync must be importable:
the project's virtualenv, or `PYTHONPATH=$PWD`); writes bench/results/transport.json and prints a table.
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


def _rpc_rank(rank: int, port: int, transports: list[str] | None, queue) -> None:
    import torch.distributed.rpc as rpc

    os.environ["TP_SOCKET_IFNAME"] = "lo"
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)  # torch's own
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8,
                                              rpc_timeout=120, _transports=transports)
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        results = {"latency_s": _median_time(lambda: rpc.rpc_sync("rank1", _echo, (torch.ones(1),)), LATENCY_REPS)}
        for size in SIZES:
            t = torch.ones(size // 4)
            results[size] = _median_time(lambda: rpc.rpc_sync("rank1", _echo, (t,)), _reps(size))
        queue.put(results)
    rpc.shutdown(graceful=True, timeout=60)


def bench_rpc(transports: list[str] | None) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    ranks = [ctx.Process(target=_rpc_rank, args=(r, port, transports, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = queue.get(timeout=300)
    for p in ranks:
        p.join(60)
    return results


def _grpc_servers(run_dirs: dict[int, str], ready, stop, queue) -> None:
    """One 1-shard ParameterServer (one float32 parameter) per size, each on its own endpoint.

    Once stopped, it times the servers' own work per pull + push (no transport) and puts it on `queue`.
    """
    from gradsync.proto.endpoints import write_endpoints
    from gradsync.proto.service import serve_grpc
    from gradsync.core.buckets import ModelSpec, plan_buckets
    from gradsync.ps.named_grads import push_named
    from gradsync.ps.server import ParameterServer, make_setup

    torch.set_num_threads(1)
    endpoints, servers = [], {}
    for size, run_dir in run_dirs.items():
        params = {"w": torch.zeros(size // 4, requires_grad=True)}
        spec = ModelSpec.of(params, {})
        setup = make_setup(plan_buckets(spec.params, 1, 1 << 30), params, {}, {}, torch.optim.SGD, {"lr": 0.0})
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
        grad = {"w": torch.ones(size // 4)}

        def pull_commit():  # what the servicer asks of the server per Pull + Push, as it asks it
            push_named(server, 0, server.pull().version, grad).wait()

        work[size] = _median_time(pull_commit, _reps(size))
    queue.put(work)


def bench_grpc() -> dict:
    from gradsync.client import Client

    ctx = mp.get_context("spawn")
    ready, stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {size: os.path.join(tmp, str(size)) for size in SIZES}
        server = ctx.Process(target=_grpc_servers, args=(run_dirs, ready, stop, queue))
        server.start()
        try:
            if not ready.wait(120):
                raise TimeoutError("bench: the gRPC server process did not start within 120 s")
            results = {}
            for size, run_dir in run_dirs.items():
                with Client(run_dir, timeout=60) as client:
                    if size == SIZES[0]:
                        results["latency_s"] = _median_time(client.health, LATENCY_REPS)
                    grad = {"w": torch.ones(size // 4)}
                    version = [0]

                    def pull():
                        _, versions = client.pull_versioned(["w"])
                        version[0] = versions[0]

                    reps = _reps(size)
                    results[size] = {
                        "pull_s": _median_time(pull, reps),
                        "push_s": _median_time(lambda: client.push(grad, version[0], worker=0), reps),
                        "pull_push_s": _median_time(lambda: (pull(), client.push(grad, version[0], worker=0)), reps),
                    }
            stop.set()
            for size, seconds in queue.get(timeout=300).items():
                results[size]["ps_work_s"] = seconds
        finally:
            stop.set()
            server.join(30)
    return results


def bench_copy() -> dict:
    out = {}
    for size in SIZES:
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    rounds = []
    for _ in range(args.repeat):  # interleaved, so that a busy spell on a shared machine hits every side
        rounds.append({
            "copy": bench_copy(),
            "rpc": {name: bench_rpc(transports) for name, transports in RPC_TRANSPORTS.items()},
            "grpc": bench_grpc(),
        })
    medians = _median_of(rounds)
    copy, grpc_results = medians["copy"], medians["grpc"]
    rpc, rpc_default = medians["rpc"]["uv"], medians["rpc"]["default"]
    mbps = lambda size, seconds: 2 * size / seconds / 1e6  # noqa: E731  (bytes read + written)
    rows = []
    for size in SIZES:
        g = grpc_results[size]
        rows.append({
            "bytes": size,
            "copy_MBps": mbps(size, copy[size]),
            "rpc_echo_MBps": mbps(size, rpc[size]),
            "rpc_default_echo_MBps": mbps(size, rpc_default[size]),
            "grpc_pull_push_MBps": mbps(size, g["pull_push_s"]),
            "grpc_pull_MBps": size / g["pull_s"] / 1e6,
            "grpc_push_MBps": size / g["push_s"] / 1e6,
            "grpc_over_rpc": rpc[size] / g["pull_push_s"],
            "grpc_over_rpc_default": rpc_default[size] / g["pull_push_s"],
            "ps_work_share": g["ps_work_s"] / g["pull_push_s"],
            # approximate: the two medians come from separate loops
            "grpc_transport_over_rpc": rpc[size] / max(g["pull_push_s"] - g["ps_work_s"], 1e-9),
            "median_s": {"copy": copy[size], "rpc_echo": rpc[size], "rpc_default_echo": rpc_default[size], **g},
        })
    report = {
        "command": f"python bench/transport.py --repeat {args.repeat}",
        "repeat": args.repeat,
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, no GPU",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "notes": "loopback only; MB/s counts bytes read + written (2 x size per round trip, 1 x size for a pull "
                 "or a push alone); medians; rpc = TensorPipe with _transports=['uv'], rpc_default = TensorPipe's "
                 "default transports; grpc_over_rpc = RPC echo time / gRPC pull+push time (same bytes); gRPC push "
                 "includes the server's SGD step; ps_work_share = the server's own pull + commit time (no "
                 "transport) / gRPC pull+push time; grpc_transport_over_rpc = RPC echo time / (gRPC pull+push "
                 "time - the server's own work), approximate; gRPC latency = Health, RPC latency = echo of one float",
        "latency_us": {"rpc": rpc["latency_s"] * 1e6, "rpc_default": rpc_default["latency_s"] * 1e6,
                       "grpc": grpc_results["latency_s"] * 1e6},
        "rows": rows,
        "wall_s": time.time() - started,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
    print("| size | copy MB/s | RPC uv echo MB/s | RPC default echo MB/s | gRPC pull+push MB/s | gRPC pull MB/s "
          "| gRPC push MB/s | gRPC / RPC uv | gRPC / RPC default | ps work share | gRPC w/o ps work / RPC uv |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        size = f"{r['bytes'] >> 20} MB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KB"
        print(f"| {size} | {r['copy_MBps']:.0f} | {r['rpc_echo_MBps']:.0f} | {r['rpc_default_echo_MBps']:.0f} | "
              f"{r['grpc_pull_push_MBps']:.0f} | {r['grpc_pull_MBps']:.0f} | {r['grpc_push_MBps']:.0f} | "
              f"{r['grpc_over_rpc']:.2f} | {r['grpc_over_rpc_default']:.2f} | {r['ps_work_share']:.2f} | "
              f"{r['grpc_transport_over_rpc']:.2f} |")
    lat = report["latency_us"]
    print(f"\nsmall round trip: torch RPC uv {lat['rpc']:.0f} us, default {lat['rpc_default']:.0f} us, "
          f"gRPC {lat['grpc']:.0f} us; "
          f"wall {report['wall_s']:.0f} s; wrote {RESULTS}")


if __name__ == "__main__":
    main()
