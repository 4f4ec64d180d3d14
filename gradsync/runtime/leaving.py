"""Leaving the job: `gradsync.shutdown` on a worker, and the wait for every worker to leave (a worker's
shutdown, bounded; a server's whole job)."""

from __future__ import annotations

import contextlib
import sys
import time

import torch.distributed as dist

from gradsync.core.job_names import StoreKeys, worker_name
from gradsync.core.waiting import wait_until
from gradsync.membership import newcomers
from gradsync.membership.member_keys import record_gone, staying
from gradsync.runtime import cluster as job
from gradsync.transport.registry import transport


def wait_for_workers(cluster: job.Cluster, deadline: float | None) -> list[int]:
    """Wait until every worker has left the job (or, in an elastic job, is gone), or until `deadline`
    (time.monotonic()); returns the workers still in it.

    Raises:
        RuntimeError: another rank failed; or, with no deadline (a server, which waits the whole job), a rank
            has sent no heartbeat for step_timeout: the job cannot go on without it. A worker that joined an
            elastic job is recorded gone instead: no launcher of the job watches it.
    """
    config, store, watch = cluster.config, cluster.store, cluster.heartbeat.watch

    def all_left() -> bool:
        if not staying(store):
            return True
        if store.check([StoreKeys.FAILED]):
            raise RuntimeError(f"another rank failed, stopping: {store.get(StoreKeys.FAILED).decode()[:2000]}")
        silent = watch.silent(config.call_timeout) if deadline is None else {}
        for rank in [r for r in silent if config.elastic and r >= config.world_size]:
            record_gone(store, rank - config.servers, f"sent no heartbeat for {silent.pop(rank):.0f} s")
        if config.replicated:  # a silent server's shard moves to its replica, as its launcher decides
            silent = {rank: s for rank, s in silent.items() if rank >= config.servers}
        if silent:
            raise RuntimeError(
                f"{watch.describe(silent)} (step_timeout {config.step_timeout:.0f} s): it is "
                "stopped, hung or dead, and the job cannot go on without it"
            )
        return False

    with contextlib.suppress(TimeoutError):  # the caller names the workers still in the job
        wait_until(all_left, deadline, "every worker to leave the job")
    return staying(store)


def shutdown() -> None:
    """Leave the job. Every worker must call it; it returns within shutdown_timeout whatever the others do.

    Marks this worker as left (a peer waiting for a step with it fails at once, naming it), waits for the
    other workers to leave too (RPC's graceful shutdown needs every rank), then stops the process group and
    RPC; when some have not left by the timeout, it says which and stops without them. A worker of an
    elastic job waits for no one: it stops its RPC agent once its own calls are answered (`RpcRank.leave`).
    Raises:
        RuntimeError: another rank failed (waiting for the others).
    """
    cluster = job.running()
    if cluster is None:
        return
    job.set_running(None)
    config = cluster.config
    deadline = time.monotonic() + config.shutdown_timeout
    for leave in cluster.leaving:  # while the servers (sharded: the other workers) still answer
        try:
            leave()
        except Exception as e:  # noqa: BLE001 -- any failure: said, and the worker leaves all the same
            print(
                f"gradsync: worker {config.worker_rank} could not gather its model's tables at shutdown, and "
                f"its module keeps them served ({type(e).__name__}: {e})",
                file=sys.stderr,
                flush=True,
            )
    # Store.append: missing from torch's stubs
    cluster.store.append(StoreKeys.LEFT, f"{config.worker_rank}:{cluster.steps},")  # type: ignore[attr-defined]
    newcomers.note_left(config.worker_rank)
    others = None  # the workers still in the job (None: not waited for)
    try:
        if not config.elastic:
            others = wait_for_workers(cluster, deadline)
        if others:
            print(
                f"gradsync: shutdown waited {config.shutdown_timeout:.0f} s (shutdown_timeout) for "
                f"{', '.join(worker_name(w) for w in others)} to leave the job; leaving without them",
                file=sys.stderr,
                flush=True,
            )
    finally:
        cluster.heartbeat.stop(max(deadline - time.monotonic(), 1.0))
        if cluster.has_process_group:
            dist.destroy_process_group()
        transport(config.transport).rank.leave(
            config, cluster.store, max(deadline - time.monotonic(), 1.0), at_once=others != []
        )
