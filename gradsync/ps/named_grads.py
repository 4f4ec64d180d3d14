"""Gradients by parameter name -> the per-bucket flat gradients a consistency rule commits.

Transports that send gradients by name (gRPC) use `commit_named`; a parameter
left out of a push counts as a zero gradient, and a bucket with no named
parameter at all is passed as None (the rule treats it as zeros too). Names of
the shard's buffers carry the worker's updated buffer values.
"""
from __future__ import annotations

import torch

from gradsync.ps.shard import GradientError, ShardState


def bucket_gradients(shard: ShardState, worker: int, grads: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """One flat gradient (or None) per bucket of `shard`.

    Raises:
        GradientError: an unknown parameter name, or a gradient whose shape or dtype differs from its parameter's.
    """
    owned = {e.name: (bucket, e) for bucket in shard.buckets for e in bucket.entries}
    unknown = sorted(set(grads) - owned.keys())
    if unknown:
        raise GradientError(
            f"worker {worker} pushed gradients for {unknown[:5]}{'...' if len(unknown) > 5 else ''}, which server "
            f"{shard.shard_id} does not own: push each parameter's gradient to the server that owns it"
        )
    for name, grad in grads.items():
        bucket, entry = owned[name]
        if tuple(grad.shape) != tuple(entry.shape) or grad.dtype != bucket.dtype:
            raise GradientError(
                f"worker {worker}: gradient of {name!r} is {tuple(grad.shape)} {grad.dtype}, "
                f"expected {tuple(entry.shape)} {bucket.dtype}"
            )
    flats: list[torch.Tensor | None] = []
    for bucket in shard.buckets:
        if not any(e.name in grads for e in bucket.entries):
            flats.append(None)
            continue
        flat = torch.zeros(bucket.numel, dtype=bucket.dtype)
        for name, view in bucket.views(flat).items():
            if name in grads:
                view.copy_(grads[name])
        flats.append(flat)
    return flats


def commit_named(server, worker: int, pulled_version: int, grads: dict[str, torch.Tensor]) -> torch.futures.Future:
    """Hand `grads` (by name) to `server.rule`; resolves to the shard's new version or fails with the reason.

    Args:
        server: a ready `ParameterServer`.
    """
    shard = server.shard
    try:
        if server.mode == "sync" and not 0 <= worker < server.num_workers:
            raise GradientError(f"worker {worker} is not a worker of this job: expected 0 .. {server.num_workers - 1}")
        if worker < 0:  # async: any worker may join and leave, under a non-negative id
            raise GradientError(f"worker {worker} is not a worker id: expected an integer >= 0")
        buffers = {n: grads[n] for n in grads if n in shard.buffers}
        flats = bucket_gradients(shard, worker, {n: g for n, g in grads.items() if n not in buffers})
    except GradientError as e:
        with shard.lock:
            shard.stats.pushes_rejected += 1
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(e)
        return fut
    return server.rule.commit(worker, pulled_version, flats, buffers)
