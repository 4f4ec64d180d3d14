"""Start-up: a process without a launcher or a strategy is refused at once, saying how to start it; a rank that
never reaches gradsync.init() or never builds its Trainer is named within startup_timeout (not the rank that
waited for it) on every strategy, mode and transport; a rank that never calls init() dies with its launcher."""
import os
import signal
import subprocess
import sys

import pytest

import gradsync
from fault_injection import sample_without_arguments, train_without_one_trainer
from gradsync.config import ConfigError, JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.membership.arrivals import wait_for_arrivals
from gradsync.membership.member_keys import create_keys
from helpers import CLI, ROOT, SUPPORT, run_cli
import killed_launcher

STARTUP_TIMEOUT = 8  # from each rank's start: forked from the launcher's fork server, the ranks that do arrive
# reach gradsync.init() within ~1 s, 2 s while the other pytest worker starts a job too


def _without_job_environment() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("GRADSYNC_") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_script_started_without_a_launcher_fails_at_once_saying_how_to_start_it():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "digits.py")], capture_output=True,
                          text=True, timeout=50, env=_without_job_environment())
    assert done.returncode == 1
    assert "gradsync.init() found no launcher (WORLD_SIZE is not set)" in done.stderr, done.stderr
    assert "gradsync run --strategy ps --workers 2 SCRIPT" in done.stderr and "torchrun" in done.stderr


def test_torchrun_without_a_strategy_is_refused_naming_GRADSYNC_STRATEGY(monkeypatch):
    monkeypatch.setattr(os, "environ", {**_without_job_environment(), "RANK": "0", "WORLD_SIZE": "2",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="no strategy: set GRADSYNC_STRATEGY to ps, allreduce, hybrid or sharded"):
        gradsync.init()


def test_the_arrival_wait_names_every_rank_that_has_not_arrived(store):
    config = JobConfig(strategy="ps", servers=1, world_size=3, startup_timeout=0.5)
    create_keys(store, config.world_size, config.num_workers)
    store.add(StoreKeys.ALIVE.format(0), 1)
    with pytest.raises(TimeoutError, match=r"rank 1 \(worker0\), rank 2 \(worker1\) did not reach gradsync.init\(\) "
                                           r"within startup_timeout \(0 s\)"):
        wait_for_arrivals(store, config)


_LATE = """import os, sys, time
if os.environ["RANK"] == "{late}":
    time.sleep(3600)  # stuck before gradsync.init()
sys.path.insert(0, {support!r})
import gradsync, fault_injection
gradsync.init()
fault_injection.train_with_fault(fault_injection.Fault(-1, -1, "none"), 3)
gradsync.shutdown()
"""


@pytest.mark.job
@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [["--strategy", "ps", "--mode", "async"], ["--strategy", "allreduce"]],
                         ids=["ps-async", "allreduce"])
def test_a_rank_that_never_reaches_init_is_named_within_the_startup_timeout(flags, tmp_path):
    """One case per layout of the ranks (ps: a server first; allreduce: workers only). Mode and transport are
    not cases: init() waits for every rank's arrival (runtime/cluster.py) before anything they decide, and the
    launcher names the absent rank from the store, whatever the job."""
    script = tmp_path / "late.py"
    late = 2 if "ps" in flags else 1  # worker1
    script.write_text(_LATE.format(late=late, support=SUPPORT))
    done = run_cli("run", *flags, "--workers", "2", "--startup-timeout", str(STARTUP_TIMEOUT), str(script),
                   timeout=140)
    assert done.returncode == 1
    headline = done.stderr[done.stderr.index("gradsync: rank"):]
    assert headline.startswith(f"gradsync: rank {late} (worker1) did not reach gradsync.init() within "
                               f"startup_timeout ({STARTUP_TIMEOUT} s)"), done.stderr


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers,mode", [("ps", 1, "sync"), ("ps", 1, "async"), ("allreduce", 0, "sync")])
def test_a_worker_that_never_builds_its_trainer_is_named_not_the_one_that_waited(launch, strategy, servers, mode):
    """Within the startup timeout under every strategy: the step timeout is longer than the job's own timeout (DDP's
    construction, a collective, would wait for the missing worker as long as the step timeout)."""
    with pytest.raises(gradsync.JobFailed) as info:
        launch(train_without_one_trainer, strategy=strategy, workers=2, servers=servers, mode=mode,
               args=(1, 3), startup_timeout=8, step_timeout=120, timeout=100)
    message = str(info.value)
    assert message.startswith(f"rank {servers + 1} (worker1): no gradsync.Trainer built "), message
    assert f"\nthen rank {servers} (worker0) failed" in message
    assert message.count("no gradsync.Trainer built") == 1, message  # the waiting rank's hint says it too


_DDP_SCRIPT = """import torch.distributed as dist
dist.init_process_group("gloo")  # an unported DDP script: no gradsync.init()
"""


_UNGUARDED_LAUNCH = """import gradsync
print(gradsync.launch(gradsync.worker_rank, strategy="allreduce", workers=1, servers=0, timeout=60))
"""


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_launch_script_without_a_main_guard_is_told_to_add_one(launch, tmp_path):
    """Each rank imports the script that called gradsync.launch; without the guard it would launch again."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_LAUNCH)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80, cwd=tmp_path,
                          env=_without_job_environment())
    assert done.returncode == 1
    assert ("RuntimeError: gradsync.launch() was called again while a rank imported your script (each rank "
            "imports the script that called launch, to find the function it runs): put the call under "
            '`if __name__ == "__main__":`') in done.stderr
    assert 'a script that calls gradsync.launch must call it under `if __name__ == "__main__":`' in done.stderr


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_script_that_never_calls_init_is_told_to(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT)
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", str(script), timeout=80)
    assert done.returncode == 1
    assert "gradsync: rank 0 (worker0) failed with exit code 1 before it reached gradsync.init()" in done.stderr
    assert "every script that gradsync runs must call gradsync.init() first" in done.stderr


@pytest.mark.job
@pytest.mark.timeout(90)
def test_distributed_sampler_without_arguments_under_ps_names_the_arguments_to_give(launch):
    with pytest.raises(gradsync.JobFailed) as info:
        launch(sample_without_arguments, strategy="ps", workers=2, timeout=80)
    assert "Default process group has not been initialized" in str(info.value)
    assert "DistributedSampler(dataset, num_replicas=gradsync.num_workers(), rank=gradsync.worker_rank())" \
        in str(info.value)
    halves = launch(sample_without_arguments, strategy="allreduce", workers=2, timeout=80)
    assert sorted(halves[0] + halves[1]) == list(range(10))  # allreduce has a process group: it works as in DDP


_FOREVER_BEFORE_INIT = """import time
{pid_file}
time.sleep(3600)
"""


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_rank_that_never_calls_init_dies_with_a_killed_launcher(tmp_path):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = tmp_path / "forever.py"
    script.write_text(_FOREVER_BEFORE_INIT.format(pid_file=killed_launcher.pid_file_code(pids_dir)))
    command = [*CLI, "run", "--strategy", "ps", "--workers", "2", str(script)]
    with killed_launcher.started(command, tmp_path / "stderr") as launcher:
        launcher.wait_for(lambda: all((pids_dir / str(rank)).exists() for rank in range(3)), "the ranks did not start")
        launcher.watched = killed_launcher.read_pids(pids_dir, 3)
        launcher.stop(signal.SIGKILL)
        assert launcher.survivors(within=5) == []
