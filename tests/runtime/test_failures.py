"""Failure behaviour: a broken worker fails the whole job fast, with its rank and traceback."""
import socket
import time

import pytest

import gradsync
from gradsync.config import ConfigError
from fault_injection import Fault, read_stamp, train_with_fault
from jobs import build_mismatched, reference_mlp, reference_skipping, train_mlp_stats, train_with_nan
from helpers import REFUSED_SCRIPT, max_diff, run_cli


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_worker_fails_the_job_within_30s(launch, strategy, servers, how, tmp_path):
    with pytest.raises(gradsync.JobFailed) as info:
        launch(train_with_fault, strategy=strategy, workers=3, servers=servers,
               args=(Fault(1, 3, how, str(tmp_path)), 50), timeout=80)
    elapsed = time.time() - read_stamp(tmp_path, "fault")
    message = str(info.value)
    assert f"rank {servers + 1} (worker1)" in message
    if how == "raise":
        assert "worker 1 broke on purpose" in message and "Traceback" in message
    else:
        assert "SIGKILL" in message
    assert elapsed < 30  # after the failure: half the 60 s step timeout that a missed failure would wait for


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_workers_with_different_models_are_refused(launch, strategy, servers):
    with pytest.raises(gradsync.JobFailed, match=r"worker 1's model differs from worker 0's: param '0.weight'"):
        launch(build_mismatched, strategy=strategy, workers=2, servers=servers, timeout=80)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_nan_gradient_raises_naming_parameter_and_worker(launch, strategy, servers):
    with pytest.raises(gradsync.JobFailed,
                       match=r"non-finite gradient .* for parameter '\d\.(weight|bias)' from worker 1"):
        launch(train_with_nan, strategy=strategy, workers=2, servers=servers, args=(6, 2), timeout=100)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", [("ps", 2), ("allreduce", 0)])
def test_nan_gradient_skip_drops_exactly_that_step(launch, strategy, servers):
    states = launch(
        train_with_nan, strategy=strategy, workers=2, servers=servers, args=(6, 2), nonfinite="skip", timeout=100
    )
    assert max_diff(states[0], reference_skipping(6, 2, skip=2)) <= 1e-5
    assert max_diff(states[0], reference_mlp(6, 2)) > 1e-4


@pytest.mark.job
@pytest.mark.timeout(120)
def test_nan_gradient_over_a_compressed_allreduce_names_parameter_and_worker(launch):
    with pytest.raises(gradsync.JobFailed,
                       match=r"non-finite gradient .* for parameter '\d\.(weight|bias)' from worker 1"):
        launch(train_with_nan, strategy="allreduce", workers=2, args=(6, 2), compression="fp16", timeout=100)


@pytest.mark.job
@pytest.mark.timeout(120)
def test_async_applies_every_push_and_uneven_workers_shut_down(launch):
    stats = launch(train_mlp_stats, strategy="ps", mode="async", workers=3, servers=1, args=(12, 3),
                   timeout=100)
    # workers 0 and 2 run 12 steps, worker 1 only 3; whoever finishes last has seen every push applied
    last = max(stats, key=lambda s: s["pushes_applied"])
    assert last["pushes_applied"] == last["version"] == 27
    assert all(s["pushes_rejected"] == 0 for s in stats)
    assert last["workers_seen"] == [0, 1, 2]  # max() of the lists would take [1, 2], read before worker 0 pushed


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(strategy="bogus", workers=2), "unknown strategy 'bogus'"),
        (dict(strategy="ps", workers=2, servers=1, mode="eventually"), "unknown mode 'eventually'"),
        (dict(strategy="ps", workers=2, servers=0), "needs at least one server, got servers=0"),
        (dict(strategy="ps", workers=0, servers=1), "workers must be a positive integer"),
        (dict(strategy="allreduce", workers=2, mode="async"), "allreduce strategy is synchronous"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(launch, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        launch(train_mlp_stats, **kwargs)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_cli_reports_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli("run", "--strategy", "ps", "--workers", "1", "--master-port", str(port), REFUSED_SCRIPT)
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr


@pytest.mark.job
@pytest.mark.timeout(60)
def test_cli_refuses_ps_without_servers():
    done = run_cli("run", "--strategy", "ps", "--workers", "2", "--servers", "0", REFUSED_SCRIPT)
    assert done.returncode == 2 and "--servers 1" in done.stderr


@pytest.mark.job
@pytest.mark.timeout(90)
def test_cli_failing_script_exits_nonzero_with_rank_and_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(
        "import gradsync\n"
        "gradsync.init()\n"
        "if gradsync.worker_rank() == 1:\n"
        "    raise ValueError('bad batch 7')\n"
        "gradsync.shutdown()\n"
    )
    start = time.monotonic()
    done = run_cli("run", "--strategy", "ps", "--workers", "2", str(script), timeout=80)
    assert done.returncode == 1
    assert "rank 2 (worker1) failed with exit code 1" in done.stderr, done.stderr
    assert "ValueError: bad batch 7" in done.stderr
    assert time.monotonic() - start < 45
