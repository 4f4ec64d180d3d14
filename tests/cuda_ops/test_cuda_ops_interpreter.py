"""Runs test_cuda_ops_kernels.py in a child pytest with TRITON_INTERPRET=1.

The Triton kernels then run on CPU tensors and are checked against the
reference on a machine without a GPU. The variable is set only in the child,
so it cannot change how Triton behaves in the other tests.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.job  # every test here starts processes

KERNEL_TESTS = pathlib.Path(__file__).with_name("test_cuda_ops_kernels.py")


@pytest.mark.timeout(240)
def test_triton_kernels_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'triton>=3.0')")
    cmd = [sys.executable, "-m", "pytest", str(KERNEL_TESTS), "-q", "-p", "no:cacheprovider"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, f"interpreter run failed:\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
