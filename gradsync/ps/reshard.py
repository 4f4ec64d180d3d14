"""Restoring a shard from a checkpoint written by any number of servers: the same layout, or another.

A checkpoint written with S servers resumes with S' (`restore_folder`): each
new shard reads the saved shards, its own index first, and takes what its
plan holds. Parameters are joined by element range (a parameter may be cut
differently, or not at all, in the new plan) and cut again by the new
entries; the optimizer's elementwise state (momentum, Adam's moments) moves
with its elements and the rest (a step count) is taken as it is; buffers and
frozen parameters go to the server that now owns them; table rows move to
their new home, row `r` on server `r % S'`, with their row optimizer state.
Reading stops once the shard is complete, so with the same layout a server
reads its own file alone. Values are copied, never recomputed: the restored
state equals the saved one bit for bit.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import torch

from gradsync.core.buckets import Entry
from gradsync.ps import checkpoint
from gradsync.ps.shard import ShardState


def restore_folder(shard: ShardState, folder: str, servers: int) -> None:
    """Restore `shard` from the checkpoint folder `folder`, written by a job with `servers` servers."""
    order = sorted(range(servers), key=lambda k: k != shard.shard_id)  # its own file first
    restore(shard, (checkpoint.load(os.path.join(folder, f"shard-{k}.ckpt")) for k in order), where=folder)


def restore(shard: ShardState, states: Iterable[dict], where: str = "the checkpoint") -> None:
    """Put the loaded shard checkpoints `states` (`checkpoint.capture`) back into `shard`, whatever layout
    they were written with, reading no more of them than it needs.

    Raises:
        ValueError: the states lack some of the shard's tensors (a checkpoint of another model, or with a
            table served in another way), naming the first; the shard is then half restored, unusable.
    """
    with shard.lock, torch.no_grad():  # the shard is not serving yet: nothing waits on the lock meanwhile
        plan = _Gathered(shard)
        for state in states:
            if "entries" not in state:
                raise ValueError(f"{where} was written by an older gradsync, whose shards do not name their "
                                 "entries: start without --resume")
            plan.take(state)
            if plan.complete():
                break
        plan.check(where)
        for bucket in shard.buckets:
            for e in bucket.entries:
                shard.params[e.key].copy_(e.piece(plan.values[e.name]).view(e.view_shape))
        for name, value in plan.named.items():
            (shard.buffers if name in shard.buffers else shard.frozen)[name].copy_(value)
        if shard.optimizer is not None:
            shard.load_optimizer_state(dict(plan.optimizer_state()), plan.groups)
        shard.stats.version = plan.version
        shard.restored()


class _Gathered:
    """What one shard needs, gathered from saved shards: whole flat parameters, their optimizer state,
    buffers and frozen parameters by name, table rows (taken into the shard's tables as they come)."""

    def __init__(self, shard: ShardState):
        self.shard = shard
        self.entries = [e for b in shard.buckets for e in b.entries]
        self.numel = {e.name: math.prod(e.shape) for e in self.entries}
        self.needed = {n: sum(e.numel for e in self.entries if e.name == n) for n in self.numel}
        self.values: dict[str, torch.Tensor] = {}
        self.filled = dict.fromkeys(self.numel, 0)  # elements of the shard's entries found
        self.state: dict[str, dict] = {}  # by parameter: elementwise state flat, other values as saved
        self.kept: dict[str, dict] = {}  # by parameter: the state of a parameter saved whole, as saved
        self.named: dict[str, torch.Tensor] = {}
        self.rows = {n: 0 for n in shard.tables}
        self.groups: list[dict] = []
        self.version = 0

    def take(self, state: dict) -> None:
        self.version = max(self.version, state["version"])
        optimizer = state["optimizer"] or {"state": {}, "groups": []}
        self.groups = self.groups or optimizer["groups"]
        for name, shape, start, numel in state["entries"]:
            if name not in self.numel:
                continue
            old = Entry(name, tuple(shape), 0, numel, start)
            value = state["params"][old.key].reshape(-1)
            flat = self.values.setdefault(name, torch.empty(self.numel[name], dtype=value.dtype))
            flat[start : start + numel] = value
            self.filled[name] += sum(max(0, min(start + numel, e.start + e.numel) - max(start, e.start))
                                     for e in self.entries if e.name == name)
            saved = optimizer["state"].get(old.key)
            if saved is not None:
                self._take_state(name, old, saved)
        for kind in ("buffers", "frozen"):
            for name, value in state[kind].items():
                if name in self.shard.buffers or name in self.shard.frozen:
                    self.named[name] = value
        for name, saved in state["tables"].items():
            if name in self.shard.tables:
                self.rows[name] += self.shard.tables[name].take(saved)

    def _take_state(self, name: str, old: Entry, saved: dict) -> None:
        if old.whole:
            self.kept[name] = saved
        mine = self.state.setdefault(name, {})
        for k, v in saved.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == old.numel:  # elementwise
                flat = mine.setdefault(k, torch.empty(self.numel[name], dtype=v.dtype))
                flat[old.start : old.start + old.numel] = v.reshape(-1)
            else:
                mine.setdefault(k, v)

    def complete(self) -> bool:
        wanted = set(self.shard.buffers) | set(self.shard.frozen)
        return (all(self.filled[n] == self.needed[n] for n in self.numel) and wanted <= set(self.named)
                and all(self.rows[n] == t.rows for n, t in self.shard.tables.items()))

    def check(self, where: str) -> None:
        for name, needed in self.needed.items():
            if self.filled[name] != needed:
                self._missing(where, f"holds {self.filled[name]} of the {needed} elements of parameter {name!r} "
                                     f"that server {self.shard.shard_id} needs")
        for name in sorted((set(self.shard.buffers) | set(self.shard.frozen)) - set(self.named)):
            self._missing(where, f"holds no tensor {name!r}")
        for name, table in self.shard.tables.items():
            if self.rows[name] != table.rows:
                self._missing(where, f"holds {self.rows[name]} of the {table.rows} rows of embedding table {name!r} "
                                     f"that server {self.shard.shard_id} needs (served row by row here)")

    def _missing(self, where: str, what: str) -> None:
        raise ValueError(f"{where} {what}: it was written by another model, or with its embedding tables served "
                         "another way (Trainer(tables=...)); resume with the model and settings that wrote it, or "
                         "start without --resume")

    def optimizer_state(self) -> Iterator[tuple[str, dict]]:
        """The state of each of the shard's entries, by entry key: cut from the gathered whole."""
        for e in self.entries:
            if e.name not in self.state:
                continue
            if e.whole and e.name in self.kept:
                yield e.key, self.kept[e.name]
                continue
            yield e.key, {k: e.piece(v).view(e.view_shape).clone()
                          if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == self.numel[e.name]
                          else v for k, v in self.state[e.name].items()}
