"""Uneven data with `trainer.join()`: workers with fewer batches join and the others go on; each step is the
mean over the workers still active in it, the same as single-process training on the batches left."""
import pytest
import torch

import gradsync
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.ps.async_rules import SSPRule
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Push
from gradsync.ps.shard import ShardState
from helpers import max_diff
from uneven import join_without_every_worker, open_join, reference_uneven, reference_uneven_bn, train_uneven

ALL = [()]  # no absent entries in the one bucket
EPOCHS = [(5, 3), (2, 4)]  # batches per worker in each epoch: worker 1 joins first, then worker 0


def _shard():
    params = {"w": torch.zeros(2, requires_grad=True)}
    buckets = plan_buckets(ModelSpec.of(params, {}).params, 1, 10**9)
    return ShardState(0, buckets, params, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 1.0}))


def test_sync_steps_average_over_the_workers_still_active():
    shard = _shard()
    rule = SyncRule(shard, num_workers=3, nonfinite="raise")
    first = [rule.commit(w, 0, Push([torch.tensor([3.0, 6.0]) * (w + 1)], ALL)) for w in (0, 1)]
    assert not first[0].done()  # waits for worker 2 ...
    rule.worker_joined(2)  # ... until it joins: the step is the mean of the two that pushed
    assert [f.wait().version for f in first] == [1, 1] and shard.flats[0].tolist() == [-4.5, -9.0]
    rule.worker_joined(0)
    assert rule.commit(1, 1, Push([torch.tensor([1.0, 1.0])], ALL)).wait().version == 2  # alone: its own gradient
    assert shard.flats[0].tolist() == [-5.5, -10.0]
    rule.worker_joined(1)  # every worker has joined: the next round waits for all three again
    assert not rule.commit(1, 2, Push([torch.tensor([1.0, 1.0])], ALL)).done()


def test_ssp_waits_for_no_joined_worker_and_weighs_pushes_by_the_active_ones():
    shard = _shard()
    rule = SSPRule(shard, num_workers=2, nonfinite="raise", staleness=0)
    held = rule.commit(0, 0, Push([torch.tensor([2.0, 2.0])], ALL))
    assert not held.done() and shard.flats[0].tolist() == [-1.0, -1.0]  # 1 / W
    rule.worker_joined(1)
    assert held.wait().version == 1
    assert rule.commit(0, 1, Push([torch.tensor([2.0, 2.0])], ALL)).wait().version == 2  # alone, not held
    assert shard.flats[0].tolist() == [-3.0, -3.0]  # 1 / the one active worker
    rule.worker_joined(0)
    assert rule.clock == {0: 0, 1: 0} and rule.scale == 0.5


def _check(states, reference, tolerance=1e-5):
    for state in states:
        assert max_diff(state, reference) <= tolerance
    assert max_diff(states[0], states[1]) <= 1e-6  # the joined worker holds the final state too


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers,counts,settings", [
    ("ps", 1, EPOCHS, {}), ("ps", 2, EPOCHS, {}), ("ps", 1, EPOCHS, {"transport": "grpc"}),
    ("allreduce", 0, [(1, 4), (3, 0)], {}),  # rank 0 joins before DDP rebuilds its buckets; a worker with no batch
    ("allreduce", 0, EPOCHS, {"compression": "int8"}),  # a comm hook of all_gathers; int8 is not exact
])
def test_uneven_data_matches_single_process_training_on_the_batches_left(launch, strategy, servers, counts, settings):
    states = launch(train_uneven, strategy=strategy, workers=2, servers=servers, args=("mlp", counts),
                    step_timeout=20, timeout=100, **settings)
    _check(states, reference_uneven("mlp", counts), 1e-2 if settings.get("compression") else 1e-5)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_batchnorm_statistics_are_averaged_over_the_active_workers(launch, strategy, servers):
    states = launch(train_uneven, strategy=strategy, workers=2, servers=servers, args=("bn", EPOCHS),
                    step_timeout=20, timeout=100)
    reference = reference_uneven_bn(EPOCHS)
    _check(states, reference)
    assert all(s["1.num_batches_tracked"].item() == 9 for s in states)  # 5 + 4 steps, on every worker


@pytest.mark.job
@pytest.mark.timeout(120)
def test_hybrid_tables_and_dense_layers_average_over_the_active_workers(launch):
    counts = [(4, 2)]
    states = launch(train_uneven, strategy="hybrid", workers=2, servers=2, args=("clicks", counts),
                    step_timeout=20, timeout=100)
    _check(states, reference_uneven("clicks", counts))


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,settings", [("async", {}), ("ssp", {"staleness": 1})])
def test_async_and_ssp_finish_with_every_push_applied(launch, mode, settings):
    results = launch(train_uneven, strategy="ps", workers=2, servers=1, mode=mode, args=("mlp", EPOCHS, True),
                     step_timeout=20, timeout=100, **settings)
    (state0, stats), (state1, _) = results
    assert stats["pushes_applied"] == sum(map(sum, EPOCHS))
    assert max_diff(state0, state1) == 0


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_worker_that_leaves_without_joining_is_named(launch):
    with pytest.raises(gradsync.JobFailed, match=r"worker1 left the job after 3 steps without joining, and "
                                                 r"worker 0 waits in trainer.join\(\)"):
        launch(join_without_every_worker, strategy="ps", workers=2, servers=1, args=(3,),
               step_timeout=20, timeout=80)


@pytest.mark.job
@pytest.mark.timeout(90)
def test_join_is_refused_with_checkpoints(launch, tmp_path):
    with pytest.raises(gradsync.JobFailed, match=r"checkpoint_every=5 needs every worker at the same step"):
        launch(open_join, strategy="allreduce", workers=1, checkpoint_dir=str(tmp_path),
               checkpoint_every=5, step_timeout=20, timeout=80)
