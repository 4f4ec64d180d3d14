"""Model spec and bucket plan: how a model's trainable parameters become flat tensors spread over servers.

A bucket is one flat tensor of one dtype holding consecutive pieces of
parameters, in reverse registration order (backward produces the last layers'
gradients first). Each piece (`Entry`) is a whole parameter or, when the plan
may split, an element range of one: then every server holds within one element
of the same number of bytes, whatever the layer sizes. Workers and servers
compute the same plan from the same `ModelSpec`, so members of a job exchange
flat buckets and never names.
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


def _specs(tensors: dict[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What every worker's model must agree on: trainable and frozen parameters, persistent buffers, and
    embedding tables served row-wise (`tables.placement`)."""

    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    frozen: tuple[TensorSpec, ...] = ()
    tables: tuple[TensorSpec, ...] = ()

    @classmethod
    def of(
        cls, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], tables: tuple[TensorSpec, ...] = ()
    ) -> ModelSpec:
        """Parameters with `requires_grad=False` are frozen: they never change and never travel per step."""
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        frozen = {n: p for n, p in params.items() if not p.requires_grad}
        return cls(_specs(trainable), _specs(buffers), _specs(frozen), tables)

    def difference(self, other: ModelSpec) -> str | None:
        """A readable description of how `other` differs from this spec, or None if equal."""
        for kind in ("params", "frozen", "buffers", "tables"):
            mine = {t.name: t for t in getattr(self, kind)}
            theirs = {t.name: t for t in getattr(other, kind)}
            if mine.keys() != theirs.keys():
                missing = sorted(mine.keys() - theirs.keys())
                extra = sorted(theirs.keys() - mine.keys())
                what = "trainable params" if kind == "params" else f"{kind} tensors"
                return f"{what} differ by name: missing {missing}, unexpected {extra}"
            for name, t in mine.items():
                o = theirs[name]
                if (t.shape, t.dtype) != (o.shape, o.dtype):
                    return (
                        f"{kind.rstrip('s')} {name!r} is {tuple(o.shape)} {o.dtype}, "
                        f"expected {tuple(t.shape)} {t.dtype}"
                    )
        return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """Elements [start, start + numel) of parameter `name` (of `shape`), at `offset` in its bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    start: int = 0

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == math.prod(self.shape)

    @property
    def key(self) -> str:
        """The parameter's name, or `name[start:end]` for a piece of a split parameter."""
        return self.name if self.whole else f"{self.name}[{self.start}:{self.start + self.numel}]"

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The parameter's shape when whole, else (numel,)."""
        return self.shape if self.whole else (self.numel,)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This entry in `flat` (a bucket), shaped `view_shape`."""
        return flat[self.offset : self.offset + self.numel].view(self.view_shape)

    def piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """This entry's elements of the whole parameter `tensor` (a 1-D view when possible)."""
        return tensor.reshape(-1)[self.start : self.start + self.numel]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat tensor of parameter pieces owned by one server."""

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
        """Each entry of this bucket as a view into `flat`, by entry key."""
        return {e.key: e.view(flat) for e in self.entries}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pack this bucket's pieces of the whole parameters `tensors` (by name) into one new flat tensor."""
        return torch.cat([e.piece(tensors[e.name].detach()).to(self.dtype) for e in self.entries])

    def pack(self, pieces: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """One gradient per entry (any shape of `numel` elements, None: no gradient) as this bucket's flat
        gradient, zeros where there is none (a single entry is passed on as it is, without a copy), and the
        indices of the entries without one; (None, all) when no entry has one."""
        absent = tuple(i for i, g in enumerate(pieces) if g is None)
        if len(absent) == len(pieces):
            return None, absent
        flat = [
            torch.zeros(e.numel, dtype=self.dtype) if g is None else g.reshape(-1) for e, g in zip(self.entries, pieces)
        ]
        return (compact(flat[0]) if len(flat) == 1 else torch.cat(flat)), absent


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a view into a larger storage: torch RPC sends a view's storage from its
    start to the view's end, so the second half of a split parameter's gradient cost the whole gradient's
    bytes on the link (bench/linkfloor.py; BENCHMARKS.md, "A ps step against its link floor")."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


def join_pieces(tensors: dict[str, torch.Tensor], pieces: list[Entry]) -> dict[str, torch.Tensor]:
    """`tensors` (by entry key) with the pieces of each split parameter joined into the whole parameter,
    under its name; the other tensors are passed on as they are. A parameter some of whose pieces are
    missing from `tensors` is left out."""
    keys = {e.key for e in pieces}
    out = {n: t for n, t in tensors.items() if n not in keys}
    for name in dict.fromkeys(e.name for e in pieces):
        parts = sorted((e for e in pieces if e.name == name), key=lambda e: e.start)
        if all(e.key in tensors for e in parts):
            out[name] = torch.cat([tensors[e.key].reshape(-1) for e in parts]).view(parts[0].shape)
    return out


ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
)
"""torch.optim classes whose update of an element depends only on that element: they may see a
parameter split across servers. Others (Adafactor, user classes) keep every parameter whole."""


def may_split(optimizer_cls: type) -> bool:
    """Whether a parameter may be split across servers for this optimizer class (exact class only)."""
    return optimizer_cls in ELEMENTWISE_OPTIMIZERS


def applied_early(optimizer_cls: type, nonfinite: str, drops_workers: bool) -> bool:
    """Whether a sync step's bucket is applied, and its pieces answered, as soon as every worker's part of it is in
    (else at the step's end): stepping buckets apart is one step (`may_split`), no later piece can void the step
    (nonfinite 'raise'), and no worker's part can be taken out of it later (worker_loss 'drop'). The server's
    rule (`ps.sync_rule`) and the worker's window of pieces in flight (`transport.base.window`) both read it."""
    return may_split(optimizer_cls) and nonfinite == "raise" and not drops_workers


ALONE_BYTES = 1 << 20
"""A parameter (or piece) this large is a bucket of its own: a worker sends its gradient without packing it."""

BALANCE = 1.05
"""A plan of whole parameters is kept when no server holds more than this times the mean bytes."""


def plan_buckets(params: tuple[TensorSpec, ...], num_servers: int, cap_bytes: int, split: bool = False) -> list[Bucket]:
    """Pack parameters into buckets and assign each to a server.

    Small parameters share buckets of up to `cap_bytes`; one of `ALONE_BYTES` or more has a bucket of its
    own, so its gradient travels as it is, without a copy into a bucket.

    Args:
        params: the model's trainable parameters in registration order.
        num_servers: S >= 1.
        cap_bytes: the largest bucket (and piece, with `split`).
        split: cut parameters by element range (only for elementwise optimizers: see `may_split`): when
            whole parameters cannot balance the servers (within `BALANCE`), so that every server holds the
            same bytes, and any piece larger than `cap_bytes` into pieces of at most that size, which travel
            (and are applied by their server) one after the other; a cut parameter costs the worker a copy
            per step to join its pieces.
    Returns:
        Buckets in reverse layer order, each with its server index.
    """
    whole = _whole_plan(params, num_servers, cap_bytes)
    loads = [sum(b.nbytes for b in whole if b.server == s) for s in range(num_servers)]
    if not split:
        return whole
    balanced = max(loads) <= BALANCE * sum(loads) / num_servers
    return _cut(whole if balanced else _split_plan(params, num_servers, cap_bytes), cap_bytes)


def _cut(buckets: list[Bucket], cap_bytes: int) -> list[Bucket]:
    """Every bucket of one entry larger than `cap_bytes` cut into pieces of at most that size (element ranges
    of the entry, in order, on the same server), so that a large parameter travels as a pipeline of pieces;
    the buckets renumbered in plan order."""
    out: list[Bucket] = []
    for b in buckets:
        (e, *more) = b.entries
        step = max(1, cap_bytes // b.dtype.itemsize)
        if more or e.numel <= step:
            out.append(dataclasses.replace(b, index=len(out)))
            continue
        for start in range(0, e.numel, step):
            piece = Entry(e.name, e.shape, 0, min(step, e.numel - start), e.start + start)
            out.append(Bucket(len(out), b.server, b.dtype, (piece,)))
    return out


def forward_order(buckets: list[Bucket]) -> list[Bucket]:
    """The buckets in the order a worker sends them: the forward pass's order (the reverse of the plan's),
    interleaved across servers by the fraction of each server's bytes sent before them, so that every
    server's link is busy from the first piece on."""
    total = {b.server: 0 for b in buckets}
    for b in buckets:
        total[b.server] += b.nbytes
    before, keyed = dict.fromkeys(total, 0), []
    for b in reversed(buckets):
        keyed.append((before[b.server] / max(1, total[b.server]), b.server, b))
        before[b.server] += b.nbytes
    return [b for _, _, b in sorted(keyed, key=lambda k: k[:2])]


def _whole_plan(params: tuple[TensorSpec, ...], num_servers: int, cap_bytes: int) -> list[Bucket]:
    """Whole parameters grouped up to the cap, groups placed largest first on the least-loaded server."""
    total = sum(p.nbytes for p in params)
    cap = max(1, min(cap_bytes, math.ceil(total / num_servers)))
    groups: list[list[TensorSpec]] = []
    for p in reversed(params):
        current = groups[-1] if groups else None
        if (
            current is not None
            and current[0].dtype == p.dtype
            and p.nbytes < ALONE_BYTES
            and current[0].nbytes < ALONE_BYTES
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


def _split_plan(params: tuple[TensorSpec, ...], num_servers: int, cap_bytes: int) -> list[Bucket]:
    """Parameters laid end to end (reverse order) and cut into S runs of equal bytes; within a run,
    small pieces are grouped up to the cap, large ones alone. A bucket also ends where the dtype changes."""
    quota = math.ceil(sum(p.nbytes for p in params) / num_servers)
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    dtype: torch.dtype | None = None  # of the open bucket
    server, used, filled = 0, 0, 0  # used: bytes on this server; filled: bytes in the open bucket

    def close() -> None:
        nonlocal entries, filled
        if entries:
            assert dtype is not None  # set with the bucket's first entry
            buckets.append(Bucket(len(buckets), server, dtype, tuple(entries)))
        entries, filled = [], 0

    for p in reversed(params):
        start = 0
        while start < p.numel:
            if used >= quota and server < num_servers - 1:
                close()
                server, used = server + 1, 0
            last = server == num_servers - 1
            count = p.numel - start if last else min(p.numel - start, -(-(quota - used) // p.dtype.itemsize))
            nbytes = count * p.dtype.itemsize
            if p.dtype != dtype or (entries and (filled + nbytes > cap_bytes or max(filled, nbytes) >= ALONE_BYTES)):
                close()
                dtype = p.dtype
            entries.append(Entry(p.name, p.shape, filled // p.dtype.itemsize, count, start))
            start += count
            used += count * p.dtype.itemsize
            filled += count * p.dtype.itemsize
    close()
    return buckets


def by_server(buckets: list[Bucket], num_servers: int) -> dict[int, list[Bucket]]:
    """Each server's buckets, in plan order (a server may own none)."""
    return {s: [b for b in buckets if b.server == s] for s in range(num_servers)}


def assign_tensors(tensors: tuple[TensorSpec, ...], num_servers: int) -> dict[str, int]:
    """Server index of each buffer or frozen parameter: largest first, on the server holding the fewest bytes."""
    load = [0] * num_servers
    owner = {}
    for t in sorted(tensors, key=lambda t: -t.nbytes):
        s = min(range(num_servers), key=lambda s: (load[s], s))
        owner[t.name] = s
        load[s] += t.nbytes
    return {t.name: owner[t.name] for t in tensors}
