"""Write a file so that readers see the old content or the new, never a torn one; and find the temporary
files of a writer that died before its rename."""

from __future__ import annotations

import os
import re
import tempfile

_TEMPORARY = re.compile(r"\..+-[^.]+\.tmp")  # `.<target name>-<random>.tmp`, what `write_atomically` writes


def write_atomically(path: str, data: bytes) -> str:
    """Write `data` to `path`: a temporary file (mode 0600) beside it, fsync, rename, fsync of the folder.

    Returns:
        `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=directory)  # _TEMPORARY
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


def temporaries(directory: str) -> list[str]:
    """The paths of the temporary files `write_atomically` left in `directory` (a writer that died before its
    rename), sorted."""
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if _TEMPORARY.fullmatch(n))
