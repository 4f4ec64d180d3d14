"""`gradsync compare SCRIPT`: the user's own training script under a grid of paradigms, side by side.

`grid` names the configurations, `runner` runs each (the same script, seeds and
data order; the script reports its scalars with `gradsync.log`) and measures it
from outside (CPU and peak memory of every process), `report` writes
report.json and report.md, `plots` the PNG charts, `predict` (--predict) fits the
cost model on the runs and writes the verdict that ends the report.
"""
from __future__ import annotations

import os
import sys


def compare(script: str, script_args: list[str], *, workers: int, out_dir: str, strategies: list[str],
            servers: list[int], modes: list[str], compressions: list[str], timeout: float,
            straggler: str | None = None, log_dir: str | None = None, link: str | None = None,
            server_link: str | None = None, predict: bool = False) -> str:
    """Run the grid and write the report; returns report.md's path. `straggler` ('W:F'): worker W's
    compute takes F times as long in every run (`gradsync.straggler`). `log_dir`: TensorBoard scalars too,
    one subdirectory per run. `link`: every run over an emulated network of this rate (`gradsync.netem`);
    `server_link`: the parameter servers behind links of this rate instead (a slow server link).
    `predict`: fit the cost model on the sync runs, predict each paradigm up to W = 1024 and end the
    report with a verdict (`compare.predict`)."""
    from tqdm import tqdm

    from gradsync.compare.grid import grid
    from gradsync.compare.plots import write_plots
    from gradsync.compare.predict import markdown
    from gradsync.compare.predict import predict as predict_runs
    from gradsync.compare.report import table, write_report
    from gradsync.compare.runner import run
    from gradsync.straggler import ENV as STRAGGLER
    from gradsync.straggler import parse as parse_straggler

    configs = grid(strategies, servers, modes, compressions)
    if straggler is not None:
        parse_straggler(straggler)
        os.environ[STRAGGLER] = straggler  # the ranks inherit it
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    for i, config in enumerate(configs):
        bar = tqdm(desc=f"[{i + 1}/{len(configs)}] {config.name}", unit="step", disable=not sys.stderr.isatty())

        def progress(steps: int, bar=bar) -> None:
            bar.update(steps - bar.n)

        runs.append(run(config, script, script_args, workers, out_dir, timeout, progress, log_dir,
                        dict(link=link, server_link=server_link)))
        bar.close()
    plots = write_plots(runs, out_dir)
    meta = {"command": " ".join(["gradsync compare", script, *script_args]), "workers": workers,
            "straggler": straggler, "link": link, "server_link": server_link, "cores": os.cpu_count(),
            "most_processes": max(workers + c.servers for c in configs)}
    prediction = predict_runs(runs, meta) if predict else None
    _, md_path = write_report(meta, runs, plots, out_dir, prediction)
    print(table(runs))
    if prediction:
        print("\n".join(["", *markdown(prediction)]))
    return md_path
