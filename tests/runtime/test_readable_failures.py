"""What a user reads: a failure is one headline naming the rank that caused it and the cause, with that rank's
traceback, once (not once per rank). (That normal output carries no warning a user cannot act on is checked
on compare's output, in tests/compare/test_compare.py.)"""
import re

import pytest

import gradsync
from fault_injection import train_resumable
from helpers import run_cli, run_failing_script

pytestmark = pytest.mark.job  # every test here starts processes



TRAIN = "gradsync.init()\nfault_injection.train_with_fault(fault_injection.Fault(1, 3, 'raise'), 30)\ngradsync.shutdown()\n"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,servers,mode", [("ps", 1, "sync"), ("allreduce", 0, "sync")])  # async: test_faults
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
def test_a_resume_mismatch_is_said_once(launch, tmp_path):
    directory = str(tmp_path / "checkpoints")
    launch(train_resumable, strategy="ps", workers=2, servers=1, args=(5, "sgd"), checkpoint_dir=directory,
           checkpoint_every=5, step_timeout=20, timeout=150)
    body = "gradsync.init()\nfault_injection.train_resumable(5, 'sgd')\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", "allreduce", "--workers", "2", "--resume",
                                          directory)
    assert headline.startswith("gradsync: rank "), stderr
    assert stderr.count("was written by a job with strategy='ps', and this job has strategy='allreduce'") == 1, stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_a_nan_gradient_is_headlined_with_the_worker_that_sent_it(strategy, servers, tmp_path):
    body = "gradsync.init()\njobs.train_with_nan(6, 2)\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", strategy, "--workers", "2")
    assert headline.startswith(f"gradsync: rank {servers + 1} (worker1) failed with exit code 1:"), stderr
    assert "from worker 1: lower the learning rate" in headline


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["rpc", "grpc"])
def test_an_exception_in_a_servers_handler_is_headlined_on_that_server_with_the_worker_that_saw_it(transport,
                                                                                                   tmp_path):
    """The server's traceback once, in its own headline (not printed raw by torch RPC or gRPC); the worker whose
    push it was answering follows in one line."""
    body = ("fault_injection.break_push(1)\ngradsync.init()\nfault_injection.train_with_fault(fault_injection.Fault(-1, -1, 'none'), 5)\n"
            "gradsync.shutdown()\n")
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", "ps", "--transport", transport,
                                          "--workers", "2", "--step-timeout", "30")
    lines = headline.splitlines()
    assert lines[:2] == ["gradsync: rank 0 (ps0) failed with exit code 1:", "Traceback (most recent call last):"], stderr
    end = lines.index("KeyError: 'the push handler broke on purpose for worker 1'")
    assert lines[end + 1] == "gradsync: server 0 failed answering worker 1's push", stderr
    assert lines[end + 2].startswith("then rank 2 (worker1) failed with exit code 1: "), stderr
    assert [line for line in lines[end + 3:] if line.strip()] == [], stderr
    assert stderr.count("Traceback") == 1, stderr


_BAD_ARGUMENT = """import argparse
import gradsync
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.parse_args()
gradsync.init()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_bad_argument_before_init_is_shown_once_with_the_ranks_that_printed_it(start, tmp_path):
    script = tmp_path / "args.py"
    script.write_text(_BAD_ARGUMENT)
    done = run_cli("run", "--strategy", "ps", "--workers", "2", str(script), timeout=100,
                   env={"GRADSYNC_RANK_START": start})
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    headline = lines.index("gradsync: rank 0 (ps0) failed with exit code 2 before it reached gradsync.init(), "
                           "printing:")
    assert lines[headline + 1:] == ["usage: args.py [-h] --lr LR",
                                    "args.py: error: the following arguments are required: --lr",
                                    "rank 1 (worker0), rank 2 (worker1) failed the same way"], done.stderr
    assert done.stderr.count("usage: args.py") == 1, done.stderr
    assert "gradsync.init() first" not in done.stderr and "EADDRINUSE" not in done.stderr


@pytest.mark.timeout(120)
def test_an_error_at_import_is_shown_once(tmp_path):
    script = tmp_path / "imports.py"
    script.write_text("import gradsync\nimport no_such_module_here\ngradsync.init()\n")
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", str(script), timeout=100)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("ModuleNotFoundError: No module named 'no_such_module_here'") == 1, done.stderr
    assert done.stderr.count("Traceback (most recent call last):") == 1, done.stderr
    headline = done.stderr[done.stderr.index("gradsync: rank "):].splitlines()
    assert headline[0] == ("gradsync: rank 0 (worker0) failed with exit code 1 before it reached gradsync.init(), "
                           "printing:")
    assert headline[-1] == "rank 1 (worker1) failed the same way", done.stderr
    assert "gradsync.init() first" not in done.stderr and "EADDRINUSE" not in done.stderr


_KILLED_BEFORE_INIT = """import os, signal
import gradsync
if os.environ["RANK"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
gradsync.init()
gradsync.shutdown()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_server_killed_before_init_is_said_to_be_without_a_traceback_or_init_advice(start, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_BEFORE_INIT)
    done = run_cli("run", "--strategy", "ps", "--workers", "2", str(script), timeout=100,
                   env={"GRADSYNC_RANK_START": start})
    assert done.returncode == 1, done.stderr
    headline = done.stderr[done.stderr.index("gradsync: rank "):]
    assert headline == ("gradsync: rank 0 (ps0) failed: killed by SIGKILL before it reached gradsync.init(), "
                        "printing nothing\n"), done.stderr
    assert "traceback" not in done.stderr.lower(), done.stderr


_CAUGHT = """gradsync.init()
try:
    fault_injection.train_with_fault(fault_injection.Fault(1, 3, 'raise'), 30)
except RuntimeError as e:  # as hydra's main does: print the error, exit with a status
    print(f"Error executing job: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
gradsync.shutdown()
"""


@pytest.mark.timeout(180)
def test_a_worker_that_catches_its_error_and_exits_is_said_to_have_failed_not_to_have_forgotten_shutdown(tmp_path):
    stderr, headline = run_failing_script(tmp_path, _CAUGHT, "--strategy", "allreduce", "--workers", "2")
    assert headline.startswith("gradsync: rank 1 (worker1) exited (code 1) without gradsync.shutdown()"), stderr
    assert "its exit status says it failed, and its own output above says why" in headline
    assert "must call gradsync.shutdown()" not in stderr
    assert stderr.count("Error executing job: worker 1 broke on purpose at step 3") == 1, stderr
