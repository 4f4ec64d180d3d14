"""`gradsync compare SCRIPT`: the user's own training script under a grid of paradigms, side by side.

`compare(options)` runs what a `CompareOptions` asks for (`options`; the command line builds it from its flags):
`grid` names the configurations, `runner` runs each (the same script, seeds and data order; the script reports
its scalars with `gradsync.log`), in a working directory of its own that `workdir` copies from the one compare
started in, and measures it from outside (CPU and peak memory of every process), `report` writes report.json and
report.md, `plots` the PNG charts (timeline.png too with --timeline), `predict` (--predict)
fits the cost model on the runs and writes the verdict that ends the report.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable

from gradsync.compare.options import CompareOptions

MARKER = ".gradsync-compare"
"""The file `compare` writes into its report directory: a later compare moves such a directory aside."""
PRISTINE = ".start-dir"
"""The copy of the directory compare started in, under --out while compare runs (`workdir`)."""


def prepare_out_dir(out_dir: str, force: bool = False) -> str | None:
    """Create the report directory and mark it; refuse one with files that `compare` did not write
    (no MARKER, and not the report.json of a compare from before the marker) unless `force`. A directory an
    earlier compare wrote is renamed to OUT-<its time> first; returns that name (None: nothing was moved)."""
    ours = any(os.path.exists(os.path.join(out_dir, name)) for name in (MARKER, "report.json"))
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not ours and not force:
        raise FileExistsError(
            f"--out {out_dir}: the directory has files that gradsync compare did not write: "
            "choose another --out, or pass --force to write the report into it anyway"
        )
    moved = None
    if ours and (kept := set(os.listdir(out_dir)) - {MARKER}):
        written = max(os.path.getmtime(os.path.join(out_dir, name)) for name in kept)
        moved = base = f"{out_dir.rstrip(os.sep)}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(written))}"
        for n in range(2, 1000):
            if not os.path.exists(moved):
                break
            moved = f"{base}-{n}"
        os.rename(out_dir, moved)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        f.write("written by gradsync compare: a later compare moves this directory aside to OUT-<time>\n")
    return moved


def compare(options: CompareOptions, *, checked: Callable[[], object] | None = None) -> tuple[str, list[dict]]:
    """Run the grid `options` names and write the report; returns report.md's path (relative when under the
    working directory) and the runs (a failed one has `error`, a skipped one `skipped`). `checked`: called once
    every option is checked, before the first run (the command line starts its ranks' fork server there)."""
    from gradsync.compare import workdir
    from gradsync.compare.grid import grid
    from gradsync.launcher.script_file import check_script
    from gradsync.runtime.straggler import parse as parse_straggler

    try:
        import matplotlib  # noqa: F401  (the plots'; torch is not imported yet)
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError(
            f"gradsync compare needs {e.name}, which is not installed in {sys.prefix}: "
            "pip install matplotlib tqdm (both are dependencies of gradsync, left out by an "
            "install with --no-deps)"
        ) from e
    if options.warmup < 1:
        raise ValueError(
            f"--warmup-steps {options.warmup}: at least the first step is warm-up (lazy imports, first "
            "calls): pass 1 or more"
        )
    check_script(options.script)
    configs = grid(list(options.strategies), list(options.servers), list(options.modes), list(options.compressions))
    if options.straggler is not None:
        parse_straggler(options.straggler)
    start, out_dir = os.getcwd(), os.path.abspath(options.out_dir)  # the ranks' working directories are elsewhere
    log_dir = None if options.log_dir is None else os.path.abspath(options.log_dir)
    if os.path.commonpath([start, out_dir]) == out_dir:
        raise ValueError(
            f"--out {out_dir} holds the working directory {start}, which every run gets a copy of: "
            "choose an --out inside the working directory or beside it"
        )
    workdir.check_size(start, MARKER, options.copy_limit_mb)
    if moved := prepare_out_dir(out_dir, options.force):
        print(f"gradsync compare: the earlier report in {_shown(out_dir)} is now in {_shown(moved)}", file=sys.stderr)
    # every argument is checked: now the imports that take seconds (torch)
    from gradsync.compare.plots import write_plots
    from gradsync.compare.predict import markdown
    from gradsync.compare.predict import predict as predict_runs
    from gradsync.compare.report import dense_tables, failures, missing, table, uneven, write_report
    from gradsync.compare.runner import NO_TABLES, TABLE_STRATEGIES, WORKDIR, run

    if checked is not None:
        checked()
    pristine = os.path.join(out_dir, PRISTINE)
    runs: list[dict] = []
    try:
        workdir.snapshot(start, pristine, MARKER)
        for i, config in enumerate(configs):
            if config.strategy in TABLE_STRATEGIES and any(r.get("skipped") == NO_TABLES for r in runs):
                # the same script builds the same model: no other hybrid or sharded run would find a table
                runs.append(
                    {"name": config.name, **config.settings(), "workers": options.workers, "skipped": NO_TABLES}
                )
                continue
            print(
                f"[{config.name}] run {i + 1} of {len(configs)}; its ranks' output follows; its working "
                f"directory: {_shown(os.path.join(out_dir, 'runs', config.slug, WORKDIR))}",
                file=sys.stderr,
                flush=True,
            )
            bar = tqdm(desc=f"[{i + 1}/{len(configs)}] {config.name}", unit="step", disable=not sys.stderr.isatty())

            def progress(steps: int, bar=bar) -> None:
                bar.update(steps - bar.n)

            runs.append(
                run(
                    config,
                    options.script,
                    list(options.script_args),
                    options.workers,
                    out_dir,
                    options.timeout,
                    options.warmup,
                    progress,
                    log_dir,
                    dict(link=options.link, server_link=options.server_link),
                    straggler=options.straggler,
                    timeline=options.timeline,
                    start=start,
                    pristine=pristine,
                )
            )
            bar.close()
    finally:
        shutil.rmtree(pristine, ignore_errors=True)
    if lacking := missing(runs):
        print(f"gradsync compare: warning: {lacking}", file=sys.stderr)
    for flag in uneven(runs):
        print(f"gradsync compare: warning: {flag}", file=sys.stderr)
    for line in failures(runs, _shown(out_dir)):
        print(f"gradsync compare: failed run {line.removeprefix('- ')}", file=sys.stderr)
    if dense := dense_tables(runs):
        print(f"gradsync compare: note: {dense}", file=sys.stderr)
    plots = write_plots(runs, out_dir, options.warmup)
    meta = {
        "command": options.command,
        "options": dict(options.flag_values),
        "workers": options.workers,
        "warmup_steps": options.warmup,
        "straggler": options.straggler,
        "link": options.link,
        "server_link": options.server_link,
        "cores": os.cpu_count(),
        "most_processes": max(options.workers + c.servers for c in configs),
    }
    prediction = predict_runs(runs, meta) if options.predict else None
    _, md_path = write_report(meta, runs, plots, out_dir, prediction)
    print(table(runs))
    if prediction:
        print("\n".join(["", *markdown(prediction)]))
    return _shown(md_path), runs


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies inside it, else as it is."""
    inside = os.path.relpath(path)
    return path if inside.split(os.sep)[0] == os.pardir else inside
