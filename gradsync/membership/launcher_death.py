"""A rank started by gradsync's launcher (GRADSYNC_LAUNCHER_PID set) dies with it: the kernel sends it SIGKILL
when its parent exits (prctl PR_SET_PDEATHSIG, Linux), and the heartbeat watches the launcher itself (a pidfd,
`LauncherWatch`), which is not the parent of `gradsync.launch`'s ranks: they are the fork server's children, and a
fork server may take many seconds to wind down after its caller died while the ranks, training on without a
store, would live on. A script the launcher starts as a new process dies with it from before its first line
(`dying_with_this_process`).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
from collections.abc import Callable

from gradsync.core import settings

_PR_SET_PDEATHSIG = 1


def launcher_pid() -> int | None:
    """The pid of the gradsync launcher that started this process, if one did."""
    return settings.LAUNCHER_PID.read()


def die_with_launcher() -> None:
    """In a rank started by gradsync's launcher: have the kernel SIGKILL this process when its parent dies
    (Linux; the launcher, or the fork server that `gradsync.launch` starts ranks from), and exit now if the
    launcher is gone already."""
    if launcher_pid() is None:
        return
    if sys.platform == "linux":
        _prctl()(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    watch_launcher()


class LauncherWatch:
    """The launcher this rank dies with. On Linux a pidfd: once the launcher is gone, a process that the kernel
    gives its pid cannot pass for it."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None  # ProcessLookupError: gone

    def gone(self) -> bool:
        if self._fd is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            return False
        return bool(select.select([self._fd], [], [], 0)[0])  # readable once the process has exited

    def exit_if_gone(self) -> None:
        """End this process at once, saying why, if the launcher is gone."""
        if self.gone():
            _orphaned(self.pid)


def watch_launcher() -> LauncherWatch | None:
    """A `LauncherWatch` of this rank's launcher (None: no gradsync launcher started it); exits at once if the
    launcher is gone already."""
    launcher = launcher_pid()
    if launcher is None:
        return None
    try:
        watch = LauncherWatch(launcher)
    except ProcessLookupError:
        _orphaned(launcher)
    watch.exit_if_gone()
    return watch


def dying_with_this_process() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` (called from the main thread, as the kernel ties the signal to the
    thread that forks): the child gets SIGKILL when this process dies, from before its first line, so that a
    script that never calls gradsync.init() cannot outlive its launcher either. None off Linux."""
    if sys.platform != "linux":
        return None
    parent, prctl = os.getpid(), _prctl()  # looked up here: the child between fork and exec only calls it

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call
            os._exit(1)

    return preexec


def _prctl():
    return ctypes.CDLL(None, use_errno=True).prctl


def _orphaned(launcher: int) -> None:
    sys.stderr.write(f"gradsync: the launcher (pid {launcher}) is gone, so this rank (pid {os.getpid()}) exits\n")
    sys.stderr.flush()
    os._exit(1)
