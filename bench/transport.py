"""Transport benchmark: torch RPC (TensorPipe) echo vs the gRPC Pull/Push service, on loopback.

For each tensor size (4 KB .. 64 MB, float32) it measures, as medians of repeated runs:
- torch RPC: a round trip `rpc_sync(echo, t)` between two processes (the tensor goes out and comes back);
- gRPC: `Client.pull` of one parameter of that size plus `Client.push` of its gradient, against a
  1-shard async ParameterServer in another process (the push includes the server's SGD step, as in training);
- a local `clone()` of the same size, the copy reference.
Throughput counts bytes read plus bytes written: 2 x size per round trip (out and back, or pull and push),
2 x size per copy. Latency: a small round trip (RPC echo of one float, gRPC Health).

Run: `python bench/transport.py` (about 1-2 minutes); writes bench/results/transport.json and prints a table.
"""
from __future__ import annotations

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


def _reps(size: int) -> int:
    return 30 if size <= 1 << 20 else (8 if size <= 16 << 20 else 5)


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


def _rpc_rank(rank: int, port: int, queue) -> None:
    import torch.distributed.rpc as rpc

    os.environ["TP_SOCKET_IFNAME"] = "lo"
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)  # torch's own
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8,
                                              rpc_timeout=120)
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        results = {"latency_s": _median_time(lambda: rpc.rpc_sync("rank1", _echo, (torch.ones(1),)), LATENCY_REPS)}
        for size in SIZES:
            t = torch.ones(size // 4)
            results[size] = _median_time(lambda: rpc.rpc_sync("rank1", _echo, (t,)), _reps(size))
        queue.put(results)
    rpc.shutdown(graceful=True, timeout=60)


def bench_rpc() -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    ranks = [ctx.Process(target=_rpc_rank, args=(r, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = queue.get(timeout=300)
    for p in ranks:
        p.join(60)
    return results


def _grpc_servers(run_dirs: dict[int, str], ready, stop) -> None:
    """One 1-shard ParameterServer (one float32 parameter) per size, each on its own endpoint."""
    from gradsync.proto.endpoints import write_endpoints
    from gradsync.proto.service import serve_grpc
    from gradsync.core.buckets import ModelSpec, plan_buckets
    from gradsync.ps.server import ParameterServer, make_setup

    endpoints = []
    for size, run_dir in run_dirs.items():
        params = {"w": torch.zeros(size // 4)}
        spec = ModelSpec.of(params, {})
        setup = make_setup(plan_buckets(spec.params, 1, 1 << 30), params, {}, torch.optim.SGD, {"lr": 0.0})
        server = ParameterServer(0, 1, "async", "raise")
        server.register(0, spec, setup).wait()
        endpoint = serve_grpc(server, token=TOKEN)
        write_endpoints(run_dir, 0, endpoint.address, TOKEN)
        endpoints.append(endpoint)
    ready.set()
    stop.wait(600)
    for endpoint in endpoints:
        endpoint.stop(1.0)


def bench_grpc() -> dict:
    from gradsync.client import Client

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {size: os.path.join(tmp, str(size)) for size in SIZES}
        server = ctx.Process(target=_grpc_servers, args=(run_dirs, ready, stop))
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


def main() -> None:
    torch.set_num_threads(1)
    started = time.time()
    copy, rpc_results, grpc_results = bench_copy(), bench_rpc(), bench_grpc()
    mbps = lambda size, seconds: 2 * size / seconds / 1e6  # noqa: E731  (bytes read + written)
    rows = []
    for size in SIZES:
        g = grpc_results[size]
        rows.append({
            "bytes": size,
            "copy_MBps": mbps(size, copy[size]),
            "rpc_echo_MBps": mbps(size, rpc_results[size]),
            "grpc_pull_push_MBps": mbps(size, g["pull_push_s"]),
            "grpc_pull_MBps": size / g["pull_s"] / 1e6,
            "grpc_push_MBps": size / g["push_s"] / 1e6,
            "grpc_over_rpc": rpc_results[size] / g["pull_push_s"],
            "median_s": {"copy": copy[size], "rpc_echo": rpc_results[size], **g},
        })
    report = {
        "command": "python bench/transport.py",
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, no GPU",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "notes": "loopback only; MB/s counts bytes read + written (2 x size per round trip); medians; "
                 "gRPC push includes the server's SGD step; gRPC latency = Health, RPC latency = echo of one float",
        "latency_us": {"rpc": rpc_results["latency_s"] * 1e6, "grpc": grpc_results["latency_s"] * 1e6},
        "rows": rows,
        "wall_s": time.time() - started,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
    print("| size | copy MB/s | torch RPC echo MB/s | gRPC pull+push MB/s | gRPC pull MB/s | gRPC push MB/s | gRPC/RPC |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        size = f"{r['bytes'] >> 20} MB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KB"
        print(f"| {size} | {r['copy_MBps']:.0f} | {r['rpc_echo_MBps']:.0f} | {r['grpc_pull_push_MBps']:.0f} | "
              f"{r['grpc_pull_MBps']:.0f} | {r['grpc_push_MBps']:.0f} | {r['grpc_over_rpc']:.2f} |")
    lat = report["latency_us"]
    print(f"\nsmall round trip: torch RPC {lat['rpc']:.0f} us, gRPC {lat['grpc']:.0f} us; "
          f"wall {report['wall_s']:.0f} s; wrote {RESULTS}")


if __name__ == "__main__":
    main()
