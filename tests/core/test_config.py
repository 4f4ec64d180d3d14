"""JobConfig: environment parsing and clear refusals."""
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
