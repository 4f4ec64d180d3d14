"""Elastic async workers: in async and ssp ps jobs a worker that dies does not stop the job, and a new worker can
join a running async job over torch RPC; sync jobs still fail fast, naming the dead rank."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

import gradsync
from elastic_jobs import (GRAD, LR, SIZE, Constant, die_before_the_trainer, kill_the_server_at,
                          train_until_killed_mid_push, train_while_a_worker_joins)
from fault_injection import Fault, train_with_fault
from gradsync.core import settings
from gradsync.membership import heartbeat, newcomers
from gradsync.config import ConfigError, JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.launcher.scripts import _joiner_ended
from gradsync.launcher.supervision import RankProcess
from gradsync.core.buckets import ModelSpec, by_server, plan_buckets
from gradsync.membership.heartbeat import Watch
from gradsync.membership.member_keys import create_keys, record_back, record_gone, staying
from gradsync.transport.grpc.endpoint_files import job_id
from grpc_harness import make_server, model_state, served
from helpers import run_cli

STEPS = 8


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,workers,settings", [("async", 3, {}), ("ssp", 2, {"staleness": 1})])
def test_a_killed_worker_leaves_the_job_and_the_others_finish(launch, mode, workers, settings, capfd):
    killed = workers - 1  # ssp: without it the bound would hold worker 0 two steps after the kill
    results = launch(train_with_fault, strategy="ps", mode=mode, workers=workers, servers=1,
                     args=(Fault(killed, 3, "kill"), STEPS), step_timeout=20, timeout=80, **settings)
    assert list(results) == [STEPS] * (workers - 1) + [None]
    (departure,) = results.departures
    assert (departure.worker, departure.rank, departure.step, departure.how) == (killed, killed + 1, 3,
                                                                                 "killed by SIGKILL")
    err = capfd.readouterr().err
    assert f"gradsync: the job finished without a worker: worker{killed} (rank {killed + 1}) left at step 3 " \
           "(killed by SIGKILL)" in err, err


@pytest.mark.job
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_push_leaves_that_push_applied_whole_or_not_at_all_on_each_server(launch):
    """Worker 1 dies during its push of step 3: ps0 got it whole, ps1 its head and one of its 4 pieces. ps0
    applied it (one more than worker 1 saw acknowledged), ps1 never applied any of it; each server's elements
    of w moved by exactly the pushes it counts (`Constant`), and the departure says the step every server has."""
    kill_at, size, cap_mb = 3, 8 * 2**16, 0.25  # 0.25 MB pieces: 4 of them on each server
    results = launch(train_until_killed_mid_push, strategy="ps", mode="async", workers=2, servers=2,
                     args=(kill_at, size, 1), bucket_cap_mb=cap_mb, step_timeout=30, timeout=110)
    assert results[1] is None
    (departure,) = results.departures
    assert (departure.worker, departure.step, departure.how) == (1, kill_at, "killed by SIGKILL")
    stats, w = results[0]["stats"], results[0]["state"]["w"]
    assert [stats[s]["pushes_by_worker"][1] for s in (0, 1)] == [kill_at + 1, kill_at]
    spec = ModelSpec.of(dict(Constant(size).named_parameters()), {})
    for s, buckets in by_server(plan_buckets(spec.params, 2, int(cap_mb * 2**20), split=True), 2).items():
        for e in (e for b in buckets for e in b.entries):
            held = w[e.start:e.start + e.numel]
            assert torch.equal(held, torch.full_like(held, -LR * GRAD * stats[s]["pushes_applied"]))


@pytest.mark.job
@pytest.mark.timeout(60)
def test_an_async_job_whose_every_worker_dies_fails_naming_them(launch):
    with pytest.raises(gradsync.JobFailed, match=r"every worker left the job, so it cannot finish: worker0 "
                       r"\(rank 1\) left \(killed by SIGKILL\)") as info:
        launch(train_with_fault, strategy="ps", mode="async", workers=1, servers=1,
               args=(Fault(0, 1, "kill"), STEPS), timeout=50)
    assert info.value.rank == 1


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_killed_server_still_fails_an_async_job_naming_it(launch):
    with pytest.raises(gradsync.JobFailed) as info:
        launch(kill_the_server_at, strategy="ps", mode="async", workers=2, servers=1, args=(2, 50),
               timeout=50)
    assert str(info.value).startswith("rank 0 (ps0) failed with signal SIGKILL"), str(info.value)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_worker_that_dies_before_registering_fails_the_others_registration_naming_it(launch):
    start = time.monotonic()
    with pytest.raises(gradsync.JobFailed, match=r"rank 1 \(worker0\) failed with exit code 1:(.|\n)*worker 1 left "
                       r"the job before all 2 workers had registered the model with server 0"):
        launch(die_before_the_trainer, strategy="ps", mode="async", workers=2, servers=1, args=(1,),
               timeout=50)
    assert time.monotonic() - start < 30  # not after the 120 s startup_timeout


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_killed_worker_still_fails_a_sync_job_fast_naming_it(launch):
    start = time.monotonic()
    with pytest.raises(gradsync.JobFailed) as info:
        launch(train_with_fault, strategy="ps", workers=2, servers=1, args=(Fault(1, 3, "kill"), 50),
               timeout=50)
    assert str(info.value).startswith("rank 2 (worker1) failed with signal SIGKILL")
    assert time.monotonic() - start < 30


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["run-dir", "address", "init"])
def test_a_new_worker_joins_a_running_async_job_over_rpc_and_its_pushes_are_applied(launch, how):
    """README: by the run directory, by the store's address, and from any process by gradsync.init's join."""
    steps, joiner_steps = 5, 4
    result = launch(train_while_a_worker_joins, strategy="ps", mode="async", workers=2, servers=1,
                    args=(steps, joiner_steps, how), step_timeout=30, timeout=110)[0]
    assert result["code"] == 0, result["out"]
    assert "joined as worker 2 of 3" in result["out"], result["out"]
    stats = result["stats"]
    by_worker = stats["pushes_by_worker"]
    assert by_worker[1] == steps and by_worker[2] == joiner_steps and by_worker[0] > steps
    assert stats["pushes_applied"] == sum(by_worker.values()) and stats["workers_seen"] == [0, 1, 2]
    assert torch.equal(result["state"]["w"], torch.full((SIZE,), -LR * GRAD * stats["pushes_applied"]))
    first_loss = float(result["out"].split("first loss ")[1].split()[0])
    pulled = -first_loss / (SIZE * LR * GRAD)  # pushes applied before the joiner's first step: it pulled them
    assert pulled == int(pulled) and steps < pulled <= stats["pushes_applied"] - joiner_steps


def test_a_running_async_server_admits_a_worker_with_the_same_model_only():
    server = make_server("async", workers=2)
    params, buffers = model_state()
    assert server.register(7, ModelSpec.of(params, buffers), None).wait() == {}
    params["fc2.bias"] = torch.zeros(5, requires_grad=True)
    with pytest.raises(ValueError, match="worker 8's model differs from worker 0's"):
        server.register(8, ModelSpec.of(params, buffers), None).wait()
    with served(server, member=True) as (_, client):  # the joined worker, with the job's member token
        grads = {n: torch.ones_like(p) for n, p in server.shard.params.items()}
        client.push(grads, 0, worker=7)
        assert client.stats()[0]["pushes_by_worker"] == {7: 1}
    with pytest.raises(RuntimeError, match="worker 2 cannot join: server 0 runs a sync job"):
        make_server("sync", workers=2).register(2, ModelSpec.of(*model_state()), None).wait()


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))


def test_a_gone_worker_counts_as_left_and_joined_workers_are_watched(monkeypatch):
    now = [0.0]  # the watch's clock, moved by hand
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: now[0])
    store = _store()
    config = JobConfig(strategy="ps", mode="async", servers=1, world_size=3)
    create_keys(store, config.world_size, config.num_workers)
    newcomers.publish_settings(store, config)
    joiner = newcomers.joiner_config(store, "127.0.0.1", store.port, {}, 1.0)
    assert (joiner.rank, joiner.world_size, joiner.worker_rank, joiner.name) == (3, 4, 2, "worker2")
    record_gone(store, 1, "killed by SIGKILL")
    watch = Watch(config)
    assert watch.read(store) == [(1, None)] and watch.gone == {1: "killed by SIGKILL"}
    assert staying(store) == [0, 2] and len(watch.counts) == 4  # the joiner is watched from now on
    store.add(StoreKeys.ALIVE.format(0), 1)
    now[0] += 0.2
    watch.read(store)
    assert sorted(watch.silent(0.1)) == [3]  # worker 1 is gone: not silent; worker 2 has not beaten


def test_a_worker_back_in_the_job_is_watched_again_and_each_death_is_told_once():
    store = _store()
    config = JobConfig(strategy="ps", servers=1, world_size=4, worker_loss="drop", max_restarts=2)
    create_keys(store, config.world_size, config.num_workers)
    watch = Watch(config)
    record_gone(store, 1, "killed by SIGKILL")
    assert watch.read(store) == [(1, None)] and staying(store) == [0, 2]
    record_back(store, 1)  # its replacement joined
    assert watch.read(store) == [] and watch.gone == {} and 1 not in watch.left and staying(store) == [0, 1, 2]
    record_gone(store, 1, "exited with code 3")
    record_gone(store, 1, "killed by SIGKILL")  # the next replacement died before it joined
    assert watch.read(store) == [(1, None), (1, None)] and watch.gone == {1: "exited with code 3"}
    assert watch.read(store) == [] and staying(store) == [0, 2]


def test_joining_refuses_jobs_that_take_no_workers_and_other_settings(tmp_path):
    store = _store()
    newcomers.publish_settings(store, JobConfig(strategy="ps", mode="sync", servers=1, world_size=2))
    with pytest.raises(ConfigError, match=r"runs strategy='ps', mode='sync'.*workers join async ps jobs"):
        newcomers.joiner_config(store, "127.0.0.1", store.port, {}, 1.0)
    store = _store()
    newcomers.publish_settings(store, JobConfig(strategy="ps", mode="async", servers=1, world_size=2))
    with pytest.raises(ConfigError, match=r"with servers=2 \(the job runs 1\)"):
        newcomers.joiner_config(store, "127.0.0.1", store.port, {"servers": 2}, 1.0)
    with pytest.raises(ConfigError, match=r"with bucket_cap_mb=1.0 \(the job runs None: chosen at start-up"):
        newcomers.joiner_config(store, "127.0.0.1", store.port, {"bucket_cap_mb": 1.0}, 1.0)  # another bucket plan
    assert newcomers.joiner_config(store, "127.0.0.1", store.port, {}, 1.0).bucket_cap_mb is None  # the job's choice
    store = _store()
    newcomers.publish_settings(store, JobConfig(strategy="ps", mode="async", servers=1, world_size=2,
                                                bucket_cap_mb=4.0))
    with pytest.raises(ConfigError, match=r"with bucket_cap_mb=1.0 \(the job runs 4.0\)"):
        newcomers.joiner_config(store, "127.0.0.1", store.port, {"bucket_cap_mb": 1.0}, 1.0)
    assert newcomers.joiner_config(store, "127.0.0.1", store.port, {}, 1.0).bucket_cap_mb == 4.0
    with pytest.raises(ConfigError, match="has no join.json"):
        newcomers.store_address(str(tmp_path))
    newcomers.write_join_file(str(tmp_path), "127.0.0.1", 1234, "job1")
    assert newcomers.store_address(str(tmp_path)) == ("127.0.0.1", 1234, "job1")
    assert newcomers.store_address("10.0.0.5:29500") == ("10.0.0.5", 29500, "")


def test_joining_through_a_run_dir_reaches_the_job_that_run_dir_names_or_says_it_does_not(tmp_path):
    store = _store()
    job = job_id(store)
    assert job_id(store) == job and len(job) == 16  # made once, by the first caller
    newcomers.write_join_file(str(tmp_path), "127.0.0.1", store.port, job)
    joined, host, port = newcomers.connect(str(tmp_path), 5.0)
    assert (host, port, joined.get(StoreKeys.JOB_ID).decode()) == ("127.0.0.1", store.port, job)
    newcomers.write_join_file(str(tmp_path), "127.0.0.1", store.port, "0123456789abcdef")  # an ended job's file
    with pytest.raises(ConnectionError, match=f"the store at 127.0.0.1:{store.port} is job {job}'s, not job "
                                              "0123456789abcdef's that .*join.json names: that job has ended"):
        newcomers.connect(str(tmp_path), 5.0)
    unnamed = _store()  # a store no gradsync launcher or server named: another program's, or a job's without servers
    newcomers.write_join_file(str(tmp_path), "127.0.0.1", unnamed.port, job)
    with pytest.raises(ConnectionError, match=r"is job \(unnamed\)'s, not job"):
        newcomers.connect(str(tmp_path), 5.0)


@pytest.mark.job
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,transport", [("sync", "rpc"), ("async", "grpc")])
def test_run_join_refuses_a_job_it_cannot_join_before_starting_anything(mode, transport, tmp_path):
    store = _store()
    newcomers.publish_settings(store, JobConfig(strategy="ps", mode=mode, transport=transport, servers=1,
                                                world_size=2))
    started = tmp_path / "started"
    script = tmp_path / "joiner.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    done = run_cli("run", "--join", f"127.0.0.1:{store.port}", str(script), timeout=50)
    assert done.returncode == 2, done.stderr
    assert (f"gradsync: error: the job at 127.0.0.1:{store.port} runs strategy='ps', mode={mode!r}, transport="
            f"{transport!r}: workers join async ps jobs over torch RPC") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not started.exists()


class _Exited:
    """A joined worker's process as `gradsync run --join` sees it: exited with `exitcode`."""

    def __init__(self, exitcode: int):
        self.pid, self.exitcode = 0, exitcode


def test_a_joined_worker_that_left_is_no_failure_when_the_job_and_its_store_are_gone_before_it_exits(
        tmp_path, monkeypatch):
    # the chaos soak's race: the joined worker's gradsync.shutdown() was the job's last, the job ended (its store
    # with it), and its process exited 0 after that: `gradsync run --join` reported it failed, exit 1
    store = _store()
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=2))
    del store  # the job's end
    monkeypatch.setenv(settings.JOIN_INDEX_FILE.env, str(tmp_path / "index-0"))
    newcomers.note_left(5)  # what its gradsync.shutdown() writes
    assert newcomers.read_index_file(str(tmp_path / "index-0")) == (5, True)
    assert _joiner_ended(RankProcess(0, _Exited(0)), str(tmp_path), client, "exited with code 0") == []
    (tmp_path / "index-0").write_text("5")  # joined, never left: still a failure
    (failure,) = _joiner_ended(RankProcess(0, _Exited(0)), str(tmp_path), client, "exited with code 0")
    assert failure.startswith("worker5 (joined) exited without calling gradsync.shutdown(), and the job's store is "
                              "gone"), failure
