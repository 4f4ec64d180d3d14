"""`gradsync compare --predict`: fit `gradsync.compare.costmodel` on the compare's own runs, predict up to W = 1024.

What the fit takes from each finished sync run: its step time (worker 0's median), the bytes and messages
its paradigm moves per step (`costmodel.traffic`, from the trainable elements the Trainer logged, dense and
in embedding tables), the batch the script logged (`gradsync.log(samples=...)`; without it the batch is
taken as 1 and compute is per step), and, from ps runs only, the compute split: a ps worker's compute is
its local forward and backward with no communication inside, while under allreduce and hybrid the part of
DDP's allreduce that overlaps the backward stays in their compute split, so theirs is not pure compute.
The rows a ps or hybrid worker moves per step are what it received beyond the dense part (median over
those runs).

One W, yet three parameters: every run of a compare has the same W and batch, so in step times alone
compute per sample and latency per message are both constants (at W = 2 allreduce and ps exchange 2
messages each) and cannot be told apart. The ps compute split pins the compute; the paradigms' different
byte volumes (at W = 2 the link of ps's one server takes both workers' pushes, twice what allreduce moves,
while their replies go out, plus the largest piece's pushes that no reply overlaps; more servers or
compression change it again) pin the cost per byte; the latency is what remains, and where every run exchanged as many
messages it is a fixed cost per step (`costmodel.latency_per_step`; the verdict says what a latency per
message would change). A compare without a finished ps sync run, or whose runs move one byte volume only,
is refused, and the verdict says which run to add.

The fitted cost per byte is this link's effective cost (on loopback: memory copies by the same CPUs), and
the predictions keep it: they are for this job at this link, each worker on a machine of its own.
"""

from __future__ import annotations

import dataclasses
import statistics

from gradsync.compare import costmodel
from gradsync.core.strategies import STRATEGIES, Dense, Tables, traits
from gradsync.launcher.netem import Link

MAX_WORKERS = 1024


def predict(runs: list[dict], meta: dict) -> dict:
    """The prediction block of report.json: the fit, predicted step times and samples/s by W for every
    finished sync run's paradigm, the winner at the measured W, where it is overtaken, and the verdict
    text; {"error": why} when the runs cannot be fitted."""
    workers = meta["workers"]
    if meta.get("server_link"):
        return {
            "error": f"--server-link {meta['server_link']} puts the servers behind another rate than the "
            "workers, and the cost model has one link: run --predict without --server-link"
        }
    try:
        fit, configs, sizes, per_message = fitted(runs, workers, meta.get("cores"))
    except ValueError as e:
        return {"error": str(e)}
    grid = [workers] + [w for w in (2**k for k in range(1, 11)) if w > workers]
    step_s = {name: [fit.step_s(c, w) for w in grid] for name, c in configs.items()}
    speed = {name: fit.throughput(c, workers) for name, c in configs.items()}
    winner, runner = sorted(speed, key=speed.__getitem__, reverse=True)[:2]
    overtaken = _overtaken(fit, configs, winner, workers)
    rate = costmodel.link_crossover(fit, configs[winner], configs[runner], workers)
    above = rate and max((winner, runner), key=lambda n: fit.throughput(configs[n], workers, 2 * rate))
    out = {
        "fit": {
            "compute_s_per_sample": fit.compute_s_per_sample,
            "s_per_byte": fit.s_per_byte,
            "latency_s": fit.latency_s,
            "step_overhead_s": fit.step_overhead_s,
            "pinned_at_zero": list(fit.pinned),
            "runs": [r["name"] for r in runs if r["name"] in configs],
            "residuals": list(fit.residuals),
            "max_rel_error": fit.max_rel_error,
        },
        "model": sizes,
        "link": meta.get("link"),
        "workers": grid,
        "step_s": step_s,
        "samples_per_s": {name: [w * c.batch / t for w, t in zip(grid, step_s[name])] for name, c in configs.items()},
        "winner": winner,
        "runner_up": runner,
        "overtaken_at": overtaken,
        "leader_at_max": _leader(fit, configs, MAX_WORKERS),
        "link_crossover": rate
        and {"bytes_per_s": rate, "faster_above": above, "faster_below": runner if above == winner else winner},
        "overtaken_at_if_latency_per_message": None
        if per_message is fit
        else _overtaken(per_message, configs, winner, workers),
    }
    out["verdict"] = verdict(out, fit, meta, left_out=[r["name"] for r in runs if r["mode"] != "sync"])
    return out


_RING = next(t.name for t in STRATEGIES.values() if not t.servers and t.tables is Tables.REPLICATED)
"""The strategy whose every parameter goes round the ring (allreduce): a run's dense part under DDP."""


def _tables(run: dict) -> Tables:
    """Where the strategy of `run` (a report.json run) trains the tables."""
    return traits(run["strategy"]).tables


def _dense_on_servers(run: dict) -> bool:
    """Whether the strategy of `run` trains the dense layers on the servers (ps): its compute split is the
    worker's compute alone, and its pieces are its own plan's."""
    return traits(run["strategy"]).dense is Dense.SERVERS


def fitted(
    runs: list[dict], workers: int, cores: int | None
) -> tuple[costmodel.Fit, dict[str, costmodel.Config], dict, costmodel.Fit]:
    """The fit on a compare's finished sync runs (report.json's "runs", all at W = `workers` on a machine of
    `cores` cores), the cost model's config of each by run name, the sizes they share, and the fit with its
    latency per message. When every run exchanged the same number of messages the first has that latency
    as a fixed cost per step (`costmodel.latency_per_step`), else the two are the same. Raises ValueError
    saying why not."""
    configs, sizes = _configs(runs, workers)
    measured = [
        costmodel.Run(
            configs[r["name"]],
            workers,
            r["step_s"],
            cores=cores,
            compute_s=r["compute_s"] if _dense_on_servers(r) else None,
        )
        for r in runs
        if r["name"] in configs
    ]
    try:
        per_message = costmodel.fit(measured)
    except ValueError as e:
        raise ValueError(
            f"{e}. At one W, a compare needs a finished ps sync run (its compute split separates "
            "compute from latency) and runs that move different bytes (allreduce next to ps, "
            "--servers 1,2, or --compressions none,fp16)"
        ) from None
    if len({costmodel.traffic(c, workers)[1] for c in configs.values()}) > 1:
        return per_message, configs, sizes, per_message
    return costmodel.latency_per_step(per_message), configs, sizes, per_message


def _leader(fit: costmodel.Fit, configs: dict[str, costmodel.Config], workers: int) -> str:
    return max(configs, key=lambda n: fit.throughput(configs[n], workers))


def _overtaken(fit: costmodel.Fit, configs: dict[str, costmodel.Config], winner: str, workers: int) -> dict | None:
    """The first W above `workers` where another config is faster than `winner`, and the fastest there."""
    w = min(
        (
            w
            for name in configs
            if name != winner
            and (w := costmodel.crossover(fit, configs[winner], configs[name], None, MAX_WORKERS, workers))
        ),
        default=None,
    )
    return None if w is None else {"workers": w, "by": _leader(fit, configs, w)}  # w: None or a W above 0


def _configs(runs: list[dict], workers: int) -> tuple[dict[str, costmodel.Config], dict]:
    """The cost model's config of every finished sync run, by run name, and the sizes they share."""
    done = [r for r in runs if "error" not in r and r.get("steps") and r["mode"] == "sync"]
    if len(done) < 2:
        raise ValueError(
            f"{len(done)} sync run(s) finished ({', '.join(r['name'] for r in done) or 'none'}): "
            "the verdict compares paradigms, so it needs at least 2, e.g. --strategies allreduce,ps "
            "--modes sync"
        )
    # the servers know what they serve: a ps or hybrid run's sizes, else any run's
    model = next(
        (r["model"] for r in sorted(done, key=lambda r: _tables(r) is Tables.REPLICATED) if r.get("model")), None
    )
    if model is None:
        raise ValueError(
            "the runs logged no model sizes (the Trainer logs them under gradsync compare): "
            "build a gradsync.Trainer in the script"
        )
    batch = next((r["batch"] for r in done if r.get("batch")), None)
    sizes = {**model, "batch": batch or 1, "batch_logged": batch is not None, "row_bytes": 0}
    if model["tables"]:
        served = [r for r in done if _tables(r) is Tables.SERVED] or [r for r in done if _tables(r) is Tables.SHARDED]
        if not served:
            raise ValueError(
                "the model has embedding tables, and no ps, hybrid or sharded run measured the rows a "
                "worker moves per step: add --strategies ps, hybrid or sharded"
            )
        sizes["row_bytes"] = round(statistics.median(_rows_received(r, model, workers) for r in served))
    configs = {}
    for r in done:
        piece = (r.get("model") or {}).get("largest_piece", 0) if _dense_on_servers(r) else 0  # its own plan's
        config = costmodel.Config(
            r["strategy"],
            sizes["batch"],
            model["dense"],
            servers=r["servers"],
            compression=r["compression"],
            piece=piece,
        )
        sparse = (r.get("model") or {}).get("sparse_tables", 0)
        if sparse and workers > 1:  # the tables' rows are all-gathered: this run's own rows, measured
            rows = max(0.0, r["bytes_sent"] - costmodel.traffic(config, workers)[0]) / (workers - 1)
            configs[r["name"]] = dataclasses.replace(config, sparse_tables=sparse, row_bytes=round(rows))
            continue
        configs[r["name"]] = dataclasses.replace(
            config,
            tables=model["tables"],
            row_bytes=0 if _tables(r) is Tables.REPLICATED else sizes["row_bytes"],
            sharded_tables=(r.get("model") or {}).get("sharded_tables", 0) if _tables(r) is Tables.SHARDED else 0,
        )
    return configs, sizes


def _rows_received(run: dict, model: dict, workers: int) -> float:
    """Bytes of table rows a ps, hybrid or sharded worker looks up per step, from what it received beyond the
    dense part: a sharded worker's count holds the rows of its lookups and about as many gradient bytes
    (rows and their ids) that it receives as an owner, so half of it."""
    rows = max(0.0, run["bytes_received"] - _dense_received(run, model, workers))
    return rows / 2 if _tables(run) is Tables.SHARDED else rows


def _dense_received(run: dict, model: dict, workers: int) -> float:
    """Bytes a ps, hybrid or sharded worker receives per step for the dense part: the fp32 weights (ps), its
    share of the ring (hybrid, sharded)."""
    if _dense_on_servers(run):
        return costmodel.FP32 * model["dense"]
    ring = costmodel.Config(_RING, 1, model["dense"], compression=run["compression"])
    return costmodel.traffic(ring, workers)[0]


def verdict(prediction: dict, fit: costmodel.Fit, meta: dict, left_out: list[str]) -> str:
    """Plain sentences: the winner at this W and link, where it is overtaken, how far to trust it."""
    workers, winner, runner = meta["workers"], prediction["winner"], prediction["runner_up"]
    step = {name: times[0] for name, times in prediction["step_s"].items()}  # the grid starts at the measured W
    where = f"the emulated {meta['link']} link" if meta.get("link") else "loopback"
    text = [
        f"At W = {workers} on {where}, {winner} wins: {1000 * step[winner]:.1f} ms per step predicted, "
        f"{step[runner] / step[winner]:.2f}x faster than {runner}."
    ]
    over = prediction["overtaken_at"]
    if over is None:
        text.append(f"No other run of this compare overtakes it: no crossover up to W = {MAX_WORKERS}.")
    else:
        text.append(
            f"The crossover is at W = {over['workers']}, where {over['by']} overtakes it; at "
            f"W = {MAX_WORKERS} {prediction['leader_at_max']} leads."
        )
    cross = prediction["link_crossover"]
    if cross:
        text.append(
            f"At W = {workers}, {cross['faster_above']} is faster on links above "
            f"{_gbit(cross['bytes_per_s'])} and {cross['faster_below']} below."
        )
    if prediction["fit"]["step_overhead_s"]:
        text.append(_fixed_cost(prediction, fit))
    if fit.s_per_byte > 0:
        nominal = f" against the link's nominal {_gbit(_nominal(meta))}" if meta.get("link") else ""
        text.append(f"The fitted cost per byte is {_gbit(1 / fit.s_per_byte)}{nominal}.")
    if not prediction["model"]["batch_logged"]:
        text.append("The script logs no samples per step (gradsync.log(samples=...)): compute is per step.")
    if left_out:
        text.append(
            f"Left out of the fit and the verdict: {', '.join(left_out)} (their steps apply stale "
            "gradients, so their speed is not the same progress)."
        )
    return " ".join(text + [costmodel.confidence(fit, _doubts(fit, meta))])


def _nominal(meta: dict) -> float:
    """The emulated link's rate in bytes/s."""
    return Link.parse(meta["link"]).bits_per_s / 8


def _fixed_cost(prediction: dict, fit: costmodel.Fit) -> str:
    """The sentence on the fixed cost per step, and what a latency per message would make of it."""
    messages = costmodel.traffic(fit.runs[0].config, fit.runs[0].workers)[1]
    text = (
        f"Every fitted run exchanged {messages} messages per step, so the {1000 * fit.step_overhead_s:.3g} ms "
        "they cost beyond compute and bytes is taken as a fixed cost per step;"
    )
    other = prediction["overtaken_at_if_latency_per_message"]
    if other is None:
        return text + " were it a latency per message (a ring's 2 (W-1) messages), still no crossover up to W = 1024."
    return (
        text + f" were it a latency per message (a ring's 2 (W-1) messages), the crossover would be at "
        f"W = {other['workers']} ({other['by']})."
    )


def _doubts(fit: costmodel.Fit, meta: dict) -> list[tuple[str, str]]:
    """What weakens the prediction beyond the fit's residuals, as (highest grade it allows, why): loopback,
    time-sliced cores, a straggler, a cost per byte far from the link's."""
    out = []
    if not meta.get("link"):
        out.append(
            (
                "low",
                "the runs were on loopback, where the cost per byte is memory copies by the same CPUs, "
                "not a network, so this prediction is for loopback only (measure with --link RATE for "
                "a network)",
            )
        )
    cores = meta.get("cores") or 0
    sliced = [r for r in fit.runs if r.workers + r.config.servers > cores]
    if cores and sliced:
        out.append(
            (
                "low",
                f"{len(sliced)} of the {len(fit.runs)} fitted runs had more processes (workers + "
                f"servers) than this machine's {cores} cores: time-sliced, their compute and "
                "communication competed for CPU as they would not on separate machines (the fit "
                "divides out workers computing at once, W / cores, not the rest)",
            )
        )
    if meta.get("straggler"):
        out.append(
            (
                "moderate",
                "a straggler slowed every run and the model has no straggler term: its waits count as communication",
            )
        )
    if meta.get("link") and fit.s_per_byte > 0 and not 0.5 <= _nominal(meta) * fit.s_per_byte <= 2:
        out.append(
            (
                "moderate",
                f"the fitted cost per byte ({_gbit(1 / fit.s_per_byte)}) is more than 2x off the "
                f"link's nominal {_gbit(_nominal(meta))}, so the bytes the model counts are not "
                "what the link carried",
            )
        )
    return out


def _gbit(bytes_per_s: float) -> str:
    return f"{8 * bytes_per_s / 1e9:.3g} Gbit/s"


def percent(fraction: float) -> str:
    """A signed whole percentage, never '-0%': a residue such as -1e-17 is '+0%'."""
    return f"{round(100 * fraction):+d}%"


def markdown(prediction: dict) -> list[str]:
    """report.md's closing section: the verdict, the predicted step times by W, the fit."""
    lines = ["## Verdict (cost model, `--predict`)", ""]
    if "error" in prediction:
        return lines + [f"No prediction: the cost model could not be fitted on these runs. {prediction['error']}"]
    names = list(prediction["step_s"])
    fitted = prediction["fit"]
    lines += [
        prediction["verdict"],
        "",
        f"Predicted ms per step at {prediction['link'] or 'loopback'} (each worker on its own machine):",
        "",
        "| W | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for i, w in enumerate(prediction["workers"]):
        lines.append(f"| {w} | " + " | ".join(f"{1000 * prediction['step_s'][n][i]:.1f}" for n in names) + " |")
    residuals = ", ".join(f"{n} {percent(r)}" for n, r in zip(fitted["runs"], fitted["residuals"]))
    fixed = (
        f"{1e3 * fitted['step_overhead_s']:.3g} ms fixed per step"
        if fitted["step_overhead_s"]
        else f"{1e3 * fitted['latency_s']:.3g} ms per message"
    )
    lines += [
        "",
        f"Fit: {1e6 * fitted['compute_s_per_sample']:.3g} us per sample, {1e9 * fitted['s_per_byte']:.3g} "
        f"ns per byte, {fixed}; predicted / measured - 1 on the fitted runs: {residuals}.",
    ]
    return lines
