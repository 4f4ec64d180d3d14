"""Checks gradsync.compare.costmodel on measured results: fit on the W = 2 runs, predict the W = 4 ones.

bench/results/sparse.json (bench/sparse.py: allreduce, ps and hybrid on click models of 1e4..1e7 rows):
the model's dense part is examples/ctr.py's MLP; under allreduce the tables are dense too; under ps and
hybrid a worker's rows per step (each way) are taken from the W = 2 ps run of the same table size (its
bytes sent + received less the dense pull and push), so nothing measured at W = 4 enters the fit.
bench/results/overhead.json (bench/overhead.py) is tried as well: its W = 2 workload is one model at one
batch, which the fit refuses (the refusal is printed).
Prints the fit, a markdown table of predicted vs measured step times, the table size where hybrid
overtakes allreduce at W = 2 and 4, and two verdicts.

    .venv/bin/python bench/costmodel_check.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from ctr import CTRModel  # noqa: E402

from gradsync.compare.costmodel import FP32, Config, Run, fit, table_crossover, verdict  # noqa: E402

STRATEGY = {"gradsync_allreduce": ("allreduce", 0), "gradsync_ps_sync_s1": ("ps", 1),
            "gradsync_ps_sync_s2": ("ps", 2)}


def sparse_runs(data: dict) -> list[tuple[int, Run]]:
    """(table rows, run) for every job in bench/sparse.py's results."""
    model = CTRModel(data["fields"], 1, data["dim"])
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables"))
    rows_each_way = {r["rows"]: (r["bytes_per_step"] - 2 * FP32 * dense) / 2 for r in data["results"]
                     if r["config"] == "ps" and r["workers"] == 2}
    runs = []
    for r in data["results"]:
        if r["config"] == "allreduce":
            config = Config("allreduce", data["batch"], dense, tables=r["rows"] * data["dim"])
        else:
            config = Config(r["config"], data["batch"], dense, row_bytes=round(rows_each_way[r["rows"]]), servers=1)
        runs.append((r["rows"], Run(config, r["workers"], r["step_s"], bytes_per_step=r["bytes_per_step"])))
    return runs


def overhead_runs(path: str) -> list[Run]:
    """The reference workload's sync gradsync configurations (all at W = 2)."""
    with open(path) as f:
        data = json.load(f)
    workload = data["settings"]["workloads"]["reference"]
    sizes = workload["sizes"]
    dense = sum(i * o + o for i, o in zip(sizes, sizes[1:]))  # the MLP's weights and biases
    return [Run(Config(strategy, workload["batch"], dense, servers=servers), workload["workers"],
                data["summary"]["reference"][name]["median_ms"] / 1000)
            for name, (strategy, servers) in STRATEGY.items()]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        fit(overhead_runs(os.path.join(HERE, "results", "overhead.json")))
    except ValueError as e:
        print(f"overhead.json, W = 2 reference workload: fit refused: {e}\n")
    with open(os.path.join(HERE, "results", "sparse.json")) as f:
        data = json.load(f)
    runs = sparse_runs(data)
    fitted = fit([run for _, run in runs if run.workers == 2])
    print(f"sparse.json, fit on the {len(fitted.runs)} W = 2 runs: {1e6 * fitted.compute_s_per_sample:.3g} us "
          f"per sample, {1e9 * fitted.s_per_byte:.3g} ns per byte ({1 / fitted.s_per_byte / 1e9:.3g} GB/s), "
          f"{1e3 * fitted.latency_s:.3g} ms per message; max relative error on them {fitted.max_rel_error:.0%}\n")
    print("| rows | W | config | measured ms | predicted ms | predicted / measured |\n|---|---|---|---|---|---|")
    ratios = []
    for rows, run in runs:
        predicted = fitted.step_s(run.config, run.workers)
        if run.workers != 2:
            ratios.append(predicted / run.step_s)
        print(f"| {rows:.0e} | {run.workers} | {run.config.strategy} | {1e3 * run.step_s:.1f} | {1e3 * predicted:.1f} "
              f"| {predicted / run.step_s:.2f} |")
    print(f"\nW = 4 (not fitted), predicted / measured: {min(ratios):.2f} .. {max(ratios):.2f}\n")
    million = {run.config.strategy: run.config for rows, run in runs if rows == 10**6 and run.workers == 2}
    for workers in (2, 4):
        rows = table_crossover(fitted, million["allreduce"], million["hybrid"], workers) / data["dim"]
        print(f"W = {workers}: hybrid overtakes allreduce from {rows:,.0f} table rows on (predicted)")
    print("R = 1e6:", verdict(fitted, million, workers=4))
    print("R = 1e6:", verdict(fitted, million, workers=64, link=10e9 / 8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
