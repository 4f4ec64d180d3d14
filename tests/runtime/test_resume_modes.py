"""Checkpoints of every mode: async, ssp, hybrid and gRPC jobs killed at step 12 resume from their step-10
checkpoint with the state it holds, bit for bit, and train on (sync ones to the uninterrupted run's end)."""
import functools
import json
import os

import pytest
import torch

import gradsync
from fault_injection import Fault
from resumable import by_name, saved, train_clicks, train_mlp_with_fault
from helpers import max_diff

pytestmark = pytest.mark.job  # every test here starts processes

STEPS, KILL_AT, EVERY = 16, 12, 5
JOBS = {  # name: (strategy, mode, transport)
    "async": ("ps", "async", "rpc"),
    "ssp": ("ps", "ssp", "rpc"),
    "hybrid": ("hybrid", "sync", "rpc"),
    "hybrid-async": ("hybrid", "async", "rpc"),
    "grpc": ("ps", "sync", "grpc"),
}


def _launch(job: str, **settings) -> list:
    strategy, mode, transport = JOBS[job]
    return gradsync.launch(train_clicks, strategy=strategy, mode=mode, transport=transport, workers=2, servers=2,
                           step_timeout=20, timeout=90, checkpoint_every=EVERY, **settings)


@functools.cache
def _uninterrupted(job: str, directory: str) -> dict:
    (start, state), _ = _launch(job, args=(STEPS,), checkpoint_dir=directory)
    return state


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k], f"{what} {k}")
        else:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), f"{what} {k}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("job", list(JOBS))
def test_a_job_of_every_mode_killed_at_step_12_resumes_from_its_checkpoint(job, tmp_path):
    directory, out = str(tmp_path / "checkpoints"), str(tmp_path)
    with pytest.raises(gradsync.JobFailed, match="SIGKILL"):
        _launch(job, args=(STEPS, KILL_AT), checkpoint_dir=directory)
    resumed = _launch(job, args=(STEPS, None, out), checkpoint_dir=directory, resume=directory)
    written = saved(os.path.join(directory, "step-00000010"))
    start = torch.load(os.path.join(out, "start.pt"))
    sync = JOBS[job][1] == "sync"  # else each worker's push is a version: every shard holds both workers' first 10
    assert written["versions"] == ({0: 10, 1: 10} if sync else {0: 20, 1: 20})
    assert max_diff(start["model"], {k: written["model"][k] for k in start["model"]}) == 0  # bit for bit
    if JOBS[job][0] == "hybrid":  # the dense optimizer is the worker's; the rows' state is on the servers
        _equal(start["optimizer"]["state"], written["worker"]["optimizer"]["state"], "optimizer")
        assert start["optimizer"]["param_groups"] == written["worker"]["optimizer"]["param_groups"]
    else:  # the servers' optimizer state, keyed by parameter as the single-process optimizer's
        names = list(start["model"])
        _equal(by_name(start["optimizer"], names), written["optimizer"], "optimizer")
    assert start["optimizer"]["param_groups"][0]["lr"] == 0.01 * 0.9**9  # the lr of the checkpoint's last step
    for first, state in resumed:
        assert first == 10
        assert max_diff(state, start["model"]) > 1e-3  # it trained on
        assert all(torch.isfinite(t).all() for t in state.values())
    if sync:  # exact: the parameters of a run never killed
        reference = _uninterrupted(job, str(tmp_path / "uninterrupted"))
        assert max_diff(resumed[0][1], reference) <= 1e-6


@pytest.mark.timeout(180)
def test_an_elastic_async_job_checkpoints_without_a_worker_that_died(launch, tmp_path):
    """Worker 0 of 3 is killed at step 3: worker 1 coordinates the checkpoints of steps 5 and 10, which hold the
    two workers left, and a job of 3 resumes from step 10 (its worker 0 starts from worker 1's file)."""
    directory = str(tmp_path / "checkpoints")
    done = launch(train_mlp_with_fault, strategy="ps", mode="async", workers=3, servers=1,
                  args=(12, Fault(0, 3, "kill")), step_timeout=20, timeout=90, checkpoint_dir=directory,
                  checkpoint_every=EVERY)
    assert [d.worker for d in done.departures] == [0]
    for step in (5, 10):
        with open(os.path.join(directory, f"step-{step:08d}", "MANIFEST.json")) as f:
            assert sorted(json.load(f)["files"]) == ["shard-0.ckpt", "worker-1.ckpt", "worker-2.ckpt"]
    resumed = launch(train_mlp_with_fault, strategy="ps", mode="async", workers=3, servers=1,
                     args=(14, Fault(-1, -1, "none")), step_timeout=20, timeout=90, resume=directory)
    assert [first for first, _ in resumed] == [10, 10, 10]


@pytest.mark.timeout(180)
def test_an_async_job_checkpoints_without_a_worker_that_finished_first(launch, tmp_path):
    """Worker 1 leaves after 7 steps (fewer batches): the checkpoint of step 10 holds worker 0 alone."""
    directory = str(tmp_path / "checkpoints")
    launch(train_mlp_with_fault, strategy="ps", mode="async", workers=2, servers=1,
           args=(12, Fault(1, 7, "leave")), step_timeout=20, timeout=90, checkpoint_dir=directory,
           checkpoint_every=EVERY)
    with open(os.path.join(directory, "step-00000010", "MANIFEST.json")) as f:
        assert sorted(json.load(f)["files"]) == ["shard-0.ckpt", "worker-0.ckpt"]
