"""gradsync.launcher.procfs against processes whose state is known: the run-queue wait of two processes
pinned to one CPU, each spinning."""
import time

import pytest

from helpers import spinning_on_one_cpu

from gradsync.launcher import procfs

pytestmark = pytest.mark.job  # every test here starts processes


def test_two_processes_on_one_cpu_wait_for_it_in_turn():
    with spinning_on_one_cpu(2, 0.4) as pids:
        time.sleep(0.6)
        waits = [procfs.runqueue_wait_ns(f"/proc/{pid}/task/{pid}") for pid in pids]
        by_thread = [procfs.runqueue_waits_ns(pid) for pid in pids]
    # both runnable for 0.4 s of wall time on one CPU: at most 0.4 s of the 0.8 s running, the rest waiting
    assert all(w is not None for w in waits), waits
    assert sum(waits) > 0.35e9, waits
    # each process's threads by id, its main thread among them (a child forked from a process with torch's
    # thread pools may start threads of its own)
    assert [threads[pid] for pid, threads in zip(pids, by_thread)] == waits
    assert procfs.runqueue_wait_ns("/proc/0/task/0") is None and procfs.runqueue_waits_ns(0) == {}
