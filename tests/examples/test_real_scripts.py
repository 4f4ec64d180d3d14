"""A script in the shape users bring (examples/snapshots.py: argparse, DataLoader workers of every start method,
bfloat16 autocast, a snapshot in the working directory with the script's own optimizer object) runs as it is
under `gradsync compare` and `gradsync run`, ps and allreduce: loader workers of any start method give the losses
of loading in the training process, every run of the compare trains every epoch in its own working directory,
and a second `gradsync run` resumes the first's snapshot to the state of one run straight through."""
import json
import os

import pytest
import torch

from helpers import ROOT, run_cli

pytestmark = pytest.mark.job  # every test here starts processes

SCRIPT = os.path.join(ROOT, "examples", "snapshots.py")
ARGS = ["--losses", "losses.json", "--loader-workers", "1", "--amp"]


def _losses(directory) -> dict:
    with open(os.path.join(directory, "losses.json")) as f:
        return json.load(f)


def _run(cwd, strategy: str, *args: str) -> dict:
    """`gradsync run` of the script in `cwd` (where it keeps snapshot.pt); worker 0's losses."""
    done = run_cli("run", "--strategy", strategy, "--workers", "2", "--timeout", "150", SCRIPT, *ARGS, *args,
                   timeout=170, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(cwd)


@pytest.mark.timeout(420)
def test_loader_workers_of_every_start_method_under_compare_and_a_resumed_snapshot_match_plain_runs(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    done = run_cli("compare", "--out", str(tmp_path / "report"), "--strategies", "allreduce,ps", "--servers", "1",
                   "--modes", "sync", SCRIPT, *ARGS, "--epochs", "4", "--loaders", "default,fork,spawn,forkserver",
                   timeout=260, cwd=project)
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.listdir(project) == []  # each run wrote in its own copy of the working directory
    for strategy, slug in (("allreduce", "allreduce"), ("ps", "ps_sync_S1")):
        workdir = tmp_path / "report" / "runs" / slug / "workdir"
        every = _losses(workdir)
        plain = tmp_path / strategy
        plain.mkdir()
        first = _run(plain, strategy, "--epochs", "2", "--loaders", "none")
        resumed = _run(plain, strategy, "--epochs", "4", "--loaders", "none")
        assert every["first_epoch"] == 0 and first["first_epoch"] == 0 and resumed["first_epoch"] == 2
        assert len(every["losses"]) == 4 and every["losses"][0] > every["losses"][-1]  # it learns
        assert first["losses"] + resumed["losses"] == pytest.approx(every["losses"], rel=1e-6, abs=0)
        a, b = torch.load(workdir / "snapshot.pt"), torch.load(plain / "snapshot.pt")
        assert a["epochs_run"] == b["epochs_run"] == 4
        for key, value in a["model"].items():
            torch.testing.assert_close(value, b["model"][key], rtol=1e-5, atol=1e-7)
        momentum = {i: s["momentum_buffer"] for i, s in a["optimizer"]["state"].items()}
        assert len(momentum) == 4 and all(m.abs().sum() > 0 for m in momentum.values())  # the real state was saved
        for i, m in momentum.items():
            torch.testing.assert_close(m, b["optimizer"]["state"][i]["momentum_buffer"], rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
def test_loader_workers_of_every_start_method_in_a_rank_of_gradsync_launch(launch):
    import gradsync
    from real_loops import loader_batches

    batches = launch(loader_batches, strategy="allreduce", workers=1, timeout=110,
                     args=((None, "fork", "spawn", "forkserver"),))[0]
    assert len(batches["none"]) == 6
    for name in ("None", "fork", "spawn", "forkserver"):
        assert len(batches[name]) == 6 and all(torch.equal(a, b) for a, b in zip(batches[name], batches["none"]))
