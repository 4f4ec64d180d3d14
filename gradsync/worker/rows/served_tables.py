"""Worker side of embedding tables served row-wise: look up only the rows a batch needs.

`ServedTables` takes each table's weight out of the user's module (worker 0
first hands its values to the servers, row `r` to server `r % S`) and
replaces the module's forward. A lookup with gradients returns at once a
`PendingRows` (worker.rows.pending_rows) and waits with the forward's other lookups
until one of them is used: then their batches' unique ids are pulled together
(one call per server holding any, for every waiting lookup), and each runs
`F.embedding` / `F.embedding_bag` on its rows as a leaf tensor, remembered
for the step. `row_grads` turns the leaves' gradients of a dist_autograd
context into each server's push: unique local ids and their summed gradients
per table. A worker never holds more of a table than the rows its batches
pulled.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.core.torch_internals import current_context_id
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.ps.messages import RowGrads, TableSetup
from gradsync.tables.placement import TableModule, check_ids, join_rows, merge_rows, split_ids, table_specs
from gradsync.worker.module.plain_module import Attachments, check_gatherable
from gradsync.worker.rows.pending_rows import WaitingLookups, resolved

if TYPE_CHECKING:
    from gradsync.transport.base import WorkerTransport


class _Lookup:
    """One table lookup of a forward: the unique global ids, their rows (a leaf), and what `_pull` answered
    beside the rows (each server's version; sharded: the route the ids took)."""

    def __init__(self, table: str, ids: torch.Tensor, leaf: torch.Tensor, pulled):
        self.table = table
        self.ids = ids
        self.leaf = leaf
        self.pulled = pulled


def output_shape(module: TableModule, input: torch.Tensor, offsets=None) -> torch.Size:
    """The shape of `module`'s forward (an `nn.Embedding` or `nn.EmbeddingBag`) of `input` with `offsets`."""
    if not isinstance(module, nn.EmbeddingBag):
        return torch.Size((*input.shape, module.embedding_dim))
    if input.dim() == 2 and offsets is None:
        return torch.Size((input.shape[0], module.embedding_dim))
    if input.dim() != 1 or offsets is None:
        raise ValueError(
            f"an EmbeddingBag takes a 2-D input without offsets or a 1-D input with offsets, got a "
            f"{input.dim()}-D input {'with' if offsets is not None else 'without'} offsets"
        )
    return torch.Size((offsets.numel() - int(module.include_last_offset), module.embedding_dim))


@dataclasses.dataclass(frozen=True)
class _Waiting:
    """A lookup with gradients whose rows are not fetched yet: its table, what its result is computed from once
    they are (the module, the unique ids, each input's place among them, the bag's offsets and per-sample
    weights) and the dist_autograd context it was made in."""

    table: str
    module: TableModule
    ids: torch.Tensor
    inverse: torch.Tensor
    bag: tuple
    context: int | None


class ServedTables:
    """The model's row-wise tables (`tables.placement.find_tables`), looked up through `transport`."""

    def __init__(
        self, tables: dict[str, TableModule], num_servers: int, metrics: StepMetrics, transport: WorkerTransport | None
    ):
        """`transport`: the job's, which serves the rows (None: the subclass holds them, `ShardedTables`)."""
        for name, module in tables.items():
            if module.max_norm is not None:
                raise ValueError(
                    f"embedding table {name!r} has max_norm={module.max_norm}: renormalising rows in the forward "
                    "writes to the table, which lives on the parameter servers (sharded: with its rows' owners); "
                    "build it without max_norm, or keep the tables dense with Trainer(..., tables='dense')"
                )
        self.modules = tables
        self.specs = table_specs(tables)
        self.dtypes = {t.name: t.dtype for t in self.specs}
        self.num_servers = num_servers
        self.metrics = metrics
        self.transport = transport
        self.before: frozenset[int] = frozenset()  # servers whose rows a replacement's first step takes as before
        self.serving = False  # once the servers answer (`RowLayout.begin_serving`): the module's state_dict gathers
        self.loaded: dict[str, torch.Tensor] = {}  # the whole weights a module's load_state_dict took, by table
        self._lookups: dict[int, list[_Lookup]] = {}
        self._waiting = WaitingLookups(self._results)  # lookups whose rows are not fetched yet (`flush`)

    def setups(self, rows: dict[str, tuple]) -> dict[int, dict[str, TableSetup]]:
        """Per server, what registration sends of each table: its rows of worker 0's values (None for a
        table built on the meta device: the servers initialise it), and from `rows` ({table: (row optimizer,
        the optimizer group whose schedule its learning rate follows, or None)}) its row optimizer."""
        out: dict[int, dict[str, TableSetup]] = {s: {} for s in range(self.num_servers)}
        for spec in self.specs:
            module = self.modules[spec.name]
            weight = module.weight.detach()
            for s in range(self.num_servers):
                values = None if weight.is_meta else weight[s :: self.num_servers].contiguous()
                out[s][spec.name] = TableSetup(spec, values, module.padding_idx, *rows[spec.name])
        return out

    def take_over(self, attached: Attachments) -> None:
        """Remove each table's weight from its module (freeing it) and route its forward through the servers,
        every change made through `attached`: the module's `state_dict()` then gathers the table from the servers
        (once `serving`), a `load_state_dict` takes its weight for them (`loading`), and a copy of the module
        holds its whole weight (`plain_module`)."""
        for spec in self.specs:
            module = self.modules[spec.name]
            # torch declares the weight a Parameter; a module's parameter may be set to None
            module.weight = None  # type: ignore[assignment]
            attached.set(module, "forward", functools.partial(self._lookup, spec.name, module))
            attached.hook(module, module.register_state_dict_post_hook(functools.partial(self._gathered, spec)))
            attached.hook(module, module.register_load_state_dict_pre_hook(functools.partial(self._loading, spec)))
            attached.plain(module, functools.partial(self._plain, spec))

    def whole(self, table: str) -> torch.Tensor:
        """The whole table `table`, as the servers hold it now."""
        spec = next(s for s in self.specs if s.name == table)
        check_gatherable(table, spec.shape, spec.dtype)
        assert self.transport is not None  # served tables are given theirs
        return join_rows(self.transport.table_rows(table), spec.shape, self.num_servers)

    def _plain(self, spec, module: nn.Module) -> dict:
        """A served table's module as an ordinary one: its whole weight back among its parameters."""
        return {"_parameters": {**module._parameters, "weight": nn.Parameter(self.whole(spec.name))}}

    def _gathered(self, spec, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        """State-dict hook of a served table's module: the whole table, as the servers hold it now, so that
        the user's `model.state_dict()` (and `torch.save` of it) has every key."""
        if self.serving:
            state_dict[prefix + "weight"] = self.whole(spec.name)

    def _loading(
        self,
        spec,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata,
        strict,
        missing: list,
        unexpected,
        errors: list,
    ) -> None:
        """Load-state-dict pre-hook of a served table's module: its weight taken out of the state dict (a copy in
        `loaded`, which the strategy sends where the rows are trained once the whole load succeeded), checked
        as torch checks a parameter."""
        key = prefix + "weight"
        if not self.serving:
            return
        if key not in state_dict:
            missing.append(key)
            return
        value = state_dict.pop(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            errors.append(
                f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, the "
                f"shape in current model is {torch.Size(spec.shape)}."
            )
            return
        self.loaded[spec.name] = value.detach().to("cpu", spec.dtype, copy=True)

    def discard_load(self) -> None:
        """Forget the weights a load took (it raised, or another begins)."""
        self.loaded.clear()

    def loaded_rows(self, server: int) -> dict[str, torch.Tensor]:
        """Server `server`'s rows of each table a load took (`loaded`), by table."""
        return {name: weight[server :: self.num_servers].contiguous() for name, weight in self.loaded.items()}

    def _lookup(self, name: str, module: TableModule, input: torch.Tensor, offsets=None, per_sample_weights=None):
        """A lookup with gradients waits with the forward's others until one of them is used (`PendingRows`,
        `flush`: their rows fetched together); any other reads its rows at once."""
        self._check(name, input, module.num_embeddings)
        ids, inverse = torch.unique(input.long(), return_inverse=True)
        if not torch.is_grad_enabled():
            values, _ = self._pull(name, ids)
            return self._embed(module, ids, inverse, values, offsets, per_sample_weights)
        waiting = _Waiting(name, module, ids, inverse, resolved((offsets, per_sample_weights)), current_context_id())
        return self._waiting.add(waiting, output_shape(module, input, offsets), self.dtypes[name])

    def flush(self) -> None:
        """Fetch the rows of every waiting lookup and make each lookup's result real (`_results`)."""
        self._waiting.flush()

    def _results(self, waiting: list[_Waiting]) -> list[torch.Tensor]:
        """The waiting lookups' results, their rows fetched together (`_fetch`), each lookup's rows a leaf
        recorded for the step to send its gradients."""
        out = []
        for w, (values, pulled) in zip(waiting, self._fetch(waiting)):
            leaf = values.requires_grad_()
            if w.context is not None:
                self.record(w.context, w.table, w.ids, leaf, pulled)
            out.append(self._embed(w.module, w.ids, w.inverse, leaf, *w.bag))
        return out

    def forward_ended(self, module: nn.Module, inputs, output):
        """Forward hook of the user's module: the lookups still waiting are fetched, and their results in its
        output made real (DDP and the caller see plain tensors)."""
        self.flush()
        return resolved(output)

    def _fetch(self, waiting: list[_Waiting]) -> list[tuple[torch.Tensor, Any]]:
        """The rows of waiting lookups, in one call per server for them all (`_pull_all`), each with what
        `_Lookup.pulled` keeps."""
        return self._pull_all([(w.table, w.ids) for w in waiting])

    @staticmethod
    def _embed(
        module: TableModule,
        ids: torch.Tensor,
        inverse: torch.Tensor,
        leaf: torch.Tensor,
        offsets=None,
        per_sample_weights=None,
    ) -> torch.Tensor:
        """`module`'s forward on the rows `leaf` of its unique `ids`, the input being `ids[inverse]`."""
        pad = None
        if module.padding_idx is not None:
            at = torch.searchsorted(ids, module.padding_idx)
            pad = int(at) if at < ids.numel() and ids[at] == module.padding_idx else None
        if isinstance(module, nn.EmbeddingBag):
            return F.embedding_bag(
                inverse,
                leaf,
                offsets,
                None,
                module.norm_type,
                module.scale_grad_by_freq,
                module.mode,
                False,
                per_sample_weights,
                module.include_last_offset,
                pad,
            )
        return F.embedding(inverse, leaf, pad, None, module.norm_type, module.scale_grad_by_freq, False)

    def record(self, context: int, name: str, ids: torch.Tensor, leaf: torch.Tensor, pulled) -> None:
        """Keep a lookup of table `name` in dist_autograd context `context`, whose step sends its gradients."""
        self._lookups.setdefault(context, []).append(_Lookup(name, ids, leaf, pulled))

    def _check(self, name: str, ids: torch.Tensor, rows: int) -> None:
        """Refuse a lookup's ids before anything is pulled (`placement.check_ids`)."""
        check_ids(name, ids, rows)

    def _split(self, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per holder of any of the unique global `ids`: (their positions in `ids`, the ids it is sent)."""
        return split_ids(ids, self.num_servers)

    def _pull(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The rows of the unique global `ids` of table `name`, in their order, and the version each server
        answered at."""
        return self._pull_all([(name, ids)])[0]

    def _pull_all(self, lookups: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, dict[int, int]]]:
        """Per lookup (table, its unique global ids): its rows, in the ids' order, and the version each server
        answered at; one call per server for them all (the time and bytes in the step's metrics, as pull)."""
        start = time.perf_counter()
        wheres = [split_ids(ids, self.num_servers) for _, ids in lookups]
        assert self.transport is not None  # served tables are given theirs
        answers = self.transport.pull_rows_many(
            [(name, {s: local for s, (_, local) in where.items()}) for (name, _), where in zip(lookups, wheres)],
            self.before,
        )
        out = []
        for (name, ids), where, answer in zip(lookups, wheres, answers):
            if self.num_servers == 1 and answer:
                values = answer[0][1]
            else:
                values = torch.empty(ids.numel(), self.modules[name].embedding_dim, dtype=self.dtypes[name])
                for s, (positions, _) in where.items():
                    values[positions] = answer[s][1]
            out.append((values, {s: version for s, (version, _) in answer.items()}))
        self.metrics.rows_pulled(time.perf_counter() - start, sum(values.nbytes for values, _ in out))
        return out

    def row_grads(self, context_id: int, grads: dict[torch.Tensor, torch.Tensor]) -> dict[int, dict[str, RowGrads]]:
        """The pushes of this context's lookups: per server, {table: `RowGrads`}; forgets the context's
        lookups."""
        self.flush()  # lookups whose results were never used
        lookups = self._lookups.pop(context_id, [])
        self._lookups.clear()  # lookups of contexts that were never stepped
        out: dict[int, dict[str, RowGrads]] = {s: {} for s in range(self.num_servers)}
        for name in dict.fromkeys(lk.table for lk in lookups):
            mine = [lk for lk in lookups if lk.table == name and lk.leaf in grads]
            if not mine:
                continue
            pushes = [(lk.ids, grads[lk.leaf]) for lk in mine]
            ids, summed = pushes[0] if len(pushes) == 1 else merge_rows(pushes, 1.0)
            for s, (positions, local) in self._split(ids).items():
                version = min(lk.pulled[s] for lk in mine if s in lk.pulled)  # the oldest rows pulled
                out[s][name] = RowGrads(version, local, summed if self.num_servers == 1 else summed[positions])
        return out

    def whole_tables(self, named_by_server: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Whole tables from each server's rows (the `state()` of every server), by weight name."""
        return {
            spec.name: join_rows(
                {s: named[spec.name] for s, named in named_by_server.items()}, spec.shape, self.num_servers
            )
            for spec in self.specs
        }
