"""A small ps shard and deterministic gradients for it: the one-process tests of the consistency rules and of
compression build on these."""
import torch

from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.ps.shard import ShardState

ALL = [()]
"""No absent entries in make_shard's one bucket: every parameter got a gradient."""


def make_shard():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, requires_grad=True), "b": torch.randn(4, requires_grad=True)}
    buckets = plan_buckets(ModelSpec.of(params, {}).params, 1, 10**9)
    shard = ShardState(0, buckets, params, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}))
    return shard, params


def grads_of(worker, shard):
    g = torch.Generator().manual_seed(worker)
    return [torch.randn(b.numel, generator=g) * 1e3 for b in shard.buckets]


def make_pieced_shard(optimizer=torch.optim.SGD):
    """A shard whose parameters are cut into pieces of 8 elements (4 buckets)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 4, requires_grad=True), "b": torch.randn(4, requires_grad=True)}
    buckets = plan_buckets(ModelSpec.of(params, {}).params, 1, 32, split=True)  # pieces of 8 elements
    shard = ShardState(0, buckets, params, {}, OptimizerSpec.one_group(optimizer, {"lr": 0.5}))
    return shard


def piece_part(worker: int, b: int, shard) -> torch.Tensor:
    """Worker `worker`'s gradient of bucket `b`: a constant that names both."""
    return torch.full((shard.buckets[b].numel,), float(worker + 1 + 10 * b))
