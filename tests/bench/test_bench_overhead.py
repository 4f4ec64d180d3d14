"""Smoke test of bench/overhead.py: tiny models, one repeat, gradsync's ps against the naive one it is measured
against; the JSON has every figure."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.job  # every test here starts processes

CONFIGS = ["gradsync_ps_sync_s1", "naive_ps"]


@pytest.mark.timeout(240)
def test_overhead_bench_writes_step_times_and_cpu(tmp_path):
    out = tmp_path / "overhead.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "overhead.py"), "--tiny", "--repeats", "1", "--steps", "3",
         "--warmup", "1", "--workloads", "reference", "--configs", *CONFIGS, "--out", str(out)],
        capture_output=True, text=True, timeout=220, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["summary"]["reference"]
    assert list(summary) == CONFIGS
    for config in CONFIGS:
        row, run = summary[config], result["runs"]["reference"][config][0]
        assert row["median_ms"] > 0 and row["cpu_s_per_step"] > 0, (config, row)
        assert row["busy_poll_cpu_s_per_step"] >= 0 and row["threads"], (config, row)
        assert row["runqueue_wait_s_per_step"] >= 0 and set(run["threads_waited"]) == set(run["threads"]), run
        assert run["processes"] == 3, (config, run["processes"])
        assert len(run["step_times_s"]) == 3
    assert summary["gradsync_ps_sync_s1"]["ratios"]["naive_ps"]["per_repeat"]
    assert result["runs"]["reference"]["gradsync_ps_sync_s1"][0]["metrics"]["step_s"] > 0
    assert "| reference | naive_ps |" in done.stdout and "reference gradsync_ps_sync_s1 / naive_ps" in done.stdout
