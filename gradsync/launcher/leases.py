"""Leases on what a launcher creates and must remove at exit: its emulated network, its temporary run directory.

The launcher holds an exclusive `flock` on a lease file for as long as the thing exists. The kernel drops the
lock when the process dies, however it dies (SIGKILL included), so a lease file nobody holds marks what a dead
launcher left behind: the next launcher finds it (`abandoned`) and removes it.
"""
from __future__ import annotations

import fcntl
import os


class Lease:
    """An exclusive lock on a new file at `path`, held by this process until `release` (or its death).
    Raises FileExistsError when `path` exists."""

    def __init__(self, path: str):
        self.path = path
        making = f"{path}.{os.getpid()}.new"  # locked before it gets its name: no one sees it unlocked
        self._fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(making, path)
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            os.unlink(making)

    def release(self) -> None:
        """Remove the file and drop the lock; idempotent."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def abandoned(path: str) -> bool:
    """Whether the lease file at `path` exists and no process holds it: its launcher died."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
