"""Each run of `gradsync compare` in a working directory of its own, as the user's was when compare started.

A script that saves a snapshot in its working directory and resumes from one it finds (pytorch/examples'
trainers) would, in a shared directory, resume from another run's. So compare copies the directory it was
started from once (`snapshot`: the pristine copy, before the first run) and gives each run a fresh copy of that
(`fresh`) in its run folder: each run sees the files and relative paths of the start, and what it writes stays
in its own folder. Copies, not hard links: a run that rewrites a file in place (torch.save truncates it) would
change every link of it. Left out of the copy: version control (.git, .hg, .svn), virtual environments (a
pyvenv.cfg) and report directories of compare (its MARKER; --out among them); symbolic links stay links, those
with a relative target outside the directory made absolute. A script inside the directory runs as its copy
(`script_in`); a script and data given by an absolute path outside it are used where they are.
"""

from __future__ import annotations

import os
import shutil

SKIPPED_NAMES = {".git", ".hg", ".svn"}


def skipped(path: str, marker: str) -> bool:
    """Whether directory `path` stays out of the copy: version control, a virtual environment, or a directory
    holding `marker` (a report directory of compare)."""
    return (
        os.path.basename(path) in SKIPPED_NAMES
        or os.path.exists(os.path.join(path, "pyvenv.cfg"))
        or os.path.exists(os.path.join(path, marker))
    )


def _tree(start: str, marker: str):
    """(directory, files, links) below `start` relative to it, skipped directories left out; `links`: symbolic
    links (to files or directories), which are not followed."""
    for top, dirs, files in os.walk(start):
        links = [n for n in dirs + files if os.path.islink(os.path.join(top, n))]
        dirs[:] = [d for d in dirs if d not in links and not skipped(os.path.join(top, d), marker)]
        yield os.path.relpath(top, start), [f for f in files if f not in links], links


def check_size(start: str, marker: str, limit_mb: float) -> None:
    """Refuse (ValueError) a directory whose copy would hold more than `limit_mb` MB of files (counting stops
    there: a home directory is not walked to its end)."""
    total = 0
    for top, files, _ in _tree(start, marker):
        total += sum(
            os.path.getsize(os.path.join(start, top, f)) for f in files if os.path.isfile(os.path.join(start, top, f))
        )
        if total > limit_mb * 2**20:
            raise ValueError(
                f"the working directory {start} holds over {limit_mb:g} MB to copy (--copy-limit-mb): "
                "each run of compare works in its own copy of it, so run compare from a directory "
                "that holds just the script and the files it reads by relative path (give large data "
                "by absolute path), or raise --copy-limit-mb"
            )


def snapshot(start: str, dest: str, marker: str) -> None:
    """Copy directory `start` to `dest`, leaving out what `skipped` names."""
    start = os.path.realpath(start)
    for top, files, links in _tree(start, marker):
        os.makedirs(os.path.join(dest, top), exist_ok=True)
        for name in files:
            source = os.path.join(start, top, name)
            if os.path.isfile(source):  # sockets and pipes are not copied
                shutil.copy2(source, os.path.join(dest, top, name))
        for name in links:
            target = os.readlink(os.path.join(start, top, name))
            resolved = os.path.normpath(os.path.join(start, top, target))
            if not os.path.isabs(target) and os.path.commonpath([resolved, start]) != start:
                target = resolved  # a relative link out of the directory would point elsewhere from the copy
            os.symlink(target, os.path.join(dest, top, name))


def fresh(pristine: str, dest: str) -> None:
    """A new copy of the pristine copy at `dest` (replacing what an earlier run left there)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(pristine, dest, symlinks=True)


def script_in(script: str, start: str, workdir: str) -> str:
    """The path a run whose working directory is `workdir` (a copy of `start`) runs `script` by: a relative path
    inside the copy as given (it resolves in the copy), an absolute one inside `start` mapped into the copy, and
    one outside `start` (or left out of the copy) made absolute."""
    path = os.path.abspath(script)
    inside = os.path.relpath(path, start)
    if inside.split(os.sep)[0] == os.pardir or not os.path.isfile(os.path.join(workdir, inside)):
        return path
    return script if not os.path.isabs(script) else os.path.join(workdir, inside)
