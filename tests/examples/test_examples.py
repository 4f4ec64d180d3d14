"""The examples reach their targets under every strategy: digits 95% test accuracy, the click model
within 0.02 of the planted model's AUC. Each example also runs once as written, as a script under
`gradsync run`; the other strategies run its same `train` function through `gradsync.launch`, which
spares the fresh interpreters (and their imports of torch) of a `gradsync run` per job."""
import os
import re
import sys

import pytest

import gradsync
from helpers import ROOT, run_cli

pytestmark = pytest.mark.job  # every test here starts processes

EXAMPLES = os.path.join(ROOT, "examples")
CTR_ARGS = dict(fields=4, rows=10000, steps=150)  # the rest: the script's defaults, as `gradsync run` passes them


def _run(flags: list[str], script: str, args: list[str], tmp_path) -> str:
    """`gradsync run FLAGS examples/SCRIPT ARGS`; returns what it printed."""
    done = run_cli("run", *flags, "--run-dir", str(tmp_path), os.path.join(EXAMPLES, script), *args, timeout=190)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _examples_importable() -> None:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # the ranks get this process's sys.path


@pytest.mark.timeout(200)
def test_digits_script_reaches_95_percent_under_gradsync_run_at_three_workers(tmp_path):
    # 1,438 training samples do not split evenly in 3: each worker takes 479, the same number of steps
    printed = _run(["--strategy", "ps", "--workers", "3"], "digits.py", [], tmp_path)
    accuracy = float(re.search(r"test accuracy ([\d.]+)", printed).group(1))
    assert accuracy >= 0.95, printed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_digits_reaches_95_percent_and_int8_compression_is_within_one_point(launch, strategy, servers):
    _examples_importable()
    from digits import train

    plain = launch(train, strategy=strategy, workers=2, servers=servers, timeout=190)[0]
    int8 = launch(train, strategy=strategy, workers=2, servers=servers, compression="int8", timeout=190)[0]
    assert plain["test_accuracy"] >= 0.95, plain
    assert int8["test_accuracy"] >= plain["test_accuracy"] - 0.01, (int8, plain)
    assert int8["test_accuracy"] >= 0.95
    assert int8["final_loss"] != plain["final_loss"]  # the hook really ran: compressed training differs


@pytest.mark.timeout(200)
def test_ctr_script_reaches_the_planted_auc_under_gradsync_run(tmp_path):
    printed = _run(["--strategy", "hybrid", "--workers", "2", "--servers", "1"], "ctr.py",
                   [f"--{name}={value}" for name, value in CTR_ARGS.items()], tmp_path)
    found = re.search(r"AUC ([\d.]+) \(planted model: ([\d.]+)\)", printed)
    trained, planted = float(found.group(1)), float(found.group(2))
    assert 0.7 < planted and trained >= planted - 0.02, printed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy,servers", [("ps", 2), ("allreduce", 0)])
def test_ctr_reaches_the_planted_auc(launch, strategy, servers):
    _examples_importable()
    from ctr import train

    args = (CTR_ARGS["fields"], CTR_ARGS["rows"], 8, CTR_ARGS["steps"], 256, 0.1, 20_000)  # ctr.py's defaults
    summary = launch(train, strategy=strategy, workers=2, servers=servers, args=args, timeout=190)[0]
    assert 0.7 < summary["planted_auc"] and summary["auc"] >= summary["planted_auc"] - 0.02, summary
