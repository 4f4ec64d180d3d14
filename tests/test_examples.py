"""The digits example reaches 95% test accuracy under both strategies, launched as a user would."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_digits_reaches_95_percent(strategy, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "run", "--strategy", strategy, "--workers", "2",
         "--run-dir", str(tmp_path), os.path.join(ROOT, "examples", "digits.py")],
        capture_output=True, text=True, timeout=190,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([\d.]+)", done.stdout).group(1))
    assert accuracy >= 0.95, done.stdout
