"""The PNG charts of a `gradsync compare` report (matplotlib, no display needed)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from gradsync.compare.report import warmup_text  # noqa: E402
from gradsync.metrics.step_metrics import STEP_PARTS  # noqa: E402


def write_plots(runs: list[dict], out_dir: str, warmup: int) -> list[str]:
    """loss.png (loss against wall-clock time after the `warmup` steps and against step, every run that logged a
    loss on one chart, a failed one up to its failure), step_time.png (median step split into pull / compute /
    commit) and bytes.png (bytes per step) of the finished runs with step figures, and timeline.png when a run
    recorded its timeline (`--timeline`); returns the paths of those drawn (a chart with nothing to draw is not
    written)."""
    paths = []
    if curves := [r for r in runs if "skipped" not in r and r.get("curve")]:
        paths.append(_losses(curves, out_dir, warmup))
    done = [r for r in runs if "error" not in r and "skipped" not in r and r["step_s"] == r["step_s"]]  # not NaN
    if not done:
        return paths
    names = [r["name"] for r in done]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(done)), 4.5))
    bottom = [0.0] * len(done)
    for part in STEP_PARTS:
        heights = [1000 * r[part] for r in done]
        ax.bar(names, heights, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(ylabel="ms per step (median, worker 0)", title="where a step's time goes")
    ax.legend()
    ax.tick_params(axis="x", labelrotation=30)
    paths.append(_save(fig, out_dir, "step_time.png"))

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(done)), 4.5))
    ax.bar(names, [r["bytes_per_step"] / 2**20 for r in done])
    ax.set(ylabel="MB sent + received per step (worker 0)", title="traffic per step")
    ax.tick_params(axis="x", labelrotation=30)
    paths.append(_save(fig, out_dir, "bytes.png"))
    if timed := [r for r in done if (r.get("timeline") or {}).get("pieces")]:
        paths.append(_timeline(timed, out_dir))
    return paths


def _losses(curves: list[dict], out_dir: str, warmup: int) -> str:
    """loss.png: each run's logged losses against time after its warm-up and against step."""
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in curves:
        label = f"{r['name']} (failed)" if "error" in r else r["name"]
        t, step, loss = zip(*r["curve"])
        warm = r["warmup_t"] or 0.0
        after = [(s - warm, v) for s, v in zip(t, loss) if s >= warm]
        if after:
            by_time.plot(*zip(*after), label=label)
        by_step.plot(step, loss, label=label)
    by_time.set(
        xlabel=f"seconds after the warm-up ({warmup_text(warmup)})", ylabel="loss (worker 0)", title="loss against time"
    )
    by_step.set(xlabel="step", ylabel="loss (worker 0)", title="loss against step")
    by_step.legend(fontsize="small")
    return _save(fig, out_dir, "loss.png")


SERVED = (
    ("push, and the other workers' parts", "left", "arrived", "tab:blue"),
    ("apply", "arrived", "applied", "tab:orange"),
    ("reply", "applied", "back", "tab:green"),
)
"""A ps piece's bars: (label, from event, to event, colour)."""
EXCHANGED = (("exchange (allreduce bucket, ps header)", "left", "back", "tab:gray"),)
"""The bar of a lane without server events."""


def _timeline(timed: list[dict], out_dir: str) -> str:
    """timeline.png: for each run (each with a timeline with lanes), its median step, a lane per piece or
    bucket, bars from when it left to when it came back, in ms from the step's first departure."""
    lanes = [len(r["timeline"]["pieces"]) for r in timed]
    fig, axes = plt.subplots(
        len(timed),
        1,
        figsize=(13, 1.5 + 0.25 * sum(lanes) + 0.8 * len(timed)),
        squeeze=False,
        gridspec_kw={"height_ratios": lanes},
    )
    for ax, r in zip(axes[:, 0], timed):
        pieces = r["timeline"]["pieces"]
        start = min(p["left"] for p in pieces)
        for y, p in enumerate(pieces):
            for _label, begin, end, colour in SERVED if p["arrived"] is not None else EXCHANGED:
                if p[begin] is not None and p[end] is not None:
                    ax.barh(y, 1000 * (p[end] - p[begin]), left=1000 * (p[begin] - start), color=colour)
        ax.set_yticks(range(len(pieces)), [p["lane"] for p in pieces], fontsize="small")
        ax.invert_yaxis()
        ax.set(
            title=f"{r['name']}: step {r['timeline']['step']} (median time)",
            xlabel="ms from the step's first departure (worker 0)",
        )
    axes[0, 0].legend(
        handles=[Patch(color=colour, label=label) for label, _, _, colour in SERVED + EXCHANGED],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize="small",
    )
    return _save(fig, out_dir, "timeline.png")


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
