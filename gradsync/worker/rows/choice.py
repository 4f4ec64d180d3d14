"""Which of a model's tables a strategy trains row by row (`choose_tables`), why none when none is
(`why_dense`), and its dynamic tables (`find_dynamic`): the same rules for ps, hybrid and sharded."""

from __future__ import annotations

from torch import nn

from gradsync.core.errors import NoTablesToServe
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.tables.dynamic_embedding import DynamicEmbedding
from gradsync.tables.placement import TABLE_MODULES, TableModule, find_tables
from gradsync.tables.row_optim import exact_row_optimizer, inexact_part, no_row_form


def find_dynamic(module: nn.Module) -> dict[str, DynamicEmbedding]:
    """The `DynamicEmbedding` modules of `module`, by module name."""
    return {name or "table": m for name, m in module.named_modules() if isinstance(m, DynamicEmbedding)}


WORTH_SERVING_SHARE = 0.1
"""The share of the model's parameters from which a table left dense is worth a line (here; and compare's note
on allreduce without `sparse=True`, `AllreduceStrategy.model_sizes`): moving only its touched rows can
save at most its share of the bytes a step moves (a batch's rows instead of the whole table), so below a tenth
the gain is smaller than the spread between runs of one job (BENCHMARKS.md, "How these figures are measured"),
while the line would repeat in every run of a model whose small token embedding has no row optimizer."""


def choose_tables(
    module: nn.Module, tables: str, optimizer: OptimizerSpec, table_optimizer, say: bool
) -> tuple[dict[str, TableModule], dict[str, tuple]]:
    """The tables of `module` trained row by row, by weight name, and each one's (row optimizer, the optimizer
    group whose schedule its learning rate follows, or None).

    tables='auto' takes a table when a row optimizer applies to it: `table_optimizer`, or the exact row-wise
    form of its group's optimizer (plain SGD, whose learning rate then follows the group's schedule); any
    other table stays dense, said once (when `say`) where it matters (`WORTH_SERVING_SHARE`). tables='rows'
    takes every table and refuses one without a row optimizer; tables='dense' takes none.
    """
    found = find_tables(module) if tables in ("auto", "rows") else {}
    group_of = optimizer.group_of(found)
    chosen: dict[str, TableModule] = {}
    rows: dict[str, tuple] = {}
    for name, table in found.items():
        options = optimizer.groups[group_of[name]]
        exact = exact_row_optimizer(optimizer.cls, options)
        if table_optimizer is None and exact is None:
            if tables == "rows":
                raise ValueError(no_row_form(optimizer.cls, options, name))
            if say and table.weight.numel() >= WORTH_SERVING_SHARE * sum(p.numel() for p in module.parameters()):
                print(
                    f"gradsync: embedding table {name!r} {tuple(table.weight.shape)} stays in the dense path "
                    f"(tables='auto'): {inexact_part(optimizer.cls, options)} has no exact row-wise form; serve "
                    f"it row by row with {ROW_OPTIMIZER_FIX}",
                    flush=True,
                )
            continue
        chosen[name] = table
        rows[name] = (table_optimizer, None) if table_optimizer is not None else (exact, group_of[name])
    return chosen, rows


ROW_OPTIMIZER_FIX = "Trainer(..., table_optimizer=gradsync.RowSGD(lr=..., momentum=...)) or gradsync.RowAdagrad(lr=...)"


def why_dense(module: nn.Module, tables: str, optimizer: OptimizerSpec, table_optimizer) -> str | None:
    """None when `choose_tables` takes a table of `module`; else the end of the refusal of a strategy that needs
    one (hybrid, sharded; the caller checks for a `DynamicEmbedding`): each embedding table and why it stays
    dense (tables='dense', frozen, tied to another layer, its optimizer without an exact row-wise form), then
    the fixes."""
    if choose_tables(module, tables, optimizer, table_optimizer, say=False)[0]:
        return None
    found = {
        f"{path}.weight" if path else "weight": m for path, m in module.named_modules() if isinstance(m, TABLE_MODULES)
    }
    if not found:
        return (
            "this model has no embedding table (nn.Embedding, nn.EmbeddingBag, gradsync.DynamicEmbedding): use "
            "--strategy allreduce"
        )
    shown = {name: f"{name!r} {tuple(table.weight.shape)}" for name, table in found.items()}
    if tables == "dense":
        return (
            f"tables='dense' keeps every table of this model dense ({', '.join(shown.values())}). Fix: build "
            "the Trainer with tables='auto' (the default); or use --strategy allreduce"
        )
    users: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name)
    reasons, fixes = [], []
    for name, table in found.items():
        tied = [other for other in users[id(table.weight)] if other != name]
        if not table.weight.requires_grad:
            reasons.append(f"{shown[name]} is frozen (requires_grad=False): nothing trains it")
        elif tied:
            reasons.append(f"{shown[name]} is tied to {', '.join(map(repr, tied))}, which trains it in the dense path")
        else:
            options = optimizer.groups[optimizer.group_of([name])[name]]
            reasons.append(
                f"{shown[name]} trains with {inexact_part(optimizer.cls, options)}, which has no exact row-wise form"
            )
            fixes = [f"give the tables a row optimizer, {ROW_OPTIMIZER_FIX}"]
    fix = "; or ".join([*fixes, "use --strategy allreduce"])
    return f"every table of this model stays dense: {'; '.join(reasons)}. Fix: {fix}"


def needed_tables(
    module: nn.Module, tables: str, optimizer: OptimizerSpec, table_optimizer, say: bool, strategy: str
) -> tuple[dict[str, TableModule], dict[str, tuple]]:
    """`choose_tables` for a strategy that needs a table to train by rows (hybrid, sharded: `strategy`, what it
    does with them, in words), refusing a model without one (nor a `DynamicEmbedding`) before any is taken
    over or said (`why_dense`)."""
    dense = why_dense(module, tables, optimizer, table_optimizer)
    if dense is not None and not find_dynamic(module):
        raise NoTablesToServe(f"{strategy}, and {dense}")
    return choose_tables(module, tables, optimizer, table_optimizer, say)
