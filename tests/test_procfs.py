"""gradsync.launcher.procfs against processes whose state is known: the run-queue wait of two processes
pinned to one CPU, each spinning."""
import os
import time

from gradsync.launcher import procfs


def test_two_processes_on_one_cpu_wait_for_it_in_turn():
    cpu = min(os.sched_getaffinity(0))
    spinners = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # spin on the shared CPU for 0.4 s, then sleep until killed
            os.sched_setaffinity(0, {cpu})
            end = time.monotonic() + 0.4
            while time.monotonic() < end:
                pass
            time.sleep(30)
            os._exit(0)
        spinners.append(pid)
    try:
        time.sleep(0.6)
        waits = [procfs.runqueue_wait_ns(f"/proc/{pid}/task/{pid}") for pid in spinners]
    finally:
        for pid in spinners:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    # two runnable processes on one CPU for 0.4 s: together they waited about 0.4 s (each its turn)
    assert all(w is not None for w in waits), waits
    assert sum(waits) > 0.1e9, waits
    assert procfs.runqueue_wait_ns("/proc/0/task/0") is None
