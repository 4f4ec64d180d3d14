"""Shared test setup: tests/ on sys.path (for the helper modules, and for the ranks the tests spawn, which
import jobs.py and friends by module path), pytest-timeout required, and the fixtures many files use."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    # pyproject's required_plugins refuses a run where pytest-timeout is not installed; this also refuses one
    # where it is installed but not loaded (-p no:timeout): every hang guard of the suite would vanish silently.
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("the test suite needs the pytest-timeout plugin loaded: its multi-process tests "
                                "rely on @pytest.mark.timeout never to hang (pip install -r requirements.txt)")


@pytest.fixture
def store():
    """A rendezvous store hosted on loopback, on a port the kernel picked (no free-port guess to race)."""
    from gradsync.launcher.local_job import host_store

    return host_store(0)
