"""The level of torch's C++ log lines in the processes of a job on this machine: TORCH_CPP_LOG_LEVEL, else ERROR.

Below ERROR those lines tell a user nothing to do: a TensorPipe EOF per worker that leaves an async job, and
behind `--link` c10d's "hostname of the client socket cannot be retrieved" from each store client that connects
inside the emulated network, where no DNS answers. torch reads the variable once, when it is imported: a rank
started as a new process finds it in its environment; a process that imported torch before sets the level
itself: a rank `gradsync.launch` forks from its fork server, and the launcher while it hosts the store of an
emulated network (the store connects to itself from the hub).
"""

from __future__ import annotations

import contextlib
import os

from gradsync.core.torch_internals import cpp_log_level

_LEVELS = {"INFO": 0, "WARNING": 1, "ERROR": 2, "FATAL": 3, "0": 0, "1": 1, "2": 2, "3": 3}
"""What torch reads in TORCH_CPP_LOG_LEVEL, in any case (it ignores any other value)."""


def level() -> str:
    """The level of the job's processes, which their environment gets: TORCH_CPP_LOG_LEVEL, else ERROR."""
    return os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")


def apply() -> None:
    """From now on, log torch's C++ lines at `level()` in this process, which imported torch already."""
    flag = cpp_log_level()
    flag.value = _LEVELS.get(level().upper(), flag.value)


@contextlib.contextmanager
def applied():
    """torch's C++ lines at `level()` inside the block; after it, at the level before."""
    before = cpp_log_level().value
    apply()
    try:
        yield
    finally:
        cpp_log_level().value = before
