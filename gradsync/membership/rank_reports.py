"""What a rank that gradsync's launcher started leaves for the launcher to show: its failure (`error_file`, which
`runtime.failures` writes), its Python stack when asked, and what it wrote to stderr before `gradsync.init()`.

Stacks: a rank registers faulthandler for `STACK_SIGNAL` on its STACK_FILE (`register_stack_file`): a forked rank
at its start (`launcher.forked.become_rank`), one started as a new process in `gradsync.init()`. faulthandler
writes every thread's stack from C, so a rank answers even while its main thread blocks in C holding the GIL. The
launcher asks every rank that registered (`ask_stacks`) when a worker stalls (stall_report) and before it stops a
job that hangs (its timeout, a signal, a rank that never arrived or fell silent), and shows them once.

Early stderr: until `gradsync.init()`, a rank's stderr goes to its EARLY_STDERR file (a rank started as a new
process gets it from its launcher; a forked rank redirects its own: `hold_early_stderr`), so that a script that
fails before init on every rank (a bad argument, an error at import) is shown once, by the launcher, naming the
ranks, not once per rank. At init the rank writes what it held to the launcher's stderr (STDERR_FD), unless
another rank of the job wrote the same text already, and writes there from then on (`release_early_stderr`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import sys
import time

import torch.distributed as dist

from gradsync.core.job_names import StoreKeys
from gradsync.core.settings import EARLY_STDERR, STACK_FILE, STDERR_FD
from gradsync.core.waiting import wait_until

STACK_SIGNAL = signal.SIGUSR1
"""The signal a launcher sends a rank for its stack."""
_STACK_WAIT_S = 3.0  # for every asked rank to write its stack: a stopped process never does
_stack_file = None  # the open file faulthandler writes this rank's stack to


def error_file(directory: str, index: int) -> str:
    """Where rank `index` of a launched job (or joining worker `index`) records its failure for its launcher
    (GRADSYNC_ERROR_FILE): `directory` is the job's run directory (a joiner's: its launcher's files)."""
    return os.path.join(directory, f"error-{index}.txt")


def recorded_error(directory: str, index: int) -> str | None:
    """The failure rank `index` recorded in its `error_file`; None when it recorded none."""
    path = error_file(directory, index)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def stack_file(run_dir: str, rank: int) -> str:
    """Where rank `rank` of a launched job writes its stack (STACK_FILE)."""
    return os.path.join(run_dir, f"stack-{rank}.txt")


def early_stderr_file(run_dir: str, rank: int) -> str:
    """Where rank `rank` of a launched job writes its stderr until `gradsync.init()` (EARLY_STDERR)."""
    return os.path.join(run_dir, f"stderr-{rank}.txt")


def start_launched_rank() -> None:
    """In a rank forked by gradsync's launcher, before the script: hold its stderr until init, and answer
    `STACK_SIGNAL` with its stack."""
    hold_early_stderr()
    register_stack_file()


def register_stack_file() -> None:
    """Write every thread's stack to STACK_FILE on `STACK_SIGNAL` (once per process; nothing without a launcher).
    The file appears only once the handler is in place: the launcher signals only a rank whose file exists (the
    signal's default action would end the process)."""
    global _stack_file
    path = STACK_FILE.read()
    if not path or _stack_file is not None:
        return
    _stack_file = open(path + ".partial", "w")
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
    os.replace(path + ".partial", path)


def hold_early_stderr() -> None:
    """Send this process's stderr (descriptor 2) to EARLY_STDERR until `release_early_stderr`, keeping the
    launcher's in STDERR_FD."""
    path = EARLY_STDERR.read()
    if not path or STDERR_FD.read() is not None:
        return
    sys.stderr.flush()
    held = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.environ[STDERR_FD.env] = str(os.dup(2))
    os.dup2(held, 2)
    os.close(held)


def release_early_stderr(store: dist.Store) -> None:
    """At `gradsync.init()`: stderr back to the launcher's, with what was held written there first, unless
    another rank of the job (`store`) wrote the same text already."""
    saved, path = STDERR_FD.read(), EARLY_STDERR.read()
    if saved is None or not path:
        return
    sys.stderr.flush()
    with open(path, "rb") as f:
        held = f.read()
    os.dup2(saved, 2)
    os.close(saved)
    os.environ[STDERR_FD.env] = ""
    os.remove(path)  # the launcher shows only what a rank still holds
    if held and store.add(StoreKeys.EARLY_STDERR.format(hashlib.sha256(held).hexdigest()), 1) == 1:
        view = memoryview(held)
        while view:
            view = view[os.write(2, view) :]


def early_stderr(path: str) -> str | None:
    """What a rank holds in its EARLY_STDERR file `path`: it has not reached init; None when it holds nothing
    there (it released it at init, or gradsync never took its stderr)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def ask_stacks(ranks: dict[str, tuple[int, str]]) -> dict[str, str | None]:
    """The stacks of the running ranks `ranks` ({name: (pid, STACK_FILE)}): each one whose file exists is sent
    `STACK_SIGNAL`, and what it writes is read back once it stops growing, within a few seconds for them all.
    None for a rank that wrote nothing (it had not registered, is stopped, or exited)."""
    asked = {}
    for name, (pid, path) in ranks.items():
        try:
            before = os.path.getsize(path)
            os.kill(pid, STACK_SIGNAL)
        except (FileNotFoundError, ProcessLookupError):
            continue
        asked[name] = (path, before)
    sizes = {name: before for name, (_, before) in asked.items()}

    def written() -> bool:
        """Every asked file grew, and has not grown since the last look."""
        nonlocal sizes
        now = {name: os.path.getsize(path) for name, (path, _) in asked.items()}
        done = all(now[name] > before and now[name] == sizes[name] for name, (_, before) in asked.items())
        sizes = now
        return done

    with contextlib.suppress(TimeoutError):  # a rank that wrote nothing by then is shown as such
        wait_until(written, time.monotonic() + _STACK_WAIT_S, "the asked ranks' stacks")
    stacks: dict[str, str | None] = {name: None for name in ranks}
    for name, (path, before) in asked.items():
        with open(path, errors="replace") as f:
            f.seek(before)
            stacks[name] = _without_launcher(f.read()) or None
    return stacks


_LAUNCHER_FRAME = f'  File "{os.path.join(os.path.dirname(os.path.dirname(__file__)), "launcher")}{os.sep}'


def _without_launcher(dump: str) -> str:
    """A faulthandler dump with each thread's frames from the launcher's code on left out: those of a forked
    rank's start (gradsync.launcher, multiprocessing's fork server, the command line it was forked from)."""
    kept, below = [], False
    for line in dump.splitlines(keepends=True):
        below = below and line.startswith("  ") or line.startswith(_LAUNCHER_FRAME)
        if not below:
            kept.append(line)
    return "".join(kept)
