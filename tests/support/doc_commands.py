"""What the documentation tests share (no test file imports another): the `gradsync ...` and `make ...` commands of
a Markdown page and their check against the command line's own parser, the page's code blocks, and the bodies
that run a page's programs (a gradsync program on each rank of `gradsync.launch`; the DDP programs in two plain
processes, as torchrun would start them)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import sys
import traceback

from helpers import ROOT


def commands(markdown: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each `gradsync` or `make` command in the fenced code blocks, continued lines
    joined and comments left out."""
    out, fenced, pending = [], False, None
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line)
        elif re.match(r"\s*(gradsync|make)( |$)", line):
            pending = (number, line)
        if pending is not None and not pending[1].rstrip().endswith("\\"):
            out.append((pending[0], shlex.split(pending[1].replace("\\", " "), comments=True)))
            pending = None
    return out


def make_targets() -> set[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        return set(re.findall(r"^([\w.-]+):", f.read(), re.MULTILINE))


def command_problem(where: str, argv: list[str], targets: set[str] | None = None) -> str | None:
    """Why `argv` (a `gradsync ...` or `make ...` command found at `where`) would not run as written, or None:
    a make target missing from the Makefile, flags the command line's parser refuses, or a script in a folder
    of this repository that is not there."""
    from gradsync import cli
    from gradsync.config import ConfigError

    if argv[0] == "make":
        missing = [a for a in argv[1:]
                   if "=" not in a and a not in (targets if targets is not None else make_targets())]
        return f"{where}: make {' '.join(missing)}: no such target in the Makefile" if missing else None
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            args = cli.parse_args(argv[1:])
    except SystemExit:
        return f"{where}: {shlex.join(argv)} does not parse: {said.getvalue().strip()}"
    except (ConfigError, ValueError) as e:
        return f"{where}: {shlex.join(argv)}: {e}"
    script = getattr(args, "script", None)
    if script and os.path.isdir(os.path.join(ROOT, os.path.dirname(script) or "-")):
        if not os.path.exists(os.path.join(ROOT, script)):
            return f"{where}: {script} is not in the repository"
    return None


def code_blocks(markdown: str, language: str = "python") -> list[tuple[int, str]]:
    """(line number of the block's first line, text) of each fenced block opened with ```language."""
    out, opened, lines = [], None, []
    for number, line in enumerate(markdown.splitlines(), 1):
        if opened is None and line.strip() == "```" + language:
            opened, lines = number + 1, []
        elif opened is not None and line.strip() == "```":
            out.append((opened, "\n".join(lines) + "\n"))
            opened = None
        elif opened is not None:
            lines.append(line)
    return out


@contextlib.contextmanager
def _in_folder(folder: str):
    """Run a program as `python program.py` would from `folder`: its folder first on sys.path, its files there."""
    cwd = os.getcwd()
    os.chdir(folder)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        os.chdir(cwd)


def run_program(path: str, argv: list[str] | tuple = ()) -> str:
    """A rank's body under `gradsync.launch`: run the script at `path` with arguments `argv` as `__main__` (its
    own gradsync.init() joins the launched job) in its folder; returns what it printed."""
    printed, saved = io.StringIO(), sys.argv
    sys.argv = [path, *argv]
    try:
        with _in_folder(os.path.dirname(path)), contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved
    return printed.getvalue()


def _agreed_port(folder: str, index: int, rank: int, timeout: float = 60.0) -> int:
    """The MASTER_PORT of program `index`: rank 0 asks the kernel for a free port just before its program binds
    it and publishes it in `folder`; the other ranks read it there. (Ports picked for every program up front
    stayed free for a minute or more, long enough for another process on the machine to take one.)"""
    import socket
    import time

    path = os.path.join(folder, f"port-{index}")
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(path + ".tmp", path)
        return port
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish the port of program {index} within {timeout:.0f} s")
        time.sleep(0.02)
    with open(path) as f:
        return int(f.read())


def run_ddp_programs(spec_path: str) -> None:
    """One rank of plain torch.distributed programs, as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR set
    by the caller): spec {"runs": [[path, argv], ...], "out": folder} runs each program in turn, with
    MASTER_PORT a port rank 0 picks just before it (`_agreed_port`), and writes {index: printed} to
    out/rank-<RANK>.json; a failure is written there too, and the process exits 1 at once (so that the other
    ranks' collectives fail instead of waiting).

    Each group a program destroys is kept alive until this process ends with os._exit: when the last reference
    to a gloo group goes (a DDP model freed after `destroy_process_group()`, as a program's `main` returns),
    torch 2.13's ProcessGroupGloo destructor sometimes waits forever joining its threads (seen here about once
    in ten programs), and the next program would never start."""
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    kept, destroy = [], dist.destroy_process_group

    def destroy_and_keep(group=None):
        kept.append(group if group is not None else dist.distributed_c10d._get_default_group())
        destroy(group)

    dist.destroy_process_group = destroy_and_keep
    rank, printed = int(os.environ["RANK"]), {}
    out = os.path.join(spec["out"], f"rank-{rank}.json")
    for index, (path, argv) in enumerate(spec["runs"]):
        try:
            os.environ["MASTER_PORT"] = str(_agreed_port(spec["out"], index, rank))
            printed[index] = run_program(path, argv)
        except BaseException:
            printed[index] = "FAILED\n" + traceback.format_exc()
            with open(out, "w") as f:
                json.dump(printed, f)
            sys.stderr.write(printed[index])
            sys.stderr.flush()
            os._exit(1)
    with open(out, "w") as f:
        json.dump(printed, f)
    sys.stdout.flush()
    os._exit(0)  # without the kept groups' destructors
