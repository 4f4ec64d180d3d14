"""gradsync's pytest plugin (`gradsync.testing`), as a user gets it: the guide's example test file, run by pytest
in a directory of its own (the plugin comes from the installed entry point, not from this suite's conftest), and
a job whose rank fails, named with its traceback."""
import os
import re
import subprocess
import sys
import types

import pytest

from gradsync import testing
from helpers import ROOT

MARK = "<!-- gradsync_job example: tests/launcher/test_testing_plugin.py runs this file as written -->"

FAILING = '''
import pytest
import gradsync


def fail_on_worker_one():
    if gradsync.worker_rank() == 1:
        raise ValueError("worker one's own error")
    return gradsync.worker_rank()


@pytest.mark.timeout(100)
def test_a_failing_rank_is_named(gradsync_job):
    gradsync_job(fail_on_worker_one, strategy="allreduce", workers=2)
'''


def _guide_example() -> str:
    guide = open(os.path.join(ROOT, "docs", "guide.md")).read()
    after = guide[guide.index(MARK):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.job
@pytest.mark.timeout(240)
def test_the_guides_example_passes_and_a_failing_rank_is_named_with_its_traceback(tmp_path):
    (tmp_path / "test_training.py").write_text(_guide_example())
    (tmp_path / "test_failing.py").write_text(FAILING)
    # without pytest-timeout (-p no:timeout) the plugin registers the `timeout` mark both files use: no unknown-mark
    # warning, which -W turns into an error (as --strict-markers would the mark itself)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout", "-rf",
                          "--strict-markers", "-W", "error::pytest.PytestUnknownMarkWarning",
                          "test_training.py", "test_failing.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=220)
    out = run.stdout + run.stderr
    assert re.search(r"\b1 failed\b", out) and re.search(r"\b2 passed\b", out), out
    assert "warning" not in out.lower(), out
    assert "JobFailed: rank 1 (worker1) failed" in out and "ValueError: worker one's own error" in out, out
    assert "test_failing.py::test_a_failing_rank_is_named" in out, out


def _item(timeout=None, ini="300"):
    marker = None if timeout is None else types.SimpleNamespace(args=(timeout,))
    return types.SimpleNamespace(get_closest_marker=lambda name: marker if name == "timeout" else None,
                                 config=types.SimpleNamespace(getini=lambda name: ini))


def test_a_job_times_out_before_its_test():
    assert testing.job_timeout(_item(120)) == 120 - testing.MARGIN_S
    assert testing.job_timeout(_item(5)) == testing.MARGIN_S  # never below the margin
    assert testing.job_timeout(_item(None, ini="45")) == 45.0


def test_the_timeout_mark_is_registered_only_where_pytest_timeout_does_not_register_it():
    for installed in (True, False):
        lines = []
        config = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(hasplugin=lambda name: installed and name == "timeout"),
                                       addinivalue_line=lambda name, line: lines.append((name, line)))
        testing.pytest_configure(config)
        assert [(name, line.split(":")[0]) for name, line in lines] == ([] if installed else
                                                                        [("markers", "timeout(seconds)")])
