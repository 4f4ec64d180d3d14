"""Uneven data under allreduce: the collectives of a worker that has joined (`trainer.join()`).

The idea of `torch.distributed.algorithms.Join`, fitted to gradsync's step. Inside a join block every
training step of an active worker begins with `count_active(1)`; a worker that ran out of data calls
`count_active(0)` and, while the count is not 0, answers the step's other collectives: `shadow_buckets`
runs DDP's bucket rebuild (once in a job) and every gradient bucket through the job's comm hook with zeros,
through the same reducer calls DDP's own join hook uses, and hands back the averaged gradients, which the
strategy then steps its optimizer with, as the active workers do. When the count is 0 every worker has
joined; `broadcast_from_last` then gives every worker the integer buffers of one that was active to the end.

Why not DDP's own `model.join()`: it does not know the strategy's per-step collective (NaN flags, used
parameters, buffers), its `divide_by_initial_world_size=False` does not reach a comm hook (compression),
and its joined rank does not step its optimizer (it broadcasts the parameters at the end, so the optimizer
state of that worker falls behind).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.core.torch_internals import ddp_push_rebuilt_params, ddp_shadow_round


def count_active(mine: bool, device: torch.device) -> int:
    """The number of workers still active in this step (`mine`: this one is). Every worker must reach it."""
    count = torch.tensor([float(mine)], device=device)
    dist.all_reduce(count)
    return round(count.item())


def shadow_buckets(ddp: DDP) -> dict[torch.Tensor, torch.Tensor]:
    """Run the collectives of one backward pass of `ddp` with zero gradients; returns {parameter: its averaged
    gradient}, the result of the active workers' allreduce. Every worker that has joined must call it once per
    step of the others."""
    buckets, futures = ddp_shadow_round(ddp.reducer)
    grads = {}
    for bucket, fut in zip(buckets, futures):
        flat = fut.wait()
        flat = flat[0] if isinstance(flat, list) else flat  # DDP's built-in allreduce answers a list
        params = bucket.parameters()
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            grads[p] = g.view_as(p)
    ddp_push_rebuilt_params(ddp.reducer)
    return grads


def broadcast_from_last(tensors: list[torch.Tensor], last: bool, device: torch.device) -> None:
    """Overwrite `tensors` with those of the highest-ranked worker that was active until every worker had
    joined (`last`: this one was). Every worker must reach it."""
    rank = torch.tensor([float(dist.get_rank()) if last else -1.0], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX)
    for t in tensors:
        dist.broadcast(t, round(rank.item()))
