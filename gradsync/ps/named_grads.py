"""Gradients by name (from clients outside the job) -> the bucket payloads a `ParameterServer` takes.

A name is a bucket entry's key: a parameter's name, or `name[start:end]` for
the piece of a split parameter a shard holds. A parameter left out of a push
has no gradient this step (the optimizer skips it, as torch.optim does for a
`.grad` of None); a bucket with no named entry at all is passed as None.
Names of the shard's buffers carry the worker's updated buffer values.
"""

from __future__ import annotations

import torch

from gradsync.core.errors import GradientError
from gradsync.ps.gradient_codecs import PLAIN
from gradsync.ps.messages import Push
from gradsync.ps.shard import ShardState


def bucket_gradients(
    shard: ShardState, worker: int, grads: dict[str, torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[tuple[int, ...]]]:
    """One flat gradient (or None) per bucket of `shard`, and the indices of entries without a gradient.

    Raises:
        GradientError: an unknown name, or a gradient whose shape or dtype differs from its entry's.
    """
    owned = {e.key: (bucket, e) for bucket in shard.buckets for e in bucket.entries}
    unknown = sorted(set(grads) - owned.keys())
    if unknown:
        raise GradientError(
            f"worker {worker} pushed gradients for {unknown[:5]}{'...' if len(unknown) > 5 else ''}, which server "
            f"{shard.shard_id} does not own: push each parameter's gradient to the server that owns it"
        )
    for key, grad in grads.items():
        bucket, entry = owned[key]
        shape = entry.view_shape
        if tuple(grad.shape) != shape or grad.dtype != bucket.dtype:
            raise GradientError(
                f"worker {worker}: gradient of {key!r} is {tuple(grad.shape)} {grad.dtype}, "
                f"expected {shape} {bucket.dtype}"
            )
    packed = [b.pack([grads.get(e.key) for e in b.entries]) for b in shard.buckets]
    flats, absent = [flat for flat, _ in packed], [missing for _, missing in packed]
    return flats, absent


def push_named(server, worker: int, pulled_version: int, grads: dict[str, torch.Tensor]) -> torch.futures.Future:
    """Hand `grads` (by name) to `server.push` in plain format; resolves to a `Committed` (the shard's
    version after the step) or fails with the reason.

    Args:
        server: a ready `ParameterServer`.
    """
    shard = server.shard
    try:
        buffers = {n: grads[n] for n in grads if n in shard.buffers}
        flats, absent = bucket_gradients(shard, worker, {n: g for n, g in grads.items() if n not in buffers})
    except GradientError as e:
        return server.rejected(e)
    return server.push(worker, pulled_version, Push(flats, absent, buffers), PLAIN)
