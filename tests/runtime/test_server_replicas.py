"""replicas 1: every shard is kept on the next server too, a step (async: a push) is answered once both copies hold
it, and when a server dies its shard's replica serves it: the job ends bit for bit as without the death, wherever in
the step the server died (async: with one worker, whose pushes come in one order)."""
import pytest
import torch

import gradsync
from helpers import checkpoint_files, same
from replaced import Death
from replicated import ServerDeath, train, train_clicks, train_real_loop, train_with_worker_deaths

pytestmark = pytest.mark.job

STEPS = 8
SHAPES = {  # function, servers, workers, its arguments after the death, the death, settings
    "a push mid-step, two servers, three workers": (train, 2, 3, (STEPS,), ServerDeath(1, 3, "pushed"), {}),
    "a clipped step held, three servers": (train, 3, 2, (STEPS, 0.5), ServerDeath(0, 4, "held"), {}),
    "tables served by rows and a GradScaler, the step applied but unanswered": (
        train_clicks, 2, 2, (STEPS,), ServerDeath(0, 3, "closed"), {}),
    "a real loop's model: two groups, an lr schedule, BatchNorm, a frozen layer, an unused branch": (
        train_real_loop, 2, 2, (STEPS,), ServerDeath(1, 3, "closed"), {}),
    "async, one worker: a push as it arrives": (train, 2, 1, (STEPS,), ServerDeath(1, 3, "pushed"), dict(mode="async")),
    "async, one worker: a push applied but unanswered": (
        train, 2, 1, (STEPS,), ServerDeath(0, 4, "closed"), dict(mode="async")),
    "a server stopped until the launcher kills it": (
        train, 2, 2, (STEPS,), ServerDeath(1, 2, "stop"), dict(step_timeout=3.0)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_ends_bit_for_bit_as_without_the_server_death(launch, shape, capfd):
    fn, servers, workers, args, death, settings = SHAPES[shape]
    runs = {run: launch(fn, strategy="ps", workers=workers, servers=servers, timeout=200, replicas=1, **settings,
                        args=(() if run == "clean" else (death,), *args))
            for run in ("clean", "died")}
    err = capfd.readouterr().err
    for w, ((clean, _), (died, stats)) in enumerate(zip(runs["clean"], runs["died"])):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean), w
        moved = stats[death.server]
        assert moved["version"] == runs["clean"][w][1][death.server]["version"]
        assert moved["pid"] == stats[(death.server + 1) % servers]["pid"]  # its replica's server serves it
        bare = {death.server, (death.server - 1) % servers}  # the dead one's shard, and the one it kept
        assert {s: st["replica"] for s, st in stats.items()} == {
            s: "" if s in bare else f"ps{(s + 1) % servers}" for s in range(servers)}
        assert {s: st["replica"] for s, st in runs["clean"][w][1].items()} == {
            s: f"ps{(s + 1) % servers}" for s in range(servers)}
    how = "stopped responding" if death.point == "stop" else "was killed by SIGKILL"
    assert f"ps{death.server} (rank {death.server}) {how}" in err, err
    assert f"shard {death.server} is served by its replica on ps{(death.server + 1) % servers}" in err, err


@pytest.mark.timeout(180)
def test_a_server_dying_as_it_writes_its_checkpoint_leaves_every_checkpoint_whole(launch, tmp_path, capfd):
    """ps1 writes its shard's file of step 6's checkpoint and dies before it answers: its replica's server writes
    the shard again, and every checkpoint, like the job's end, is the clean run's bit for bit."""
    runs = {run: launch(train, strategy="ps", workers=2, servers=2, timeout=150, replicas=1, checkpoint_every=3,
                        checkpoint_dir=str(tmp_path / run),
                        args=(() if run == "clean" else (ServerDeath(1, 5, "checkpoint"),), STEPS))
            for run in ("clean", "died")}
    for (clean, _), (died, stats) in zip(runs["clean"], runs["died"]):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean)
        assert stats[1]["pid"] == stats[0]["pid"]
    assert "ps1 (rank 1) was killed by SIGKILL" in capfd.readouterr().err
    clean, died = checkpoint_files(tmp_path / "clean"), checkpoint_files(tmp_path / "died")
    assert {folder for folder, _ in clean} == {"step-00000003", "step-00000006"} and same(clean, died), sorted(died)


@pytest.mark.timeout(120)
def test_a_second_server_death_fails_the_job_naming_both(launch):
    with pytest.raises(gradsync.JobFailed) as failed:
        launch(train, strategy="ps", workers=2, servers=2, timeout=100, replicas=1,
               args=((ServerDeath(1, 2, "pushed"), ServerDeath(0, 5, "pushed")), STEPS))
    assert failed.value.rank == 0
    assert str(failed.value).startswith("ps0 (rank 0) was killed by SIGKILL"), failed.value
    assert "serving shard 0 alone since ps1 (rank 1) was killed by SIGKILL" in str(failed.value)
    assert "its last copy is gone, so the job cannot go on" in str(failed.value)


@pytest.mark.timeout(180)
def test_a_dead_server_started_again_keeps_the_replicas_again_and_the_job_survives_the_next_death(launch, capfd):
    """ps1 dies, its replacement copies both shards from ps0 and keeps their replicas; then ps0 dies, and ps1's
    replacement serves both: bit for bit as without the deaths (ps0's replacement may come after the job ended)."""
    deaths = (ServerDeath(1, 2, "pushed"), ServerDeath(0, 8, "pushed", after=1))
    died = launch(train, strategy="ps", workers=2, servers=2, timeout=150, replicas=1, max_restarts=1,
                  args=(deaths, 16, 0.5))
    clean = launch(train, strategy="ps", workers=2, servers=2, timeout=150, replicas=1, args=((), 16, 0.5))
    err = capfd.readouterr().err
    for w, ((state, stats), (reference, _)) in enumerate(zip(died, clean)):
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state), w
        assert stats[0]["pid"] == stats[1]["pid"] and stats[0]["version"] == stats[1]["version"] == 16
    assert "ps1 (rank 1) was killed by SIGKILL" in err and "ps0 (rank 0) was killed by SIGKILL" in err, err
    assert "ps1 (rank 1) replaced" in err and "it keeps the replicas of shards 0, 1 again" in err, err


@pytest.mark.timeout(120)
def test_replicas_change_nothing_a_job_computes(launch):
    """The same job with and without replicas ends bit for bit alike (which the suite's parity tests hold to
    single-process training)."""
    runs = [launch(train, strategy="ps", workers=2, servers=2, timeout=100, replicas=replicas, args=((), STEPS, 0.5))
            for replicas in (0, 1)]
    for (plain, _), (replicated, _) in zip(*runs):
        assert plain.keys() == replicated.keys() and all(torch.equal(plain[k], replicated[k]) for k in plain)


@pytest.mark.timeout(180)
def test_a_job_with_replicas_and_replaced_workers_survives_both_deaths_bit_for_bit(launch, capfd):
    """`--worker-loss wait` with replicas: worker 1 dies (its replacement takes its place), then server 1 (its
    replica serves), then the replacement dies in turn: bit for bit as the same job without the deaths."""
    settings = dict(strategy="ps", workers=2, servers=2, timeout=150, replicas=1, worker_loss="wait", max_restarts=2)
    died = launch(train_with_worker_deaths, **settings,
                  args=((ServerDeath(1, 5, "pushed"),), (Death(1, 2, "backward"), Death(1, 7, "forward")), 10))
    clean = launch(train_with_worker_deaths, **settings, args=((), (), 10))
    for w, (state, reference) in enumerate(zip(died, clean)):
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state), w
    err = capfd.readouterr().err
    assert err.count("worker1 (rank 3) was killed by SIGKILL") == 2 and "ps1 (rank 1) was killed by SIGKILL" in err
    assert "replacement continues from step 2" in err and "replacement continues from step 7" in err, err


@pytest.mark.timeout(120)
def test_an_async_job_applies_each_push_once_through_a_server_death(launch):
    """Two async workers, server 1 dead after it applied a push whose record its replica held, before it answered:
    each shard applies each worker's every push exactly once (the re-sent one is answered from the replica)."""
    done = launch(train, strategy="ps", mode="async", workers=2, servers=2, timeout=100, replicas=1,
                  args=((ServerDeath(1, 7, "closed"),), STEPS))
    # each shard as the worker that read it last saw it (the other may still have been pushing to it then)
    last = {s: max((stats[s] for _, stats in done), key=lambda st: st["version"]) for s in (0, 1)}
    assert {s: (st["version"], st["pushes_by_worker"]) for s, st in last.items()} == {
        s: (2 * STEPS, {0: STEPS, 1: STEPS}) for s in (0, 1)}, last
    assert last[1]["pid"] == last[0]["pid"]
