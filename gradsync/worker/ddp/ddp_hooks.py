"""DDP communication hooks of the allreduce strategy: the mean, with optional compression.

The compression itself is done by the ops of `gradsync.cuda_ops`; this module
only wires them into DDP. `make_ddp_hook` returns a `(state, hook)` pair for
`DistributedDataParallel.register_comm_hook`. Every hook produces the MEAN of
the ranks' gradient buckets, like DDP's default: 'none' scales by
1 / world size and all-reduces (DDP's own arithmetic, bit for bit); 'fp16'/'bf16' fuse the 1 / world size scale
into the cast (`compress`), all-reduce the 16-bit tensor and cast back
(`decompress`); 'int8' quantizes the bucket with error feedback
(`compress_int8`, one residual per bucket kept in the state), all-gathers
every rank's payload and scales, and decodes their mean in one pass
(`dequantize_aggregate`). The hook is called by DDP on every rank for every
bucket; like any collective, every rank of the group must reach it.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.core.settings import COMPRESSION
from gradsync.cuda_ops import DEFAULT_BLOCK_SIZE, compress, compress_int8, decompress, dequantize_aggregate
from gradsync.cuda_ops.checks import block_size as check_block_size

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass
class DDPHookState:
    """What a gradsync DDP hook keeps between calls."""

    compression: str = "none"
    """'none', 'fp16', 'bf16' or 'int8'."""
    process_group: dist.ProcessGroup | None = None
    """Group to average over; None is the default group (pass DDP's group if it is another)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Elements per int8 scale (a power of two); unused by the other compressions."""
    residuals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, init=False)
    """int8 error-feedback buffers, fp32, keyed by bucket index."""
    _layouts: dict[int, tuple] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        allowed = COMPRESSION.choices
        if self.compression not in allowed:
            raise ValueError(
                f"compression: unknown value {self.compression!r}; use one of {', '.join(map(repr, allowed))}"
            )
        check_block_size(self.block_size)

    def residual_for(self, bucket: dist.GradBucket) -> torch.Tensor:
        """This bucket's residual; a new zero buffer when the bucket's parameters changed
        (DDP rebuilds its buckets after the first iteration)."""
        buf = bucket.buffer()
        layout = (buf.numel(), buf.device, tuple(p.data_ptr() for p in bucket.parameters()))
        if self._layouts.get(bucket.index()) != layout:
            self._layouts[bucket.index()] = layout
            self.residuals[bucket.index()] = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        return self.residuals[bucket.index()]


def _allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    buf.mul_(1.0 / dist.get_world_size(state.process_group))  # as DDP's built-in allreduce scales: bit for bit
    fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _half_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    packed = compress(buf, _HALF[state.compression], scale=1.0 / world)
    fut = dist.all_reduce(packed, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: decompress(f.value()[0], out_dtype=buf.dtype))


def _int8_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    c = compress_int8(buf, state.residual_for(bucket), state.block_size)
    payloads = buf.new_empty((world, c.payload.numel()), dtype=torch.int8)
    scales = buf.new_empty((world, c.scales.numel()), dtype=torch.float32)
    futs = [
        dist.all_gather(list(payloads.unbind(0)), c.payload, group=group, async_op=True).get_future(),
        dist.all_gather(list(scales.unbind(0)), c.scales, group=group, async_op=True).get_future(),
    ]

    def finish(all_done: torch.futures.Future) -> torch.Tensor:
        for f in all_done.value():
            f.wait()  # re-raises a failed all_gather
        return dequantize_aggregate(payloads, scales, state.block_size, 1.0 / world, buf.dtype)

    return torch.futures.collect_all(futs).then(finish)


def make_ddp_hook(
    compression: str = "none",
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[DDPHookState, Callable]:
    """Build a mean-producing DDP communication hook.

    Args:
        compression: 'none', 'fp16', 'bf16' or 'int8' (see the module docstring).
        block_size: elements per int8 scale, a power of two in [8, 8192].
        process_group: group to average over; None is the default group.

    Returns:
        `(state, hook)`; use `ddp_model.register_comm_hook(state, hook)`.
    """
    state = DDPHookState(compression, process_group, block_size)
    hooks = {"none": _allreduce_hook, "fp16": _half_hook, "bf16": _half_hook, "int8": _int8_hook}
    return state, hooks[compression]
