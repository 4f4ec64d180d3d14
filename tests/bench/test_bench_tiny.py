"""The benchmarks the other bench tests leave out, each run at its smallest size, so that a module moved or renamed
cannot silently break a benchmark whose figures the docs quote: each writes its JSON to the test's folder (never
into bench/results) with every figure it reports, finite and positive. The analyses of stored results
(costmodel_check.py, costmodel_link.py --refit) and dynamic_index.py run in this process; the others start jobs,
and link.py, linkfloor.py and costmodel_link.py's measuring run need root for their emulated links."""
import contextlib
import io
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, needs_root

BENCH = os.path.join(ROOT, "bench")


def _positive(*numbers) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in numbers)


def _run_here(monkeypatch, script: str, *args: str) -> str:
    """`python bench/SCRIPT ARGS` in this process (with the isolated_imports fixture): its stdout."""
    path = os.path.join(BENCH, script)
    sys.path.insert(0, BENCH)
    monkeypatch.setattr(sys, "argv", [path, *args])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), out.getvalue()
    return out.getvalue()


def _run(script: str, *args: str, timeout: float) -> str:
    """`python bench/SCRIPT ARGS` in a process of its own: its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_costmodel_check_fits_the_stored_sparse_runs_and_predicts_each(isolated_imports, monkeypatch):
    printed = _run_here(monkeypatch, "costmodel_check.py")
    with open(os.path.join(BENCH, "results", "sparse.json")) as f:
        runs = len(json.load(f)["results"])
    fit = re.search(r"fit on the (\d+) W = 2 runs: (\S+) us per sample, (\S+) ns per byte \((\S+) GB/s\), (\S+) ms "
                    r"per message; max relative error on them (\d+)%", printed)
    assert fit and _positive(*(float(x) for x in fit.groups()[:5])), printed
    rows = re.findall(r"^\| (\S+) \| (\d) \| (\w+) \| (\S+) \| (\S+) \| (\S+) \|$", printed, re.MULTILINE)
    assert len(rows) == runs and int(fit.group(1)) == sum(w == "2" for _, w, *_ in rows), printed
    assert all(_positive(*(float(x) for x in (rows_, *figures))) for rows_, _, _, *figures in rows), rows
    low, high = re.search(r"W = 4 \(not fitted\), predicted / measured: (\S+) \.\. (\S+)", printed).groups()
    assert _positive(float(low), float(high)) and float(low) <= float(high)
    crossovers = re.findall(r"W = [24]: hybrid overtakes allreduce from ([\d,]+) table rows", printed)
    assert len(crossovers) == 2 and _positive(*(int(c.replace(",", "")) for c in crossovers)), printed
    assert len(re.findall(r"^R = 1e6: At W = (4|64) .* wins: [\d,]+ samples/s", printed, re.MULTILINE)) == 2, printed


def test_costmodel_link_refit_analyses_the_stored_sessions_and_runs_nothing(isolated_imports, monkeypatch, tmp_path):
    stored = os.path.join(BENCH, "results", "costmodel_link.json")
    out = tmp_path / "costmodel_link.json"
    shutil.copy(stored, out)
    printed = _run_here(monkeypatch, "costmodel_link.py", "--refit", "--out", str(out))
    with open(stored) as f:
        sessions = len(json.load(f)["sessions"])
    result = json.loads(out.read_text())
    assert len(result["sessions"]) == sessions and printed.count("## session ") == sessions
    for session in result["sessions"]:
        assert [r["link"] for r in session["results"]] == list(session["runs"])
        for analysis in session["results"]:
            fit = analysis["fit"]
            assert _positive(fit["compute_s_per_sample"], fit["s_per_byte"]), fit
            assert fit["latency_s"] >= 0 and fit["step_overhead_s"] >= 0, fit
            rows = [r for r in analysis["rows"] if "error" not in r]
            assert rows and all(_positive(r["measured_s"], r["predicted_s"], r["predicted_here_s"],
                                          r["predicted_per_message_s"]) for r in rows), analysis["rows"]


def test_dynamic_index_reports_ids_per_second_for_each_batch(isolated_imports, monkeypatch, tmp_path):
    out, threads = tmp_path / "dynamic_index.json", torch.get_num_threads()
    try:
        printed = _run_here(monkeypatch, "dynamic_index.py", "--ids", "2000", "--batch", "500", "2000", "--dim", "4",
                            "--repeats", "1", "--page-batches", "2", "--out", str(out))
    finally:
        torch.set_num_threads(threads)  # the bench runs on one thread
    result = json.loads(out.read_text())
    assert result["ids"] == 2000 and list(result["batches"]) == ["500", "2000"]
    for figures in result["batches"].values():
        assert list(figures["ids_per_second"]) == ["index_insert", "dict_insert", "index_lookup", "dict_lookup",
                                                   "table_create", "table_resident"]
        assert _positive(*figures["ids_per_second"].values(), figures["insert_vs_dict"], figures["lookup_vs_dict"],
                         figures["index_bytes_per_id"]), figures
        assert figures["insert_vs_dict"] == figures["ids_per_second"]["index_insert"] / \
            figures["ids_per_second"]["dict_insert"]
    assert printed.count("M ids/s") == 2
    pages = result["pages"]
    assert _positive(*pages["probe_ns_per_id"].values()) and pages["buckets"] >= 4000, pages
    assert pages["huge_over_small_speed"] == pages["probe_ns_per_id"]["small"] / pages["probe_ns_per_id"]["huge"]


@pytest.mark.job
@pytest.mark.timeout(120)
def test_step_time_times_ps_against_allreduce(tmp_path):
    out = tmp_path / "step_time.json"
    printed = _run("step_time.py", "--sizes", "0.01", "--workers", "2", "--servers", "1", "--steps", "3",
                   "--repeats", "1", "--out", str(out), timeout=110)
    result = json.loads(out.read_text())
    [row] = result["rows"]
    # DEPTH 4 layers around 256 features, width 18: 256 x 18 + 18, 2 x (18 x 18 + 18), 18 x 256 + 256
    assert (row["params"], row["workers"], row["servers"]) == (10174, 2, 1)
    [ps], [allreduce] = row["ps_step_s"], row["allreduce_step_s"]
    assert _positive(ps, allreduce) and row["ratios"] == [ps / allreduce] == [row["ratio"]]
    assert result["median_ratio"] == row["ratio"] and "W=2 S=1: ps" in printed


@pytest.mark.job
@pytest.mark.timeout(240)
def test_faults_measures_each_policy_on_a_death_and_its_cost_per_step(tmp_path):
    out = tmp_path / "faults.json"
    configs = ["ps wait, death mid-step", "ps drop, death mid-step", "ps S=2 replicas 1, server death mid-step",
               "ps S=2, server death, whole job again from its checkpoint", "allreduce wait, death mid-step"]
    printed = _run("faults.py", "--steps", "4", "--kill-at", "2", "--compute-s", "0", "--repeats", "1",
                   "--checkpoint-every", "1", "--cost-steps", "22", "--configs", *configs, "--out", str(out),
                   timeout=230)
    result = json.loads(out.read_text())
    deaths, cost = result["deaths"], result["step_cost"]
    assert set(deaths) == {*configs, "ps, no death", "ps S=2 replicas 1, no death", "ps S=2, no death",
                           "allreduce, no death"}
    assert all(_positive(row["wall_s"]) and math.isfinite(row["time_lost_s"]) for row in deaths.values())
    for name, row in deaths.items():  # wait and a resume end where the job without the death ends; drop does not
        assert row["same_result"] is ("drop" not in name), name
        assert row["samples_lost"] == (2 * 64 if "drop" in name else 0), name  # worker 1's steps 2 and 3
    assert all(_positive(row["step_ms"], row["wall_step_ms"], row["x_fail"], row["cpu_s_per_step"])
               for row in cost.values())
    assert cost["ps fail"]["x_fail"] == cost["allreduce fail"]["x_fail"] == 1.0 and "allreduce wait" in cost
    replicas = result["replication_cost"]["loopback"]
    assert replicas["replicas 0"]["x_none"] == 1.0 and _positive(replicas["replicas 1"]["x_none"])
    assert "| ps wait, death mid-step |" in printed and "| loopback | 1 |" in printed


@pytest.mark.job
@pytest.mark.timeout(120)
def test_transport_measures_rpc_grpc_and_the_copy_reference(tmp_path):
    out = tmp_path / "transport.json"
    printed = _run("transport.py", "--sizes", "1", "--repeat", "1", "--out", str(out), timeout=110)
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["bytes"] == 1 << 20
    figures = [k for k in row if k.endswith("_MBps") or k.startswith(("grpc_over", "grpc_transport"))]
    assert len(figures) == 9 and _positive(*(row[k] for k in figures), row["ps_work_share"]), row
    median = row["median_s"]
    assert _positive(*median.values()) and set(median) == {"copy", "rpc_echo", "rpc_default_echo", "job_step_s",
                                                          "job_pull_s", "named_pull_push_s", "ps_work_s"}
    assert row["grpc_over_rpc"] == median["rpc_echo"] / median["job_step_s"]
    assert _positive(*result["latency_us"].values()) and set(result["latency_us"]) == {"rpc", "rpc_default", "grpc"}
    assert "| 1 MB |" in printed


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
def test_link_measures_tcp_throughput_through_an_emulated_link(tmp_path):
    out = tmp_path / "link.json"
    printed = _run("link.py", "--rates", "100mbit", "--seconds", "2", "--repeats", "1", "--out", str(out), timeout=80)
    [row] = json.loads(out.read_text())["rows"]
    assert (row["link"], row["configured_bit_s"]) == ("100mbit", 10**8)
    assert _positive(row["achieved_bit_s"], row["ratio"], row["seconds"]) and row["ratios"] == [row["ratio"]]
    assert "Mbit/s achieved (median of 1)" in printed


@pytest.mark.job
@needs_root
@pytest.mark.timeout(150)
def test_linkfloor_sets_each_step_against_its_links_floor(tmp_path):
    out = tmp_path / "linkfloor.json"
    printed = _run("linkfloor.py", "--links", "1gbit", "--configs", "allreduce", "ps_s1", "--repeats", "1", "--steps",
                   "2", "--warmup", "1", "--out", str(out), timeout=140)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["link"], r["workload"], r["workers"], r["config"]) for r in rows] == [
        ("1gbit", "issue", 2, "allreduce"), ("1gbit", "issue", 2, "ps_s1")]
    model = (12288 * 128 + 128 + 128 * 128 + 128 + 128 * 30 + 30) * 4  # the issue workload's fp32 bytes
    # at W = 2 a ring carries 2 (W - 1) / W = 1 model each way on every link; the one server's link W = 2 models
    for row, floor_bytes in zip(rows, (model, 2 * model)):
        assert row["floor_mb"] == pytest.approx(floor_bytes / 1e6)
        assert row["floor_ms"] == pytest.approx(1000 * floor_bytes / (1e9 / 8))
        assert _positive(row["step_ms"], row["ratio"], row["busiest_link_mb"], row["cpu_s_per_step"], *row["ratios"])
        assert row["runqueue_wait_s_per_step"] >= 0 and list(row["parts_ms"]) == ["forward", "backward", "step"]
        assert row["ratio"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    assert printed.count("| 1gbit | issue | 2 |") == 2


@pytest.mark.job
@needs_root
@pytest.mark.timeout(150)
def test_costmodel_link_fits_a_session_of_its_own(tmp_path):
    out = tmp_path / "costmodel_link.json"
    printed = _run("costmodel_link.py", "--workload", "tables", "--links", "1gbit", "--workers", "2", "--steps", "3",
                   "--out", str(out), timeout=140)
    [session] = json.loads(out.read_text())["sessions"]
    [analysis] = session["results"]
    assert analysis["link"] == "1gbit"
    fit = analysis["fit"]
    assert _positive(fit["compute_s_per_sample"]), fit
    # three steps a run: the bytes' time may fall within the noise, and the fit then pins it at zero
    assert fit["s_per_byte"] > 0 or (fit["s_per_byte"] == 0 and "cost per byte" in fit["pinned_at_zero"]), fit
    rows = analysis["rows"]
    assert session["workload"] == "tables"
    assert [(r["workers"], r["name"], r["steps"]) for r in rows] == [
        (2, "allreduce", 3), (2, "ps sync S=1", 3), (2, "sharded", 3)], rows
    for r in rows:
        assert _positive(r["measured_s"], r["predicted_s"], r["predicted_here_s"], r["predicted_per_message_s"],
                         r["bytes_per_step"]), r
        # CPU per step is NaN where the 100 ms samples missed so short a run (compare's rule), else positive
        assert math.isnan(r["cpu_s_per_step"]) or r["cpu_s_per_step"] > 0, r
    assert printed.count("| 1gbit | 2 |") == 3 and f"wrote {out}" in printed
