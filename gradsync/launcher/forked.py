"""Ranks forked from a fork server that imported torch and gradsync once, rather than started as new processes.

A rank started as `python SCRIPT` spends seconds of CPU importing torch, and more importing torch._dynamo (at its first
optimizer step or DDP: BENCHMARKS.md, "Starting a job"). A launcher starts one fork server (multiprocessing's) with
`PRELOADED` imported (the command line forks it from itself once it imported them) and forks its ranks from it:
`gradsync.launch`'s always, `gradsync run`'s unless GRADSYNC_RANK_START is exec. A forked rank first becomes what a new
process would be (`become_rank`): the rank's environment and no other, dying with the launcher (as the fork server
does), multiprocessing with no start method and no fork server chosen (`forget_fork_server`: so a DataLoader's workers
start as in a new process), torch's C++ log level and thread count from that environment (torch read both when the fork
server imported it), torch's and numpy's global random states its own, and, behind --link, its network namespace with
/sys showing that network's devices (as `ip netns exec` does). `run_script` then runs the script as `python SCRIPT ARGS`
does: as `__main__`, its directory first on sys.path, and on its way out non-daemon threads joined, atexit functions run
and an uncaught exception shown by sys.excepthook from the script's first frame.

What a forked rank does not share with a new process: its command line and initial environment in /proc (the
command line's, or the fork server's), the variables other than those above that torch reads once at import
(the launcher's), the hash seed of str (the same in every rank) and stdin (/dev/null).
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import importlib.machinery
import io
import multiprocessing
import os
import signal
import sys
import threading
import types
from multiprocessing import forkserver

PRELOADED = (
    "torch",
    "torch._dynamo",
    "gradsync.runtime.start",
    "gradsync.worker.strategies.ps_strategy",
    "gradsync.worker.strategies.allreduce_strategy",
    "gradsync.worker.strategies.hybrid_strategy",
    "gradsync.worker.strategies.sharded_strategy",
    "gradsync.ps.server",
)
"""What the fork server imports once for every rank it starts (torch imports torch._dynamo at the first
optimizer step or DDP)."""


def rank_starter(from_here: bool = False) -> tuple[multiprocessing.context.ForkServerContext, int]:
    """The multiprocessing context that forks ranks (a fork server with `PRELOADED` imported, started once per
    process and shared by its jobs), and the pid of the ranks' parent (the fork server).

    from_here: import `PRELOADED` in this process and fork the fork server from it, rather than start a new
    interpreter that imports them (the command line, which needs torch itself, saves one import of torch a
    job). Only for a process that was `single_threaded()` before it imported torch and has run no torch
    operation since (a fork of a thread's locks, or of an OpenMP pool that ran, can hang the ranks); it still
    falls back to a new interpreter if a Python thread runs now."""
    from gradsync.core.torch_internals import (
        fork_fork_server,
        forkserver_pid,
        quiet_resource_tracker,
        short_fork_server_folder,
    )

    context = multiprocessing.get_context("forkserver")
    short_fork_server_folder()
    quiet_resource_tracker()
    if from_here and threading.active_count() == 1 and forkserver_pid() is None:
        for name in PRELOADED:
            importlib.import_module(name)
        fork_fork_server()
    else:
        context.set_forkserver_preload(list(PRELOADED))
        forkserver.ensure_running()
    return context, forkserver_pid()


def single_threaded() -> bool:
    """Whether this process runs no thread but its main one (Linux's task list; False elsewhere): asked before
    torch is imported, whose import starts native thread pools."""
    tasks = "/proc/self/task"
    return os.path.isdir(tasks) and len(os.listdir(tasks)) == 1


def become_rank(env: dict[str, str], namespace: str | None) -> None:
    """Make this freshly forked process the rank `env` describes (see the module's docstring); `namespace`: its
    network namespace behind an emulated link, else None."""
    import numpy
    import torch

    from gradsync.core.torch_internals import forget_fork_server
    from gradsync.launcher import netem, torch_logs
    from gradsync.membership.launcher_death import die_with_launcher
    from gradsync.membership.rank_reports import start_launched_rank

    os.environ.clear()
    os.environ.update(env)
    start_launched_rank()
    forget_fork_server()
    die_with_launcher()
    torch_logs.apply()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    numpy.random.seed()  # from the OS's entropy, as a new process would
    torch.seed()
    if namespace is not None:
        netem.enter_as_process(namespace)


def run_script(env: dict[str, str], script: str, args: list[str], namespace: str | None) -> None:
    """Body of a forked `gradsync run` rank: `python script args` in a session of its own (as the launcher
    starts an exec'd rank); exits with the status python would."""
    os.setsid()
    become_rank(env, namespace)
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __builtins__=builtins, __loader__=importlib.machinery.SourceFileLoader("__main__", path)
    )
    sys.modules["__main__"] = main
    code, interrupted = 0, False
    try:
        with io.open_code(path) as f:
            source = compile(f.read(), path, "exec")
        exec(source, main.__dict__)
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException as e:  # what python does with any uncaught exception
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
        e = e.with_traceback(_from(e.__traceback__, path))
        sys.excepthook(type(e), e, e.__traceback__)
    # what the interpreter does at exit, in its order: threads, atexit, streams (threading._shutdown: private)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # python ends on an uncaught Ctrl-C by that signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_status(code) -> int:
    """The exit status of SystemExit(code), as python gives it (a message goes to stderr with status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _from(tb: types.TracebackType | None, path: str) -> types.TracebackType | None:
    """The traceback from the script's own first frame on, without this module's (None when the script has no
    frame in it: a SyntaxError shows only itself, as python shows it)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return tb
