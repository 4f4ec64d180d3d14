"""JobConfig: environment parsing and clear refusals."""
import re

import pytest

from gradsync.config import ConfigError, JobConfig


def test_torchrun_environment_makes_the_first_ranks_servers():
    env = {"RANK": "2", "WORLD_SIZE": "5", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400",
           "GRADSYNC_SERVERS": "2", "GRADSYNC_MODE": "async", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    config = JobConfig.from_env(env)
    assert (config.strategy, config.mode, config.servers, config.num_workers) == ("ps", "async", 2, 3)
    assert not config.is_server and config.worker_rank == 0 and config.name == "worker0"
    assert config.store_is_hosted and config.master_port == 29400
    assert JobConfig.from_env(dict(env, RANK="1")).name == "ps1"


def test_settings_survive_the_trip_through_the_environment():
    config = JobConfig(strategy="ps", servers=2, world_size=4, step_timeout=7.5, nonfinite="skip",
                       checkpoint_dir="ckpt", checkpoint_every=5, resume="old")
    again = JobConfig.from_env({**config.to_env(), "WORLD_SIZE": "4"})
    assert (again.step_timeout, again.nonfinite, again.servers) == (7.5, "skip", 2)
    assert (again.checkpoint_dir, again.checkpoint_every, again.resume) == ("ckpt", 5, "old")


def test_sharded_has_no_servers_unless_asked():
    config = JobConfig.from_env({"GRADSYNC_STRATEGY": "sharded", "WORLD_SIZE": "4"})
    assert (config.servers, config.num_workers, config.mode) == (0, 4, "sync")


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"GRADSYNC_STEP_TIMEOUT": "soon"}, "GRADSYNC_STEP_TIMEOUT='soon' is not a number"),
        ({"GRADSYNC_STEP_TIMEOUT": "-1"}, "step_timeout must be > 0"),
        ({"RANK": "4", "WORLD_SIZE": "3"}, "rank 4 is outside 0..2"),
        ({"WORLD_SIZE": "2", "GRADSYNC_SERVERS": "2"}, "leaves no workers"),
        ({"GRADSYNC_COMPRESSION": "zip"}, "unknown compression 'zip'"),
        ({"GRADSYNC_SERVER_DEVICE": "gpu0"}, "server_device 'gpu0' is not a device"),
        ({"GRADSYNC_STRATEGY": "allreduce", "GRADSYNC_SERVERS": "1", "WORLD_SIZE": "3"}, "pass --servers 0"),
        ({"GRADSYNC_STRATEGY": "sharded", "GRADSYNC_SERVERS": "1", "WORLD_SIZE": "3"}, "the sharded strategy uses "
                                                                                      "no servers, got servers=1"),
        ({"GRADSYNC_STRATEGY": "sharded", "GRADSYNC_MODE": "ssp"}, r"the sharded strategy is synchronous .*, got "
                                                                   "--mode ssp: pass --mode sync"),
        ({"GRADSYNC_CHECKPOINT_EVERY": "5"}, "checkpoint_dir='': pass both --checkpoint-dir DIR and --checkpoint"),
    ],
)
def test_bad_environment_is_refused_with_the_value_and_the_fix(env, match):
    with pytest.raises(ConfigError, match=match):
        JobConfig.from_env(env)


@pytest.mark.parametrize("settings,refusal", [
    (dict(worker_loss="drop", max_restarts=2, mode="ssp"), "worker_loss='drop' with max_restarts=2 and mode='ssp': "
                                                           "a dropped worker's replacement joins a sync job at a step"),
    (dict(worker_loss="drop", max_restarts=1, transport="grpc"), "the grpc transport does not yet: use --transport"),
    (dict(worker_loss="drop", strategy="allreduce", servers=0),
     "worker_loss='drop' is available for ps sync/async/ssp jobs so far, got strategy='allreduce'"),
    (dict(replicas=2), "replicas=2: pass --replicas 1"),
    (dict(replicas=1), "replicas=1 with strategy='ps', mode='sync', transport='rpc', servers=1: a replica of "
                       "each shard is kept in ps sync/async jobs over torch RPC with two servers or more so far"),
    (dict(replicas=1, servers=2, mode="ssp"), "mode='ssp'"),
    (dict(replicas=1, servers=2, transport="grpc"), "transport='grpc'"),
    (dict(replicas=1, servers=2, pipeline="on"), "replicas=1 with pipeline='on'"),
    (dict(replicas=1, servers=2, worker_loss="drop"),
     "replicas=1 with worker_loss='drop': servers that keep each other's shards do not yet go on without a dead"),
    (dict(max_restarts=-1), "max_restarts=-1: pass --max-restarts N with N >= 0"),
    (dict(worker_loss="gone"), "unknown worker_loss policy 'gone': expected one of 'fail', 'wait', 'drop'"),
    (dict(worker_loss="wait", strategy="sharded", servers=0),
     "worker_loss='wait' is available for ps sync/async/ssp, allreduce sync jobs so far, got strategy='sharded'"),
    (dict(worker_loss="wait", transport="grpc"),
     "the grpc transport does not yet: use --transport rpc"),
])
def test_fault_settings_are_refused_with_the_fix(settings, refusal):
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        JobConfig(world_size=3, **settings)


def test_a_replacement_has_a_name_and_rank_of_its_own_in_the_rpc_group():
    assert JobConfig(world_size=4, servers=1, rank=2).rpc_identity == ("worker1", 2)
    assert JobConfig(world_size=4, servers=1, rank=2, replacement=1).rpc_identity == ("worker1_r1", 5)
    assert JobConfig(world_size=4, servers=1, rank=2, replacement=2).rpc_identity == ("worker1_r2", 8)
    waits = JobConfig(world_size=3, worker_loss="wait", step_timeout=5.0, restart_timeout=7.0)
    assert waits.dynamic_group and waits.call_timeout == 12.0 and JobConfig(world_size=3).call_timeout == 60.0
    readmits = JobConfig(world_size=3, worker_loss="drop", max_restarts=1, step_timeout=5.0, restart_timeout=7.0)
    assert readmits.readmits_workers and not readmits.replaces_workers and readmits.call_timeout == 12.0
