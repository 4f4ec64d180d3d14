"""A rank's failure, recorded once: in its error file for the launcher and in the store for the other ranks.

Under a launcher a rank prints nothing itself (the launcher's headline shows the failure), from the start of
`gradsync.init`; an uncaught exception exits the process at once (`report_failures`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback

from gradsync.core import settings
from gradsync.core.errors import blamed_worker
from gradsync.core.job_names import StoreKeys
from gradsync.core.strategies import traits
from gradsync.metrics import scalars
from gradsync.runtime.cluster import Cluster


def report_failures(cluster: Cluster | None) -> None:
    """On an uncaught exception: record it (`record_failure`), say it (`say_failure`), and exit at once: a
    process whose heartbeat thread, store connection or RPC agent still runs would abort (SIGABRT) at
    interpreter exit, and its launcher would report that signal instead of the exception. Before the rank
    has a `Cluster` (a bad setting in `init`), the failure goes to the launcher's file only: one headline,
    not a traceback per rank."""

    def hook(kind, value, tb):
        with contextlib.suppress(OSError):  # the last step's line (compare measures a failed run up to its failure)
            scalars.flush()  # before the record, on which the launcher stops the ranks
        rank = cluster.config.rank if cluster is not None else int(os.environ.get("RANK", "0"))
        text = record_failure(cluster, rank, "".join(traceback.format_exception(kind, value, tb)))
        say_failure(text)
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


_NO_PROCESS_GROUP = "Default process group has not been initialized"  # torch's error, e.g. from DistributedSampler
_SAMPLER_HINT = (
    "gradsync: the ps strategy has no torch.distributed process group: give DistributedSampler its "
    "place explicitly, DistributedSampler(dataset, num_replicas=gradsync.num_workers(), "
    "rank=gradsync.worker_rank()) (the same works under every strategy)\n"
)


def say_failure(text: str) -> None:
    """Write a rank's failure to stderr, unless a gradsync launcher (GRADSYNC_ERROR_FILE) shows it: once, in
    the job's headline, not once per rank."""
    if not settings.ERROR_FILE.read():
        sys.stderr.write(text)
    sys.stderr.flush()


def record_failure(cluster: Cluster | None, rank: int, text: str) -> str:
    """Save a rank's failure for the launcher (GRADSYNC_ERROR_FILE) and the other ranks (the store; not from a
    worker that joined the running job, whose launcher records it gone), with a hint for an exception
    gradsync can explain and the ranks this one has seen fall silent for half the step timeout, or not build
    their Trainer: the likely cause. A failure whose text blames a worker (`blamed_worker`: its non-finite
    gradient) is recorded in the store under that worker's rank, so the launcher's headline names it. Returns
    the text saved."""
    if cluster is not None and not traits(cluster.config.strategy).process_group and _NO_PROCESS_GROUP in text:
        text += _SAMPLER_HINT
    if cluster is not None:
        config, watch = cluster.config, cluster.heartbeat.watch
        silent = watch.silent(config.step_timeout / 2)
        if silent:
            text += f"gradsync: {watch.describe(silent)}: stopped, hung or dead?\n"
        late = watch.without_trainer(min(config.startup_timeout, config.step_timeout) / 2)
        if late:
            text += f"gradsync: {watch.describe_without_trainer(late)}\n"
    path = settings.ERROR_FILE.read()
    if path:
        with open(path, "w") as f:
            f.write(text)
    if cluster is not None and not cluster.joined:
        blamed = blamed_worker(text)
        if blamed is not None and blamed < cluster.config.num_workers:
            rank = cluster.config.servers + blamed
        try:
            cluster.store.compare_set(StoreKeys.FAILED, "", f"rank {rank}: {text}")
        except Exception:  # the store may be gone already; the launcher still has the file
            pass
    return text


def exit_now(cluster: Cluster, text: str) -> None:
    """Fail this rank from a thread other than the main one, which waits where no exception can reach it (a
    collective in C++): record `text` and the main thread's stack, and exit the process with status 1."""
    ident = threading.main_thread().ident
    frame = None if ident is None else sys._current_frames().get(ident)
    text += "\nThe main thread was here:\n" + "".join(traceback.format_stack(frame))
    say_failure(record_failure(cluster, cluster.config.rank, text))
    os._exit(1)
