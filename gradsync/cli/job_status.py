"""What `gradsync status RUN_DIR` prints and `gradsync pull RUN_DIR OUT` writes: a running job's shards as markdown
tables (from a `Client`'s health and stats, or an ended job's final counters in its run directory), and the run's
state dict saved with `torch.save`."""

from __future__ import annotations

import glob
import io
import json
import os
import re

import torch

from gradsync.core.atomic_file import write_atomically
from gradsync.transport.grpc.client import Client


def status_table(client: Client) -> str:
    """`gradsync status RUN_DIR`: one row per shard, as a markdown table, then one row per shard of each
    embedding table."""
    health = client.health()
    stats = client.stats() if all(h["ready"] for h in health.values()) else {}  # GetStats needs a ready shard
    return _table(
        {
            shard: [client.addresses[shard], "yes" if h["ready"] else "no", str(h["version"])]
            for shard, h in sorted(health.items())
        },
        stats,
    )


def final_status_table(run_dir: str) -> str | None:
    """`gradsync status RUN_DIR` of a job that has ended: `status_table` from the servers' final counters
    (`stats-<shard>.json`, which they write as they stop); None while they have not."""
    stats = {}
    for path in glob.glob(os.path.join(run_dir, "stats-*.json")):
        with open(path) as f:
            shard = re.search(r"stats-(\d+)\.json$", path)
            assert shard is not None  # what the pattern above lists
            stats[int(shard.group(1))] = json.load(f)
    if not stats:
        return None
    table = _table({shard: ["-", "ended", str(s["version"])] for shard, s in sorted(stats.items())}, stats)
    return f"the job has ended; its servers' final counters:\n\n{table}"


def _table(first: dict[int, list[str]], stats: dict[int, dict]) -> str:
    """The status table: per shard its `first` cells (address, ready, version) and its `stats`, if any."""
    header = [
        "shard",
        "address",
        "ready",
        "version",
        "workers seen",
        "pushes applied",
        "pushes rejected",
        "steps skipped",
        "max staleness",
        "staleness: pushes",
        "workers replaced: times",
        "replica",
        "MB in",
        "MB out",
    ]
    rows = []
    for shard, cells in first.items():
        s = stats.get(shard)
        rows.append(
            [str(shard), *cells]
            + (
                [
                    ",".join(map(str, s["workers_seen"])),
                    str(s["pushes_applied"]),
                    str(s["pushes_rejected"]),
                    str(s["steps_skipped"]),
                    str(s["max_staleness"]),
                    " ".join(f"{k}:{v}" for k, v in sorted(s["staleness_histogram"].items())) or "-",
                    " ".join(f"{k}:{v}" for k, v in sorted(s.get("workers_replaced", {}).items())) or "-",
                    s["replica"] or "none" if "replica" in s else "-",
                    f"{s['bytes_in'] / 1e6:.1f}",
                    f"{s['bytes_out'] / 1e6:.1f}",
                ]
                if s
                else ["-"] * 10
            )
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    tables = [(shard, name, t) for shard, s in sorted(stats.items()) for name, t in s["tables"].items()]
    if tables:
        lines += [
            "",
            "| table | shard | rows | MB | rows pulled | rows pushed | max staleness | admitted | filtered | evicted |",
            "|" + "---|" * 10,
        ]
        lines += [_table_row(name, str(shard), t) for shard, name, t in tables]
        for name in dict.fromkeys(name for _, name, _ in tables):  # a table on several shards: its totals too
            parts = [t for _, n, t in tables if n == name]
            if len(parts) > 1:
                total = {k: sum(t.get(k, 0) for t in parts) for k in parts[0]}
                total["max_staleness"] = max(t["max_staleness"] for t in parts)
                lines.append(_table_row(name, "all", total))
    return "\n".join(lines)


def _table_row(name: str, shard: str, t: dict) -> str:
    """One row of the tables' part of the status: a table's counters on `shard` (a dynamic table's admitted,
    filtered and evicted; 0 for a fixed table)."""
    return (
        f"| {name} | {shard} | {t['rows']} | {t['bytes'] / 1e6:.1f} | {t['rows_pulled']} | {t['rows_pushed']} | "
        f"{t['max_staleness']} | {t.get('admitted', 0)} | {t.get('filtered', 0)} | {t.get('evicted', 0)} |"
    )


def pull_to_file(client: Client, path: str) -> dict[int, int]:
    """`gradsync pull RUN_DIR out.pt`: save the run's state dict with `torch.save`, atomically.

    Returns:
        The version of each shard's part of the saved state.
    """
    state, versions = client.pull_versioned()
    payload = io.BytesIO()
    torch.save(state, payload)
    write_atomically(path, payload.getvalue())
    return versions
