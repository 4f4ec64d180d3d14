"""A server's death in a job whose shards have replicas (replicas 1), as its launcher takes it.

`supervision.supervise` hands `ServerLoss.take` each server killed by a signal or silent past step_timeout
(which the launcher kills first); a server that exits with an error of its own fails the job as before. Each
shard the dead server served is served by its replica from then on, each it kept has none
(`membership.lost_servers`), said in one line, and the job goes on. Within max_restarts the launcher starts the
server's replacement, which copies every shard left without a replica from its primary and keeps its replica
from then on; `check` says when it does, or fails the job past restart_timeout. A death that leaves a shard with
no copy (its primary dies while it has no replica) fails the job, naming the servers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.errors import JobFailed
from gradsync.core.job_names import server_name
from gradsync.launcher.restarts import say_replaced
from gradsync.membership import lost_servers
from gradsync.membership.heartbeat import Watch


class ServerLoss:
    """Where one job's shards are served and kept, the servers it has lost, and their replacements."""

    def __init__(self, config: JobConfig, store: dist.Store, start: Callable[[int, int], object] | None):
        """`start(rank, number)`: the `number`-th replacement of server `rank`, started (a RankProcess)."""
        self.config, self.store, self.start = config, store, start
        servers = config.servers
        self.primary = {s: s for s in range(servers)}  # shard -> the server rank that serves it
        self.replica: dict[int, int | None] = {s: lost_servers.replica_server(s, servers) for s in range(servers)}
        self.numbers: dict[int, int] = {}  # server rank -> replacements started
        self.down: dict[int, str] = {}  # server rank -> how it died, while no process of it runs
        self.deaths: list[str] = []  # each death so far, said
        self.coming: dict[int, tuple[int, float]] = {}  # server rank -> (its replacement's number, when it died)
        self.began = time.monotonic()

    def name(self, rank: int) -> str:
        """The RPC name of the process of server `rank` now (`JobConfig.rpc_identity`)."""
        number = self.numbers.get(rank, 0)
        return server_name(rank) + (f"_r{number}" if number else "")

    def take(self, ranks: list, rank: int, how: str, watch: Watch) -> None:
        """Server `rank` died (`how`): its shards are served by their replicas from now on; within max_restarts,
        its replacement starts (in `ranks`).

        Raises:
            JobFailed: a shard it served had no replica (an earlier death took it), naming the servers.
        """
        self.check()  # a replacement that keeps its replicas by now
        config, store, now = self.config, self.store, time.monotonic()
        said = f"{config.role(rank)} (rank {rank}) {how}, {now - self.began:.1f} s into the job"
        alone = [s for s, p in self.primary.items() if p == rank and self.replica[s] is None]
        self.deaths.append(said)
        if alone:
            raise JobFailed(
                f"{said}, serving shard {alone[0]} alone since {'; '.join(self.deaths[:-1])}: its last copy is "
                "gone, so the job cannot "
                "go on (--replicas 1 keeps one replica of each shard; --max-restarts N starts a dead server again, "
                "which then keeps the replicas again)",
                rank,
            )
        moved = []
        for s in range(config.servers):
            kept = self.replica[s]
            if self.primary[s] == rank and kept is not None:
                self.primary[s], self.replica[s] = kept, None
                lost_servers.record_primary(store, s, self.name(kept))
                moved.append(f"shard {s} is served by its replica on {config.role(kept)} (rank {kept}) from now on")
            if self.replica[s] == rank:
                self.replica[s] = None
            keeper = self.replica[s]
            lost_servers.record_replica(store, s, None if keeper is None else self.name(keeper))
        lost_servers.record_dead(store, self.name(rank))
        bare = ", ".join(str(s) for s, r in self.replica.items() if r is None)
        said = "; ".join([said, *moved])
        number = self.numbers.get(rank, 0) + 1
        if self.start is None or number > config.max_restarts:
            self.down[rank] = how
            print(f"gradsync: {said}; the job goes on, shards {bare} without a replica", file=sys.stderr, flush=True)
            return
        ranks[rank] = self.start(rank, number)
        watch.forget(rank)
        self.numbers[rank], self.coming[rank] = number, (number, now)
        print(
            f"gradsync: {said}; the job goes on, and its replacement (restart {number} of {config.max_restarts}) "
            f"copies shards {bare} from their primaries and keeps their replicas",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        """Say each replacement that keeps its replicas now.

        Raises:
            JobFailed: one does not within restart_timeout of its server's death, naming it.
        """
        for rank, (number, died) in list(self.coming.items()):
            kept = lost_servers.replicas_kept(self.store, rank, number)
            if kept is None:
                if time.monotonic() - died > self.config.restart_timeout:
                    raise JobFailed(
                        f"the replacement of {self.config.role(rank)} (rank {rank}) did not keep the replicas of "
                        f"its shards within restart_timeout ({self.config.restart_timeout:g} s) of its death",
                        rank,
                    )
                continue
            for s in kept:
                self.replica[s] = rank
            del self.coming[rank]
            say_replaced(self.config, rank, died, f"it keeps the replicas of shards {', '.join(map(str, kept))} again")
