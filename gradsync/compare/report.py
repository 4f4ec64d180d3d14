"""report.json (every metric of every run) and report.md (the side-by-side table) of `gradsync compare`."""

from __future__ import annotations

import json
import math
import os

from gradsync.compare.predict import markdown
from gradsync.core.strategies import STRATEGIES, Tables

COLUMNS = (  # (heading, key, format, what it is)
    (
        "final loss",
        "final_loss",
        "{:.4f}",
        "the mean of the last tenth of worker 0's logged losses (at least its "
        "last one): a smoothed end point, so it differs from the last loss a script prints",
    ),
    ("accuracy", "accuracy", "{:.3f}", "the last `acc` worker 0 logged"),
    (
        "samples/s",
        "samples_per_s",
        "{:.0f}",
        "the `samples` every worker logged per second after its warm-up, summed over the workers",
    ),
    ("step ms", "step_s", "ms", "pull + all-to-all + compute + commit"),
    ("pull ms", "pull_s", "ms", "fetching parameters or embedding rows from the servers (none under allreduce)"),
    (
        "all-to-all ms",
        "exchange_s",
        "ms",
        "the sharded strategy's all-to-all exchanges among the workers: the ids "
        "and rows of each lookup in the forward, the row gradients at the step (none under the other strategies)",
    ),
    (
        "compute ms",
        "compute_s",
        "ms",
        "the forward and backward on the worker (under allreduce with the part of "
        "DDP's allreduce that overlaps the backward)",
    ),
    (
        "commit ms",
        "commit_s",
        "ms",
        "from the last gradient to the next step's parameters: the gradient exchange "
        "(ps: push and the servers' reply; allreduce: DDP's allreduce that the backward waits for at its end) and "
        "the optimizer step",
    ),
    ("KB/step", "bytes_per_step", "kb", "bytes worker 0 sent and received per step"),
    (
        "CPU-s/step",
        "cpu_s_per_step",
        "{:.3f}",
        "CPU-seconds of every process of the job (workers and servers) per "
        "step, from the end of worker 0's warm-up to its last step",
    ),
    (
        "CPU wait s/step",
        "cpu_wait_s_per_step",
        "{:.3f}",
        "seconds per step the job's threads were ready to run "
        "but waited for a CPU (summed over threads; /proc schedstat), over the same steps: the time-slicing of more "
        "busy threads than this machine's cores, which a machine per rank would not have",
    ),
    ("worker peak MB", "worker_peak_mb", "{:.0f}", "the largest peak resident memory (VmHWM) of a worker process"),
    ("server peak MB", "server_peak_mb", "{:.0f}", "the same of a server process (0: the run has none)"),
    (
        "staleness: pushes",
        "staleness",
        "histogram",
        "async and ssp runs: pushes the servers applied, by how many versions behind they were",
    ),
)


def _cell(value, fmt: str) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    if fmt == "ms":
        return f"{1000 * value:.2f}"
    if fmt == "kb":
        return f"{value / 1024:.0f}"
    if fmt == "histogram":
        return " ".join(f"{k}:{v}" for k, v in value.items()) or "-"
    return fmt.format(value)


def table(runs: list[dict]) -> str:
    """The markdown table: one row per run; a failed run shows its error, a skipped one why."""
    lines = ["| run | " + " | ".join(h for h, _, _, _ in COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for r in runs:
        if "error" in r or "skipped" in r:
            why = f"failed: {r['error'][:200]}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['name']} | {why} |" + " |" * (len(COLUMNS) - 1))
        else:
            lines.append(f"| {r['name']} | " + " | ".join(_cell(r.get(k), f) for _, k, f, _ in COLUMNS) + " |")
    return "\n".join(lines)


def warmup_text(warmup: int) -> str:
    """'the first step' or 'the first N steps'."""
    return "the first step" if warmup == 1 else f"the first {warmup} steps"


def legend(warmup: int) -> list[str]:
    """What every column of the table is, as a markdown list."""
    return [
        f"Medians per step of worker 0 after its warm-up: {warmup_text(warmup)} of every worker (first calls, "
        "lazy imports) is left out of every per-step column. The step columns come from the Trainer's record of "
        "each step; loss, accuracy and samples from what the script passes to gradsync.log.",
        "",
        '- run: the strategy, the ps mode, S = the servers, the compression; "skipped: no tables": a hybrid '
        "run on a model with no embedding table that hybrid would serve",
        *[f"- {heading}: {meaning}" for heading, _, _, meaning in COLUMNS],
    ]


PER_STEP, AT_THE_END = "once per step in the training loop", "once after training"
LOGGED = (  # (the name the script passes to gradsync.log, what the report shows of it, the call, when)
    ("loss", "final loss and loss.png", "loss=loss.item()", PER_STEP),
    ("samples", "samples/s", "samples=len(x)", PER_STEP),
    ("acc", "accuracy", "acc=accuracy", AT_THE_END),
)


def missing(runs: list[dict]) -> str | None:
    """What the report lacks because the script logs it in no finished run (`LOGGED`), why, and the calls that
    give it; None when it lacks none (a run that took fewer steps than another is `uneven`'s)."""
    finished = [r for r in runs if "error" not in r and "skipped" not in r]
    logged = {name for r in finished for name in r["logged"]}
    lacking = [entry for entry in LOGGED if entry[0] not in logged]
    if not finished or not lacking:
        return None
    calls = [
        f"gradsync.log({', '.join(call for _, _, call, w in lacking if w == when)}) {when}"
        for when in (PER_STEP, AT_THE_END)
        if any(w == when for *_, w in lacking)
    ]
    measured = "" if logged else " (its step times, bytes, CPU and memory come from the Trainer itself)"
    return (
        f"the script logs no {_either(name for name, *_ in lacking)} with gradsync.log, so the report has no "
        f"{_either(shown for _, shown, *_ in lacking)}{measured}: call {' and '.join(calls)}"
    )


def _either(words) -> str:
    """'a', 'a or b', 'a, b or c'."""
    *rest, last = words
    return f"{', '.join(rest)} or {last}" if rest else last


def uneven(runs: list[dict]) -> list[str]:
    """A warning per finished run that logged fewer steps than another finished run, or that resumed (its first
    logged step is later than the first: 0 or 1, or an earlier run's first)."""
    finished = [r for r in runs if "error" not in r and "skipped" not in r]
    most = max(finished, key=lambda r: r["steps"], default=None)
    if most is None:  # no finished run
        return []
    firsts = [r["first_step"] for r in finished if r.get("first_step") is not None]
    first = min([1, *firsts])
    out = []
    for r in finished:
        if r["steps"] < most["steps"]:
            out.append(
                f"{r['name']} logged {r['steps']} steps, {most['name']} {most['steps']}: its final loss and "
                "medians cover other steps than the other runs', so its row does not compare like for like "
                "(did the script stop early, or resume from a snapshot it found?)"
            )
        if r.get("first_step") is not None and r["first_step"] > first:
            out.append(
                f"{r['name']} resumed: its first logged step is {r['first_step']}, not {first}, so it "
                "continued a training that began before it and its loss curve starts where that one stopped "
                "(a snapshot that was in the working directory when compare started: every run starts from "
                "a copy of that directory)"
            )
    return out


def failures(runs: list[dict], out_dir: str = "") -> list[str]:
    """A line per failed run: the failing rank, the file with its traceback (under `out_dir`), the steps each
    worker logged before the failure."""
    out = []
    for r in (r for r in runs if "error" in r):
        logged = ", ".join(f"worker{w} {n}" for w, n in enumerate(r.get("worker_steps", [])))
        rank = f"{r['failed_rank']} failed" if r.get("failed_rank") else "it failed"
        drawn = " (its loss up to the failure is in loss.png)" if r.get("curve") else ""
        out.append(
            f"- {r['name']}: {rank}: {r['error']}; the traceback is in {os.path.join(out_dir, r['failure'])}; "
            f"steps logged before the failure: {logged or 'none'}{drawn}"
        )
    return out


def dense_tables(runs: list[dict]) -> str | None:
    """The note for allreduce runs that averaged embedding tables densely (every row, every step), which is
    not allreduce at its best; None when no run did."""
    replicated = [
        r for r in runs if r.get("strategy") in STRATEGIES and STRATEGIES[r["strategy"]].tables is Tables.REPLICATED
    ]
    count = max(((r.get("model") or {}).get("dense_tables", 0) for r in replicated), default=0)
    if not count:
        return None
    return (
        f"allreduce averaged {count} embedding table(s) with dense gradients, every row at every step; "
        "with large tables a DDP user builds them with nn.Embedding(..., sparse=True) and an optimizer that "
        "takes sparse gradients (SGD, Adagrad, SparseAdam), so only the touched rows travel: build them so in "
        "the script to compare against allreduce at its best"
    )


def summary(runs: list[dict]) -> str:
    """Plain sentences: the fastest run per step and the one with the lowest final loss."""
    done = [r for r in runs if "error" not in r and r.get("steps") and not math.isnan(r["step_s"])]
    if not done:
        if any(sum(r.get("worker_steps", [])) for r in runs if "error" in r):
            return "No run finished; the failed runs logged steps before they failed (Failed runs, below)."
        return "No run logged a step to compare."
    fastest = min(done, key=lambda r: r["step_s"])
    lines = [f"Fastest step: {fastest['name']} ({1000 * fastest['step_s']:.2f} ms, median of worker 0)."]
    scored = [r for r in done if r["final_loss"] is not None]
    if scored:
        best = min(scored, key=lambda r: r["final_loss"])
        lines.append(f"Lowest final loss: {best['name']} ({best['final_loss']:.4f}).")
    return " ".join(lines)


def write_report(
    meta: dict, runs: list[dict], plots: list[str], out_dir: str, prediction: dict | None = None
) -> tuple[str, str]:
    """Write report.json and report.md under `out_dir`; returns their paths. `prediction`
    (`compare.predict.predict`): in report.json, and report.md ends with its verdict."""
    json_path, md_path = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(json_path, "w") as f:
        json.dump({**meta, "runs": runs, **({"prediction": prediction} if prediction else {})}, f, indent=1)
    lacking, dense, flags, failed = missing(runs), dense_tables(runs), uneven(runs), failures(runs)
    lines = [
        f"# gradsync compare: {meta['command']}",
        "",
        "Options: " + ", ".join(f"{name} {value}" for name, value in meta["options"].items()) + ".",
        "",
        f"{meta['workers']} workers in every run.",
        *_conditions(meta),
        "",
        table(runs),
        "",
        *legend(meta["warmup_steps"]),
        "",
        *([f"Warning: {lacking}.", ""] if lacking else []),
        *[line for flag in flags for line in (f"Warning: {flag}.", "")],
        *([f"Note: {dense}.", ""] if dense else []),
        summary(runs),
        "",
        *(["Failed runs:", "", *failed, ""] if failed else []),
        *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots],
        *(["", *markdown(prediction)] if prediction else []),
    ]
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return json_path, md_path


def _conditions(meta: dict) -> list[str]:
    """What the reader must know about how the runs were made: a straggler, time-sliced cores."""
    out = []
    if meta.get("link"):
        out.append(f"Network: every rank behind an emulated {meta['link']} link (its own namespace, tc tbf).")
    if meta.get("server_link"):
        out.append(
            f"Slow server link: each parameter server behind {meta['server_link']} instead (allreduce "
            "runs have no servers: only the workers' links count there)."
        )
    if meta.get("straggler"):
        worker, factor = meta["straggler"].split(":")
        out.append(f"Straggler: worker {worker}'s compute took {factor} times as long in every run.")
    if meta.get("most_processes", 0) > meta.get("cores", 1 << 30):
        out.append(
            f"Time-sliced: up to {meta['most_processes']} processes shared {meta['cores']} cores, so "
            "compute and communication compete for CPU; on separate machines they would not."
        )
    return [""] + out if out else []
