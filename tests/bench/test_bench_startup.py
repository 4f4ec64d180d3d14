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
        assert row["teardown_aborts"] in (0, 1)  # torch's known abort of the DDP twin, counted
        assert wall > 0 and cpu > 0, (name, row)
        assert row["wall_s"] == wall and row["wall_vs_torchrun"] == wall / torchrun["wall_s"]
        assert row["cpu_vs_torchrun"] == cpu / torchrun["cpu_s"]
    assert "| allreduce_fork |" in done.stdout and result["machine"]


_ABORTS_AFTER_ITS_WORK = """import os, sys
for _ in range({finished}):
    print("finished", flush=True)
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


@pytest.mark.parametrize("finished,counted", [(2, True), (1, False)])
def test_a_baselines_teardown_abort_after_every_rank_finished_is_counted_not_fatal(finished, counted):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from startup import measure
    finally:
        sys.path.pop(0)
    argv = [sys.executable, "-c", _ABORTS_AFTER_ITS_WORK.format(finished=finished)]
    if counted:
        wall, cpu, aborted = measure(argv, dict(os.environ), workers=2)
        assert aborted and wall > 0 and cpu >= 0
    else:
        with pytest.raises(RuntimeError, match="terminate called without an active exception"):
            measure(argv, dict(os.environ), workers=2)
