"""report.json (every metric of every run) and report.md (the side-by-side table) of `gradsync compare`."""
from __future__ import annotations

import json
import os

from gradsync.compare.predict import markdown

COLUMNS = (  # (heading, key, format)
    ("final loss", "final_loss", "{:.4f}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("step ms", "step_s", "ms"),
    ("pull ms", "pull_s", "ms"),
    ("compute ms", "compute_s", "ms"),
    ("commit ms", "commit_s", "ms"),
    ("KB/step", "bytes_per_step", "kb"),
    ("CPU-s/step", "cpu_s_per_step", "{:.3f}"),
    ("worker peak MB", "worker_peak_mb", "{:.0f}"),
    ("server peak MB", "server_peak_mb", "{:.0f}"),
    ("staleness: pushes", "staleness", "histogram"),
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
    """The markdown table: one row per run; a failed run shows its error."""
    lines = ["| run | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:200]} |" + " |" * (len(COLUMNS) - 1))
        else:
            lines.append(f"| {r['name']} | " + " | ".join(_cell(r.get(k), f) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines)


def summary(runs: list[dict]) -> str:
    """Plain sentences: the fastest run per step and the one with the lowest final loss."""
    done = [r for r in runs if "error" not in r and r.get("steps")]
    if not done:
        return "No run finished: see the errors in the table."
    fastest = min(done, key=lambda r: r["step_s"])
    lines = [f"Fastest step: {fastest['name']} ({1000 * fastest['step_s']:.2f} ms, median of worker 0)."]
    scored = [r for r in done if r["final_loss"] is not None]
    if scored:
        best = min(scored, key=lambda r: r["final_loss"])
        lines.append(f"Lowest final loss: {best['name']} ({best['final_loss']:.4f}).")
    return " ".join(lines)


def write_report(meta: dict, runs: list[dict], plots: list[str], out_dir: str,
                 prediction: dict | None = None) -> tuple[str, str]:
    """Write report.json and report.md under `out_dir`; returns their paths. `prediction`
    (`compare.predict.predict`): in report.json, and report.md ends with its verdict."""
    json_path, md_path = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(json_path, "w") as f:
        json.dump({**meta, "runs": runs, **({"prediction": prediction} if prediction else {})}, f, indent=1)
    lines = [
        f"# gradsync compare: {meta['command']}",
        "",
        f"{meta['workers']} workers; medians per step of worker 0 after its first step; CPU-s per step of every "
        "process of the job while the script logged steps; peak resident memory per process.",
        *_conditions(meta),
        "",
        table(runs),
        "",
        summary(runs),
        "",
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
        out.append(f"Slow server link: each parameter server behind {meta['server_link']} instead (allreduce "
                   "runs have no servers: only the workers' links count there).")
    if meta.get("straggler"):
        worker, factor = meta["straggler"].split(":")
        out.append(f"Straggler: worker {worker}'s compute took {factor} times as long in every run.")
    if meta.get("most_processes", 0) > meta.get("cores", 1 << 30):
        out.append(f"Time-sliced: up to {meta['most_processes']} processes shared {meta['cores']} cores, so "
                   "compute and communication compete for CPU; on separate machines they would not.")
    return [""] + out if out else []
