"""worker_loss wait: a sync ps job whose worker dies keeps its servers and other workers, the launcher starts a
replacement with the same rank, the step in flight waits for it, and the job ends bit for bit as without the
death, wherever in the step the worker died."""
import json
import re

import pytest
import torch

import gradsync
from helpers import SUPPORT, checkpoint_files, run_cli, same
from replaced import (Death, reference, starts_at, train, train_async, train_clicks, train_dropping, train_dynamic_tables,
                      train_joining_dropping,
                      train_joining, train_killing_a_server, train_real_loop, reference_real_loop)

pytestmark = pytest.mark.job

STEPS = 10
SHAPES = {  # servers, workers, settings, clipping, micro-batches, width, GradScaler, deaths: several per job
    "pipelined pieces, one server": (
        1, 2, dict(bucket_cap_mb=0.0005), None, 2, 16, False,
        (Death(1, 1, "forward"), Death(1, 3, "backward"), Death(1, 5, "pieces"), Death(1, 7, "pushed")),
    ),
    "pieces streamed in the backward, more than a window of them": (  # 1 MB: 5 pieces, a window of 2
        1, 2, dict(bucket_cap_mb=0.25), None, 1, 512, False, (Death(1, 3, "forward"), Death(1, 6, "backward")),
    ),
    "whole steps, two servers, three workers": (
        2, 3, dict(pipeline="off", step_timeout=3.0), None, 1, 16, False,
        (Death(1, 2, "one server"), Death(2, 4, "stop"), Death(0, 6, "forward"), Death(2, 6, "backward"),
         Death(1, 8, "backward")),  # two at once at step 6
    ),
    "clipping and checkpoints, two servers": (
        2, 2, dict(checkpoint_every=3), 0.5, 1, 16, False,
        (Death(1, 2, "finish"), Death(1, 4, "pushed"), Death(0, 6, "one server"), Death(1, 8, "checkpoint")),
    ),
    "a GradScaler whose scale grows every 2 steps, two servers": (
        2, 2, {}, None, 1, 16, True, (Death(1, 3, "forward"), Death(0, 5, "finish"), Death(1, 7, "pushed")),
    ),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_ends_bit_for_bit_as_without_the_deaths(launch, shape, tmp_path, capfd):
    servers, workers, settings, clip, micro, hidden, scaled, deaths = SHAPES[shape]
    held = clip is not None or scaled
    runs = {}
    for run in ("clean", "died"):
        saved = {"checkpoint_dir": str(tmp_path / run)} if "checkpoint_every" in settings else {}
        runs[run] = launch(train, strategy="ps", workers=workers, servers=servers, timeout=200,
                           args=(() if run == "clean" else deaths, STEPS, clip, micro, hidden, scaled),
                           worker_loss="wait", max_restarts=len(deaths), **settings, **saved)
    err = capfd.readouterr().err
    for w, ((_, _, clean, _), (start, restarts, died, replaced)) in enumerate(zip(runs["clean"], runs["died"])):
        mine = [d for d in deaths if d.worker == w]
        assert restarts == len(mine) and start == (starts_at(mine[-1], held) if mine else 0), (w, start, restarts)
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean), w
        counts = {d.worker: sum(e.worker == d.worker for e in deaths) for d in deaths}
        assert replaced == {s: counts for s in range(servers)}, replaced  # each server's count, in the status
    for d in deaths:
        rank = servers + d.worker
        how = "stopped responding" if d.point == "stop" else "was killed by SIGKILL"
        assert re.search(rf"gradsync: worker{d.worker} \(rank {rank}\) {how}.* starting its replacement", err), err
        assert f"replacement continues from step {starts_at(d, held)}" in err, err
    assert err.count("starting its replacement") == err.count("replaced ") == len(deaths), err
    if "checkpoint_every" in settings:  # the checkpoint a worker died writing is whole, and each is the clean run's
        clean, died = checkpoint_files(tmp_path / "clean"), checkpoint_files(tmp_path / "died")
        assert len(clean) == 3 * (servers + workers) and same(clean, died)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_replacements_go_on_after_the_pushes_the_servers_applied(launch, mode, capfd):
    """A dead worker's replacement takes its rank, not a departure: it goes on after the pushes of it the servers
    applied, so each server applies exactly one push of it per step (also where it died with its push applied on
    both servers, or on one of two: `one server`); under ssp the others wait for it within the staleness bound."""
    deaths = (Death(1, 2, "forward"), Death(1, 4, "one server"), Death(1, 6, "pushed"))
    done = launch(train_async, strategy="ps", mode=mode, workers=2, servers=2, timeout=150, args=(deaths, 10),
                  worker_loss="wait", max_restarts=3,
                  **(dict(staleness=1) if mode == "ssp" else {}))
    (start0, restarts0, _), (start, restarts, pushed) = done
    assert (start0, restarts0, start, restarts) == (0, 0, 7, 3)
    assert {s: p for s, (p, _) in pushed.items()} == {0: 10, 1: 10}, pushed
    if mode == "ssp":
        assert all(lead <= 1 for _, lead in pushed.values()), pushed
    err = capfd.readouterr().err
    going_on = "the others go on within the staleness bound" if mode == "ssp" else "the others go on"
    assert err.count(f"starting its replacement (restart") == 3 and f": {going_on}" in err, err
    assert [f"continues from step {s}" in err for s in (2, 4, 7)] == [True] * 3 and "left the job" not in err, err


@pytest.mark.timeout(120)
def test_a_worker_dying_past_its_restarts_fails_the_job_naming_it(launch):
    deaths = (Death(1, 1, "forward"), Death(1, 3, "backward"))
    with pytest.raises(gradsync.JobFailed) as failed:
        launch(train, strategy="ps", workers=2, servers=1, timeout=100, args=(deaths, STEPS),
               worker_loss="wait", max_restarts=1)
    assert str(failed.value).startswith("rank 2 (worker1) failed with signal SIGKILL (1 of max_restarts 1 restarts "
                                        "spent)"), str(failed.value)
    assert failed.value.rank == 2


def late_trainer(steps: int) -> int:
    """`train` whose replacements never come: a replacement waits before building its Trainer."""
    if gradsync.restart_count():
        import time
        time.sleep(60)
    return train((Death(1, 2, "forward"),), steps)[0]


@pytest.mark.timeout(120)
def test_a_replacement_that_does_not_rejoin_in_time_fails_the_job_naming_the_worker(launch):
    with pytest.raises(gradsync.JobFailed) as failed:
        launch(late_trainer, strategy="ps", workers=2, servers=1, timeout=100, args=(STEPS,),
               worker_loss="wait", max_restarts=1, restart_timeout=3.0)
    assert str(failed.value).startswith(
        "rank 2 (worker1) was killed by SIGKILL, and its replacement did not rejoin the job within restart_timeout "
        "(3 s; --restart-timeout)"), str(failed.value)


@pytest.mark.timeout(180)
def test_tables_served_by_rows_end_bit_for_bit_as_without_the_deaths(launch):
    deaths = (Death(1, 2, "one server"), Death(0, 4, "forward"), Death(1, 6, "pushed"))  # ps0 a step ahead first
    runs = [launch(train_clicks, strategy="ps", workers=2, servers=2, timeout=150, args=(died, 8),
                   worker_loss="wait", max_restarts=2, pipeline="off")
            for died in ((), deaths)]
    assert [start for start, _ in runs[1]] == [4, 7]
    for (_, clean), (_, died) in zip(*runs):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean)


@pytest.mark.timeout(180)
def test_a_real_loop_ends_bit_for_bit_as_without_the_deaths(launch):
    """Parameter groups with their own lr and weight decay, an lr schedule set from the step that holds for two
    steps (a replacement of an odd step changes no option, as the others change none), a frozen layer,
    BatchNorm's running statistics and a layer unused on odd steps."""
    deaths = (Death(1, 3, "backward"), Death(0, 5, "forward"), Death(1, 7, "pushed"))
    runs = [launch(train_real_loop, strategy="ps", workers=2, servers=2, timeout=150, args=(died, 10),
                   worker_loss="wait", max_restarts=2)
            for died in ((), deaths)]
    assert [start for start, _, _ in runs[1]] == [5, 8]
    for (_, clean, _), (_, died, _) in zip(*runs):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean)
    assert not torch.equal(runs[1][0][1]["norm.running_mean"], torch.zeros(16))  # the statistics moved


@pytest.mark.timeout(180)
def test_dynamic_tables_end_bit_for_bit_as_without_the_deaths(launch):
    """Their ids admitted, counted and evicted as without the deaths: a replacement's lookups of the step in
    flight are answered as its dead process's were, also by a server a step ahead (`ps.lookup_replay`)."""
    deaths = (Death(1, 2, "forward"), Death(0, 4, "one server"), Death(1, 6, "backward"), Death(0, 8, "pushed"))
    runs = [launch(train_dynamic_tables, strategy="ps", workers=2, servers=2, timeout=150, args=(died, 10),
                   worker_loss="wait", max_restarts=2, pipeline="off")
            for died in ((), deaths)]
    assert [start for start, _ in runs[1]] == [9, 6]
    for (_, clean), (_, died) in zip(*runs):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean)
    state = runs[1][0][1]
    assert int(state["tags.counters"][-1]) > 0 and int(state["items.counters"][-1]) > 0  # rows were evicted


@pytest.mark.timeout(120)
def test_a_replacement_inside_trainer_join_fails_the_job_with_the_fix(launch):
    with pytest.raises(gradsync.JobFailed) as failed:
        launch(train_joining, strategy="ps", workers=2, servers=1, timeout=100, args=(Death(1, 2, "forward"), 5),
               worker_loss="wait", max_restarts=1)
    text = str(failed.value)
    assert "worker 1's replacement (worker_loss='wait') entered trainer.join()" in text and "drop_last" in text
    assert text.count("entered trainer.join()") == 1, text


@pytest.mark.timeout(180)
def test_gradsync_run_replaces_a_worker_started_as_a_new_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys, torch\nsys.path.insert(0, {str(SUPPORT)!r})\nimport gradsync\nfrom replaced import Death, train\n"
        "gradsync.init()\n"
        "deaths = (Death(1, int(sys.argv[2]), 'backward'),) if len(sys.argv) > 2 else ()\n"
        "done = train(deaths, 6)\n"
        "torch.save(done, f'{sys.argv[1]}-{gradsync.worker_rank()}.pt')\n"
        "gradsync.shutdown()\n")
    runs = {}
    for run, death in (("clean", []), ("died", ["3"])):
        done = run_cli("run", "--strategy", "ps", "--workers", "2", "--worker-loss", "wait", "--max-restarts", "1",
                       str(script), str(tmp_path / run), *death, timeout=150, env={"GRADSYNC_RANK_START": "exec"})
        assert done.returncode == 0, done.stderr
        runs[run] = [torch.load(tmp_path / f"{run}-{w}.pt") for w in range(2)]
    assert "gradsync: worker1 (rank 2) was killed by SIGKILL" in done.stderr
    assert "replacement continues from step 3" in done.stderr
    assert [r[:2] for r in runs["died"]] == [(0, 0), (3, 1)]
    for (_, _, clean, _), (_, _, died, _) in zip(runs["clean"], runs["died"]):
        assert all(torch.equal(clean[k], died[k]) for k in clean)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,restarts", [("forward", 0), ("pieces", 1), ("pushed", 1), ("checkpoint", 1)])
def test_with_drop_the_job_goes_on_without_the_dead_worker_as_the_mean_of_the_others(launch, point, restarts, capfd,
                                                                                     tmp_path):
    """Without restarts, to the end; with one, until its replacement joins at a step boundary. A worker that dies
    after its push of a step reached every server (or as it writes its part of that step's checkpoint) is in that
    step."""
    workers, death = 3, Death(1, 2, point)
    saved = dict(checkpoint_dir=str(tmp_path), checkpoint_every=3) if point == "checkpoint" else {}  # after step 2
    results = launch(train_dropping, strategy="ps", workers=workers, servers=2, timeout=100,
                     args=(death, STEPS, 0.3), worker_loss="drop", max_restarts=restarts, bucket_cap_mb=0.0005, **saved)
    err = capfd.readouterr().err
    if restarts:
        start = results[1][2]
        assert 2 < start < STEPS and not results.departures, start
        assert ("gradsync: worker1 (rank 3) was killed by SIGKILL" in err and "starting its replacement (restart 1 "
                "of 1): the job goes on without it, and the replacement joins at a step boundary" in err), err
        assert f"the replacement joins the job at step {start}" in err
    else:
        start = STEPS
        assert results[1] is None and [d.worker for d in results.departures] == [1]
        assert "gradsync: worker1 (rank 3) left (killed by SIGKILL)" in err
    (state, without, _), (other, _, _) = results[0], results[2]
    assert without[0] == without[1] and all(torch.equal(state[k], other[k]) for k in state)
    first = 2 + (point in ("pushed", "checkpoint"))  # from the step it died in on (or the next), until it joined
    assert without[0] == {step: [1] for step in range(first, start)}
    expected = reference(STEPS, workers, without[0])
    assert all(torch.allclose(state[k], expected[k], atol=1e-5) for k in expected)
    if restarts:
        assert all(torch.equal(state[k], results[1][0][k]) for k in state)
    if saved:  # the checkpoint it died writing is whole without its part, and the replacement's later ones with it
        written = {c: json.loads((tmp_path / f"step-{c:08d}" / "MANIFEST.json").read_text())["written"] for c in (3, 9)}
        assert written == {3: [0, 2], 9: [0, 1, 2]}, written


@pytest.mark.timeout(180)
def test_a_dead_server_restarts_the_whole_job_from_its_checkpoint(launch, tmp_path, capfd):
    runs = {}
    for run, kill_at in (("clean", -1), ("died", 7)):
        runs[run] = launch(train_killing_a_server, strategy="ps", workers=2, servers=2, timeout=150, args=(kill_at, 10),
                           checkpoint_dir=str(tmp_path / run), checkpoint_every=3, max_restarts=1, step_timeout=10.0)
    err = capfd.readouterr().err
    assert re.search(r"gradsync: rank 0 \(ps0\) failed with signal SIGKILL; restarting the whole job from its "
                     r"checkpoint of step 6 \(.*step-00000006; restart 1 of 1\): every worker redoes the steps it "
                     r"took after step 6", err), err
    assert [r[:2] for r in runs["died"]] == [(6, 1), (6, 1)]
    for (_, _, clean), (_, _, died) in zip(runs["clean"], runs["died"]):
        assert all(torch.equal(clean[k], died[k]) for k in clean)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batches,death,closed", [((10, 10, 7), Death(1, 2, "forward"), 11),
                                                  ((5, 10, 5), Death(1, 7, "forward"), 8)])
def test_with_drop_trainer_join_counts_a_dead_worker_as_joined(launch, batches, death, closed):
    """Uneven data inside `trainer.join()`: worker 1 dies before the others join, or once they all have (then its
    death ends the round); then a step of every live worker (the next round). The servers close `closed` steps."""
    results = launch(train_joining_dropping, strategy="ps", workers=3, servers=2, timeout=100, args=(death, batches),
                     worker_loss="drop")
    assert results[1] is None and [d.worker for d in results.departures] == [1]
    (state, without), (other, _) = results[0], results[2]
    assert all(torch.equal(state[k], other[k]) for k in state)
    assert without == {step: [1] for step in range(death.step, closed)}  # the steps closed while it was gone
    last = max(batches)  # the step after the block, whose batches are those of step `last`
    applied = {s: [w for w in range(3) if (s < batches[w] or s == last) and not (w == 1 and s >= death.step)]
               for s in range(last + 1)}
    expected = reference(last + 1, 3, {s: [w for w in range(3) if w not in applied[s]] for s in applied})
    assert all(torch.allclose(state[k], expected[k], atol=1e-5) for k in expected)


@pytest.mark.timeout(120)
def test_with_drop_a_replacement_that_comes_after_the_last_step_is_stopped_and_the_job_ends(launch, capfd):
    death = Death(1, STEPS - 1, "forward")
    results = launch(train_dropping, strategy="ps", workers=3, servers=1, timeout=100, args=(death, STEPS, 0.0, 5.0),
                     worker_loss="drop", max_restarts=1)
    assert results[1] is None and not results.departures
    state, without, _ = results[0]
    assert without[0] == {STEPS - 1: [1]}
    expected = reference(STEPS, 3, without[0])
    assert all(torch.allclose(state[k], expected[k], atol=1e-5) for k in expected)
    assert "gradsync: the job ended before the replacement of worker1 (rank 2) joined it" in capfd.readouterr().err


@pytest.mark.timeout(120)
def test_with_drop_and_restarts_a_real_loop_is_single_process_training_on_the_batches_applied(launch, capfd):
    """Two parameter groups on an lr schedule set from the step, a frozen layer, BatchNorm, a layer unused on odd
    steps: worker 1 killed in step 2's backward, its replacement joining a few steps later."""
    results = launch(train_real_loop, strategy="ps", workers=3, servers=2, timeout=100, args=((Death(1, 2, "backward"),),
                     STEPS, 0.3), worker_loss="drop", max_restarts=1)
    start = results[1][0]
    assert 2 < start < STEPS and f"the replacement joins the job at step {start}" in capfd.readouterr().err
    assert all(without == {step: [1] for step in range(2, start)} for _, _, without in results)
    state = results[0][1]
    assert all(all(torch.equal(state[k], other[k]) for k in state) for _, other, _ in results[1:])
    expected = reference_real_loop(STEPS, 3, results[0][2])
    assert all(torch.allclose(state[k].float(), expected[k].float(), atol=1e-5) for k in expected), max(
        (state[k].float() - expected[k].float()).abs().max().item() for k in expected)
