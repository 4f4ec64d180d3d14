"""A hung job says where it is: each rank's Python stack, headed with the rank, shown once when a worker's main
thread stays at the same place for stall_report seconds, and before the launcher stops the job (its timeout,
a signal)."""
import os
import re
import signal
import subprocess

import pytest

from helpers import CLI, run_cli

pytestmark = pytest.mark.job  # every test here starts processes

_STUCK = """import threading
import gradsync

def stuck_here():
    print("stuck", flush=True)
    threading.Event().wait()

gradsync.init()
if gradsync.worker_rank() == 1:
    stuck_here()
gradsync.shutdown()
"""
_RANKS = ("ps0 (rank 0)", "worker0 (rank 1)", "worker1 (rank 2)")


def _said_once_each(report: str) -> None:
    """Each rank's stack once, and `stuck_here` once: in worker1's."""
    for name in _RANKS:
        assert report.count(f"\n{name} stack:\n") == 1, report
    assert report.count(" in stuck_here\n") == 1, report
    assert report.index(" in stuck_here\n") > report.index("\nworker1 (rank 2) stack:\n"), report


@pytest.mark.timeout(150)
def test_a_job_out_of_time_shows_each_ranks_stack_once(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    done = run_cli("run", "--strategy", "ps", "--workers", "2", "--timeout", "12", str(script), timeout=140)
    assert done.returncode == 1, done.stderr
    report = done.stderr[done.stderr.index("gradsync: job timed out after 12 s; still running: ps0, worker0, "
                                           "worker1\n"):]
    _said_once_each(report)


@pytest.mark.timeout(150)
def test_a_stalled_worker_and_a_stop_by_sigterm_each_show_every_stack_once(tmp_path):
    """Ranks started as new processes (they register in gradsync.init()); the stall report comes while the job
    goes on, then SIGTERM stops it with the stacks once more."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    launcher = subprocess.Popen([*CLI, "run", "--strategy", "ps", "--workers", "2", "--stall-report", "3",
                                 str(script)], stderr=subprocess.PIPE, text=True, stdout=subprocess.DEVNULL,
                                env={**os.environ, "GRADSYNC_RANK_START": "exec"})
    try:
        lines = []
        while not lines or not lines[-1].endswith(" in stuck_here\n"):  # the stall report's last rank
            lines.append(launcher.stderr.readline())
            assert lines[-1], "".join(lines)
        launcher.send_signal(signal.SIGTERM)
        rest = launcher.communicate(timeout=60)[1]
    finally:
        launcher.kill()
    stall, stop = "".join(lines), rest
    assert launcher.returncode == 128 + signal.SIGTERM, stall + stop
    headline = re.search(r"gradsync: no progress: the main thread has stayed at the same place in (.*) "
                         r"\(stall_report 3 s: --stall-report or GRADSYNC_STALL_REPORT\); the job goes on; each "
                         r"rank's stack:\n", stall)
    assert headline is not None and re.search(r"rank 2 \(worker1\) for \d+ s", headline[1]), stall
    _said_once_each(stall[stall.index("gradsync: no progress"):] + "\n")
    assert stop.count("gradsync: stopping the job; where each rank was:\n") == 1, stop
    _said_once_each(stop)
    assert stop.endswith("gradsync: stopped by SIGTERM: every rank was stopped\n"), stop


_STUCK_BEFORE_INIT = """import sys, threading

def stuck_before_init():
    threading.Event().wait()

print("loading the data set", file=sys.stderr, flush=True)
stuck_before_init()
"""


@pytest.mark.timeout(120)
def test_a_job_hung_before_init_shows_where_and_what_its_ranks_wrote_once(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_BEFORE_INIT)
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", "--timeout", "8", str(script), timeout=110)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count(" in stuck_before_init\n") == 2, done.stderr  # each forked rank's stack
    assert done.stderr.count("loading the data set") == 1, done.stderr
    assert "worker0 (rank 0), worker1 (rank 1) wrote before gradsync.init():\nloading the data set" in done.stderr
