"""What the test files share that is not a fixture: comparing state dicts, running `gradsync run`, telling
whether a process is gone. Test files import these from here, never from one another (tests/conftest.py puts
this folder on sys.path, for the tests and for the ranks they spawn)."""
from __future__ import annotations

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys in the same order."""
    assert list(a) == list(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def gradsync_run(*args, timeout=60, env=None) -> subprocess.CompletedProcess:
    """`gradsync run ARGS` in a subprocess (`env`: variables added to this environment)."""
    return subprocess.run([sys.executable, "-m", "gradsync.cli", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def gone(pid: int) -> bool:
    """The process has exited (a zombie has exited too: its new parent reaps it)."""
    from gradsync.launcher import procfs

    return procfs.state(pid) in (None, "Z")
