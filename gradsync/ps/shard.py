"""One server's part of the model: flat parameter buckets, buffers, optimizer and version.

`ShardState` knows nothing of transports or consistency rules: it hands out
consistent copies (`snapshot`), validates incoming gradients (`check_gradients`)
and applies an averaged gradient with the server-side optimizer (`apply`).
The optimizer sees each parameter as its own tensor (a view into the bucket),
so any `torch.optim` class behaves exactly as it would on the model.
Callers hold `lock` around anything that must see one version.
"""
from __future__ import annotations

import dataclasses
import threading

import torch

from gradsync.ps.buckets import Bucket


class GradientError(ValueError):
    """A pushed gradient is unusable (wrong shape/dtype, non-finite, stale); nothing was changed."""


@dataclasses.dataclass
class ShardStats:
    """Counters a server reports (gRPC `GetStats`, `gradsync status`)."""

    version: int = 0
    workers_seen: set = dataclasses.field(default_factory=set)
    pushes_applied: int = 0
    pushes_rejected: int = 0
    steps_skipped: int = 0
    max_staleness: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class ShardState:
    """Parameters of the buckets one server owns, plus its buffers and optimizer."""

    def __init__(
        self,
        shard_id: int,
        buckets: list[Bucket],
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        optimizer_cls,
        optimizer_kwargs: dict,
        device: torch.device | str = "cpu",
    ):
        self.shard_id = shard_id
        self.buckets = list(buckets)
        self.device = torch.device(device)
        self.flats = [b.flatten(params).to(self.device).contiguous() for b in self.buckets]
        self.params: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(self.buckets, self.flats):
            for name, view in bucket.views(flat).items():
                self.params[name] = view.requires_grad_(True)
        self.buffers = {n: t.detach().clone().to(self.device) for n, t in buffers.items()}
        self.optimizer = optimizer_cls(list(self.params.values()), **optimizer_kwargs) if self.params else None
        self.lock = threading.Lock()
        self.stats = ShardStats()

    @property
    def version(self) -> int:
        return self.stats.version

    def snapshot(self) -> tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]:
        """A CPU copy of every bucket and buffer at one version. Call with `lock` held."""
        flats = [f.detach().to("cpu", copy=True) for f in self.flats]
        buffers = {n: b.to("cpu", copy=True) for n, b in self.buffers.items()}
        self.stats.bytes_out += sum(f.nbytes for f in flats) + sum(b.nbytes for b in buffers.values())
        return self.version, flats, buffers

    def check_gradients(self, worker: int, grads: list, wire) -> list:
        """Validate one worker's bucket payloads in `wire`'s format; a missing plain gradient becomes zeros.

        Raises:
            GradientError: naming the bucket/parameter and the worker; nothing is changed.
        """
        if len(grads) != len(self.buckets):
            raise GradientError(
                f"worker {worker} sent {len(grads)} bucket gradients to server {self.shard_id}, "
                f"which owns {len(self.buckets)} buckets"
            )
        checked = []
        for bucket, grad in zip(self.buckets, grads):
            if grad is None and wire.name == "none":
                checked.append(torch.zeros(bucket.numel, dtype=bucket.dtype, device=self.device))
                continue
            wire.validate(worker, bucket, grad)
            checked.append(wire.to_device(grad, self.device))
        self.stats.bytes_in += sum(wire.nbytes(g) for g in grads if g is not None)
        return checked

    def check_buffers(self, worker: int, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validate one worker's updated buffers (names, shapes, dtypes); raises GradientError."""
        for name, value in buffers.items():
            mine = self.buffers.get(name)
            if mine is None:
                raise GradientError(f"worker {worker} sent unknown buffer {name!r} to server {self.shard_id}")
            if value.shape != mine.shape or value.dtype != mine.dtype:
                raise GradientError(
                    f"worker {worker}: buffer {name!r} is {tuple(value.shape)} {value.dtype}, "
                    f"expected {tuple(mine.shape)} {mine.dtype}"
                )
        return {n: v.to(self.device) for n, v in buffers.items()}

    def nonfinite_parameter(self, grads: list, wire) -> str | None:
        """Name of the first parameter whose gradient holds NaN or Inf, or None."""
        for bucket, grad in zip(self.buckets, grads):
            if wire.nonfinite(grad):
                for name, view in bucket.views(wire.decode(grad, torch.float32)).items():
                    if not bool(torch.isfinite(view).all()):
                        return name
        return None

    def apply(self, grads: list[torch.Tensor], buffers: dict[str, torch.Tensor] | None) -> None:
        """One optimizer step with these (already averaged) bucket gradients. Call with `lock` held."""
        if self.optimizer is not None:
            for bucket, grad in zip(self.buckets, grads):
                for name, view in bucket.views(grad).items():
                    self.params[name].grad = view
            self.optimizer.step()
            for p in self.params.values():
                p.grad = None
        if buffers:
            with torch.no_grad():
                for name, value in buffers.items():
                    self.buffers[name].copy_(value)
        self.stats.version += 1
        self.stats.pushes_applied += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of this shard's parameters and buffers by name. Call with `lock` held."""
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        out.update({n: b.to("cpu", copy=True) for n, b in self.buffers.items()})
        return out
