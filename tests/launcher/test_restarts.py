"""The launcher's side of worker_loss wait, in one process: who may be replaced, what starting a replacement clears
of the dead process, the lines it says, and a failure's headline once the worker's restarts are spent."""
import time

import pytest
import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.errors import JobFailed
from gradsync.core.job_names import StoreKeys
from gradsync.launcher.restarts import Restarts, death, replacement_environment
from gradsync.membership.heartbeat import Watch
from gradsync.membership.member_keys import create_keys
from gradsync.membership.rank_reports import error_file
from gradsync.runtime.replacement import say_rejoined


def test_a_worker_is_replaced_within_its_restarts_and_what_its_dead_process_left_is_cleared(tmp_path, capsys):
    config = JobConfig(world_size=3, servers=1, worker_loss="wait", max_restarts=1, restart_timeout=5.0)
    store = dist.HashStore()
    create_keys(store, config.world_size, config.num_workers)
    store.set(StoreKeys.FAILED, "rank 2: Traceback ...")
    store.append(StoreKeys.EXITED, "1,0,")
    with open(error_file(str(tmp_path), 2), "w") as f:
        f.write("its traceback")
    started = []
    restarts = Restarts(config, store, str(tmp_path), lambda rank, n: started.append((rank, n)) or f"process {n}")
    ranks, watch = ["ps0", "worker0", "worker1"], Watch(config)
    watch.moved[2] = watch.placed[2] = 1.0  # the dead process had beaten
    assert not restarts.take(ranks, 0, death(-9), watch)  # a server: never
    assert restarts.take(ranks, 2, death(-9), watch) and ranks[2] == "process 1" and started == [(2, 1)]
    assert not store.check([StoreKeys.FAILED]) and store.get(StoreKeys.EXITED) == b"0,"
    assert not (tmp_path / error_file("", 2)).exists() and watch.moved[2] is None
    assert "worker1 (rank 2) was killed by SIGKILL" in capsys.readouterr().err
    restarts.check()  # not yet rejoined, not yet late
    say_rejoined(store, 1, 1, 7)
    restarts.check()
    err = capsys.readouterr().err
    assert "worker1 (rank 2) replaced" in err and "the replacement continues from step 7" in err
    assert not restarts.allows(2) and not restarts.take(ranks, 2, death(1), watch)  # its one restart is spent
    failed = restarts.spent(JobFailed("rank 2 (worker1) failed with exit code 1:\nTraceback", 2))
    assert str(failed) == "rank 2 (worker1) failed with exit code 1 (1 of max_restarts 1 restarts spent):\nTraceback"
    assert replacement_environment(2) == {"GRADSYNC_REPLACEMENT": "2", "TORCHELASTIC_RESTART_COUNT": "2"}


def test_a_replacement_late_past_restart_timeout_fails_the_job_naming_the_worker(tmp_path):
    config = JobConfig(world_size=2, servers=1, worker_loss="wait", max_restarts=2, restart_timeout=0.01)
    store = dist.HashStore()
    create_keys(store, config.world_size, config.num_workers)
    restarts = Restarts(config, store, str(tmp_path), lambda rank, n: object())
    ranks = ["ps0", "worker0"]
    restarts.take(ranks, 1, death(-9), Watch(config))
    time.sleep(0.05)
    with pytest.raises(JobFailed, match=r"rank 1 \(worker0\) was killed by SIGKILL, and its replacement did not "
                                        r"rejoin the job within restart_timeout \(0.01 s"):
        restarts.check()
