"""The dynamic table's id index against a Python dict, in one process and the same run.

A stream of `--ids` distinct int64 ids drawn uniformly from the whole 64-bit range, in batches of `--batch`
(each size in turn), as tensors in and out (the dict pays `tolist()` and `torch.tensor` of its answers, as a
dict-based table would):
  - insert: each batch looked up, then its missing ids inserted with a slot each (IdIndex.find + insert;
    the dict: `get` per id, then a store per missing id), until every id is in;
  - lookup: every id looked up again, in shuffled batches (IdIndex.find; the dict: `get` per id);
  - table: `DynamicTable.lookup` on the same batches (index, row creation with the default init, counters)
    into a table holding every id (dim `--dim`), then the same batches again, resident.
Each figure is ids per second, the median of `--repeats` runs; "vs dict" is the index's median over the
dict's, both from the same run. One thread (torch.set_num_threads(1)), as a server's shard would run.
Pages: the index of every id probed by batches of 4,096 of its ids, each batch after 64 MB written elsewhere
(a server's cache, taken by the other processes of a job), its buckets on 2 MB pages (`core/huge_pages.py`, as
the index allocates them) against the same buckets on 4 KB pages, alternated: ns per id, median of
`--page-batches` batches.

    .venv/bin/python bench/dynamic_index.py [--ids 1000000] [--batch 4096 65536] [--dim 16] [--repeats 3]
        [--page-batches 200] [--out bench/results/dynamic_index.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.id_index import IdIndex
from gradsync.tables.row_init import HashedUniform


def batches(ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(ids.split(size))


def index_insert(stream: list[torch.Tensor]) -> IdIndex:
    index, next_slot = IdIndex(), 0
    for batch in stream:
        missing = batch[index.find(batch) < 0]
        index.insert(missing, torch.arange(next_slot, next_slot + missing.numel()))
        next_slot += missing.numel()
    return index


def dict_insert(stream: list[torch.Tensor]) -> dict[int, int]:
    index: dict[int, int] = {}
    for batch in stream:
        ids = batch.tolist()
        slots = torch.tensor([index.get(i, -1) for i in ids])
        for i, slot in zip(ids, slots.tolist()):
            if slot < 0:
                index[i] = len(index)
    return index


def index_lookup(index: IdIndex, stream: list[torch.Tensor]) -> None:
    for batch in stream:
        index.find(batch)


def dict_lookup(index: dict[int, int], stream: list[torch.Tensor]) -> None:
    for batch in stream:
        torch.tensor([index.get(i, -1) for i in batch.tolist()])


def table_lookups(stream: list[torch.Tensor], dim: int, capacity: int) -> tuple[float, float]:
    table = DynamicTable(dim, capacity=capacity, init=HashedUniform(dim))
    start = time.perf_counter()
    for batch in stream:
        table.lookup(batch, 0)
    create = time.perf_counter() - start
    start = time.perf_counter()
    for batch in stream:
        table.lookup(batch, 1)
    return create, time.perf_counter() - start


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(ids: torch.Tensor, shuffled: torch.Tensor, size: int, args) -> dict:
    stream, lookups = batches(ids, size), batches(shuffled, size)
    runs: dict[str, list[float]] = {k: [] for k in ("index_insert", "dict_insert", "index_lookup", "dict_lookup",
                                                    "table_create", "table_resident")}
    for _ in range(args.repeats):
        start = time.perf_counter()
        index = index_insert(stream)
        runs["index_insert"].append(time.perf_counter() - start)
        start = time.perf_counter()
        table = dict_insert(stream)
        runs["dict_insert"].append(time.perf_counter() - start)
        runs["index_lookup"].append(timed(index_lookup, index, lookups))
        runs["dict_lookup"].append(timed(dict_lookup, table, lookups))
        create, resident = table_lookups(stream, args.dim, ids.numel())
        runs["table_create"].append(create)
        runs["table_resident"].append(resident)
    per_second = {k: ids.numel() / statistics.median(v) for k, v in runs.items()}
    return {"ids_per_second": per_second,
            "insert_vs_dict": per_second["index_insert"] / per_second["dict_insert"],
            "lookup_vs_dict": per_second["index_lookup"] / per_second["dict_lookup"],
            "index_bytes_per_id": index.nbytes / len(index), "seconds": runs}


def pages(ids: torch.Tensor, count: int) -> dict:
    """Cold probes of the index with its buckets on 2 MB pages and on 4 KB pages (module docstring)."""
    index = IdIndex()
    index.insert(ids, torch.arange(ids.numel()))
    huge, small = index.buckets, torch.full_like(index.buckets, -1).copy_(index.buckets)
    elsewhere = torch.zeros(64 * 2**20 // 8, dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    runs: dict[str, list[float]] = {"huge": [], "small": []}
    for _ in range(count):
        batch = ids[torch.randint(0, ids.numel(), (4096,), generator=g)]
        for name, buckets in (("huge", huge), ("small", small)):
            index.buckets, index._buckets = buckets, buckets.numpy()
            elsewhere.add_(1)
            runs[name].append(timed(index.find, batch) / batch.numel())
    ns = {name: 1e9 * statistics.median(v) for name, v in runs.items()}
    return {"probe_ns_per_id": ns, "huge_over_small_speed": ns["small"] / ns["huge"],
            "buckets": huge.shape[0], "huge_pages_mode": _thp_mode()}


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=10**6)
    parser.add_argument("--batch", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-batches", type=int, default=200)
    parser.add_argument("--out", default="bench/results/dynamic_index.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(-2**63, 2**63 - 1, (args.ids,), generator=g, dtype=torch.int64))
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    shuffled = ids[torch.randperm(ids.numel(), generator=g)]
    result = {
        "what": "id index (IdIndex) and DynamicTable.lookup against a Python dict, ids per second, one thread",
        "command": "bench/dynamic_index.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()),
        "date": datetime.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "ids": ids.numel(), "dim": args.dim, "batches": {},
    }
    for size in args.batch:
        result["batches"][size] = measure(ids, shuffled, size, args)
    result["pages"] = pages(ids, args.page_batches)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for size, figures in result["batches"].items():
        print(f"batch {size}: " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in figures["ids_per_second"].items())
              + f" M ids/s; insert {figures['insert_vs_dict']:.2f}x the dict, lookup "
              f"{figures['lookup_vs_dict']:.2f}x; index {figures['index_bytes_per_id']:.1f} bytes per id")
    probe = result["pages"]["probe_ns_per_id"]
    print(f"cold probes: {probe['huge']:.1f} ns per id on 2 MB pages, {probe['small']:.1f} on 4 KB pages "
          f"({result['pages']['huge_over_small_speed']:.2f}x)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
