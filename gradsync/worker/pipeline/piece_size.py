"""The size of a ps step's pieces when the job does not set `bucket_cap_mb`: chosen at start-up from the
bandwidth worker 0 measures to the servers.

A piece costs its bytes on the link and a fixed amount of CPU (an RPC each way, a lock, an optimizer step:
`PIECE_CPU_S`, measured on the loopback reference workload). Smaller pieces let a server answer the first
piece while the next are still coming (the pipeline waits for about W pieces' worth of bytes on the busiest
link before it flows, W p / B), but each costs that CPU (M / (S p) pieces per server): the step's overhead
W p / B + M c / (S p) is least at p = sqrt(M c B / (S W)). A piece smaller than a parameter also costs two
copies of it a step, so the smallest piece that cuts none is chosen instead when that costs less (on a fast
link). The sizes it chooses, and how they fare against fixed ones: BENCHMARKS.md, "Piece sizes".
Whether a sync step is a pipeline at all is `pipelined`: over gRPC on one machine it is not (whole steps and
the largest buckets, unmeasured), as gRPC's pipeline threads cost more CPU than the overlap saves where no
link is slower than the CPUs. Behind a link it is where it pays (`pipeline_pays`): a whole step's replies
wait for all its pushes, so its busiest link's bytes cross twice in a row; for a small model that is a few
milliseconds, less than a pipeline's CPU per piece (BENCHMARKS.md, "Whole steps or a pipeline"). Worker 0
measures and publishes the plan in the store; every other worker, and one that joins later, takes it from
there, so that all build the same plan. Each transport measures
with its own messages (torch RPC, gRPC's JobProbe: `transport.base.link_rate`); one that cannot gets
`LARGEST_MB`.
"""

from __future__ import annotations

import datetime
import math

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.core.transport_capabilities import Capabilities
from gradsync.runtime.store import is_loopback

PIECE_CPU_S = 1.5e-3
"""CPU seconds a piece costs beyond its bytes (loopback, reference workload, pieces of 0.25-25 MB: BENCHMARKS.md,
"Piece sizes")."""
SPLIT_S_PER_BYTE = 1.1e-9
"""Seconds per byte of a parameter cut into pieces: a worker copies it twice a step (its gradient's pieces out,
the values' pieces joined back into fresh memory; py-spy on a worker, BENCHMARKS.md, "Piece sizes")."""
LARGEST_MB = 25.0
"""The largest piece: DDP's default bucket, and gradsync's before pieces were chosen."""
SMALLEST_MB = 0.0625
"""The smallest piece chosen: 64 KiB, below which a piece is all overhead."""


def overhead_s(piece: float, sizes: list[int], servers: int, workers: int, bandwidth: float) -> float:
    """What pieces of `piece` bytes add to a step beyond its link time (see the module): the pipeline's fill,
    the CPU per piece, and the copies of the parameters (of `sizes` bytes) they cut."""
    model = sum(sizes)
    return (
        workers * piece / bandwidth
        + model * PIECE_CPU_S / (servers * piece)
        + SPLIT_S_PER_BYTE * sum(size for size in sizes if size > piece)
    )


def best_piece_mb(sizes: list[int], servers: int, workers: int, bandwidth: float | None) -> float:
    """The piece size in MB that costs a step least (see the module), for parameters of `sizes` bytes and
    `bandwidth` bytes/s between a worker and a server; None: not measured, the largest. The balance of fill
    and CPU, sqrt(M c B / (S W)), or the smallest piece that cuts no parameter, whichever costs less."""
    if bandwidth is None:
        return LARGEST_MB
    servers, workers = max(servers, 1), max(workers, 1)
    clamp = lambda mb: min(LARGEST_MB, max(SMALLEST_MB, mb))  # noqa: E731
    balanced = clamp(math.sqrt(sum(sizes) * PIECE_CPU_S * bandwidth / (servers * workers)) / 2**20)
    whole = clamp(max(balanced, max(sizes, default=0) / 2**20))
    return min((balanced, whole), key=lambda mb: overhead_s(mb * 2**20, sizes, servers, workers, bandwidth))


def pipelined(config: JobConfig, transport: Capabilities) -> bool:
    """Whether a sync step goes as a pipeline of pieces (the `pipeline` setting): with auto, always over a
    transport that `pipelines_on_one_host`, else only when the job's store is not on loopback (the job spans
    machines, or an emulated link separates its ranks); never with replicas. BENCHMARKS.md, "gRPC against torch RPC"."""
    if config.pipeline != "auto" or config.replicated:  # a replicated shard's step is answered whole (`ps.replica`)
        return config.pipeline == "on"
    return transport.pipelines_on_one_host or not is_loopback(config.master_addr)


def whole_step_overhead_s(sizes: list[int], servers: int, workers: int, bandwidth: float) -> float:
    """What a whole step adds beyond its link time: its replies wait for every push, so the busiest link's
    bytes (a worker's M, or a server's W M / S) cross a second time after the first."""
    model = sum(sizes)
    return max(model, workers * model / max(servers, 1)) / bandwidth


def pipeline_pays(piece: float, sizes: list[int], servers: int, workers: int, bandwidth: float) -> bool:
    """Whether a pipeline of `piece`-byte pieces adds less to a step than going whole (`overhead_s` against
    `whole_step_overhead_s`); each also sends one head or push per server, which cancels out."""
    return overhead_s(piece, sizes, servers, workers, bandwidth) < whole_step_overhead_s(
        sizes, servers, workers, bandwidth
    )


def step_plan(config: JobConfig, store: dist.Store, sizes: list[int], measure, pipeline: bool) -> tuple[float, bool]:
    """The job's piece size in MB and whether its sync steps go as a pipeline (`pipeline`: what `pipelined`
    said). `bucket_cap_mb` when set; else worker 0's choice from `measure()` (the bandwidth to the servers in
    bytes/s, or None) for parameters of `sizes` bytes, and behind a link (the store not on loopback) with the
    `pipeline` setting auto a pipeline only where it pays, else whole steps of the largest buckets; published
    in the store for the others (and worker 0's replacement, which takes the plan the job runs)."""
    if config.bucket_cap_mb is not None:
        return config.bucket_cap_mb, pipeline
    if config.worker_rank == 0 and not config.replacement:  # a worker that joins later has another index
        servers, workers, bandwidth = config.servers, config.num_workers, measure()
        chosen = best_piece_mb(sizes, servers, workers, bandwidth)
        if (
            pipeline
            and bandwidth is not None
            and config.pipeline == "auto"
            and not is_loopback(config.master_addr)
            and not pipeline_pays(chosen * 2**20, sizes, servers, workers, bandwidth)
        ):
            chosen, pipeline = LARGEST_MB, False
        store.set(StoreKeys.PIECE_MB, repr(chosen))
        store.set(StoreKeys.PIPELINE, "on" if pipeline else "off")
        return chosen, pipeline
    store.wait([StoreKeys.PIECE_MB, StoreKeys.PIPELINE], datetime.timedelta(seconds=config.startup_timeout))
    return float(store.get(StoreKeys.PIECE_MB).decode()), store.get(StoreKeys.PIPELINE) == b"on"
