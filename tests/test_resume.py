"""Checkpoint and exact resume: a sync job killed at step 12 resumes from its last complete checkpoint and ends
where an uninterrupted run ends."""
import functools
import json
import os
import shutil

import pytest
import torch

import gradsync
from faults import build_wider, train_resumable
from gradsync.ps import checkpoint
from gradsync.runtime import resume
from jobs import make_mlp
from helpers import gradsync_run, max_diff

TESTS = os.path.dirname(os.path.abspath(__file__))

STEPS, KILL_AT, EVERY = 20, 12, 5
JOBS = [("ps", 2), ("allreduce", 0)]


def _launch(strategy: str, servers: int, optimizer: str, workers: int = 2, steps: int = STEPS, kill_at=None,
            **settings) -> list:
    return gradsync.launch(train_resumable, strategy=strategy, workers=workers, servers=servers,
                           args=(steps, optimizer, kill_at), step_timeout=20, timeout=60, **settings)


@functools.cache
def _uninterrupted(strategy: str, servers: int, optimizer: str) -> dict:
    (start, state), _ = _launch(strategy, servers, optimizer)
    assert start == 0 and max_diff(state, make_mlp().state_dict()) > 1e-2
    return state


def _killed_at_12(strategy: str, servers: int, optimizer: str, directory: str) -> None:
    with pytest.raises(gradsync.JobFailed, match="SIGKILL"):
        _launch(strategy, servers, optimizer, kill_at=KILL_AT, checkpoint_dir=directory, checkpoint_every=EVERY)
    assert sorted(os.listdir(directory)) == ["step-00000005", "step-00000010"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("strategy,servers", JOBS)
def test_a_job_killed_at_step_12_resumes_to_the_uninterrupted_parameters(strategy, servers, optimizer, tmp_path):
    directory = str(tmp_path / "checkpoints")
    _killed_at_12(strategy, servers, optimizer, directory)
    resumed = _launch(strategy, servers, optimizer, checkpoint_dir=directory, checkpoint_every=EVERY,
                      resume=directory)
    reference = _uninterrupted(strategy, servers, optimizer)
    for start, state in resumed:
        assert start == 10
        assert max_diff(state, reference) <= 1e-6
    assert sorted(os.listdir(directory))[-2:] == ["step-00000015", "step-00000020"]  # the resumed job goes on writing


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damage", ["corrupt shard", "no manifest", "another step's file"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_complete_one(damage, tmp_path):
    directory = str(tmp_path / "checkpoints")
    _killed_at_12("ps", 2, "sgd", directory)
    newest = os.path.join(directory, "step-00000010")
    if damage == "corrupt shard":
        with open(os.path.join(newest, "shard-1.ckpt"), "r+b") as f:
            f.seek(-5, os.SEEK_END)
            f.write(b"\0\1\2\3\4")
    elif damage == "no manifest":
        os.remove(os.path.join(newest, "MANIFEST.json"))
    else:  # intact, but not the file the manifest names
        shutil.copy(os.path.join(directory, "step-00000005", "worker-1.ckpt"), os.path.join(newest, "worker-1.ckpt"))
    resumed = _launch("ps", 2, "sgd", resume=directory)
    for start, state in resumed:
        assert start == 5
        assert max_diff(state, _uninterrupted("ps", 2, "sgd")) <= 1e-6


@pytest.mark.timeout(150)
def test_resume_refuses_a_checkpoint_of_another_strategy_or_model(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _launch("ps", 2, "sgd", steps=EVERY, checkpoint_dir=directory, checkpoint_every=EVERY)
    with pytest.raises(gradsync.JobFailed, match=r"written by a job with strategy='ps', and this job has "
                                                 r"strategy='allreduce': resume with --strategy ps"):
        _launch("allreduce", 0, "sgd", resume=directory)
    with pytest.raises(gradsync.JobFailed, match=r"holds a different model: '0.weight' is \[\[16, 8\], "
                                                 r"'torch.float32'\] there and \[\[17, 8\], 'torch.float32'\]"):
        gradsync.launch(build_wider, strategy="ps", workers=2, servers=2, resume=directory, step_timeout=20,
                        timeout=60)


@pytest.mark.timeout(150)
def test_gradsync_run_flags_checkpoint_and_resume(tmp_path):
    directory, out = str(tmp_path / "checkpoints"), str(tmp_path / "state.pt")
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys; sys.path[:0] = [{TESTS!r}, {os.path.dirname(TESTS)!r}]\n"
        "import torch, gradsync\nfrom faults import train_resumable\n"
        "gradsync.init()\nresult = train_resumable(int(sys.argv[1]), 'sgd')\n"
        "if gradsync.worker_rank() == 0:\n    torch.save(result, sys.argv[2])\ngradsync.shutdown()\n"
    )
    flags = ["--strategy", "allreduce", "--workers", "2", "--checkpoint-dir", directory, "--checkpoint-every", "5"]
    done = gradsync_run(*flags, "--timeout", "50", str(script), "12", out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(directory)) == ["step-00000005", "step-00000010"]
    done = gradsync_run(*flags, "--resume", directory, "--timeout", "50", str(script), str(STEPS), out, timeout=60)
    assert done.returncode == 0, done.stderr
    start, state = torch.load(out)
    assert start == 10
    assert max_diff(state, _uninterrupted("allreduce", 0, "sgd")) <= 1e-6


def _write_checkpoint(directory: str, step: int, servers: int, workers: int) -> str:
    """A checkpoint folder as `resume.save` leaves it (placeholder states), with its manifest."""
    path = resume.step_dir(directory, step)
    files = {}
    for name in resume.needed_files(servers, list(range(workers))):
        files[name] = checkpoint.stored_digest(checkpoint.write(os.path.join(path, name), {"step": step}))
    manifest = dict(step=step, strategy="ps", servers=servers, workers=workers, written=list(range(workers)),
                    model={}, files=files)
    with open(os.path.join(path, resume.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


@pytest.mark.parametrize("omitted", ["shard-1.ckpt", "worker-1.ckpt"])
def test_a_manifest_edited_to_omit_a_file_is_skipped_saying_why(omitted, tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2)
    newest = _write_checkpoint(directory, 10, servers=2, workers=2)
    with open(os.path.join(newest, resume.MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["files"][omitted]  # the file is there and intact; the manifest no longer names it
    with open(os.path.join(newest, resume.MANIFEST), "w") as f:
        json.dump(manifest, f)
    found = resume.latest_complete(directory)
    assert found.step == 5
    assert found.skipped == (f"{newest}: its MANIFEST.json does not list {omitted}, which a checkpoint of 2 servers "
                             "and 2 workers needs",)
