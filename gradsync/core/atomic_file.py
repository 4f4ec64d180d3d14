"""Write a file so that readers see the old content or the new, never a torn one."""
from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, data: bytes) -> str:
    """Write `data` to `path`: a temporary file (mode 0600) beside it, fsync, rename, fsync of the folder.

    Returns:
        `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
