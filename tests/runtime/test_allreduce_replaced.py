"""worker_loss wait under allreduce: a dead worker's replacement takes its rank, heals from a live peer (parameters,
optimizer state, step; its own RNG states as of that step), the survivors keep their step's gradients and average
them again with its part, and the job ends bit for bit as without the death, wherever in the step it died."""
import functools
import re

import pytest
import torch

import gradsync
from helpers import checkpoint_files, same
from replaced import Death, reference_real_loop, train, train_clicks, train_real_loop

pytestmark = pytest.mark.job

STEPS = 8
SHAPES = {  # workers, settings, clipping, micro-batches, GradScaler, deaths: several per job
    "two workers, many buckets": (
        2, dict(bucket_cap_mb=0.0005, step_timeout=3.0), None, 1, False,
        (Death(1, 1, "backward"), Death(1, 3, "allreduce"), Death(0, 4, "stepped"), Death(1, 6, "stop")),
    ),
    "three workers, clipping, micro-batches, a GradScaler, checkpoints": (
        3, dict(bucket_cap_mb=0.0005, checkpoint_every=3), 0.5, 2, True,
        (Death(1, 2, "forward"), Death(2, 2, "backward"), Death(0, 4, "allreduce"), Death(2, 5, "checkpoint"),
         Death(1, 6, "stepped")),  # two at once at step 2
    ),
}


def _starts_at(death: Death) -> int:
    """The step the replacement of the process `death` ends continues from: the step it died in, or the next
    when its step was done (or its checkpoint's step written)."""
    return death.step + (death.point in ("stepped", "checkpoint"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_ends_bit_for_bit_as_without_the_deaths(launch, shape, tmp_path, capfd):
    workers, settings, clip, micro, scaled, deaths = SHAPES[shape]
    runs = {}
    for run in ("clean", "died"):
        saved = {"checkpoint_dir": str(tmp_path / run)} if "checkpoint_every" in settings else {}
        runs[run] = launch(train, strategy="allreduce", workers=workers, servers=0, timeout=200,
                           args=(() if run == "clean" else deaths, STEPS, clip, micro, 16, scaled),
                           worker_loss="wait", max_restarts=len(deaths), **settings, **saved)
    err = capfd.readouterr().err
    for w, ((_, _, clean, _), (start, restarts, died, _)) in enumerate(zip(runs["clean"], runs["died"])):
        mine = [d for d in deaths if d.worker == w]
        assert restarts == len(mine) and start == (_starts_at(mine[-1]) if mine else 0), (w, start, restarts)
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean), w
    for d in deaths:
        how = "stopped responding" if d.point == "stop" else "was killed by SIGKILL"
        assert re.search(rf"gradsync: worker{d.worker} \(rank {d.worker}\) {how}.* starting its replacement", err), err
        assert f"worker{d.worker} (rank {d.worker}) replaced" in err and f"continues from step {_starts_at(d)}" in err
    assert err.count("starting its replacement") == err.count("replaced ") == len(deaths), err
    if "checkpoint_every" in settings:  # the checkpoint a worker died writing is whole, and each is the clean run's
        clean, died = checkpoint_files(tmp_path / "clean"), checkpoint_files(tmp_path / "died")
        assert len(clean) == 2 * workers and same(clean, died)


@pytest.mark.timeout(120)
def test_a_real_loop_ends_bit_for_bit_as_without_the_deaths_and_as_one_process(launch):
    """Two parameter groups with their own lr and weight decay, a schedule set from the step, BatchNorm (buffers
    averaged in the step's own collective), a frozen layer and one the odd steps leave unused
    (find_unused_parameters)."""
    deaths = (Death(1, 1, "backward"), Death(0, 4, "stepped"))
    loop = functools.partial(train_real_loop, find_unused_parameters=True)
    runs = [launch(loop, strategy="allreduce", workers=2, servers=0, timeout=100, worker_loss="wait", max_restarts=2,
                   args=(d, STEPS)) for d in ((), deaths)]
    clean, died = runs[0][0][1], runs[1][1][1]
    assert [start for start, _, _ in runs[1]] == [5, 1] and all(torch.equal(clean[k], died[k]) for k in clean)
    assert all(all(torch.equal(died[k], other[k]) for k in died) for _, other, _ in runs[1])
    expected = reference_real_loop(STEPS, 2, {})
    assert all(torch.allclose(died[k].float(), expected[k].float(), atol=1e-5) for k in expected)


@pytest.mark.timeout(120)
def test_every_worker_dying_at_once_fails_the_job_saying_none_holds_the_state(launch):
    """No survivor to heal from: the replacements say so, and the job fails once the restarts are spent, rather
    than waiting for a worker that never comes."""
    with pytest.raises(gradsync.JobFailed, match="no live worker holds the state their replacements would continue "
                                                 r"from: resume the job from its latest checkpoint \(--resume\)"):
        launch(train, strategy="allreduce", workers=2, servers=0, timeout=100, worker_loss="wait", max_restarts=1,
               args=((Death(0, 2, "forward"), Death(1, 2, "forward")), STEPS))


@pytest.mark.timeout(120)
def test_tables_with_sparse_gradients_end_bit_for_bit_as_without_the_deaths(launch):
    """nn.EmbeddingBag and nn.Embedding with sparse=True: their sparse gradients averaged one by one after the
    buckets, in the same order on every worker, and kept for a replay as the dense ones."""
    deaths = (Death(1, 2, "backward"), Death(0, 4, "allreduce"))
    runs = [launch(train_clicks, strategy="allreduce", workers=2, servers=0, timeout=100, worker_loss="wait",
                   max_restarts=2, args=(d, STEPS, True)) for d in ((), deaths)]
    assert [start for start, _ in runs[1]] == [4, 2]
    for (_, clean), (_, died) in zip(*runs):
        assert all(torch.equal(clean[k], died[k]) for k in clean)
