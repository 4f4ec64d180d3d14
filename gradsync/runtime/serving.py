"""A parameter server's life after `gradsync.init`: its `ParameterServer`, the serving loop, the exit.

The server is created and installed on the job's transport before the transport starts, so no request can
arrive first (`install_server`); `serve` then opens the gRPC endpoint for the world outside the job, lets
the transport do what it needs before the workers' first calls, waits until every worker has left, writes
the final counters, and exits the process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from gradsync.core.atomic_file import write_atomically
from gradsync.core.job_names import server_name
from gradsync.membership import lost_servers, uneven_data
from gradsync.membership.lost_servers import replica_server
from gradsync.membership.member_keys import staying
from gradsync.ps.server import ParameterServer
from gradsync.runtime import checkpoints
from gradsync.runtime.cluster import Cluster
from gradsync.runtime.failures import record_failure, say_failure
from gradsync.runtime.leaving import wait_for_workers
from gradsync.transport.registry import transport


def install_server(cluster: Cluster) -> list[ParameterServer]:
    """Create this process's parameter server and make it the target of the job transport's calls; with
    replicas, the replica of the shard before too, which its primary keeps as its own (`ps.replica`). Returns
    them, this server's own first (a dead server's replacement: none yet, `keep_replicas`). The servers' own
    failure (a shard it cannot restore from the checkpoint the job resumes, an exception inside a handler:
    `ParameterServer.fail`) fails the job on this server, recorded before the worker that called sees it (the
    workers fail after it)."""
    config, resumed = cluster.config, cluster.resumed
    if config.replacement:
        return []
    resume_from = (resumed.path, resumed.manifest["servers"], checkpoints.base_of(resumed)) if resumed else None
    servers = [_server(cluster, config.rank, resume_from, server_name(replica_server(config.rank, config.servers)))]
    if config.replicated:  # the shard whose replica this server keeps
        kept = next(s for s in range(config.servers) if replica_server(s, config.servers) == config.rank)
        servers.append(_server(cluster, kept, resume_from))
    for server in servers:
        transport(config.transport).rank.install(server)
    return servers


def _server(cluster: Cluster, shard: int, resume_from=None, replica: str | None = None) -> ParameterServer:
    """A parameter server of `shard` in this process (not yet installed); with replicas, with its link to the
    server of RPC name `replica`, which keeps its replica (None: none yet)."""
    config = cluster.config

    def fail(text: str) -> None:
        say_failure(record_failure(cluster, config.rank, text))

    server = ParameterServer(
        shard,
        config.num_workers,
        config.mode,
        config.nonfinite,
        config.compression,
        config.server_device,
        config.staleness,
        resume_from,
        fail,
        config.worker_loss,
        config.replicated,
    )
    if config.replicated:
        server.link = transport(config.transport).rank.replica_link(shard, replica, config, cluster.store)
    return server


def keep_replicas(cluster: Cluster) -> list[ParameterServer]:
    """A dead server's replacement (replicas 1): copy every shard left without a replica from its primary, and
    keep its replica from then on (`ps.replica`, `membership.lost_servers`); returns their servers."""
    config, store = cluster.config, cluster.store
    rank_side, me, timeout = transport(config.transport).rank, config.rpc_identity[0], config.call_timeout
    shards = [
        s
        for s in range(config.servers)
        if lost_servers.replica(store, s, config.servers) is None and lost_servers.primary(store, s) != me
    ]
    servers = []
    for shard in shards:
        primary = lost_servers.primary(store, shard)
        server = _server(cluster, shard)
        server.adopt(rank_side.copy_shard(shard, primary, me, timeout))
        rank_side.install(server)
        rank_side.keep_shard(shard, primary, me, timeout)
        servers.append(server)
    lost_servers.record_kept(store, config.rank, config.replacement, shards)
    return servers


def serve(cluster: Cluster, servers: list[ParameterServer]) -> None:
    """Serve until every worker has left, then exit the process: 0, or 1 when the job failed (recorded here,
    unless the failure is this server's own, recorded already: an exception must not leave a process whose RPC
    agent still runs, as interpreter exit then aborts it). `servers`: this server's own shard first, then the
    replica it keeps (its counters are written too when it served its shard: `lost_servers`)."""
    from gradsync.transport.grpc.endpoint import start_endpoint  # here: importing gradsync loads no grpc

    config = cluster.config
    rank_side = transport(config.transport).rank
    code = 0
    try:
        servers = servers or keep_replicas(cluster)
        server = servers[0]
        for each in servers:
            cluster.heartbeat.on_left(each.worker_left)
            uneven_data.serve(cluster.store, each, config)
        endpoint = start_endpoint(server, cluster.store, config.step_timeout)
        rank_side.serve(server, cluster.store, config)
        wait_for_workers(cluster, deadline=None)
        for each in servers:
            if lost_servers.primary(cluster.store, each.shard_id) == config.rpc_identity[0]:
                _write_stats(each)
        rank_side.leave(config, cluster.store, config.shutdown_timeout)
        endpoint.stop()
    except BaseException:
        if config.replacement and not servers and not staying(cluster.store):
            code = 0  # the job ended while this replacement copied its shards: nothing is left to keep
        else:
            if not any(each.failed for each in servers):
                say_failure(record_failure(cluster, config.rank, traceback.format_exc()))
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_stats(server: ParameterServer) -> None:
    """The server's final counters as `stats-<shard>.json` in the run directory (`gradsync compare` reads them)."""
    from gradsync.transport.grpc.endpoint import run_dir

    if server.shard is not None:
        stats = {**server.stats(), "tables": server.table_stats()}
        write_atomically(os.path.join(run_dir(), f"stats-{server.shard_id}.json"), json.dumps(stats).encode())
