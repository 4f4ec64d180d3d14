"""Restoring a shard from a checkpoint written by any number of servers: the same layout, or another.

A checkpoint written with S servers resumes with S' (`restore_folder`): each
new shard reads the saved shards, its own index first, and takes what its
plan holds. Parameters are gathered by element range (a parameter may be cut
differently, or not at all, in the new plan) over the span the new entries
cover, never more, and cut again by the new entries; the optimizer's elementwise state (momentum, Adam's moments) moves
with its elements and the rest (a step count) is taken as it is; buffers and
frozen parameters go to the server that now owns them; table rows move to
their new home, row `r` on server `r % S'`, with their row optimizer state; a dynamic table's ids (with their
rows, row optimizer state and admission and eviction state) to server `server_of(id, S')`, a delta checkpoint's
put onto its full one first (`tables.dynamic_checkpoint`).
Reading stops once the shard is complete, so with the same layout a server
reads its own file alone (one saved shard in memory at a time). Values are copied, never recomputed: the restored
state equals the saved one bit for bit.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator

import torch

from gradsync.core.buckets import Entry
from gradsync.ps import shard_file
from gradsync.ps.shard import ShardState
from gradsync.tables.dynamic_checkpoint import as_full


def restore_folder(shard: ShardState, folder: str, servers: int, base: str | None = None) -> None:
    """Restore `shard` from the checkpoint folder `folder`, written by a job with `servers` servers; a delta
    checkpoint's dynamic tables onto those of the full checkpoint in folder `base` (written by the same job)."""
    order = sorted(range(servers), key=lambda k: k != shard.shard_id)  # its own file first

    def state(k: int) -> dict:
        loaded = shard_file.load(os.path.join(folder, f"shard-{k}.ckpt"))
        full = (
            functools.cache(lambda: shard_file.load(os.path.join(base, f"shard-{k}.ckpt"))["tables"]) if base else None
        )
        for n in [n for n, t in loaded["tables"].items() if "removed" in t]:
            onto = None if full is None else (lambda n=n, full=full: full()[n])
            loaded["tables"][n] = as_full(n, loaded["tables"][n], onto, folder)
        return loaded

    restore(shard, (state(k) for k in order), where=folder)


def restore(shard: ShardState, states: Iterable[dict], where: str = "the checkpoint") -> None:
    """Put the loaded shard checkpoints `states` (`shard_file.capture`) back into `shard`, whatever layout
    they were written with, reading no more of them than it needs.

    Raises:
        ValueError: the states lack some of the shard's tensors (a checkpoint of another model, or with a
            table served in another way), naming the first; the shard is then half restored, unusable.
    """
    with shard.lock, torch.no_grad():  # the shard is not serving yet: nothing waits on the lock meanwhile
        plan = _Gathered(shard)
        for state in states:
            if "entries" not in state:
                raise ValueError(
                    f"{where} was written by an older gradsync, whose shards do not name their "
                    "entries: start without --resume"
                )
            plan.take(state)
            if plan.complete():
                break
        plan.check(where)
        for bucket in shard.buckets:
            for e in bucket.entries:
                shard.params[e.key].copy_(plan.cut(plan.values[e.name], e))
        for name, value in plan.named.items():
            (shard.buffers if name in shard.buffers else shard.frozen)[name].copy_(value)
        for table in shard.tables.values():
            table.restored()
        if shard.optimizer is not None:
            shard.load_optimizer_state(dict(plan.optimizer_state()), plan.groups)
        shard.stats.version = plan.version
        shard.restored()


class _Gathered:
    """What one shard needs, gathered from saved shards: per parameter the element span its entries cover
    (flat) with the optimizer's elementwise state over it, buffers and frozen parameters by name, table rows
    (taken into the shard's tables as they come), each dynamic table's parts."""

    def __init__(self, shard: ShardState):
        self.shard = shard
        self.entries = [e for b in shard.buckets for e in b.entries]
        names = dict.fromkeys(e.name for e in self.entries)
        self.span = {
            n: (
                min(e.start for e in self.entries if e.name == n),
                max(e.start + e.numel for e in self.entries if e.name == n),
            )
            for n in names
        }
        self.needed = {n: sum(e.numel for e in self.entries if e.name == n) for n in self.span}
        self.filled = dict.fromkeys(self.span, 0)  # elements of the shard's entries found
        self.values: dict[str, torch.Tensor] = {}  # by parameter: its span
        self.flat_state: dict[str, dict] = {}  # by parameter: elementwise state over its span
        self.other_state: dict[str, dict] = {}  # by parameter: the rest of its state (a step count), as saved
        self.kept: dict[str, dict] = {}  # by parameter: the state of a parameter saved whole, as saved
        self.named: dict[str, torch.Tensor] = {}
        self.groups: list[dict] = []
        self.version = 0

    def take(self, state: dict) -> None:
        self.version = max(self.version, state["version"])
        optimizer = state["optimizer"] or {"state": {}, "groups": []}
        self.groups = self.groups or optimizer["groups"]
        for name, shape, start, numel in state["entries"]:
            if name not in self.span:
                continue
            old = Entry(name, tuple(shape), 0, numel, start)
            self._copy(self.values, name, state["params"][old.key], old)
            self.filled[name] += sum(
                max(0, min(start + numel, e.start + e.numel) - max(start, e.start))
                for e in self.entries
                if e.name == name
            )
            saved = optimizer["state"].get(old.key)
            if saved is None:
                continue
            if old.whole:
                self.kept[name] = saved
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel:  # elementwise
                    self._copy(self.flat_state.setdefault(name, {}), k, v, old)
                else:
                    self.other_state.setdefault(name, {}).setdefault(k, v)
        for kind in ("buffers", "frozen"):
            for name, value in state[kind].items():
                if name in self.shard.buffers or name in self.shard.frozen:
                    self.named[name] = value
        for name, saved in state["tables"].items():
            if name in self.shard.tables:
                self.shard.tables[name].take(saved)

    def _copy(self, into: dict, key: str, value: torch.Tensor, old: Entry) -> None:
        """Copy the elements of `value` (old's elements of its parameter) that fall in the parameter's span
        into `into[key]`, a flat tensor over the span."""
        lo, hi = self.span[old.name]
        flat = into.setdefault(key, torch.empty(hi - lo, dtype=value.dtype))
        a, b = max(old.start, lo), min(old.start + old.numel, hi)
        if a < b:
            flat[a - lo : b - lo] = value.reshape(-1)[a - old.start : b - old.start]

    def cut(self, flat: torch.Tensor, e: Entry) -> torch.Tensor:
        """Entry `e`'s elements of a flat tensor over its parameter's span, shaped as `e`."""
        lo = self.span[e.name][0]
        return flat[e.start - lo : e.start - lo + e.numel].view(e.view_shape)

    def complete(self) -> bool:
        wanted = set(self.shard.buffers) | set(self.shard.frozen)
        return (
            all(self.filled[n] == self.needed[n] for n in self.span)
            and wanted <= set(self.named)
            and all(t.complete() for t in self.shard.tables.values())
        )

    def check(self, where: str) -> None:
        for name, needed in self.needed.items():
            if self.filled[name] != needed:
                self._missing(
                    where,
                    f"holds {self.filled[name]} of the {needed} elements of parameter {name!r} "
                    f"that server {self.shard.shard_id} needs",
                )
        for name in sorted((set(self.shard.buffers) | set(self.shard.frozen)) - set(self.named)):
            self._missing(where, f"holds no tensor {name!r}")
        for table in self.shard.tables.values():
            if not table.complete():
                self._missing(where, f"holds {table.missing()}")

    def _missing(self, where: str, what: str) -> None:
        raise ValueError(
            f"{where} {what}: it was written by another model, or with its embedding tables served "
            "another way (Trainer(tables=...)); resume with the model and settings that wrote it, or "
            "start without --resume"
        )

    def optimizer_state(self) -> Iterator[tuple[str, dict]]:
        """The state of each of the shard's entries, by entry key: cut from the gathered span."""
        for e in self.entries:
            if e.whole and e.name in self.kept:
                yield e.key, self.kept[e.name]
            elif e.name in self.flat_state or e.name in self.other_state:
                # every piece gets its own copy: pieces of one parameter on this server step their counts apart
                other = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in self.other_state.get(e.name, {}).items()
                }
                cut = {k: self.cut(v, e).clone() for k, v in self.flat_state.get(e.name, {}).items()}
                yield e.key, {**other, **cut}
