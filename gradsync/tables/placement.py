"""Embedding tables served row-wise: which modules qualify, and which server holds which row.

An `nn.Embedding` or `nn.EmbeddingBag` whose weight is trainable and used by
that module alone (not tied to another layer) is a table: its rows live on
the parameter servers, row `r` on server `r % S` at local index `r // S`, and
a worker pulls only the rows its batch looks up. Every other parameter keeps
the dense bucket path.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.core.buckets import TensorSpec

TABLE_MODULES = (nn.Embedding, nn.EmbeddingBag)
TableModule = nn.Embedding | nn.EmbeddingBag
"""A module of `TABLE_MODULES`."""


def find_tables(module: nn.Module) -> dict[str, TableModule]:
    """The embedding modules of `module` served row-wise, by the name of their weight (as in `state_dict`).

    A weight shared with another module (tied input/output embeddings), frozen, or not 2-D stays dense.
    """
    users: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        users[id(p)] = users.get(id(p), 0) + 1
    tables: dict[str, TableModule] = {}
    for path, sub in module.named_modules():
        if isinstance(sub, TABLE_MODULES) and sub.weight.requires_grad and users.get(id(sub.weight)) == 1:
            tables[f"{path}.weight" if path else "weight"] = sub
    return tables


def table_specs(tables: dict[str, TableModule]) -> tuple[TensorSpec, ...]:
    """Name, (rows, dim) and dtype of each table, in model order."""
    return tuple(TensorSpec(name, tuple(m.weight.shape), m.weight.dtype) for name, m in tables.items())


def rows_on(rows: int, server: int, num_servers: int) -> int:
    """How many of a table's `rows` server `server` holds (rows server, server + S, ...)."""
    return len(range(server, rows, num_servers))


def split_ids(ids: torch.Tensor, num_servers: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per server with any: (positions in `ids`, local row indices on that server) of the global row ids."""
    owner = ids % num_servers
    out = {}
    for s in range(num_servers):
        where = (owner == s).nonzero().view(-1) if num_servers > 1 else torch.arange(ids.numel())
        if where.numel():
            out[s] = (where, ids[where] // num_servers)
    return out


def check_id_dtype(name: str, ids: torch.Tensor) -> None:
    """Refuse ids that are not integers, naming the table."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"table {name!r} was looked up with {ids.dtype} ids: pass an integer tensor (torch.long)")


def check_ids(name: str, ids: torch.Tensor, rows: int) -> None:
    """Refuse ids that are not integers in 0..rows-1, naming the table and the first bad id."""
    check_id_dtype(name, ids)
    bad = out_of_range(ids, rows)
    if bad is not None:
        raise IndexError(
            f"table {name!r} has rows 0..{rows - 1}, but a batch looked up id {bad}: fix the input ids "
            "(nothing was pulled or applied)"
        )


def out_of_range(ids: torch.Tensor, rows: int) -> int | None:
    """An id of `ids` outside 0..rows-1 (the lowest when one is negative, else the highest), or None."""
    if ids.numel() == 0:
        return None
    low, high = int(ids.min()), int(ids.max())
    return low if low < 0 else high if high >= rows else None


def merge_rows(pushes: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unique local rows of several lookups or pushes (ids, grads) and `scale` times each row's summed gradient,
    summed in push order."""
    ids = torch.cat([i for i, _ in pushes])
    grads = torch.cat([g for _, g in pushes])
    unique, inverse = torch.unique(ids, return_inverse=True)
    out = grads.new_zeros(unique.numel(), grads.shape[1])
    out.index_add_(0, inverse, grads)
    return unique, out.mul_(scale)


def join_rows(parts: dict[int, torch.Tensor], shape: tuple[int, ...], num_servers: int) -> torch.Tensor:
    """A whole table from each server's rows (server s's local row i is row s + i * S)."""
    first = next(iter(parts.values()))
    whole = torch.empty(shape, dtype=first.dtype)
    for s, rows in parts.items():
        whole[s::num_servers] = rows
    return whole
