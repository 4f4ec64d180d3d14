"""The examples reach their targets under every strategy: digits 95% test accuracy, the click model
within 0.02 of the planted model's AUC."""
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


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_digits_with_int8_compression_is_within_one_point(strategy, servers):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gradsync
    from digits import train

    plain = gradsync.launch(train, strategy=strategy, workers=2, servers=servers, timeout=190)[0]
    int8 = gradsync.launch(train, strategy=strategy, workers=2, servers=servers, compression="int8", timeout=190)[0]
    assert int8["test_accuracy"] >= plain["test_accuracy"] - 0.01, (int8, plain)
    assert int8["test_accuracy"] >= 0.95
    assert int8["final_loss"] != plain["final_loss"]  # the hook really ran: compressed training differs


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy,servers", [("hybrid", 1), ("ps", 2), ("allreduce", 0)])
def test_ctr_reaches_the_planted_auc(strategy, servers, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "run", "--strategy", strategy, "--workers", "2", "--servers",
         str(servers), "--run-dir", str(tmp_path), os.path.join(ROOT, "examples", "ctr.py"),
         "--rows", "10000", "--fields", "4", "--steps", "150"],
        capture_output=True, text=True, timeout=190,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"AUC ([\d.]+) \(planted model: ([\d.]+)\)", done.stdout)
    trained, planted = float(found.group(1)), float(found.group(2))
    assert 0.7 < planted and trained >= planted - 0.02, done.stdout
