"""`gradsync compare`: the grid, gradsync.log, and a report whose numbers come from the runs."""
import json
import math
import os
import statistics
import time

import pytest

import gradsync
from gradsync.compare import costmodel
from gradsync.compare.grid import Config, grid
from gradsync.compare.predict import fitted, markdown, percent, predict
from gradsync.compare.runner import headline, read_log
from gradsync.core.settings import STRAGGLER, TENSORBOARD_DIR
from helpers import NOISE, SUPPORT, check_timeline_order, run_cli, spinning_on_one_cpu
from jobs import make_mlp


def test_grid_covers_what_each_strategy_means():
    names = [c.name for c in grid(["allreduce", "ps", "hybrid", "sharded"], [1, 2], ["sync", "async"],
                                  ["none", "int8"])]
    assert names == ["allreduce", "allreduce int8",
                     "ps sync S=1", "ps sync S=2", "ps async S=1", "ps async S=2",
                     "ps sync S=1 int8", "ps sync S=2 int8", "ps async S=1 int8", "ps async S=2 int8",
                     "hybrid S=1", "hybrid S=2", "hybrid S=1 int8", "hybrid S=2 int8", "sharded", "sharded int8"]
    assert Config("sharded", compression="int8").settings() == dict(strategy="sharded", mode="sync", servers=0,
                                                                     compression="int8")
    assert Config("ps", "async", 2, "fp16").slug == "ps_async_S2_fp16"
    with pytest.raises(ValueError, match="unknown strategy 'dp'"):
        grid(["dp"], [1], ["sync"], ["none"])
    with pytest.raises(ValueError, match=r"--servers \[0\]"):
        grid(["ps"], [0], ["sync"], ["none"])


def test_log_refuses_what_is_not_a_finite_number_and_writes_nothing_outside_compare(monkeypatch):
    monkeypatch.delenv("GRADSYNC_LOG_DIR", raising=False)
    gradsync.log(loss=1.0)  # no GRADSYNC_LOG_DIR: nothing to write, no error
    for bad in (float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"gradsync.log\(loss="):
            gradsync.log(loss=bad)


def test_headline_is_the_exception_line():
    text = "rank 2 (worker1) failed with exit code 1:\nTraceback ...\n  File x\nValueError: no tables here\n"
    assert headline(text) == "ValueError: no tables here"
    assert headline("rank 0 (ps0) was killed") == "rank 0 (ps0) was killed"


def test_a_log_line_cut_short_is_left_out(tmp_path):
    log = tmp_path / "worker-0.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')  # a rank killed in the middle of its line
    assert read_log(log) == [{"step": 1, "loss": 0.5}] and read_log(tmp_path / "none.jsonl") == []


def test_every_committed_step_gets_its_whole_line_whether_or_not_the_script_logs(tmp_path, monkeypatch):
    from gradsync.compare.runner import measure
    from gradsync.metrics import scalars
    from gradsync.metrics.step_metrics import StepMetrics

    monkeypatch.setenv("GRADSYNC_LOG_DIR", str(tmp_path))
    monkeypatch.setattr(scalars, "CURRENT", scalars.WorkerLog(worker=1))
    metrics = StepMetrics()
    scalars.watch(metrics, {"dense": 10, "tables": 0})
    for step in range(1, 4):
        metrics.pulled(0.0, 100)
        metrics.committed(time.perf_counter(), 40)
        metrics.sent_after_commit(2)  # what hybrid sends after the dense step's commit counts in that step
        if step == 2:
            gradsync.log(loss=0.5)
    written = read_log(tmp_path / "worker-1.jsonl")
    # a step's line waits until the step is whole: the next commit or the script's next gradsync.log
    assert [line.get("step", "model") for line in written] == ["model", 1, 2, 2]
    scalars.flush()  # leaving the job (cluster.set_running(None)) or failing
    lines = read_log(tmp_path / "worker-1.jsonl")
    assert [line.get("step", "model") for line in lines] == ["model", 1, 2, 2, 3]
    steps = [line for line in lines if "record" in line]
    assert [(r["record"]["bytes_sent"], r["record"]["bytes_received"]) for r in steps] == [(42, 100)] * 3
    assert lines[3] == {"t": lines[3]["t"], "wall": lines[3]["wall"], "step": 2, "loss": 0.5}
    run = measure([lines], _Idle(), 1)
    assert run["steps"] == 3 and run["logged"] == ["loss"] and run["bytes_per_step"] == 142
    assert run["curve"] == [(lines[3]["t"], 2, 0.5)] and run["first_step"] == 2 and run["samples_per_s"] is None


@pytest.mark.job
@pytest.mark.timeout(240)
def test_compare_report_numbers_come_from_the_runs(tmp_path):
    out = tmp_path / "report"
    done = run_cli("compare", "--out", str(out), "--strategies", "allreduce,ps,hybrid", "--servers", "1", "--modes",
                   "sync,async", "--predict", "--timeline", os.path.join(SUPPORT, "compare_script.py"), timeout=230,
                   without=("TORCH_CPP_LOG_LEVEL",))  # gradsync must set it itself
    assert done.returncode == 0, done.stderr[-3000:]
    # make run's compare (allreduce and ps, sync and async) prints nothing a user cannot act on, and hybrid on a
    # model without tables is skipped without the refused ranks' tracebacks
    assert NOISE.findall(done.stdout + done.stderr) == [], done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["allreduce", "ps sync S=1", "ps async S=1", "hybrid S=1"]
    assert sum(runs["ps async S=1"]["staleness"].values()) == 2 * 10  # every applied push, from the server's counters
    assert runs["ps sync S=1"]["staleness"] == {} and runs["allreduce"]["staleness"] == {}
    assert not (out / "runs" / "ps_async_S1" / "job").exists()  # the job's token files are gone
    assert runs["hybrid S=1"]["skipped"] == "no tables" and "error" not in runs["hybrid S=1"]  # the MLP has none
    logs = {}
    for name in ("allreduce", "ps sync S=1"):
        run = runs[name]
        slug = Config(run["strategy"], run["mode"], run["servers"]).slug
        logs[name] = [read_log(out / "runs" / slug / f"worker-{w}.jsonl") for w in (0, 1)]
        log = logs[name][0]
        losses = [line["loss"] for line in log if "loss" in line]
        assert run["steps"] == len(losses) == 10 and run["warmup_steps"] == 1
        assert run["final_loss"] == pytest.approx(statistics.fmean(losses[-1:]))  # the last tenth of 10 losses
        assert run["accuracy"] == 0.5  # worker 0's last acc
        records = [line["record"] for line in log if "record" in line][1:]  # the first step is warm-up
        assert run["commit_s"] == pytest.approx(statistics.median(r["commit_s"] for r in records))
        assert run["bytes_per_step"] > 0 and run["worker_peak_mb"] > 100
        # measured over the same steps, or NaN where the ranks ended within a sampling interval of the last step
        # (what they ran after the last sample went unseen), never a made-up 0
        cpu, wait = run["cpu_s_per_step"], run["cpu_wait_s_per_step"]
        assert (cpu > 0 and 0 <= wait < 60) or (math.isnan(cpu) and math.isnan(wait)), (cpu, wait)
        # samples/s: each worker's 9 steps after the first, 6 samples each, over its time since the first
        stepped = [[line for line in worker if "loss" in line] for worker in logs[name]]
        assert run["samples_per_s"] == pytest.approx(sum(9 * 6 / (w[-1]["t"] - w[0]["t"]) for w in stepped))
    assert runs["ps sync S=1"]["server_peak_mb"] > 100 and runs["allreduce"]["server_peak_mb"] == 0
    assert runs["allreduce"]["curve"] and [c[2] for c in runs["allreduce"]["curve"]] == pytest.approx(
        [c[2] for c in runs["ps sync S=1"]["curve"]], abs=1e-5)  # the same math, step by step
    for png in ("loss.png", "step_time.png", "bytes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / png).stat().st_size > 5000
    md = (out / "report.md").read_text()
    assert md.startswith(f"# gradsync compare: gradsync compare --out {out} --strategies allreduce,ps,hybrid "
                         "--servers 1 --modes sync,async --predict ")
    assert "Options: --workers 2, --out " in md and "--compressions none, --warmup-steps 1," in md
    assert "| allreduce |" in md and "| ps sync S=1 |" in md and "| hybrid S=1 | skipped: no tables |" in md
    assert "- final loss: the mean of the last tenth of worker 0's logged losses" in md and "![loss.png]" in md
    # --predict: fitted on the two sync runs that finished, from what their workers logged
    assert runs["allreduce"]["model"] == {"dense": 484, "tables": 0, "sparse_tables": 0, "dense_tables": 0}
    assert "Note: allreduce averaged" not in md
    # the jobs.py MLP 8-16-16-4, one piece under the 25 MB bucket cap
    assert runs["ps sync S=1"]["model"] == {"dense": 484, "tables": 0, "largest_piece": 484}
    assert runs["allreduce"]["batch"] == runs["ps sync S=1"]["batch"] == 6  # 6 samples per step
    prediction = report["prediction"]
    assert prediction["fit"]["runs"] == list(prediction["step_s"]) == ["allreduce", "ps sync S=1"]
    assert prediction["workers"] == [2 ** k for k in range(1, 11)]
    for name, residual in zip(prediction["fit"]["runs"], prediction["fit"]["residuals"]):
        assert prediction["step_s"][name][0] == pytest.approx(runs[name]["step_s"] * (1 + residual))  # measured
    winner = prediction["winner"]
    assert {winner, prediction["runner_up"]} == {"allreduce", "ps sync S=1"}
    # the winner is the fitted run predicted fastest at W = 2 (from the step times checked above)
    assert winner == min(("allreduce", "ps sync S=1"), key=lambda n: prediction["step_s"][n][0])
    verdict = md[md.index("## Verdict"):]
    assert verdict.split("\n\n")[1].startswith(
        f"At W = 2 on loopback, {winner} wins: {1000 * prediction['step_s'][winner][0]:.1f} ms")
    assert "Left out of the fit and the verdict: ps async S=1" in verdict and "| 1024 | " in verdict
    # 2 step times and 1 compute split for 3 parameters, on loopback: one confidence, low, for both reasons
    assert verdict.count("Confidence is") == 1 and "Confidence is low: the fit is exactly determined by 3 " in verdict
    assert "the runs were on loopback" in verdict
    # --timeline: each sync run's median step, drawn; its pieces carry the gradients, each in order
    assert (out / "timeline.png").stat().st_size > 0 and "timeline.png" in md
    gradients = 4 * sum(p.numel() for p in make_mlp().parameters())
    for name in ("allreduce", "ps sync S=1"):
        pieces = runs[name]["timeline"]["pieces"]
        assert sum(p["bytes_sent"] for p in pieces) == gradients, name  # W = 2, no buffers
        check_timeline_order(pieces)


@pytest.mark.job
@pytest.mark.timeout(240)
def test_compare_measures_a_script_that_never_logs_and_exits_non_zero_when_a_run_fails(tmp_path):
    out = tmp_path / "report"
    done = run_cli("compare", "--out", str(out), "--strategies", "allreduce,ps", "--servers", "1", "--modes", "sync",
                   os.path.join(SUPPORT, "compare_script.py"), "--quiet", "--fail-under", "ps", timeout=230)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "gradsync: 1 of 2 runs failed (ps sync S=1): their errors are in " in done.stderr
    runs = {r["name"]: r for r in json.loads((out / "report.json").read_text())["runs"]}
    # no gradsync.log call: the step figures still come from the Trainer's own step records
    quiet = runs["allreduce"]
    assert quiet["logged"] == [] and quiet["steps"] == 10 and quiet["worker_steps"] == [10, 10]
    assert quiet["step_s"] > 0 and quiet["compute_s"] > 0 and quiet["bytes_per_step"] > 0
    assert quiet["first_step"] == 1 and quiet["model"]["dense"] == 484 and quiet["worker_peak_mb"] > 100
    assert quiet["curve"] == [] and quiet["final_loss"] is None and quiet["samples_per_s"] is None
    cpu = quiet["cpu_s_per_step"]  # over the Trainer's steps; NaN where the ranks ended within a sampling interval
    assert cpu > 0 or math.isnan(cpu), cpu
    log = read_log(out / "runs" / "allreduce" / "worker-0.jsonl")
    assert [line["step"] for line in log if "record" in line] == list(range(1, 11))
    assert sorted(p.name for p in out.glob("*.png")) == ["bytes.png", "step_time.png"]  # no loss to draw
    warning = ("the script logs no loss, samples or acc with gradsync.log, so the report has no final loss and "
               "loss.png, samples/s or accuracy (its step times, bytes, CPU and memory come from the Trainer "
               "itself): call gradsync.log(loss=loss.item(), samples=len(x)) once per step in the training loop "
               "and gradsync.log(acc=accuracy) once after training")
    assert done.stderr.count(warning) == 1 and "No artists with labels" not in done.stderr
    md = (out / "report.md").read_text()
    assert md.count("the script logs no") == 1 and f"Warning: {warning}." in md
    assert "| ps sync S=1 | failed: RuntimeError: compare_script.py fails" in md
    assert "Fastest step: allreduce" in md and "![step_time.png]" in md


# A job whose runs a known cost model made: 32 samples per step at 1 ms each, 100 MB/s, 1 ms per message,
# 10,000 dense elements (40 KB). At W = 2 every run exchanges 2 messages, so the fit sees their 2 ms as a fixed
# cost per step: allreduce 0.032 + 8e-4 (W-1)/W + 2e-3 s, ps S=2 0.032 + 4e-4 W + 2e-3, ps S=1
# 0.032 + 8e-4 W + 2e-3. Allreduce wins at every W (34.4 ms at W = 2, ps S=2 34.8); with the latency per
# message (a ring's 2 (W-1)) ps S=2 would overtake it at W = 3 (35.2 ms against 36.5).
MADE = costmodel.Fit(compute_s_per_sample=1e-3, s_per_byte=1e-8, latency_s=1e-3, runs=(), residuals=())
DENSE = 10_000


def made_run(strategy: str, servers: int = 0, mode: str = "sync", compression: str = "none", tables: int = 0,
             rows: int = 0, **extra) -> dict:
    """A report.json run at W = 2 as MADE predicts it (`rows`: bytes of table rows a ps or hybrid worker
    pulls per step). Allreduce's compute split holds its whole step, as under DDP, whose allreduce runs
    inside the backward: the fit must not take it for compute."""
    rows = 0 if strategy == "allreduce" else rows
    config = costmodel.Config(strategy, 32, DENSE, tables=tables, row_bytes=rows, servers=servers,
                              compression=compression)
    step = MADE.step_s(config, 2)
    ring = costmodel.traffic(costmodel.Config("allreduce", 1, DENSE, compression=compression), 2)[0]
    received = {"ps": 4 * DENSE, "hybrid": ring}.get(strategy, ring) + rows  # what the worker's metrics count
    return {"name": Config(strategy, mode, servers, compression).name, "strategy": strategy, "mode": mode,
            "servers": servers, "compression": compression, "steps": 10, "step_s": step,
            "compute_s": 0.032 if strategy == "ps" else step, "batch": 32, "model": {"dense": DENSE, "tables": tables},
            "bytes_received": received, **extra}


def test_predict_fits_the_runs_and_names_the_faster_paradigm():
    runs = [made_run("allreduce"), made_run("ps", 1), made_run("ps", 2), made_run("ps", 1, mode="async")]
    got = predict(runs, {"workers": 2, "cores": 64, "link": None})
    assert got["fit"]["compute_s_per_sample"] == pytest.approx(1e-3, rel=1e-9)
    assert got["fit"]["s_per_byte"] == pytest.approx(1e-8, rel=1e-9)
    assert got["fit"]["latency_s"] == 0 and got["fit"]["step_overhead_s"] == pytest.approx(2e-3, rel=1e-9)
    assert got["fit"]["runs"] == ["allreduce", "ps sync S=1", "ps sync S=2"]  # async left out
    assert got["workers"] == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for name, w, expected in (("allreduce", 2, 0.0344), ("ps sync S=2", 2, 0.0348), ("ps sync S=1", 4, 0.0372),
                              ("allreduce", 1024, 0.032 + 8e-4 * 1023 / 1024 + 2e-3)):
        assert got["step_s"][name][got["workers"].index(w)] == pytest.approx(expected, rel=1e-9)
    assert got["samples_per_s"]["allreduce"][0] == pytest.approx(2 * 32 / 0.0344, rel=1e-9)
    first = {name: times[0] for name, times in got["step_s"].items()}
    assert got["winner"] == min(first, key=first.get) == "allreduce" and got["runner_up"] == "ps sync S=2"
    assert got["overtaken_at"] is None and got["leader_at_max"] == "allreduce"
    assert got["overtaken_at_if_latency_per_message"] == {"workers": 3, "by": "ps sync S=2"}
    assert got["link_crossover"] is None  # at W = 2 ring and 2 servers move 40 and 80 KB after equal fixed costs
    assert got["verdict"].startswith(
        "At W = 2 on loopback, allreduce wins: 34.4 ms per step predicted, 1.01x faster than ps sync S=2. "
        "No other run of this compare overtakes it: no crossover up to W = 1024. Every fitted run exchanged 2 "
        "messages per step, so the 2 ms they cost beyond compute and bytes is taken as a fixed cost per step; "
        "were it a latency per message (a ring's 2 (W-1) messages), the crossover would be at W = 3 (ps sync S=2). "
        "The fitted cost per byte is 0.8 Gbit/s. Left out of the fit and the verdict: ps async S=1")
    # one confidence: the residuals alone would make it high; loopback makes it low, and it says both
    assert got["verdict"].endswith(
        "Confidence is low: the model reproduces its 3 fitted runs within 0% (max relative error); the runs were on "
        "loopback, where the cost per byte is memory copies by the same CPUs, not a network, so this prediction is "
        "for loopback only (measure with --link RATE for a network). Fitted at W = 2; anything else is an "
        "extrapolation.")
    assert "time-sliced" not in got["verdict"]
    sliced = predict(runs, {"workers": 2, "cores": 2, "link": "1gbit"})["verdict"]
    assert sliced.count("Confidence is") == 1 and "Confidence is low: " in sliced
    assert "; 2 of the 3 fitted runs had more processes (workers + servers) than this machine's 2 cores" in sliced
    section = "\n".join(markdown(got))
    assert section.startswith("## Verdict") and "| 2 | 34.4 | 35.6 | 34.8 |" in section
    assert ("1e+03 us per sample, 10 ns per byte, 2 ms fixed per step; predicted / measured - 1 on the fitted runs: "
            "allreduce +0%, ps sync S=1 +0%, ps sync S=2 +0%.") in section


def test_predict_models_allreduce_with_sparse_tables_from_its_measured_rows():
    """An allreduce run whose tables have sparse gradients: its own rows come from the bytes it sent, and
    the prediction all-gathers them (bytes growing with W) instead of averaging the tables densely."""
    own, tables = 3_000, 1_000_000
    sparse = costmodel.Config("allreduce", 32, DENSE, sparse_tables=2, row_bytes=own)
    ring = costmodel.traffic(costmodel.Config("allreduce", 1, DENSE), 2)[0]
    allreduce = {**made_run("allreduce"), "step_s": MADE.step_s(sparse, 2), "bytes_sent": ring + own,
                 "model": {"dense": DENSE, "tables": tables, "sparse_tables": 2}}
    allreduce["compute_s"] = allreduce["step_s"]
    runs = [allreduce, made_run("ps", 1, tables=tables, rows=5_000), made_run("hybrid", 1, tables=tables, rows=5_000)]
    fit, configs, sizes, _ = fitted(runs, 2, None)
    assert configs["allreduce"] == sparse and sizes["tables"] == tables
    got = predict(runs, {"workers": 2, "cores": 64, "link": None})
    w8 = got["workers"].index(8)
    assert got["step_s"]["allreduce"][w8] == pytest.approx(fit.step_s(sparse, 8), rel=1e-9)
    assert fit.step_s(sparse, 8) > fit.step_s(sparse, 2)  # the rows grow with W


def test_percent_never_prints_minus_zero():
    assert [percent(r) for r in (-1e-17, 0.0, -0.004, -0.006, 0.126, -0.25)] == ["+0%", "+0%", "+0%", "-1%", "+13%",
                                                                                 "-25%"]


def test_predict_keeps_a_latency_per_message_where_the_runs_measure_one_and_takes_rows_from_the_bytes():
    # ps with tables and hybrid exchange 4 and 6 messages at W = 2, allreduce 2: the latency is measured
    runs = [made_run(s, n, tables=1_000_000, rows=5_000) for s, n in (("allreduce", 0), ("ps", 1), ("hybrid", 1))]
    fit, configs, sizes, per_message = fitted(runs, 2, None)
    assert per_message is fit and fit.latency_s == pytest.approx(1e-3, rel=1e-9) and fit.step_overhead_s == 0
    assert configs["ps sync S=1"].row_bytes == configs["hybrid S=1"].row_bytes == sizes["row_bytes"] == 5_000
    assert configs["allreduce"].tables == 1_000_000 and configs["allreduce"].row_bytes == 0
    got = predict(runs, {"workers": 2, "cores": 64, "link": "100mbit"})
    assert got["winner"] == "ps sync S=1" and got["overtaken_at_if_latency_per_message"] is None
    assert "fixed cost per step" not in got["verdict"] and "loopback" not in got["verdict"]
    assert "on the emulated 100mbit link" in got["verdict"]
    assert "The fitted cost per byte is 0.8 Gbit/s against the link's nominal 0.1 Gbit/s." in got["verdict"]
    # residuals alone: high; a cost per byte 8x off the link's: moderate, said once with its reason
    assert got["verdict"].count("Confidence is") == 1 and "Confidence is moderate: the model reproduces its 3 " \
        "fitted runs within 0% (max relative error); the fitted cost per byte (0.8 Gbit/s) is more than 2x off " \
        "the link's nominal 0.1 Gbit/s" in got["verdict"]


def test_predict_says_plainly_why_it_cannot_fit():
    one = predict([made_run("allreduce"), made_run("ps", 1, error="ValueError: x")], {"workers": 2, "cores": 2})
    assert one["error"].startswith("1 sync run(s) finished (allreduce): the verdict compares paradigms")
    no_ps = predict([made_run("allreduce"), made_run("allreduce", compression="fp16")], {"workers": 2, "cores": 2})
    assert "cannot separate compute per sample, cost per byte and latency per message" in no_ps["error"]
    assert "a compare needs a finished ps sync run" in no_ps["error"]
    blind = predict([made_run("allreduce", model=None), made_run("ps", 1, model=None)], {"workers": 2, "cores": 2})
    assert "logged no model sizes" in blind["error"]
    tables = predict([made_run("allreduce", model={"dense": 10, "tables": 10}),
                      made_run("allreduce", compression="fp16", model={"dense": 10, "tables": 10})],
                     {"workers": 2, "cores": 2})
    assert "no ps, hybrid or sharded run measured the rows" in tables["error"]
    assert markdown(no_ps)[-1].startswith("No prediction: the cost model could not be fitted on these runs. ")
    slow = predict([made_run("allreduce"), made_run("ps", 1)],
                   {"workers": 2, "link": "1gbit", "server_link": "100mbit"})
    assert slow["error"].startswith("--server-link 100mbit puts the servers behind another rate")


def test_straggler_sleeps_factor_minus_one_times_its_compute(monkeypatch):
    from gradsync.runtime import straggler

    monkeypatch.setenv(STRAGGLER.env, "1:3.0")
    slept, clock = [], iter([10.0, 10.5, 11.0, 12.0, 12.5])  # built, commit at +0.5 s, ended, next 1 s later, ended
    monkeypatch.setattr(straggler.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    commits = []

    def commit(context_id, scaler):
        commits.append((context_id, scaler))

    slow = straggler.straggler_of(1).slowed(commit)
    slow(7, None)
    slow(8, None)
    assert slept == [pytest.approx(1.0), pytest.approx(2.0)]  # (3 - 1) x 0.5 s, then (3 - 1) x 1 s
    assert commits == [(7, None), (8, None)]
    assert straggler.straggler_of(0) is None  # another worker commits through the strategy's step itself
    monkeypatch.setenv(STRAGGLER.env, "1:1.0")
    assert straggler.straggler_of(1) is None  # a factor of 1 slows nothing
    monkeypatch.delenv(STRAGGLER.env)
    assert straggler.straggler_of(1) is None
    for bad in ("1", "x:2", "1:0.5", "-1:2"):
        with pytest.raises(ValueError, match="straggler"):
            straggler.parse(bad)


META = {"command": "gradsync compare x.py", "options": {"--workers": "4"}, "workers": 4, "warmup_steps": 2,
        "straggler": None, "cores": 64, "most_processes": 4}


def test_report_says_when_runs_were_time_sliced_or_had_a_straggler(tmp_path):
    from gradsync.compare.report import write_report

    _, md = write_report({**META, "straggler": "1:2.0", "cores": 2, "most_processes": 6}, [], [], str(tmp_path))
    text = open(md).read()
    assert "worker 1's compute took 2.0 times as long" in text and "up to 6 processes shared 2 cores" in text


def test_report_explains_every_column_and_the_warm_up_under_the_table(tmp_path):
    from gradsync.compare.report import COLUMNS, write_report

    skipped = {"name": "hybrid S=1", "skipped": "no tables"}
    _, md = write_report(META, [skipped], [], str(tmp_path))
    text = open(md).read()
    assert text.startswith("# gradsync compare: gradsync compare x.py\n\nOptions: --workers 4.\n")
    assert "| hybrid S=1 | skipped: no tables |" in text
    assert "Medians per step of worker 0 after its warm-up: the first 2 steps of every worker" in text
    legend = text[text.index("- run: "):]
    for heading, _, _, _ in COLUMNS:
        assert f"\n- {heading}: " in legend, heading
    assert "No run logged a step to compare." in text  # a skipped run has none


def _finished(name: str, logged=("loss", "samples", "acc")) -> dict:
    return {"name": name, "logged": list(logged), "steps": 0, "warmup_steps": 1, "warmup_t": None, "curve": [],
            "final_loss": None, "step_s": float("nan"), "pull_s": 0.0, "exchange_s": 0.0, "compute_s": 0.0,
            "commit_s": 0.0, "bytes_per_step": 0.0}


def test_the_report_says_once_what_the_script_never_logs_and_plots_what_there_is(tmp_path):
    import warnings

    from gradsync.compare.plots import write_plots
    from gradsync.compare.report import missing, write_report

    measured = {**_finished("allreduce", ()), "steps": 9, "step_s": 0.003, "compute_s": 0.002, "commit_s": 0.001,
                "bytes_per_step": 2048.0}  # the Trainer's step figures, no gradsync.log call
    failed = {**_finished("x", ()), "error": "E: y", "failure": "runs/x/failure.txt", "worker_steps": [0, 0]}
    runs = [measured, _finished("ps sync S=1", ()), failed]
    assert missing(runs) == (
        "the script logs no loss, samples or acc with gradsync.log, so the report has no final loss and loss.png, "
        "samples/s or accuracy (its step times, bytes, CPU and memory come from the Trainer itself): call "
        "gradsync.log(loss=loss.item(), samples=len(x)) once per step in the training loop and "
        "gradsync.log(acc=accuracy) once after training")
    # what some run logged is not missing (a run that logged fewer steps is `uneven`'s); a failed run counts for none
    assert missing([measured, _finished("ps sync S=1", ("loss",)), failed]) == (
        "the script logs no samples or acc with gradsync.log, so the report has no samples/s or accuracy: call "
        "gradsync.log(samples=len(x)) once per step in the training loop and gradsync.log(acc=accuracy) once "
        "after training")
    assert missing([_finished("allreduce"), failed]) is None and missing([failed]) is None
    with warnings.catch_warnings():  # (what a run with steps draws: the compare job tests)
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found" is a warning
        assert write_plots([_finished("ps sync S=1", ()), failed], str(tmp_path), 1) == []  # no step, no loss
    assert not list(tmp_path.glob("*.png"))
    _, md = write_report(META, runs, [], str(tmp_path))
    text = open(md).read()
    assert text.count("the script logs no") == 1 and f"Warning: {missing(runs)}." in text
    assert "Fastest step: allreduce (3.00 ms, median of worker 0)." in text


def test_allreduce_averaging_tables_densely_gets_a_note_naming_sparse_gradients(tmp_path):
    from gradsync.compare.report import dense_tables, write_report

    dense = {**_finished("allreduce"), "strategy": "allreduce",
             "model": {"dense": 10, "tables": 0, "sparse_tables": 0, "dense_tables": 2}}
    sparse = {**dense, "model": {**dense["model"], "dense_tables": 0, "sparse_tables": 2}}
    note = dense_tables([dense, _finished("ps sync S=1")])
    assert note.startswith("allreduce averaged 2 embedding table(s) with dense gradients")
    assert "nn.Embedding(..., sparse=True)" in note and "SGD, Adagrad, SparseAdam" in note
    assert dense_tables([sparse]) is None and dense_tables([_finished("allreduce")]) is None
    _, md = write_report(META, [dense], [], str(tmp_path))
    assert f"Note: {note}." in open(md).read()


def test_hybrid_runs_after_one_that_found_no_tables_are_skipped_without_running(tmp_path, monkeypatch):
    from gradsync.compare import CompareOptions, compare, runner

    started = []

    def fake_run(config, *args, **kwargs):
        started.append(config.name)
        if config.strategy == "hybrid":
            return {"name": config.name, **config.settings(), "skipped": runner.NO_TABLES}
        return {**_finished(config.name), **config.settings()}

    monkeypatch.setattr(runner, "run", fake_run)
    script = tmp_path / "x.py"
    script.write_text("")
    _, runs = compare(CompareOptions(script=str(script), workers=2, out_dir=str(tmp_path / "out"),
                                     strategies=["allreduce", "hybrid", "sharded"], servers=[1, 2], modes=["sync"],
                                     compressions=["none", "int8"], timeout=10, warmup=1, command="c"))
    assert started == ["allreduce", "allreduce int8", "hybrid S=1"]
    assert [(r["name"], r.get("skipped")) for r in runs][2:] == [("hybrid S=1", "no tables"),
                                                                ("hybrid S=2", "no tables"),
                                                                ("hybrid S=1 int8", "no tables"),
                                                                ("hybrid S=2 int8", "no tables"),
                                                                ("sharded", "no tables"),
                                                                ("sharded int8", "no tables")]


def test_the_straggler_goes_to_the_runs_not_into_the_callers_environment(tmp_path, monkeypatch):
    from gradsync.compare import CompareOptions, compare, runner

    monkeypatch.delenv(STRAGGLER.env, raising=False)
    given = []

    def fake_run(config, *args, straggler=None, **kwargs):
        given.append(straggler)
        return {**_finished(config.name), **config.settings()}

    monkeypatch.setattr(runner, "run", fake_run)
    script = tmp_path / "x.py"
    script.write_text("")
    compare(CompareOptions(script=str(script), workers=2, out_dir=str(tmp_path / "out"), strategies=["allreduce", "ps"],
                           servers=[1], modes=["sync"], compressions=["none"], timeout=10, warmup=1, straggler="1:2.0",
                           command="c"))
    assert given == ["1:2.0", "1:2.0"]
    assert STRAGGLER.env not in os.environ


class _Idle:
    """A sampler that saw no process: no memory, no CPU."""

    def peak_mb(self, role: str) -> float:
        return 0.0

    def cpu_between(self, start: float, end: float) -> float:
        return 0.0

    def wait_between(self, start: float, end: float) -> float:
        return 0.0


def test_a_sharded_runs_all_to_all_time_is_its_own_column_and_part_of_the_step():
    from gradsync.compare.report import table
    from gradsync.compare.runner import measure

    parts = [(0.0, 9.0, 9.0, 9.0), (0.0, 0.002, 0.010, 0.001), (0.0, 0.004, 0.012, 0.002), (0.0, 0.003, 0.020, 0.005)]
    log = [{"step": s + 1, "t": float(s), "wall": float(s), "loss": 1.0,
            "record": dict(zip(("pull_s", "exchange_s", "compute_s", "commit_s"), p), bytes_sent=0, bytes_received=0)}
           for s, p in enumerate(parts)]  # the first step is the warm-up
    run = {"name": "sharded", **measure([log], _Idle(), 1)}
    assert run["exchange_s"] == pytest.approx(0.003) and run["compute_s"] == pytest.approx(0.012)
    assert run["step_s"] == pytest.approx(0.003 + 0.012 + 0.002)  # pull + all-to-all + compute + commit
    assert run["timeline"] is None
    header, _, row = table([run]).split("\n")
    cells = dict(zip(header.split(" | "), row.split(" | ")))
    assert cells["all-to-all ms"] == "3.00" and cells["compute ms"] == "12.00" and cells["step ms"] == "17.00"


def test_throughput_leaves_the_warm_up_steps_out():
    from gradsync.compare.runner import samples_per_s

    # worker 0: a 5 s first step, then 3 steps of 8 samples in 1 s each; worker 1 the same at half the speed
    fast = [{"t": t, "samples": 8} for t in (5.0, 6.0, 7.0, 8.0)]
    slow = [{"t": t, "samples": 8} for t in (5.0, 7.0, 9.0, 11.0)]
    assert samples_per_s([fast, slow], 1) == pytest.approx(24 / 3 + 24 / 6)
    assert samples_per_s([fast, slow], 2) == pytest.approx(16 / 2 + 16 / 4)
    assert samples_per_s([fast, slow], 4) is None  # no step after the warm-up
    assert samples_per_s([fast, [{"t": 5.0}, {"t": 6.0}]], 1) is None  # a worker logs no samples


@pytest.mark.job
def test_the_sampler_counts_what_ranks_sharing_a_cpu_waited_for_it():
    from types import SimpleNamespace

    from gradsync.compare.runner import Sampler

    sampler = Sampler(servers=1)
    with spinning_on_one_cpu(2, 0.4) as pids:  # a "server" and a "worker" taking turns on one CPU
        sampler.started([SimpleNamespace(rank=r, proc=SimpleNamespace(pid=pid)) for r, pid in enumerate(pids)])
        start = time.time()
        sampler.sample()
        time.sleep(0.6)
        sampler.sample()
        end = time.time()
        cpu, waited = sampler.cpu_between(start, end), sampler.wait_between(start, end)
    assert sampler.role == {pids[0]: "server", pids[1]: "worker"}
    # both runnable for 0.4 s of wall time on one CPU: 0.8 s runnable together, at most 0.4 s of it running
    # (the bound above leaves room for threads a child forked from this process may start: numpy's BLAS pool)
    assert 0.05 < cpu and 0.3 < waited and cpu + waited < 1.2, (cpu, waited)
    assert sampler.wait_between(end + 1, end + 2) == 0.0  # nothing after the last sample


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> list[tuple[int, object]]:
    """(field number, value) of a protobuf message: varints, doubles, floats and bytes."""
    import struct

    out, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 0:
            value, at = _varint(data, at)
        elif kind == 1:
            value, at = struct.unpack("<d", data[at:at + 8])[0], at + 8
        elif kind == 5:
            value, at = struct.unpack("<f", data[at:at + 4])[0], at + 4
        else:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        out.append((key >> 3, value))
    return out


def test_tensorboard_events_are_tfrecords_of_scalar_summaries(tmp_path, monkeypatch):
    import struct

    from gradsync.metrics import scalars
    from gradsync.metrics import tensorboard

    assert tensorboard.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    monkeypatch.setenv(TENSORBOARD_DIR.env, str(tmp_path))
    monkeypatch.setattr(scalars, "_worker", lambda: 3)
    monkeypatch.setattr(scalars, "CURRENT", scalars.WorkerLog())
    gradsync.log(step=7, loss=0.25, acc=0.5)
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("events.out.tfevents.") and path.name.endswith(".worker3")
    data, events = path.read_bytes(), []
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        body = data[12:12 + length]
        assert (data[12 + length:16 + length] == tensorboard._masked(body)
                and data[8:12] == tensorboard._masked(data[:8]))
        events.append(dict(_fields(body)))
        data = data[16 + length:]
    assert events[0][3] == b"brain.Event:2"
    values = [dict(_fields(v)) for n, v in _fields(events[1][5]) if n == 1]
    assert events[1][2] == 7 and values == [{1: b"loss", 2: 0.25}, {1: b"acc", 2: 0.5}]


def _project(tmp_path) -> str:
    """A working directory holding snapshot_script.py, the jobs.py it imports and notes.txt, as a user's
    project would."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("snapshot_script.py", "jobs.py"):
        (project / name).write_text(open(os.path.join(SUPPORT, name)).read())
    (project / "notes.txt").write_text("before\n")
    return str(project)


def _tree(top: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), top): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(top) for f in files}


@pytest.mark.job
@pytest.mark.timeout(240)
def test_compare_runs_each_run_in_its_own_copy_of_the_working_directory(tmp_path):
    """A script that resumes from the snapshot it finds in its working directory trains every step in every
    run: no run sees what another wrote. The ps run is made to train 2 epochs of 3: it is flagged."""
    import torch

    project = _project(tmp_path)
    before = _tree(project)
    done = run_cli("compare", "--out", "report", "--strategies", "allreduce,ps", "--servers", "1", "--modes", "sync",
                   "snapshot_script.py", "--epochs-under", "ps:2", timeout=230, cwd=project)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(open(os.path.join(project, "report", "report.json")).read())
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["allreduce"]["worker_steps"] == [9, 9] and runs["ps sync S=1"]["worker_steps"] == [6, 6]
    assert runs["allreduce"]["first_step"] == runs["ps sync S=1"]["first_step"] == 0
    for slug, last, epochs in (("allreduce", 2, "allreduce epoch 0\nallreduce epoch 1\nallreduce epoch 2\n"),
                               ("ps_sync_S1", 1, "ps epoch 0\nps epoch 1\n")):
        workdir = os.path.join(project, "report", "runs", slug, "workdir")
        assert torch.load(os.path.join(workdir, "snapshot.pt")) == {"epoch": last}
        model = torch.load(os.path.join(workdir, "model.pt"), weights_only=False)  # the whole module, plain
        assert type(model) is torch.nn.Sequential and not any(vars(m).get("load_state_dict") for m in model.modules())
        assert open(os.path.join(workdir, "notes.txt")).read() == "before\n" + epochs  # its own lines only
        assert open(os.path.join(workdir, "jobs.py")).read() == before["jobs.py"].decode()
    # the working directory is as it was, beside the report; the copy the runs started from is gone
    assert {k: v for k, v in _tree(project).items() if not k.startswith("report" + os.sep)} == before
    assert not os.path.exists(os.path.join(project, "report", ".start-dir"))
    flag = ("ps sync S=1 logged 6 steps, allreduce 9: its final loss and medians cover other steps than the other "
            "runs', so its row does not compare like for like")
    md = open(os.path.join(project, "report", "report.md")).read()
    assert f"Warning: {flag}" in md and flag in done.stderr and "resumed" not in md
    # each run's output under a heading that names it
    headings = [done.stderr.index(f"[{name}] run {i} of 2; its ranks' output follows; its working directory: "
                                  f"{os.path.join('report', 'runs', slug, 'workdir')}")
                for i, (name, slug) in enumerate((("allreduce", "allreduce"), ("ps sync S=1", "ps_sync_S1")), 1)]
    said = [done.stderr.index(f"snapshot_script.py: {s} saved epoch 0") for s in ("allreduce", "ps")]
    assert headings[0] < said[0] < headings[1] < said[1]
    # the ps run, 2 epochs of 3, resumed from its snapshot and whole module: it ends where allreduce's 3 ended
    ps_dir, allreduce_dir = (os.path.join(project, "report", "runs", slug, "workdir") for slug in ("ps_sync_S1",
                                                                                                    "allreduce"))
    resumed = run_cli("run", "--strategy", "ps", "--workers", "2", "--servers", "1", "snapshot_script.py", timeout=60,
                      cwd=ps_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert open(os.path.join(ps_dir, "notes.txt")).read().endswith("ps epoch 1\nps epoch 2\n")
    ends = [torch.load(os.path.join(d, "model.pt"), weights_only=False).state_dict() for d in (ps_dir, allreduce_dir)]
    torch.testing.assert_close(*ends, rtol=1e-5, atol=1e-6)


@pytest.mark.job
@pytest.mark.timeout(240)
def test_a_compare_whose_runs_all_fail_names_the_rank_its_traceback_and_the_steps_logged(tmp_path):
    out = tmp_path / "report"
    done = run_cli("compare", "--out", str(out), "--strategies", "ps", "--servers", "1", "--modes", "sync",
                   os.path.join(SUPPORT, "snapshot_script.py"), "--fail-after", "4", timeout=230)
    assert done.returncode == 1, done.stderr[-3000:]
    (run,) = json.loads((out / "report.json").read_text())["runs"]
    assert run["failed_rank"] == "rank 2 (worker1)" and run["worker_steps"] == [4, 4]
    assert run["failure"] == os.path.join("runs", "ps_sync_S1", "failure.txt")
    failure = (out / run["failure"]).read_text()
    assert "Traceback" in failure and "RuntimeError: snapshot_script.py fails after 4 steps on purpose" in failure
    assert [c[1] for c in run["curve"]] == [0, 1, 2, 3]  # worker 0's losses up to the failure
    md = (out / "report.md").read_text()
    line = (f"- ps sync S=1: rank 2 (worker1) failed: RuntimeError: snapshot_script.py fails after 4 steps on "
            f"purpose; the traceback is in {run['failure']}; steps logged before the failure: worker0 4, worker1 4 "
            "(its loss up to the failure is in loss.png)")
    assert line in md and "No run logged a step to compare" not in md
    assert "No run finished; the failed runs logged steps before they failed" in md
    assert "rank 2 (worker1) failed" in done.stderr and str(out / run["failure"]) in done.stderr
    assert sorted(p.name for p in out.glob("*.png")) == ["loss.png"]  # no empty chart


def test_the_copy_of_the_working_directory_leaves_out_vcs_venvs_and_reports_and_keeps_links_pointing_right(
        tmp_path, monkeypatch):
    from gradsync.compare import MARKER, workdir

    start, outside = tmp_path / "project", tmp_path / "data"
    for d in (start / "sub", start / ".git", start / "venv", start / "old-report", outside):
        d.mkdir(parents=True)
    (start / "train.py").write_text("print('hi')")
    (start / "sub" / "conf.txt").write_text("lr 0.1")
    (start / ".git" / "HEAD").write_text("ref")
    (start / "venv" / "pyvenv.cfg").write_text("home = /usr")
    (start / "old-report" / MARKER).write_text("")
    (outside / "big.bin").write_bytes(b"x" * 2048)
    os.symlink("sub/conf.txt", start / "inside")  # stays relative: it resolves in the copy
    os.symlink("../data", start / "data")  # relative, out of the directory: made absolute
    copy = tmp_path / "copy"
    workdir.snapshot(str(start), str(copy), MARKER)
    assert sorted(os.listdir(copy)) == ["data", "inside", "sub", "train.py"]
    assert os.readlink(copy / "inside") == "sub/conf.txt" and (copy / "inside").read_text() == "lr 0.1"
    assert os.readlink(copy / "data") == str(outside) and (copy / "data" / "big.bin").stat().st_size == 2048
    run = tmp_path / "run"
    workdir.fresh(str(copy), str(run))
    (run / "sub" / "conf.txt").write_text("changed by a run")
    assert (copy / "sub" / "conf.txt").read_text() == "lr 0.1"  # a copy, not a link
    workdir.fresh(str(copy), str(run))
    assert (run / "sub" / "conf.txt").read_text() == "lr 0.1"
    # the script the run starts: its copy when it is inside the directory, else where it is
    monkeypatch.chdir(start)
    assert workdir.script_in("train.py", str(start), str(run)) == "train.py"  # resolves in the run's directory
    assert workdir.script_in(str(start / "train.py"), str(start), str(run)) == str(run / "train.py")
    assert workdir.script_in(str(outside / "big.bin"), str(start), str(run)) == str(outside / "big.bin")
    assert workdir.script_in(str(start / "venv" / "pyvenv.cfg"), str(start), str(run)) == str(
        start / "venv" / "pyvenv.cfg")  # left out of the copy: run where it is
    workdir.check_size(str(start), MARKER, 17 / 2**20)  # train.py and conf.txt: the linked data is not copied
    with pytest.raises(ValueError, match=r"^the working directory .*project holds over 1e-05 MB to copy "
                                         r"\(--copy-limit-mb\): each run of compare works in its own copy"):
        workdir.check_size(str(start), MARKER, 1e-5)


def test_a_run_that_logged_fewer_steps_or_resumed_is_flagged(tmp_path):
    from gradsync.compare.report import missing, uneven, write_report

    full = {**_finished("allreduce"), "steps": 9, "first_step": 0}
    fewer = {**_finished("ps sync S=1"), "steps": 6, "first_step": 0}
    resumed = {**_finished("ps async S=1"), "steps": 9, "first_step": 3}
    nothing = _finished("hybrid S=1", ())
    failed = {**_finished("x"), "error": "E: y", "steps": 1, "first_step": 7, "failure": "f", "worker_steps": [1]}
    assert uneven([full, {**fewer, "steps": 9}, failed]) == []
    flags = uneven([full, fewer, resumed, nothing, failed])
    assert flags == [
        "ps sync S=1 logged 6 steps, allreduce 9: its final loss and medians cover other steps than the other runs', "
        "so its row does not compare like for like (did the script stop early, or resume from a snapshot it found?)",
        "ps async S=1 resumed: its first logged step is 3, not 0, so it continued a training that began before it "
        "and its loss curve starts where that one stopped (a snapshot that was in the working directory when "
        "compare started: every run starts from a copy of that directory)",
        "hybrid S=1 logged 0 steps, allreduce 9: its final loss and medians cover other steps than the other runs', "
        "so its row does not compare like for like (did the script stop early, or resume from a snapshot it found?)"]
    # steps counted by gradsync (from 1): every run that resumed from the same snapshot is flagged
    assert [f.split(":")[0] for f in uneven([{**full, "first_step": 4}, {**resumed, "first_step": 4}])] == [
        "allreduce resumed", "ps async S=1 resumed"]
    assert missing([full, nothing]) is None  # the script calls gradsync.log: the run that logged nothing is flagged
    _, md = write_report(META, [full, fewer], [], str(tmp_path))
    assert f"Warning: {flags[0]}.\n" in open(md).read()


def test_a_second_compare_into_the_same_out_moves_the_earlier_report_aside(tmp_path):
    from gradsync.compare import MARKER, prepare_out_dir

    out = tmp_path / "gradsync-report"
    assert prepare_out_dir(str(out)) is None
    assert prepare_out_dir(str(out)) is None  # only the marker: nothing to keep
    (out / "report.md").write_text("the first")
    os.utime(out / "report.md", (0, 1_700_000_000))
    moved = prepare_out_dir(str(out))
    assert moved == str(out) + "-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(1_700_000_000))
    assert open(os.path.join(moved, "report.md")).read() == "the first" and os.listdir(out) == [MARKER]
    (out / "report.md").write_text("the second")
    os.utime(out / "report.md", (0, 1_700_000_000))
    assert prepare_out_dir(str(out)) == moved + "-2"  # the same second: a name of its own
