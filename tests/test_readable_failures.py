"""What a user reads: a failure is one headline naming the rank that caused it and the cause, with that rank's
traceback, once (not once per rank); normal output (what `make run` runs) carries no warning a user cannot act
on."""
import os
import re
import subprocess
import sys

import pytest

import gradsync
from faults import train_resumable
from helpers import ROOT, run_failing_script



TRAIN = "gradsync.init()\nfaults.train_with_fault(faults.Fault(1, 3, 'raise'), 30)\ngradsync.shutdown()\n"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,servers,mode", [("ps", 1, "sync"), ("ps", 1, "async"), ("allreduce", 0, "sync")])
def test_an_exception_in_the_training_loop_is_one_headline_with_its_traceback(strategy, servers, mode, tmp_path):
    stderr, headline = run_failing_script(tmp_path, TRAIN, "--strategy", strategy, "--mode", mode, "--workers", "2")
    assert headline.startswith(f"gradsync: rank {servers + 1} (worker1) failed with exit code 1:\nTraceback"), stderr
    assert stderr.count("RuntimeError: worker 1 broke on purpose at step 3") == 1, stderr


@pytest.mark.timeout(180)
def test_a_config_error_in_init_is_one_headline_not_a_signal(tmp_path):
    stderr, headline = run_failing_script(tmp_path, "gradsync.init(compression='zip')\n", "--strategy", "ps",
                                   "--workers", "2")
    assert re.match(r"gradsync: rank \d \((ps0|worker\d)\) failed with exit code 1:\nTraceback", headline), stderr
    assert "before it reached gradsync.init()" not in stderr
    assert stderr.count("ConfigError: unknown compression 'zip'") == 1, stderr


@pytest.mark.timeout(240)
def test_a_resume_mismatch_is_said_once(tmp_path):
    directory = str(tmp_path / "checkpoints")
    gradsync.launch(train_resumable, strategy="ps", workers=2, servers=1, args=(5, "sgd"), checkpoint_dir=directory,
                    checkpoint_every=5, step_timeout=20, timeout=150)
    body = "gradsync.init()\nfaults.train_resumable(5, 'sgd')\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", "ps", "--workers", "3", "--resume", directory)
    assert headline.startswith("gradsync: rank "), stderr
    assert stderr.count("was written by a job with strategy='ps', servers=1, workers=2, and this job has "
                        "strategy='ps', servers=1, workers=3") == 1, stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_a_nan_gradient_is_headlined_with_the_worker_that_sent_it(strategy, servers, tmp_path):
    body = "gradsync.init()\njobs.train_with_nan(6, 2)\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", strategy, "--workers", "2")
    assert headline.startswith(f"gradsync: rank {servers + 1} (worker1) failed with exit code 1:"), stderr
    assert "from worker 1: lower the learning rate" in headline


def _without_torch_log_level() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}


# What a user cannot act on: TensorPipe's EOF of a worker leaving an async job, c10d's hostname lines, glog's
# W/E prefixes, the join hint of `gradsync run` inside compare, any traceback (refused hybrid ranks), warnings.
_NOISE = re.compile(r"EOF|c10d|hostname of the client socket|more workers can join|Traceback|warn|^[WE]\d{4} ",
                    re.IGNORECASE | re.MULTILINE)


@pytest.mark.timeout(400)
def test_make_runs_compare_prints_no_warning_a_user_cannot_act_on(tmp_path):
    """`make run`'s compare (allreduce and ps, one server, sync and async) on loopback, one epoch, and hybrid on
    the same model, which has no tables to serve: skipped, without the refused ranks' tracebacks."""
    done = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "compare", "--out", str(tmp_path / "report"), "--strategies",
         "allreduce,ps,hybrid", "--servers", "1", "--modes", "sync,async", os.path.join(ROOT, "examples", "digits.py"),
         "--epochs", "1"], capture_output=True, text=True, timeout=380, env=_without_torch_log_level(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "| ps async S=1 |" in output and "| hybrid S=1 | skipped: no tables |" in output, output
    assert _NOISE.findall(output) == [], output
