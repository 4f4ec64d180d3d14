"""The tiers' marks are trustworthy: a test using the `launch` fixture is marked `job`, and a process started
where `refusing_processes` holds (every test not marked `job`) raises and is noted, by each way Python starts one."""
import multiprocessing
import os
import subprocess
import sys
import types

import pytest

from tiers import ProcessStarted, mark_jobs, refusing_processes


def _item(*fixtures):
    item = types.SimpleNamespace(fixturenames=list(fixtures), markers=[])
    item.add_marker = item.markers.append
    return item


def test_a_test_using_launch_is_marked_job_and_no_other():
    with_launch, without = _item("tmp_path", "launch"), _item("tmp_path", "store")
    mark_jobs([with_launch, without], pytest.mark.job)
    assert with_launch.markers == [pytest.mark.job] and without.markers == []


def test_the_conftest_refuses_processes_in_a_test_not_marked_job(request):
    assert request.node.get_closest_marker("job") is None
    assert subprocess.Popen._execute_child.__name__ == os.fork.__name__ == "refused"


STARTS = {
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"], timeout=30),
    "os.system": lambda: os.system("true"),
    "os.fork": lambda: os.fork() or os._exit(0),  # a child, were the fork not refused, leaves at once
    "multiprocessing fork": lambda: multiprocessing.get_context("fork").Process(target=int).start(),
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process(target=int).start(),
}


@pytest.mark.parametrize("start", STARTS)
def test_a_process_start_is_refused_and_noted(start):
    started = []
    with refusing_processes("tests/x.py::test_x", started), pytest.raises(ProcessStarted, match="test_x.*`job`"):
        STARTS[start]()
    assert len(started) == 1, started


@pytest.mark.job
def test_starts_are_allowed_again_after_the_block():
    with refusing_processes("tests/x.py::test_x", []):
        pass
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=30).returncode == 0

