"""The suite's tiers: a test that starts a process is marked `job` (`make test-fast` leaves those out with
-m "not job"). The conftest marks every test using the `launch` fixture; modules and tests that start processes
otherwise say so with `pytestmark = pytest.mark.job` or @pytest.mark.job; `refusing_processes` fails any other
test that starts one, so the fast tier cannot quietly grow a job."""
import contextlib
import multiprocessing.process
import multiprocessing.util
import os
import subprocess

JOB_FIXTURES = {"launch", "gradsync_job"}
"""Fixtures that start processes: a test using one is marked `job` at collection."""


class ProcessStarted(RuntimeError):
    """A test not marked `job` tried to start a process."""


def mark_jobs(items, job_marker) -> None:
    """Adds `job_marker` to every collected item that uses a fixture in JOB_FIXTURES."""
    for item in items:
        if JOB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(job_marker)


def _starters() -> list[tuple[object, str]]:
    """(owner, attribute) of every call that starts a process from Python: subprocess (and so os.popen,
    gradsync run/compare, torchrun), fork and spawn, and multiprocessing's processes and fork server."""
    owners = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
              (multiprocessing.util, "spawnv_passfds")]
    owners += [(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
               if hasattr(os, name)]
    return owners


def refusal(test: str, what: str) -> str:
    return (f"{test} started a process ({what}) but is not marked `job`: add @pytest.mark.job (or "
            f"`pytestmark = pytest.mark.job` to its module) so that `make test-fast` (-m \"not job\") leaves it out")


@contextlib.contextmanager
def refusing_processes(test: str, started: list[str]):
    """Within the block every process start raises ProcessStarted naming `test` and is noted in `started` (so a
    test that catches the error is failed all the same by its caller)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _starters()]

    def refuse(what: str):
        def refused(*args, **kwargs):
            started.append(what)
            raise ProcessStarted(refusal(test, what))
        return refused

    try:
        for owner, name, _ in saved:
            setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
