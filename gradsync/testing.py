"""gradsync's pytest plugin: test a training function as a job of W workers and S servers.

Installed with gradsync (the `pytest11` entry point `gradsync`), pytest loads it in every run; it imports
gradsync only when a test asks for its fixture. `gradsync_job(fn, strategy=..., workers=..., ...)` runs
`fn(*args)` on every worker of a local job (`gradsync.launch`, the same keywords) and returns the workers'
results in worker order. When a rank fails, every rank is killed and the test fails with `JobFailed`: the rank
that caused it, named, and its traceback. The job has a hard timeout: the test's `@pytest.mark.timeout`
(pytest-timeout; without it the plugin registers the mark, and only the job's timeout applies) less
`MARGIN_S`, else the `gradsync_timeout` ini option; a job stopped by it names the rank it waited for and shows
every rank's Python stack.

    def test_my_training_matches_one_process(gradsync_job):
        ps = gradsync_job(train, strategy="ps", workers=2, servers=1)
        allreduce = gradsync_job(train, strategy="allreduce", workers=2)
        ...
"""

from __future__ import annotations

import pytest

MARGIN_S = 10.0
"""Seconds between the job's timeout and the test's: the job fails first, naming the rank it waited for, and
kills every rank, rather than pytest-timeout's dump of this process's stack."""
DEFAULT_TIMEOUT_S = "300"
"""A job's timeout when the test has no timeout mark (the `gradsync_timeout` ini option)."""


def pytest_addoption(parser):
    parser.addini(
        "gradsync_timeout",
        "seconds a gradsync_job may take when its test has no timeout mark",
        default=DEFAULT_TIMEOUT_S,
    )


def pytest_configure(config):
    """Without pytest-timeout, register its `timeout` mark, which the job's timeout reads: a test file that
    marks its gradsync_job tests gets no unknown-mark warning (nor an error under --strict-markers)."""
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line(
            "markers",
            "timeout(seconds): the seconds the test's gradsync_job jobs may take, "
            "less a margin (enforced on the test itself only with pytest-timeout)",
        )


def job_timeout(item) -> float:
    """The seconds `item`'s jobs may take: its timeout mark less MARGIN_S, else the gradsync_timeout option."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return max(float(marker.args[0]) - MARGIN_S, MARGIN_S)
    return float(item.config.getini("gradsync_timeout"))


@pytest.fixture
def gradsync_job(request):
    """`gradsync_job(fn, *, strategy, workers, servers=None, mode="sync", args=(), timeout=None, **settings)`:
    `gradsync.launch` inside the test's timeout (an explicit `timeout` wins)."""
    import gradsync

    limit = job_timeout(request.node)

    def run(fn, **kwargs):
        kwargs.setdefault("timeout", limit)
        return gradsync.launch(fn, **kwargs)

    return run
