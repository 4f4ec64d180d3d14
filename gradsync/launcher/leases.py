"""Leases on what a launcher creates and must remove at exit (its emulated network, its temporary run directory)
or holds for its job's life (its run directory).

The launcher holds an exclusive `flock` on a lease file for as long as the thing exists. The kernel drops the
lock when the process dies, however it dies (SIGKILL included), so a lease file nobody holds marks what a dead
launcher left behind: the next launcher finds it (`abandoned`) and removes it, or takes its place. The file
holds what the launcher wrote into it (`holder`): who holds it, for the one refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os


class Lease:
    """An exclusive lock on a new file at `path` holding `content`, held by this process until `release` (or its
    death). Raises FileExistsError when `path` exists, unless `take_abandoned` and no process holds it: then this
    lease replaces it."""

    def __init__(self, path: str, content: bytes = b"", take_abandoned: bool = False):
        self.path = path
        making = f"{path}.{os.getpid()}.new"  # locked and written before it gets its name: no one sees it unlocked
        self._fd: int | None = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, content)
            while not _named(making, path, take_abandoned):
                pass
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
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


def holder(path: str) -> bytes:
    """What the lease file at `path` holds (b"" once it is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _named(making: str, path: str, take_abandoned: bool) -> bool:
    """Give the locked file `making` the name `path`: True once done, False when `path` changed meanwhile (try
    again). Raises FileExistsError when `path` is held (or exists at all, without `take_abandoned`)."""
    try:
        os.link(making, path)
        return True
    except FileExistsError:
        if not take_abandoned:
            raise
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # released meanwhile
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileExistsError(f"{path} is held by a running process") from None
        try:  # locked: replaced unless another process replaced it first
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return False
        except FileNotFoundError:
            return False
        os.rename(making, path)
        return True
    finally:
        os.close(fd)
