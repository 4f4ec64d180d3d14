"""The arrival barriers: every rank in `gradsync.init`, every worker at a point before a collective.

A rank's first heartbeat is its arrival: `gradsync.init` waits until every rank of the job has arrived
(`wait_for_arrivals`, bounded by startup_timeout, naming the ranks that have not), before torch's own rendezvous,
which would wait for them without a useful limit. A worker that begins to build its Trainer appends `worker,` to
the TRAINERS key, so that a worker that never builds one is named, not the worker that waited for it; under
allreduce every worker waits for every worker's Trainer before DDP's construction, and `trainer.join()` for every
worker to open its block (`wait_for_every_worker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.core.waiting import wait_until
from gradsync.membership.member_keys import parse_workers, ranks_named


def wait_for_arrivals(store: dist.Store, config: JobConfig) -> None:
    """Wait until every rank of the job has beaten once, that is, has reached `gradsync.init`. Every rank of
    the job must call it (a worker that joins a running job does not).

    Raises:
        TimeoutError: some have not within startup_timeout, naming them.
        RuntimeError: another rank failed meanwhile.
    """
    keys = [StoreKeys.ALIVE.format(rank) for rank in range(config.world_size)]

    def missing() -> list[int]:
        return [rank for rank, count in enumerate(store.multi_get(keys)) if int(count) == 0]

    def arrived() -> bool:
        if not missing():
            return True
        if store.check([StoreKeys.FAILED]):
            raise RuntimeError(f"another rank failed, stopping: {store.get(StoreKeys.FAILED).decode()[:2000]}")
        return False

    wait_until(
        arrived,
        time.monotonic() + config.startup_timeout,
        lambda: (
            f"{ranks_named(config, missing())} did not reach gradsync.init() within startup_timeout "
            f"({config.startup_timeout:.0f} s), and every rank must call it: is its script stuck before "
            "gradsync.init(), or was it never started?"
        ),
    )


def wait_for_every_worker(
    store: dist.Store, key: str, workers: int, seconds: float, late: Callable[[list[int], list[int]], Exception]
) -> None:
    """Wait until all `workers` are in the store's `worker,` list `key`: they reached a point every worker must
    reach before a collective that would wait for them without a useful limit (a DDP construction, a join block).

    Raises:
        Exception: `late(missing, arrived)` when some are not within `seconds`, naming them.
    """
    arrived = lambda: parse_workers(store.get(key))  # noqa: E731
    try:
        wait_until(lambda: len(arrived()) >= workers, time.monotonic() + seconds, f"every worker in {key}")
    except TimeoutError:
        here = arrived()
        if len(here) < workers:  # (all of them may have arrived since the last look)
            raise late(sorted(set(range(workers)) - here), sorted(here)) from None
