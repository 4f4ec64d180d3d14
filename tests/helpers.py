"""What the test files share that is not a fixture: comparing state dicts, running `gradsync run`, telling
whether a process is gone, a self-signed certificate. Test files import these from here, never from one another (tests/conftest.py puts
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


def self_signed(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 made with the openssl command (the cryptography package is not installed)."""
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key
