"""Smoke test of bench/startup.py: one repeat of torchrun and one gradsync configuration; the JSON has every figure."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.job  # every test here starts processes


@pytest.mark.timeout(180)
def test_startup_bench_times_torchrun_and_gradsync_run(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "startup.py"), "--repeats", "1", "--configs",
                           "allreduce_fork", "--out", str(out)], capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["configs"]) == {"torchrun", "allreduce_fork"}
    torchrun = result["configs"]["torchrun"]
    for name, row in result["configs"].items():
        [(wall, cpu)] = row["runs"]
        assert wall > 0 and cpu > 0, (name, row)
        assert row["wall_s"] == wall and row["wall_vs_torchrun"] == wall / torchrun["wall_s"]
        assert row["cpu_vs_torchrun"] == cpu / torchrun["cpu_s"]
    assert "| allreduce_fork |" in done.stdout and result["machine"]
