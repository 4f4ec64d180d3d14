"""A server's death in a job whose shards have replicas (replicas 1), as its launcher takes it.

`supervision.supervise` hands `ServerLoss.take` each server that dies (killed, exits non-zero, or silent past
step_timeout, which the launcher kills first). The first: its shard moves to its replica on the next server
(`membership.lost_servers.record_moved`), said in one line, and the job goes on without it. A second: some
shard has lost both its copies (its primary and its replica, or a primary that served alone since the first
death), and the job fails naming both servers.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.errors import JobFailed
from gradsync.membership.lost_servers import record_moved, replica_server
from gradsync.membership.rank_reports import recorded_error


class ServerLoss:
    """The servers one job has lost, and where their shards went."""

    def __init__(self, config: JobConfig, store: dist.Store, run_dir: str):
        self.config, self.store, self.run_dir = config, store, run_dir
        self.lost: dict[int, str] = {}  # server rank -> how it died
        self.began = time.monotonic()

    def take(self, rank: int, how: str) -> None:
        """Server `rank` died (`how`): its shard is served by its replica from now on.

        Raises:
            JobFailed: a server died before (some shard has no copy left), naming both, with the failure the
                second recorded, if any.
        """
        config, name = self.config, f"{self.config.role(rank)} (rank {rank})"
        if self.lost:
            first, said = next(iter(self.lost.items()))
            recorded = recorded_error(self.run_dir, rank)
            raise JobFailed(
                f"{name} {how}, {time.monotonic() - self.began:.1f} s into the job, after {config.role(first)} "
                f"(rank {first}) {said}: with one replica per shard the job survives one server's death, and now "
                "a shard has no copy left (--replicas 1 keeps each shard on the next server)"
                + (f":\n{recorded}" if recorded else ""),
                rank,
            )
        to = replica_server(rank, config.servers)
        record_moved(self.store, rank, to)
        self.lost[rank] = how
        print(
            f"gradsync: {name} {how}, {time.monotonic() - self.began:.1f} s into the job; its shard is served by its "
            f"replica on {config.role(to)} (rank {to}) from now on, without a replica: the job goes on",
            file=sys.stderr,
            flush=True,
        )
