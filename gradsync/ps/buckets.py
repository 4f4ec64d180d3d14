"""Bucket plan: how a model's parameters are packed into flat tensors and spread over servers.

A bucket is one flat tensor of one dtype holding consecutive parameters (in
reverse registration order, so the last layers' gradients, which backward
produces first, travel first). Buckets are at most `cap_bytes` and at most
about 1/S of the model, then assigned largest-first to the least-loaded server.
Workers and servers compute the same plan from the same `ModelSpec`.
"""
from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one parameter or buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What every worker's model must agree on: its parameters and persistent buffers."""

    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> "ModelSpec":
        spec = lambda d: tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in d.items())  # noqa: E731
        return cls(spec(params), spec(buffers))

    def difference(self, other: "ModelSpec") -> str | None:
        """A readable description of how `other` differs from this spec, or None if equal."""
        for kind in ("params", "buffers"):
            mine = {t.name: t for t in getattr(self, kind)}
            theirs = {t.name: t for t in getattr(other, kind)}
            if mine.keys() != theirs.keys():
                missing = sorted(mine.keys() - theirs.keys())
                extra = sorted(theirs.keys() - mine.keys())
                return f"{kind} differ by name: missing {missing}, unexpected {extra}"
            for name, t in mine.items():
                o = theirs[name]
                if (t.shape, t.dtype) != (o.shape, o.dtype):
                    return (
                        f"{kind[:-1]} {name!r} is {tuple(o.shape)} {o.dtype}, "
                        f"expected {tuple(t.shape)} {t.dtype}"
                    )
        return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter's place inside a bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat tensor of parameters owned by one server."""

    index: int
    server: int
    dtype: torch.dtype
    entries: tuple[Entry, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter of this bucket as a view into `flat`."""
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pack this bucket's tensors (by name) into one new flat tensor."""
        return torch.cat([tensors[e.name].detach().reshape(-1).to(self.dtype) for e in self.entries])


def plan_buckets(params: tuple[TensorSpec, ...], num_servers: int, cap_bytes: int) -> list[Bucket]:
    """Pack parameters into buckets and assign each to a server.

    Args:
        params: the model's parameters in registration order.
        num_servers: S >= 1.
        cap_bytes: the largest bucket; a larger parameter gets a bucket of its own.
    Returns:
        Buckets in reverse layer order, each with its server index.
    """
    total = sum(p.nbytes for p in params)
    cap = max(1, min(cap_bytes, math.ceil(total / num_servers)))
    groups: list[list[TensorSpec]] = []
    for p in reversed(params):
        current = groups[-1] if groups else None
        if (
            current is not None
            and current[0].dtype == p.dtype
            and sum(q.nbytes for q in current) + p.nbytes <= cap
        ):
            current.append(p)
        else:
            groups.append([p])
    load = [0] * num_servers
    server_of: dict[int, int] = {}
    for i in sorted(range(len(groups)), key=lambda i: -sum(p.nbytes for p in groups[i])):
        s = min(range(num_servers), key=lambda s: (load[s], s))
        server_of[i] = s
        load[s] += sum(p.nbytes for p in groups[i])
    buckets = []
    for i, group in enumerate(groups):
        offset, entries = 0, []
        for p in group:
            entries.append(Entry(p.name, p.shape, offset, p.numel))
            offset += p.numel
        buckets.append(Bucket(i, server_of[i], group[0].dtype, tuple(entries)))
    return buckets


def by_server(buckets: list[Bucket], num_servers: int) -> dict[int, list[Bucket]]:
    """Each server's buckets, in plan order (a server may own none)."""
    return {s: [b for b in buckets if b.server == s] for s in range(num_servers)}


def assign_buffers(buffers: tuple[TensorSpec, ...], num_servers: int) -> dict[str, int]:
    """Server index of each buffer (round robin in registration order)."""
    return {b.name: i % num_servers for i, b in enumerate(buffers)}
