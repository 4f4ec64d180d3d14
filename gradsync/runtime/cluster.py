"""This process's place in the running job: `Cluster`, from `gradsync.init` (`runtime.start`) until
`gradsync.shutdown` (`runtime.leaving`), and the public `worker_rank` / `num_workers`."""

from __future__ import annotations

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.membership.heartbeat import Heartbeat
from gradsync.metrics import scalars
from gradsync.runtime import checkpoints

_STATE: Cluster | None = None


class Cluster:
    """This process's place in the running job."""

    def __init__(self, config: JobConfig, store: dist.Store, heartbeat: Heartbeat, joined: bool = False):
        self.config = config
        self.store = store
        self.heartbeat = heartbeat
        self.joined = joined  # joined the running job: its failure is its own, not the job's
        self.has_process_group = False
        self.steps = 0  # steps this worker has committed (Trainer.step; allreduce: and answered after joining)
        self.resumed: checkpoints.Found | None = None  # the checkpoint this job resumes from (--resume)
        self.run = ""  # the run this job's checkpoints belong to ('' without --checkpoint-dir or --resume)
        self.leaving: list = []  # what a worker's shutdown calls first, the job still up (the modules made plain)

    def building_trainer(self) -> None:
        """Note in the store that this worker builds its Trainer, so that a worker that never does is named
        (`heartbeat.Watch.without_trainer`) rather than one that waited for it."""
        # Store.append: missing from torch's stubs
        self.store.append(StoreKeys.TRAINERS, f"{self.config.worker_rank},")  # type: ignore[attr-defined]


def running() -> Cluster | None:
    """The job this process is in, or None before `gradsync.init` and after `gradsync.shutdown`."""
    return _STATE


def set_running(cluster: Cluster | None) -> None:
    """Enter the job (`cluster`) or leave it (None: the worker's last step line is written first)."""
    global _STATE
    if cluster is None:
        scalars.flush()
    _STATE = cluster
    scalars.CURRENT.worker = None if cluster is None or cluster.config.is_server else cluster.config.worker_rank


def current() -> Cluster:
    """The running job; raises if `gradsync.init` was not called."""
    if _STATE is None:
        raise RuntimeError("gradsync is not initialized in this process: call gradsync.init() first")
    return _STATE


def worker_rank() -> int:
    """This worker's index, 0 .. num_workers()-1."""
    return current().config.worker_rank


def num_workers() -> int:
    return current().config.num_workers
