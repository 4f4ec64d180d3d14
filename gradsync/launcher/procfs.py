"""What Linux's /proc says about a process: its parent, children, state, CPU ticks, waits for a CPU and memory.

Each reader returns None (or nothing) for a process that is gone or unreadable, since processes come and
go while they are read.
"""

from __future__ import annotations

import glob
import os

TICK = os.sysconf("SC_CLK_TCK")
"""CPU ticks per second."""


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc/.../stat file after the command name: [state, ppid, ...] (utime at 11, stime
    at 12); None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T, t, Z)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields[0] if fields else None


def parent(pid: int) -> int | None:
    """The pid of the process's parent."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return int(fields[1]) if fields else None


def cpu_ticks(stat_path: str) -> int | None:
    """utime + stime of a process (/proc/PID/stat) or of one of its threads (/proc/PID/task/TID/stat)."""
    fields = stat_fields(stat_path)
    return int(fields[11]) + int(fields[12]) if fields else None


def schedstat_ns(task_path: str) -> tuple[int, int] | None:
    """(nanoseconds on a CPU, nanoseconds runnable and waiting for one) of a thread (/proc/PID/task/TID): the
    scheduler's own clock, where utime/stime count 10 ms ticks. Read with one system call each way: compare
    samples it often."""
    try:
        fd = os.open(f"{task_path}/schedstat", os.O_RDONLY)
        try:
            data = os.read(fd, 256).split()
        finally:
            os.close(fd)
        return int(data[0]), int(data[1])
    except (OSError, IndexError, ValueError):
        return None


def runqueue_wait_ns(task_path: str) -> int | None:
    """Nanoseconds a thread (/proc/PID/task/TID) has been runnable and waited for a CPU (schedstat's second
    field): the time-slicing it met."""
    stat = schedstat_ns(task_path)
    return None if stat is None else stat[1]


def schedstats_ns(pid: int) -> dict[int, tuple[int, int]]:
    """`schedstat_ns` of each thread of the process, by thread id (none when it is gone)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {}
    for tid in threads:
        if (stat := schedstat_ns(f"/proc/{pid}/task/{tid}")) is not None:
            out[int(tid)] = stat
    return out


def runqueue_waits_ns(pid: int) -> dict[int, int]:
    """`runqueue_wait_ns` of each thread of the process, by thread id (none when it is gone)."""
    return {tid: waited for tid, (_, waited) in schedstats_ns(pid).items()}


def children(parent: int) -> list[int]:
    """The pids whose parent is `parent`: from the kernel's children lists, else (a kernel without
    CONFIG_PROC_CHILDREN) from every process's parent pid."""
    paths = glob.glob(f"/proc/{parent}/task/*/children")
    if paths:
        pids = []
        for path in paths:
            try:
                with open(path) as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                pass
        return pids
    return [
        int(path.split("/")[2])
        for path in glob.glob("/proc/[0-9]*/stat")
        if (fields := stat_fields(path)) and int(fields[1]) == parent
    ]


def memory(pid: int | str, field: str = "VmHWM") -> int | None:
    """A /proc/PID/status memory field in bytes: VmHWM (peak resident, the default) or VmRSS (resident now);
    pid may be "self"."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return None
