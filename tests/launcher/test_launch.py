"""gradsync.launch: the same defaults as `gradsync run`, a function that calls gradsync.init() itself, and
ranks that die with the process that called it."""
import signal
import sys

import pytest

import gradsync
from jobs import environment_value, init_then_train, reference_mlp
from helpers import SUPPORT, max_diff
import killed_launcher


@pytest.mark.job
@pytest.mark.timeout(120)
def test_ps_launch_without_servers_gets_one_and_a_script_style_init_joins_the_job():
    states = gradsync.launch(init_then_train, strategy="ps", workers=2, args=(3, {}), timeout=110)
    assert all(max_diff(state, reference_mlp(3, 2)) <= 1e-5 for state in states)


@pytest.mark.job
@pytest.mark.timeout(120)
def test_init_inside_launch_asking_for_another_job_is_refused_by_name():
    with pytest.raises(gradsync.JobFailed, match=r"asked for mode='async' \(the job runs 'sync'\)"):
        gradsync.launch(init_then_train, strategy="ps", workers=1, args=(1, {"mode": "async"}), timeout=110)


def test_a_second_init_outside_launch_is_refused():
    import types

    from gradsync.runtime import cluster

    cluster.set_running(types.SimpleNamespace(config=types.SimpleNamespace(is_server=False, worker_rank=0)))
    try:
        with pytest.raises(RuntimeError, match="already called"):
            gradsync.init(strategy="allreduce", servers=0)
    finally:
        cluster.set_running(None)


_CALLER = """import os, sys
sys.path.insert(0, {support!r})
import gradsync, jobs
gradsync.launch(jobs.forever, strategy="ps", workers=2, args=({pids!r},), timeout=600)
"""


@pytest.mark.job
@pytest.mark.timeout(150)
def test_no_rank_outlives_the_process_that_called_launch(tmp_path):
    """README: the ranks die when the process that called gradsync.launch dies, whatever the signal. They are
    the fork server's children, and the fork server may take many seconds to exit after its caller died
    (under load it did, while the ranks trained on without a store): they watch the caller itself."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    caller = [sys.executable, "-c", _CALLER.format(support=SUPPORT, pids=str(pids_dir))]
    with killed_launcher.started(caller, tmp_path / "stderr") as launcher:
        # worker 0 trained 2 steps: every rank is up
        launcher.wait_for(lambda: (pids_dir / "ranks").exists(), "the job did not start", timeout=120)
        launcher.watched = [int(p) for p in (pids_dir / "ranks").read_text().split()]
        assert len(launcher.watched) == 3  # ps0, worker0, worker1
        launcher.stop(signal.SIGKILL, timeout=10)
        assert launcher.survivors(within=10) == []


@pytest.mark.job
def test_the_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    """The fork server keeps the environment it started with; each launch's ranks see the caller's as it is."""
    probe = "GRADSYNC_TEST_PROBE"  # read only by the test's function
    one_worker = dict(strategy="allreduce", workers=1, timeout=120)
    monkeypatch.delenv(probe, raising=False)
    assert gradsync.launch(environment_value, args=(probe,), **one_worker) == [None]  # the fork server is up
    monkeypatch.setenv(probe, "set after the first launch")
    assert gradsync.launch(environment_value, args=(probe,), **one_worker) == ["set after the first launch"]
    monkeypatch.delenv(probe)
    assert gradsync.launch(environment_value, args=(probe,), **one_worker) == [None]
