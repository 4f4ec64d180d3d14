"""Worker side of embedding tables served row-wise: look up only the rows a batch needs.

`ServedTables` takes each table's weight out of the user's module (worker 0
first hands its values to the servers, row `r` to server `r % S`) and
replaces the module's forward: the lookup pulls the batch's unique ids (one
call per server holding any), runs `F.embedding` / `F.embedding_bag` on those
rows as a leaf tensor, and remembers the leaf. `row_grads` turns the leaves'
gradients of a dist_autograd context into each server's push: unique local
ids and their summed gradients per table. A worker never holds more of a
table than the rows its batches pulled.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

from gradsync.core.row_optim import default_row_optimizer
from gradsync.core.tables import check_ids, find_tables, merge_rows, split_ids, table_specs


def current_context_id() -> int | None:
    """The id of the active dist_autograd context, or None outside one."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


class _Lookup:
    """One table lookup of a forward: the unique global ids, their rows (a leaf), each server's version."""

    def __init__(self, table: str, ids: torch.Tensor, leaf: torch.Tensor, versions: dict[int, int]):
        self.table = table
        self.ids = ids
        self.leaf = leaf
        self.versions = versions


class ServedTables:
    """The model's row-wise tables (`core.tables.find_tables`), looked up through `transport`."""

    def __init__(self, tables: dict[str, nn.Module], num_servers: int, metrics):
        for name, module in tables.items():
            if module.max_norm is not None:
                raise ValueError(
                    f"embedding table {name!r} has max_norm={module.max_norm}: renormalising rows in the forward "
                    "writes to the table, which lives on the parameter servers; build it without max_norm, or "
                    "keep the tables dense with Trainer(..., tables='dense')"
                )
        self.modules = tables
        self.specs = table_specs(tables)
        self.dtypes = {t.name: t.dtype for t in self.specs}
        self.num_servers = num_servers
        self.metrics = metrics
        self.transport = None  # set by the strategy before the first forward
        self._lookups: dict[int, list[_Lookup]] = {}

    def setups(self) -> dict[int, dict[str, dict]]:
        """Per server, what registration sends of each table: its rows of worker 0's values (None for a
        table built on the meta device: the servers initialise it)."""
        out: dict[int, dict[str, dict]] = {s: {} for s in range(self.num_servers)}
        for spec in self.specs:
            module = self.modules[spec.name]
            weight = module.weight.detach()
            for s in range(self.num_servers):
                values = None if weight.is_meta else weight[s::self.num_servers].contiguous()
                out[s][spec.name] = {"spec": spec, "values": values, "padding_idx": module.padding_idx}
        return out

    def take_over(self) -> None:
        """Remove each table's weight from its module (freeing it) and route its forward through the servers."""
        for spec in self.specs:
            module = self.modules[spec.name]
            module.weight = None
            module.forward = functools.partial(self._lookup, spec.name, module)

    def _lookup(self, name: str, module: nn.Module, input: torch.Tensor, offsets=None, per_sample_weights=None):
        rows = module.num_embeddings
        check_ids(name, input, rows)
        ids, inverse = torch.unique(input.long(), return_inverse=True)
        start = time.perf_counter()
        values, versions = self._pull(name, ids)
        self.metrics.rows_pulled(time.perf_counter() - start, values.nbytes)
        context = current_context_id()
        leaf = values.requires_grad_(torch.is_grad_enabled())
        if context is not None and leaf.requires_grad:
            self._lookups.setdefault(context, []).append(_Lookup(name, ids, leaf, versions))
        pad = None
        if module.padding_idx is not None:
            at = torch.searchsorted(ids, module.padding_idx)
            pad = int(at) if at < ids.numel() and ids[at] == module.padding_idx else None
        if isinstance(module, nn.EmbeddingBag):
            return F.embedding_bag(inverse, leaf, offsets, None, module.norm_type, module.scale_grad_by_freq,
                                   module.mode, False, per_sample_weights, module.include_last_offset, pad)
        return F.embedding(inverse, leaf, pad, None, module.norm_type, module.scale_grad_by_freq, False)

    def _pull(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, int]]:
        """The rows of the unique global `ids`, in their order, and the version each server answered at."""
        where = split_ids(ids, self.num_servers)
        answers = self.transport.pull_rows(name, {s: local for s, (_, local) in where.items()})
        if self.num_servers == 1 and answers:
            version, values = answers[0]
            return values, {0: version}
        values = torch.empty(ids.numel(), self.modules[name].embedding_dim, dtype=self.dtypes[name])
        for s, (positions, _) in where.items():
            values[positions] = answers[s][1]
        return values, {s: v for s, (v, _) in answers.items()}

    def row_grads(self, context_id: int, grads: dict[torch.Tensor, torch.Tensor]) -> dict[int, dict[str, tuple]]:
        """The pushes of this context's lookups: per server, {table: (version the rows were pulled at,
        unique local ids, summed gradients)}; forgets the context's lookups."""
        lookups = self._lookups.pop(context_id, [])
        self._lookups.clear()  # lookups of contexts that were never stepped
        out: dict[int, dict[str, tuple]] = {s: {} for s in range(self.num_servers)}
        for name in dict.fromkeys(lk.table for lk in lookups):
            mine = [lk for lk in lookups if lk.table == name and lk.leaf in grads]
            if not mine:
                continue
            pushes = [(lk.ids, grads[lk.leaf]) for lk in mine]
            ids, summed = pushes[0] if len(pushes) == 1 else merge_rows(pushes, 1.0)
            for s, (positions, local) in split_ids(ids, self.num_servers).items():
                version = min(lk.versions[s] for lk in mine if s in lk.versions)  # the oldest rows pulled
                out[s][name] = (version, local, summed if self.num_servers == 1 else summed[positions])
        return out

    def full(self, named_by_server: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Whole tables from each server's rows (the `state()` of every server), by weight name."""
        out = {}
        for spec in self.specs:
            full = torch.empty(spec.shape, dtype=spec.dtype)
            for s, named in named_by_server.items():
                full[s::self.num_servers] = named[spec.name]
            out[spec.name] = full
        return out


def serve_tables(module: nn.Module, tables: str, num_servers: int, metrics, optimizer_cls, optimizer_kwargs: dict,
                 table_optimizer, send: bool) -> tuple[ServedTables, dict[int, dict], object]:
    """Take `module`'s row-wise tables over (none with tables='dense'). Returns the `ServedTables`, what
    registration sends each server of them (only when `send`: worker 0), and the row optimizer (the
    user's, else the exact row-wise form of the dense optimizer)."""
    found = find_tables(module) if tables == "auto" else {}
    if found and table_optimizer is None:
        table_optimizer = default_row_optimizer(optimizer_cls, optimizer_kwargs, next(iter(found)))
    served = ServedTables(found, num_servers, metrics)
    setups = served.setups() if send else {s: {} for s in range(num_servers)}
    served.take_over()
    return served, setups, table_optimizer
