"""Every script in bench/ imports and answers --help, so a helper moved between modules cannot silently break a
benchmark whose figures the docs quote. Each runs in this process as `python bench/X.py --help` would (its
folder first on sys.path, run as __main__): no process started, a fraction of a second each."""
import contextlib
import io
import pathlib
import runpy
import sys

import pytest

from helpers import ROOT

BENCH = pathlib.Path(ROOT) / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
LIBRARIES = {"measure.py", "sparse_workload.py", "torchrec_baseline.py"}
"""Modules the scripts import, not run: importing them is the check."""


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_shows_help(script, isolated_imports, monkeypatch):
    path = BENCH / script
    sys.path.insert(0, str(BENCH))
    if script in LIBRARIES:
        runpy.run_path(str(path), run_name=path.stem)
        return
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(path), run_name="__main__")
    assert exited.value.code == 0, (script, out.getvalue())
    assert out.getvalue().startswith(f"usage: {script}"), (script, out.getvalue()[:300])
