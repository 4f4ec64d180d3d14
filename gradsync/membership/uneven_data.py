"""Joining under the parameter servers (`trainer.join()`): how a worker that ran out of data tells the servers.

A worker that leaves its `trainer.join()` block appends an event to the rendezvous store (`JOINS` numbers
them; `JOINED/<n>` names the worker), so every transport uses one path. On each server a thread waits on the
store for the next event and tells the server's consistency rule at once: a sync step then averages over the
workers still active. When a server has seen every worker join, the round is over: its rule makes every
worker active again, and it marks the round done in the store (`JOIN_DONE/<round>/<shard>`). A joined worker
waits for that mark from every server before it leaves the block, so every worker leaves it at the final
state, and none can start a new round (the next epoch) on a server that still counts it as joined.

The wait is bounded as the job's other waits are: it fails when another rank failed, when a rank has sent no
heartbeat for step_timeout, or when a worker left the job (or, in an async or ssp job, died) without joining.
Under worker_loss drop a worker that died counts as joined: the steps go on without it, and so does the round.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys, worker_name
from gradsync.core.waiting import wait_until
from gradsync.membership.heartbeat import Heartbeat, interval
from gradsync.membership.member_keys import parse_gone, parse_left

if TYPE_CHECKING:
    from gradsync.ps.server import ParameterServer

_LISTEN = datetime.timedelta(hours=1)  # a server's listener waits as long as the job runs; this bounds each wait


class Joiner:
    """A worker's side: announce that it joined, and wait until every server has seen every worker join."""

    def __init__(self, store: dist.Store, config: JobConfig, heartbeat: Heartbeat, servers: list[int]):
        self.store, self.config, self.heartbeat = store, config, heartbeat
        self.servers = servers
        self.round = 0  # the join blocks this worker has left

    def announce(self) -> None:
        """Tell every server, through the store, that this worker has no more data this round."""
        event = self.store.add(StoreKeys.JOINS, 1)
        self.store.set(StoreKeys.JOINED.format(event), str(self.config.worker_rank))

    def wait(self) -> None:
        """Wait until every server has seen every worker join this round.

        Raises:
            RuntimeError: another rank failed, a rank fell silent for step_timeout, or a worker left the job
                without joining (naming it).
        """
        store, config, watch = self.store, self.config, self.heartbeat.watch
        keys = [StoreKeys.JOIN_DONE.format(self.round, s) for s in self.servers]
        waiting = f"worker {config.worker_rank} waits in trainer.join() for the others to run out of data"

        def all_joined() -> bool:
            if store.check(keys):
                return True
            if store.check([StoreKeys.FAILED]):
                raise RuntimeError(
                    f"another rank failed while {waiting}: {store.get(StoreKeys.FAILED).decode()[:2000]}"
                )
            left = parse_left(store.get(StoreKeys.LEFT))
            if left:
                worker, steps = next(iter(left.items()))
                raise RuntimeError(
                    f"{worker_name(worker)} left the job after {steps} steps without joining, and {waiting}: "
                    "with trainer.join(), every worker must train inside its `with trainer.join():` block"
                )
            gone = parse_gone(store.get(StoreKeys.GONE)) if config.worker_loss != "drop" else {}
            if gone:  # a worker of an async or ssp job died: it will never join (under drop it counts as joined)
                worker, how = next(iter(gone.items()))
                raise RuntimeError(f"{worker_name(worker)} left the job ({how}) without joining, and {waiting}")
            silent = watch.silent(config.step_timeout)
            if silent:
                raise RuntimeError(
                    f"{watch.describe(silent)} (step_timeout {config.step_timeout:.0f} s), and "
                    f"{waiting}: it is stopped, hung or dead"
                )
            return False

        wait_until(all_joined, None, waiting)  # bounded by the liveness checks: a silent rank raises
        self.round += 1


def serve(store: dist.Store, server: ParameterServer, config: JobConfig) -> None:
    """On a server: tell `server` of every worker that joins, as it joins (a daemon thread of its own)."""
    threading.Thread(
        target=_listen,
        # Store.clone: missing from torch's stubs
        args=(store.clone(), server, config),  # type: ignore[attr-defined]
        name="gradsync-joins",
        daemon=True,
    ).start()


def _listen(store: dist.Store, server: ParameterServer, config: JobConfig) -> None:
    """A round is over once every worker has joined, or (worker_loss drop) every worker the server's steps do not go
    on without: then its mark. Under drop it looks again every heartbeat interval, for a worker that dies once the
    others have joined ends the round too."""
    event, rounds, joined = 1, 0, set()
    wait = datetime.timedelta(seconds=interval(config.step_timeout)) if config.worker_loss == "drop" else _LISTEN
    everyone = set(range(config.num_workers))
    while True:
        key = StoreKeys.JOINED.format(event)
        try:
            store.wait([key], wait)
            worker = int(store.get(key))
            event += 1
            server.worker_joined(worker)
            joined.add(worker)
        except dist.DistStoreError:  # no join within the wait: wait again
            pass
        except dist.DistError:  # the store is gone: the job is ending
            return
        if joined and joined | server.dropped() >= everyone:
            store.set(StoreKeys.JOIN_DONE.format(rounds, server.shard_id), "1")
            rounds, joined = rounds + 1, set()
