"""Checkpoint and exact resume: a sync job killed at step 12 resumes from its last complete checkpoint and ends
where an uninterrupted run ends."""
import functools
import json
import os
import shutil
import tempfile

import pytest
import torch

import gradsync
from fault_injection import build_wider, train_resumable
from resumable import train_clicks
from gradsync.config import ConfigError, JobConfig
from gradsync.ps import shard_file
from gradsync.runtime import checkpoints
from jobs import make_mlp
from helpers import ROOT, SUPPORT, max_diff, run_cli, run_failing_script

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


@pytest.mark.job
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


@pytest.mark.job
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


@pytest.mark.job
@pytest.mark.timeout(150)
def test_resume_refuses_a_checkpoint_of_another_strategy_or_model(launch, tmp_path):
    directory = str(tmp_path / "checkpoints")
    _launch("ps", 2, "sgd", steps=EVERY, checkpoint_dir=directory, checkpoint_every=EVERY)
    with pytest.raises(gradsync.JobFailed, match=r"written by a job with strategy='ps', and this job has "
                                                 r"strategy='allreduce': resume with --strategy ps"):
        _launch("allreduce", 0, "sgd", resume=directory)
    with pytest.raises(gradsync.JobFailed, match=r"holds a different model: '0.weight' is \[\[16, 8\], "
                                                 r"'torch.float32'\] there and \[\[17, 8\], 'torch.float32'\]"):
        launch(build_wider, strategy="ps", workers=2, servers=2, resume=directory, step_timeout=20,
               timeout=60)


def _script(tmp_path) -> str:
    """A script running `train_resumable(STEPS, OPTIMIZER)` (its arguments), which saves worker 0's result to
    its third argument."""
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys; sys.path[:0] = [{SUPPORT!r}, {ROOT!r}]\n"
        "import torch, gradsync\nfrom fault_injection import train_resumable\n"
        "gradsync.init()\nresult = train_resumable(int(sys.argv[1]), sys.argv[2])\n"
        "if gradsync.worker_rank() == 0:\n    torch.save(result, sys.argv[3])\ngradsync.shutdown()\n"
    )
    return str(script)


@pytest.mark.job
@pytest.mark.timeout(150)
def test_gradsync_run_flags_checkpoint_and_resume(tmp_path):
    directory, out, script = str(tmp_path / "checkpoints"), str(tmp_path / "state.pt"), _script(tmp_path)
    flags = ["--strategy", "allreduce", "--workers", "2", "--checkpoint-dir", directory, "--checkpoint-every", "5"]
    done = run_cli("run", *flags, "--timeout", "50", script, "12", "sgd", out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(directory)) == ["step-00000005", "step-00000010"]
    done = run_cli("run", *flags, "--resume", directory, "--timeout", "50", script, str(STEPS), "sgd", out, timeout=60)
    assert done.returncode == 0, done.stderr
    start, state = torch.load(out)
    assert start == 10
    assert max_diff(state, _uninterrupted("allreduce", 0, "sgd")) <= 1e-6


def _run_of(folder: str) -> str:
    with open(os.path.join(folder, checkpoints.MANIFEST)) as f:
        return json.load(f)["run"]


@pytest.mark.job
@pytest.mark.timeout(240)
def test_a_reused_checkpoint_dir_is_refused_started_over_or_continued_as_one_run(tmp_path):
    """Run A (Adam) checkpoints steps 5 and 10; a fresh run B (SGD) into the same folder is refused, starts with
    --start-over (A's folders removed), and --resume continues B, not A: the parameters of an uninterrupted SGD
    run. A dead writer's temporary file in B's folder is removed on the way."""
    directory, out, script = str(tmp_path / "checkpoints"), str(tmp_path / "state.pt"), _script(tmp_path)
    flags = ["--strategy", "allreduce", "--workers", "2", "--checkpoint-dir", directory, "--checkpoint-every", "5",
             "--timeout", "50"]
    done = run_cli("run", *flags, script, "10", "adam", out, timeout=60)
    assert done.returncode == 0, done.stderr
    run_a = _run_of(os.path.join(directory, "step-00000010"))
    done = run_cli("run", *flags, script, "5", "sgd", out, timeout=60)
    assert done.returncode == 1
    assert done.stderr.count(f"holds another run's checkpoints (step-00000005, step-00000010 (run {run_a}))") == 1
    assert "gradsync: rank 0 (worker0) failed with exit code 1" in done.stderr, done.stderr
    assert sorted(os.listdir(directory)) == ["step-00000005", "step-00000010"]  # untouched

    done = run_cli("run", *flags, "--start-over", script, "5", "sgd", out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(directory)) == ["step-00000005"]  # B's; A's step-10 is gone
    run_b = _run_of(os.path.join(directory, "step-00000005"))
    assert run_b != run_a
    left = os.path.join(directory, "step-00000005", ".shard-0.ckpt-k2v9q_x1.tmp")
    with open(left, "wb") as f:  # what a writer killed before its rename leaves
        f.write(bytes(2**20))

    done = run_cli("run", *flags, "--resume", directory, script, str(STEPS), "sgd", out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"gradsync: resuming run {run_b} from step 5 ({directory}/step-00000005)" in done.stderr
    assert not os.path.exists(left)
    assert "removed 1 temporary files (1.0 MiB) that a checkpoint writer which died left: " \
        "step-00000005/.shard-0.ckpt-k2v9q_x1.tmp" in done.stderr
    start, state = torch.load(out)
    assert start == 5
    assert max_diff(state, _uninterrupted("allreduce", 0, "sgd")) <= 1e-6


@pytest.mark.job
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,servers,written,built", [("ps", 1, "adam", "sgd"), ("ps", 1, "sgd", "adam"),
                                                             ("allreduce", 0, "sgd", "adam")])
def test_a_changed_optimizer_is_one_refusal_on_worker_0_naming_both_classes(strategy, servers, written, built,
                                                                               tmp_path):
    directory = str(tmp_path / "checkpoints")
    _launch(strategy, servers, written, steps=EVERY, checkpoint_dir=directory, checkpoint_every=EVERY)
    body = f"gradsync.init()\nfault_injection.train_resumable(8, {built!r})\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", strategy, "--servers", str(servers),
                                          "--workers", "2", "--resume", directory)
    names = {"adam": "Adam", "sgd": "SGD"}
    assert headline.startswith(f"gradsync: rank {servers} (worker0) failed with exit code 1:"), stderr
    assert stderr.count(f"was written with the optimizer {names[written]}, and this job builds {names[built]}: "
                        "its state (and options) are") == 1, stderr
    assert "KeyError" not in stderr


@pytest.mark.job
@pytest.mark.timeout(240)
def test_a_shard_its_server_cannot_restore_is_one_refusal_on_that_server(launch, tmp_path):
    """Tables served by row when written, dense when resumed: the model and optimizer match (worker 0 lets it
    through), and server 0, which restores its shard, refuses it, headlined on that server."""
    directory = str(tmp_path / "checkpoints")
    launch(train_clicks, strategy="ps", workers=2, servers=1, args=(EVERY,), checkpoint_dir=directory,
           checkpoint_every=EVERY, step_timeout=20, timeout=90)
    body = ("gradsync.init()\nimport torch, sparse_models\nmodel = sparse_models.ClickNet()\n"
            "gradsync.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), tables='dense')\n"
            "gradsync.shutdown()\n")
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", "ps", "--servers", "1", "--workers", "2",
                                          "--resume", directory)
    assert headline.startswith("gradsync: rank 0 (ps0) failed with exit code 1:\nValueError: server 0 cannot "
                               f"restore its shard: {directory}/step-00000005 holds 0 of the "), stderr
    assert stderr.count("cannot restore its shard") == 1, stderr


def _write_checkpoint(directory: str, step: int, servers: int, workers: int, run: str = "run-a") -> str:
    """A checkpoint folder of `run` as `checkpoints.save` leaves it (placeholder states), with its manifest."""
    path = checkpoints.step_dir(directory, step)
    files = {}
    for name in checkpoints.needed_files(servers, list(range(workers))):
        files[name] = shard_file.stored_digest(shard_file.write(os.path.join(path, name), {"step": step}))
    manifest = dict(run=run, step=step, strategy="ps", servers=servers, workers=workers,
                    written=list(range(workers)), model={}, files=files)
    with open(os.path.join(path, checkpoints.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


@pytest.mark.parametrize("omitted", ["shard-1.ckpt", "worker-1.ckpt"])
def test_a_manifest_edited_to_omit_a_file_is_skipped_saying_why(omitted, tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2)
    newest = _write_checkpoint(directory, 10, servers=2, workers=2)
    with open(os.path.join(newest, checkpoints.MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["files"][omitted]  # the file is there and intact; the manifest no longer names it
    with open(os.path.join(newest, checkpoints.MANIFEST), "w") as f:
        json.dump(manifest, f)
    found = checkpoints.latest_complete(directory)
    assert found.step == 5
    assert found.skipped == (f"{newest}: its MANIFEST.json does not list {omitted}, which a checkpoint of 2 servers "
                             "and 2 workers needs",)


def _config(**checkpointing) -> JobConfig:
    """Rank 0 of a ps job of 2 servers and 2 workers, with these checkpoint settings."""
    return JobConfig(strategy="ps", servers=2, world_size=4, **checkpointing)


def test_a_folder_renamed_to_a_newer_step_is_skipped_for_the_step_its_state_holds(tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2)
    _write_checkpoint(directory, 10, servers=2, workers=2)
    os.rename(checkpoints.step_dir(directory, 5), checkpoints.step_dir(directory, 20))
    run, found = checkpoints.decide(_config(resume=directory))
    assert (run, found.step, found.path) == ("run-a", 10, checkpoints.step_dir(directory, 10))
    assert found.skipped == (f"{checkpoints.step_dir(directory, 20)}: its MANIFEST.json holds step 5, and its name says "
                             "step 20: a folder renamed or copied, refused (the step of its state is not the one its "
                             "name orders it by, and the job would later write that step's files into it)",)


def test_no_usable_folder_is_refused_with_the_reason_for_each(tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2)
    os.rename(checkpoints.step_dir(directory, 5), checkpoints.step_dir(directory, 7))
    os.makedirs(checkpoints.step_dir(directory, 10))  # unfinished: no manifest
    with pytest.raises(FileNotFoundError) as refused:
        checkpoints.decide(_config(resume=directory))
    assert str(refused.value).splitlines() == [
        f"no complete checkpoint in {directory!r} (a step-N folder with MANIFEST.json and intact files, every one "
        "listed)",
        f"  {checkpoints.step_dir(directory, 10)}: [Errno 2] No such file or directory: "
        f"'{checkpoints.step_dir(directory, 10)}/MANIFEST.json'",
        f"  {checkpoints.step_dir(directory, 7)}: its MANIFEST.json holds step 5, and its name says step 7: a folder "
        "renamed or copied, refused (the step of its state is not the one its name orders it by, and the job would "
        "later write that step's files into it)",
        "start without --resume"]


def test_a_folder_of_two_runs_is_refused_naming_both(tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2, run="run-a")
    _write_checkpoint(directory, 10, servers=2, workers=2, run="run-b")
    with pytest.raises(ConfigError, match=r"holds the checkpoints of 2 runs \(run run-b: step-00000010; run run-a: "
                                          r"step-00000005\), and a resume continues one"):
        checkpoints.decide(_config(resume=directory))


def test_a_fresh_run_refuses_another_runs_folder_or_starts_over_removing_its_step_folders(tmp_path):
    directory = str(tmp_path)
    _write_checkpoint(directory, 5, servers=2, workers=2)
    os.makedirs(checkpoints.step_dir(directory, 10))  # unfinished
    (tmp_path / "notes.txt").write_text("the user's")
    fresh = dict(checkpoint_dir=directory, checkpoint_every=5)
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(step-00000010 \(no run: unfinished "
                                          r"or older\); step-00000005 \(run run-a\)\), and this job writes run "
                                          r".*: pass --resume .* to continue that run, --start-over"):
        checkpoints.decide(_config(**fresh))
    assert sorted(os.listdir(directory)) == ["notes.txt", "step-00000005", "step-00000010"]
    run, found = checkpoints.decide(_config(**fresh, start_over=True))
    assert found is None and run != "run-a"
    assert os.listdir(directory) == ["notes.txt"]
    assert checkpoints.decide(_config(**fresh))[1] is None  # an empty folder is anyone's


def test_a_resume_refuses_to_write_into_a_folder_of_another_run(tmp_path):
    old, other = str(tmp_path / "old"), str(tmp_path / "other")
    _write_checkpoint(old, 5, servers=2, workers=2, run="run-a")
    _write_checkpoint(other, 5, servers=2, workers=2, run="run-b")
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(step-00000005 \(run run-b\)\), and "
                                          r"this job writes run run-a's"):
        checkpoints.decide(_config(resume=old, checkpoint_dir=other, checkpoint_every=5))
    run, found = checkpoints.decide(_config(resume=old, checkpoint_dir=str(tmp_path / "new"), checkpoint_every=5))
    assert (run, found.step) == ("run-a", 5)


def test_temporary_files_of_a_dead_writer_are_removed_and_nothing_else(tmp_path):
    directory = str(tmp_path)
    folder = _write_checkpoint(directory, 5, servers=2, workers=2)
    fd, left = tempfile.mkstemp(prefix=".shard-1.ckpt-", suffix=".tmp", dir=folder)  # as write_atomically names it
    os.close(fd)
    kept = sorted(os.listdir(folder))
    (tmp_path / ".notes.txt-draft.tmp").write_text("the user's, outside the step folders")
    checkpoints.decide(_config(resume=directory))
    assert not os.path.exists(left)
    assert sorted(os.listdir(folder)) == [n for n in kept if n != os.path.basename(left)]
    assert (tmp_path / ".notes.txt-draft.tmp").exists()
