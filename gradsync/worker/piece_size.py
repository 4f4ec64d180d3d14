"""The size of a ps step's pieces when the job does not set `bucket_cap_mb`: chosen at start-up from the
bandwidth worker 0 measures to the servers.

A piece costs its bytes on the link and a fixed amount of CPU (an RPC each way, a lock, an optimizer step:
`PIECE_CPU_S`, measured on the loopback reference workload). Smaller pieces let a server answer the first
piece while the next are still coming (the pipeline waits for about W pieces' worth of bytes on the busiest
link before it flows, W p / B), but each costs that CPU (M / (S p) pieces per server): the step's overhead
W p / B + M c / (S p) is least at p = sqrt(M c B / (S W)). Behind 100 Mbit/s that is ~0.25 MB for a 6 MB
model, at 1 Gbit/s ~1 MB for a 26 MB one, on loopback several MB (measured: BENCHMARKS.md, "Pieces").
Worker 0 measures and publishes the choice in the store; every other worker, and one that joins later,
takes it from there, so that all build the same plan. A transport that cannot measure (gRPC, which sends a
step whole anyway) gets `LARGEST_MB`.
"""
from __future__ import annotations

import datetime
import math

import torch.distributed as dist

from gradsync.config import JobConfig, StoreKeys

PIECE_CPU_S = 1.5e-3
"""CPU seconds a piece costs beyond its bytes (bench/overhead.py, reference workload, 1 MB pieces against 25)."""
LARGEST_MB = 25.0
"""The largest piece: DDP's default bucket, and gradsync's before pieces were chosen."""
SMALLEST_MB = 0.0625
"""The smallest piece chosen: 64 KiB, below which a piece is all overhead."""


def best_piece_mb(model_bytes: int, servers: int, workers: int, bandwidth: float | None) -> float:
    """The piece size in MB that costs a step least (see the module), for `bandwidth` bytes/s between a worker
    and a server; None: not measured, the largest."""
    if bandwidth is None:
        return LARGEST_MB
    best = math.sqrt(model_bytes * PIECE_CPU_S * bandwidth / (max(servers, 1) * max(workers, 1))) / 2**20
    return min(LARGEST_MB, max(SMALLEST_MB, best))


def piece_mb(config: JobConfig, store: dist.Store, model_bytes: int, measure) -> float:
    """The job's piece size in MB: `bucket_cap_mb` when set; else worker 0's choice from `measure()` (the
    bandwidth to the servers in bytes/s, or None), published in the store for the others."""
    if config.bucket_cap_mb is not None:
        return config.bucket_cap_mb
    if config.worker_rank == 0:  # a worker that joins later has another index
        chosen = best_piece_mb(model_bytes, config.servers, config.num_workers, measure())
        store.set(StoreKeys.PIECE_MB, repr(chosen))
        return chosen
    store.wait([StoreKeys.PIECE_MB], datetime.timedelta(seconds=config.startup_timeout))
    return float(store.get(StoreKeys.PIECE_MB).decode())
