"""A dynamic table's checkpoint parts (`DynamicTable.checkpoint`) put together: a delta onto its full
checkpoint, and the parts written by the S servers of a table re-homed onto another number of servers.

A part is a dict of tensors: rows (`ids` ascending, with `weight`, `last_step`, `lookups` and, with a row
optimizer that keeps state, `optimizer`, one entry per id), waiting ids (`waiting_ids` ascending, with
`waiting_sightings`, `waiting_last_step`), `step` and `counters`; a delta also `removed` and `waiting_removed`.
Rows and their optimizer state are taken and dropped together, so both always hold the same ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradsync.tables.id_hash import server_of

GROUPS = (
    ("ids", ("weight", "last_step", "lookups", "optimizer"), "removed"),
    ("waiting_ids", ("waiting_sightings", "waiting_last_step"), "waiting_removed"),
)
"""(the ids' key, the columns by id, the delta's key of the ids removed since the full checkpoint)."""


def with_delta(full: dict, delta: dict) -> dict:
    """The state `delta` describes: `full`'s rows and waiting ids, less those the delta removed or holds anew,
    with the delta's; its step and counters."""
    out = {"step": delta["step"], "counters": delta["counters"]}
    for ids_key, columns, removed_key in GROUPS:
        kept = ~torch.isin(full[ids_key], torch.cat([delta[removed_key], delta[ids_key]]))
        _sorted_into(
            out,
            ids_key,
            [c for c in columns if c in delta],
            [{k: full[k][kept] for k in (ids_key, *columns) if k in full}, delta],
        )
    return out


def as_full(name: str, part: dict, full: Callable[[], dict] | None, where: str) -> dict:
    """A checkpoint part of dynamic table `name` as a full one: `part` when it is full; a delta put onto `full()`, the
    table's part of the full checkpoint it goes onto (with the delta's server and number of servers, if any).

    Raises:
        ValueError: a delta and no full checkpoint (`full` None), naming `where` and the table.
    """
    if "removed" not in part:
        return part
    if full is None:
        raise ValueError(
            f"{where} holds a delta of dynamic table {name!r} and names no full checkpoint to put it "
            "onto: resume from the folder of a full checkpoint"
        )
    return {**with_delta(full(), part), **{k: part[k] for k in ("server", "num_servers") if k in part}}


def rehomed(parts: list[dict], server: int, num_servers: int) -> dict:
    """Server `server`'s part of a table of `num_servers` servers from the parts of every server that held it
    (in server order): its ids by `server_of`, the counters of the old servers k with k % num_servers ==
    server (their sum over the new servers stays the table's)."""
    out = {
        "step": parts[0]["step"],
        "counters": sum(
            (p["counters"] for k, p in enumerate(parts) if k % num_servers == server),
            torch.zeros_like(parts[0]["counters"]),
        ),
    }
    for ids_key, columns, _ in GROUPS:
        mine = [server_of(p[ids_key], num_servers) == server for p in parts]
        _sorted_into(
            out,
            ids_key,
            [c for c in columns if c in parts[0]],
            [{k: p[k][at] for k in (ids_key, *columns) if k in p} for p, at in zip(parts, mine)],
        )
    return out


def _sorted_into(out: dict, ids_key: str, columns: list[str], parts: list[dict]) -> None:
    """`parts`' ids (disjoint) joined in ascending order into `out`, each column in the same order."""
    ids = torch.cat([p[ids_key] for p in parts])
    order = torch.argsort(ids)
    out[ids_key] = ids[order]
    for column in columns:
        out[column] = torch.cat([p[column] for p in parts])[order]
