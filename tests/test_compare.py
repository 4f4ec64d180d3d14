"""`gradsync compare`: the grid, gradsync.log, and a report whose numbers come from the runs."""
import json
import os
import statistics
import subprocess
import sys

import pytest

import gradsync
from gradsync.compare.grid import Config, grid
from gradsync.compare.runner import headline, read_log

HERE = os.path.dirname(os.path.abspath(__file__))


def test_grid_covers_what_each_strategy_means():
    names = [c.name for c in grid(["allreduce", "ps", "hybrid"], [1, 2], ["sync", "async"], ["none", "int8"])]
    assert names == ["allreduce", "allreduce int8",
                     "ps sync S=1", "ps sync S=2", "ps async S=1", "ps async S=2",
                     "ps sync S=1 int8", "ps sync S=2 int8", "ps async S=1 int8", "ps async S=2 int8",
                     "hybrid S=1", "hybrid S=2", "hybrid S=1 int8", "hybrid S=2 int8"]
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


@pytest.mark.timeout(240)
def test_compare_report_numbers_come_from_the_runs(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "compare", "--out", str(out), "--strategies", "allreduce,ps,hybrid",
         "--servers", "1", "--modes", "sync,async", os.path.join(HERE, "compare_script.py")],
        capture_output=True, text=True, timeout=230,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["allreduce", "ps sync S=1", "ps async S=1", "hybrid S=1"]
    assert sum(runs["ps async S=1"]["staleness"].values()) == 2 * 10  # every applied push, from the server's counters
    assert runs["ps sync S=1"]["staleness"] == {} and runs["allreduce"]["staleness"] == {}
    assert not (out / "runs" / "ps_async_S1" / "job").exists()  # the job's token files are gone
    assert "embedding tables" in runs["hybrid S=1"]["error"]  # the MLP has none: recorded, not fatal
    for name in ("allreduce", "ps sync S=1"):
        run = runs[name]
        log = read_log(out / "runs" / Config(run["strategy"], run["mode"], run["servers"]).slug / "worker-0.jsonl")
        losses = [line["loss"] for line in log if "loss" in line]
        assert run["steps"] == len(losses) == 10
        assert run["final_loss"] == pytest.approx(statistics.fmean(losses[-1:]))
        assert run["accuracy"] == 0.5  # worker 0's last acc
        records = [line["record"] for line in log if "loss" in line][1:]
        assert run["commit_s"] == pytest.approx(statistics.median(r["commit_s"] for r in records))
        assert run["bytes_per_step"] > 0 and run["worker_peak_mb"] > 100 and run["cpu_s_per_step"] > 0
    assert runs["ps sync S=1"]["server_peak_mb"] > 100 and runs["allreduce"]["server_peak_mb"] == 0
    assert runs["allreduce"]["curve"] and [c[2] for c in runs["allreduce"]["curve"]] == pytest.approx(
        [c[2] for c in runs["ps sync S=1"]["curve"]], abs=1e-5)  # the same math, step by step
    for png in ("loss.png", "step_time.png", "bytes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / png).stat().st_size > 5000
    md = (out / "report.md").read_text()
    assert "| allreduce |" in md and "| ps sync S=1 |" in md and "failed: ValueError" in md and "![loss.png]" in md


def test_straggler_sleeps_factor_minus_one_times_its_compute(monkeypatch):
    from gradsync import straggler

    monkeypatch.setenv(straggler.ENV, "1:3.0")
    slept, clock = [], iter([10.0, 10.5, 11.0, 12.0])  # built, delay at +0.5 s, committed, delay 1 s later
    monkeypatch.setattr(straggler.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    slow = straggler.Straggler(1)
    slow.delay()
    slow.committed()
    slow.delay()
    assert slept == [pytest.approx(1.0), pytest.approx(2.0)]  # (3 - 1) x 0.5 s, then (3 - 1) x 1 s
    monkeypatch.setattr(straggler.time, "perf_counter", lambda: 0.0)
    other = straggler.Straggler(0)
    other.delay()
    assert len(slept) == 2  # another worker is not slowed
    for bad in ("1", "x:2", "1:0.5", "-1:2"):
        with pytest.raises(ValueError, match="straggler"):
            straggler.parse(bad)


def test_report_says_when_runs_were_time_sliced_or_had_a_straggler(tmp_path):
    from gradsync.compare.report import write_report

    meta = {"command": "gradsync compare x.py", "workers": 4, "straggler": "1:2.0", "cores": 2, "most_processes": 6}
    _, md = write_report(meta, [], [], str(tmp_path))
    text = open(md).read()
    assert "worker 1's compute took 2.0 times as long" in text and "up to 6 processes shared 2 cores" in text


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

    from gradsync import scalars, tensorboard

    assert tensorboard.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    monkeypatch.setenv(scalars.TENSORBOARD_DIR, str(tmp_path))
    monkeypatch.setattr(scalars, "_worker", lambda: 3)
    monkeypatch.setattr(scalars, "_board", None)
    gradsync.log(step=7, loss=0.25, acc=0.5)
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("events.out.tfevents.") and path.name.endswith(".worker3")
    data, events = path.read_bytes(), []
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        body = data[12:12 + length]
        assert data[12 + length:16 + length] == tensorboard._masked(body) and data[8:12] == tensorboard._masked(data[:8])
        events.append(dict(_fields(body)))
        data = data[16 + length:]
    assert events[0][3] == b"brain.Event:2"
    values = [dict(_fields(v)) for n, v in _fields(events[1][5]) if n == 1]
    assert events[1][2] == 7 and values == [{1: b"loss", 2: 0.25}, {1: b"acc", 2: 0.5}]
