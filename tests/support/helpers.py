"""What the test files share that is not a fixture: where things are (ROOT, SUPPORT), comparing state dicts,
running the command line (`run_cli`: every test that runs `gradsync ...` in a subprocess does it through here),
comparing checkpoint files, waiting for a condition, marking a test that needs root, telling whether a process is gone, processes that take
turns on one CPU, a self-signed certificate, what a job must not print. Test files import these from here, never
from one another (tests/conftest.py puts this folder, tests/support/, on sys.path, for the tests and for the ranks
they spawn; a script a test writes puts SUPPORT on its own sys.path)."""
from __future__ import annotations

import contextlib
import glob
import os
import re
import subprocess
import sys
import time

SUPPORT = os.path.dirname(os.path.abspath(__file__))
"""tests/support/: the helper modules, the test models and the scripts the tests run (importable by module name)."""
ROOT = os.path.dirname(os.path.dirname(SUPPORT))
"""The repository's root."""
CLI = (sys.executable, "-m", "gradsync.cli")
"""The command line as a test starts it: `[*CLI, "run", ...]` where a test needs the process itself (Popen)."""
HEADLINE = re.compile(r"^gradsync: rank \d+ \(\w+\) (?:failed|exited|stopped)", re.MULTILINE)
"""The first line of a failed job's headline."""
NOISE = re.compile(r"EOF|c10d|hostname of the client socket|more workers can join|Traceback|warn|^[WE]\d{4} ",
                   re.IGNORECASE | re.MULTILINE)
"""What a user cannot act on: TensorPipe's EOF of a worker leaving an async job, c10d's hostname lines, glog's
W/E prefixes, the join hint of `gradsync run` inside compare, any traceback (refused hybrid ranks), warnings."""


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys in the same order."""
    assert list(a) == list(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def checkpoint_files(directory) -> dict:
    """Every shard and worker file of every step folder of a checkpoint directory, loaded, by (folder, file); but
    Python's `random` state, which every process seeds anew (the test scripts draw none of it)."""
    from gradsync.ps import shard_file

    return {(os.path.basename(os.path.dirname(p)), os.path.basename(p)):
            {k: v for k, v in shard_file.load(p).items() if k != "python_rng"}
            for p in sorted(glob.glob(os.path.join(directory, "step-*", "*.ckpt")))}


def same(a, b) -> bool:
    """Whether two loaded checkpoints (nested dicts, lists and tensors) are equal bit for bit, dtypes too."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


REFUSED_SCRIPT = os.path.join(SUPPORT, "compare_script.py")
"""A script that exists, for the jobs a test expects refused before any rank runs it."""


def run_cli(*args, timeout: float = 60, cwd=None, env: dict | None = None,
            without: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`gradsync ARGS` (`run_cli("run", ...)`, `run_cli("compare", ...)`, `run_cli("status", ...)`) in a
    subprocess, its output captured as text, killed after `timeout` seconds; in `cwd` (None: this one); with this
    process's environment, less the variables named in `without`, plus `env`'s."""
    environment = {k: v for k, v in os.environ.items() if k not in without}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**environment, **(env or {})})


def needs_root(test):
    """Marked `root`, and skipped without root or iproute2: an emulated network needs both."""
    import pytest

    return pytest.mark.root(pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/sbin/ip"),
                                               reason="an emulated network needs root and iproute2")(test))


def wait_until(condition, what: str, timeout: float = 15.0):
    """gradsync's own poll loop (`core.waiting.wait_until`) with a timeout in seconds from now."""
    from gradsync.core import waiting

    return waiting.wait_until(condition, time.monotonic() + timeout, what)


def gone(pid: int) -> bool:
    """The process has exited (a zombie has exited too: its new parent reaps it)."""
    from gradsync.launcher import procfs

    return procfs.state(pid) in (None, "Z")


@contextlib.contextmanager
def spinning_on_one_cpu(processes: int = 2, seconds: float = 0.4):
    """Fork `processes` children pinned to one CPU, each spinning for `seconds` then sleeping; yields their pids
    (so they wait for that CPU in turn: together about (processes - 1) x seconds) and kills them on exit."""
    cpu = min(os.sched_getaffinity(0))
    pids = []
    try:
        for _ in range(processes):
            pid = os.fork()
            if pid == 0:
                os.sched_setaffinity(0, {cpu})
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    pass
                time.sleep(60)
                os._exit(0)
            pids.append(pid)
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def self_signed(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 made with the openssl command (the cryptography package is not
    installed)."""
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


def run_failing_script(tmp_path, body: str, *flags: str) -> tuple[str, str]:
    """`gradsync run FLAGS script` of a script that imports the tests' helpers, then runs `body`, and fails
    with one headline, not an unexplained signal; returns (its stderr, the headline: from `gradsync: rank`)."""
    script = tmp_path / "job.py"
    script.write_text(f"import sys; sys.path.insert(0, {SUPPORT!r})\nimport gradsync, fault_injection, jobs\n{body}")
    done = run_cli("run", *flags, str(script), timeout=170)
    assert done.returncode == 1, done.stderr
    assert len(HEADLINE.findall(done.stderr)) == 1, done.stderr
    assert "failed with signal" not in done.stderr, done.stderr
    return done.stderr, done.stderr[done.stderr.index("gradsync: rank "):]


def placed_once(buckets, params) -> bool:
    """Whether the entries' element ranges cover every parameter exactly, without overlap."""
    ranges = {p.name: [] for p in params}
    for b in buckets:
        for e in b.entries:
            ranges[e.name].append((e.start, e.start + e.numel))
    for p in params:
        ends = sorted(ranges[p.name])
        if not ends or ends[0][0] != 0 or ends[-1][1] != p.numel or any(a[1] != b[0] for a, b in zip(ends, ends[1:])):
            return False
    return True


def check_timeline_order(pieces: list[dict]) -> None:
    """Each piece of a step's timeline left, arrived, was applied and came back in that order."""
    for p in pieces:
        if p["arrived"] is None:  # a header or an allreduce bucket: no server events
            assert p["left"] <= p["back"], p
        else:
            assert p["left"] <= p["arrived"] <= p["applied"] <= p["back"], p

