"""Shared test setup, for the test files of every folder below: tests/support/ on sys.path (the helper modules
and test models, imported by module name, `from jobs import make_mlp`, by the tests and by the ranks they spawn,
which unpickle jobs.py's and its neighbours' functions by module path), pytest-timeout required, and the fixtures
many files use: a store, a job launcher inside the test's hard timeout, an in-process gRPC server, single-process
reference training, imports isolated for the scripts of bench/ run in this process; and the tiers
(support/tiers.py): `job` marked on tests using `launch`, and a process started by any test not marked `job` fails
it."""
import contextlib
import functools
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import tiers  # noqa: E402


def pytest_configure(config):
    # pyproject's required_plugins refuses a run where pytest-timeout is not installed; this also refuses one
    # where it is installed but not loaded (-p no:timeout): every hang guard of the suite would vanish silently.
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("the test suite needs the pytest-timeout plugin loaded: its multi-process tests "
                                "rely on @pytest.mark.timeout never to hang (pip install -r requirements.txt)")
    # matplotlib builds its font cache on first import by running fc-list: here, before any test, rather than
    # inside a test of the tier that starts no process (a fresh machine has no cache)
    from matplotlib import font_manager  # noqa: F401


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items):
    tiers.mark_jobs(items, pytest.mark.job)


def _refusing_processes_unless_job(item):
    """A hook wrapper's body: runs the phase, refusing process starts unless `item` is marked `job`."""
    if item.get_closest_marker("job"):
        return (yield)
    started = []
    with tiers.refusing_processes(item.nodeid, started):
        result = yield
    if started:
        pytest.fail(tiers.refusal(item.nodeid, started[0]))  # the test caught ProcessStarted
    return result


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_refusing_processes_unless_job)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_refusing_processes_unless_job)
pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(_refusing_processes_unless_job)


@pytest.fixture
def store():
    """A rendezvous store hosted on loopback, on a port the kernel picked (no free-port guess to race)."""
    from gradsync.launcher.local_job import host_store

    return host_store(0)


@pytest.fixture
def launch(gradsync_job):
    """gradsync's own pytest plugin (`gradsync.testing`), as users get it: `gradsync.launch` whose job times out
    before the test's @pytest.mark.timeout, every rank killed when one fails."""
    return gradsync_job


@pytest.fixture
def grpc_server():
    """`serve(mode, workers, member, timeout, **make_server keywords)` -> (server, endpoint, client): a ready
    in-process ParameterServer (`grpc_harness.make_server`) behind a gRPC endpoint, with a client holding the
    outside token (`member=True`: the members' one) whose calls time out after `timeout` seconds; every
    endpoint and client is stopped after the test."""
    from grpc_harness import make_server, served

    with contextlib.ExitStack() as stack:
        def serve(mode: str = "sync", workers: int = 2, member: bool = False, timeout: float = 10.0, **kwargs):
            server = make_server(mode, workers, **kwargs)
            endpoint, client = stack.enter_context(served(server, timeout, member))
            return server, endpoint, client

        yield serve


@pytest.fixture(scope="session")
def reference():
    """Single-process training on the workers' concatenated batches (`jobs.reference_mlp(steps, workers, ...)`),
    each setting trained once per session; the states are shared: read them, never change them."""
    from jobs import reference_mlp

    return functools.cache(reference_mlp)


@pytest.fixture
def isolated_imports(monkeypatch):
    """sys.path as it was before the test, and no module of bench/ or examples/ imported while a script of bench/
    runs in this process (it finds its neighbours afresh, as in its own process); afterwards the modules of bench/
    and examples/ that were imported before (another test's `charlm`, whose functions pickle by that module) are
    back as they were."""
    root = pathlib.Path(__file__).resolve().parent.parent
    folders = (root / "bench", root / "examples")

    def forget() -> dict:
        gone = {name: module for name, module in sys.modules.items()
                if pathlib.Path(getattr(module, "__file__", None) or "/").parent in folders}
        for name in gone:
            del sys.modules[name]
        return gone

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = forget()
    yield
    forget()
    sys.modules.update(before)
