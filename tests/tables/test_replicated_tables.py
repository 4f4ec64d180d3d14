"""gradsync.DynamicEmbedding under allreduce: a replica per worker. In one process: W replicas, each looking up
its own part of every step and fed every worker's lookups and row gradients, end every step exactly as one table
stepped on the joint batch (`DynamicTable.count_lookups`, `ReplicatedRows.apply`); the Trainer's refusals. In
jobs (W = 2 and 4): parity with nn.Embedding and the user's AdamW beside it, every replica identical and equal to
the single-process tables with eviction and admission, the state_dict keys, the bytes, bad ids; a checkpoint
(a delta onto a full one) resumed bit for bit; a delta with no full one refused."""
import random
import shutil

import pytest
import torch

import gradsync
from dynamic_jobs import reference_dynamic, train_dynamic, train_resumable
from gradsync.ps import shard_file
from gradsync.core.errors import GradientError
from gradsync.tables.dynamic_checkpoint import with_delta
from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.row_init import HashedUniform
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.worker.rows.replicated import ReplicatedRows

LOW, HIGH = -2**63, 2**63 - 1
RULES = [dict(evict="lru", admit_after=2), dict(evict="lfu", ttl_steps=2, admit_after=2, admit_probability=0.6),
         dict(evict="lru", ttl_steps=3, admit_probability=0.5), dict(evict="lfu")]
STATE_KEYS = ("ids", "last_step", "lookups", "waiting_ids", "waiting_sightings", "waiting_last_step", "step",
              "counters")


def split_steps(seed: int, workers: int, steps: int):
    """Each step's ids of every worker (some workers look nothing up in some steps) and a weight per lookup."""
    rng = random.Random(seed)
    pool = [LOW, HIGH, -1, 0] + [rng.randrange(LOW, HIGH) for _ in range(8)]
    for _ in range(steps):
        ids = [[rng.choice(pool) for _ in range(rng.choice([0, 1, 3, 6]))] for _ in range(workers)]
        yield ids, [[rng.choice([-1.0, 0.5, 2.0]) for _ in part] for part in ids]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_counting_the_other_workers_lookups_ends_the_step_as_one_lookup_of_the_joint_batch(rule):
    evicted = 0
    for seed in range(6):
        workers = 2 + seed % 3
        options = dict(capacity=1 + seed % 4, init=HashedUniform(2, seed), seed=seed, **rule)
        joint, replicas = DynamicTable(2, **options), [DynamicTable(2, **options) for _ in range(workers)]
        for t, (ids, _) in enumerate(split_steps(seed, workers, 12)):
            joint.lookup(torch.tensor(sum(ids, []), dtype=torch.int64), t)
            for me, replica in enumerate(replicas):
                replica.lookup(torch.tensor(ids[me], dtype=torch.int64), t)
                others = torch.tensor(sum((part for w, part in enumerate(ids) if w != me), []), dtype=torch.int64)
                distinct, occurrences = others.unique(return_counts=True)
                replica.count_lookups(distinct, occurrences, t)
            for table in (joint, *replicas):
                table.end_step(t)
            for replica in replicas:
                for key, value in joint.state().items():
                    assert torch.equal(replica.state()[key], value), (seed, t, key)
        evicted += joint.counters["evicted"]
    assert evicted > 0


@pytest.mark.parametrize("optimizer", [gradsync.RowSGD(lr=0.3), gradsync.RowAdagrad(lr=0.3)], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_replicas_fed_every_workers_lookups_and_gradients_equal_one_table_on_the_joint_batch(rule, optimizer):
    for seed in range(4):
        workers = 2 + seed % 3
        options = dict(capacity=2 + seed % 3, seed=seed, **rule)
        joint = gradsync.DynamicEmbedding(2, **options)
        layers = [gradsync.DynamicEmbedding(2, **options) for _ in range(workers)]
        replicas = [ReplicatedRows(torch.nn.ModuleDict({"emb": layer}), optimizer, w, workers, "raise",
                                   lambda: workers, StepMetrics())
                    for w, layer in enumerate(layers)]
        for ids, weights in split_steps(seed, workers, 12):
            losses = [(layer(torch.tensor(i, dtype=torch.int64)) * torch.tensor(w).unsqueeze(1)).sum() / workers
                      for layer, i, w in zip(layers, ids, weights)]
            sum(losses).backward()  # the mean over the workers' losses: each worker's rows get its own part
            joint_ids, joint_weights = sum(ids, []), sum(weights, [])
            joint_out = joint(torch.tensor(joint_ids, dtype=torch.int64)) * torch.tensor(joint_weights).unsqueeze(1)
            (joint_out.sum() / workers).backward()
            joint.step(optimizer)
            parts = [replica.lookups(lambda rows: rows.grad * workers) for replica in replicas]  # each its sum
            for replica in replicas:
                replica.update([[part[0] for part in parts]], workers, 1.0, True)
                replica.end_step()
            expected = joint.state_dict()
            for layer in layers:
                state = layer.state_dict()
                for key in STATE_KEYS:
                    assert torch.equal(state[key], expected[key]), (seed, key)
                torch.testing.assert_close(state["weight"], expected["weight"], rtol=0, atol=1e-6)
                assert torch.equal(state["weight"], layers[0].state_dict()["weight"])  # replicas bit for bit


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_nan_in_one_workers_row_gradients_is_refused_naming_it_or_skipped_on_every_replica(nonfinite):
    layers = [gradsync.DynamicEmbedding(2, capacity=8) for _ in range(2)]
    replicas = [ReplicatedRows(torch.nn.ModuleDict({"users": layer}), gradsync.RowSGD(lr=1.0), w, 2, nonfinite,
                               lambda: 2, StepMetrics())
                for w, layer in enumerate(layers)]
    for layer, ids, scale in zip(layers, ([3, 4], [4, 5]), (1.0, float("nan"))):
        (layer(torch.tensor(ids)).sum() * scale).backward()
    parts = [replica.lookups(lambda rows: rows.grad) for replica in replicas]
    for replica, layer in zip(replicas, layers):
        if nonfinite == "raise":
            with pytest.raises(GradientError, match=r"'users.weight' from worker 1.*nonfinite='skip'"):
                replica.update([[part[0] for part in parts]], 2, 1.0, True)
            continue
        replica.update([[part[0] for part in parts]], 2, 1.0, True)
        replica.end_step()
        state = layer.state_dict()  # the step's lookups counted, its rows as created
        assert state["ids"].tolist() == [3, 4, 5] and state["lookups"].tolist() == [1, 2, 1]
        assert torch.equal(state["weight"], HashedUniform(2)(torch.tensor([3, 4, 5]))) and state["step"] == 1


def test_a_dynamic_table_without_a_row_optimizer_is_refused_naming_it():
    model = torch.nn.ModuleDict({"users": gradsync.DynamicEmbedding(2, capacity=4)})
    with pytest.raises(ValueError, match=r"'users' is a gradsync.DynamicEmbedding.*table_optimizer=None.*RowSGD"):
        ReplicatedRows(model, None, 0, 2, "raise", lambda: 2, StepMetrics())
    ReplicatedRows(model, gradsync.RowSGD(lr=0.1), 0, 2, "raise", lambda: 2, StepMetrics())
    with pytest.raises(TypeError, match=r"'users' \(DynamicEmbedding\(dim=2, capacity=4\)\): ids must be an integer"):
        model["users"](torch.tensor([1.5]))
    assert model["users"].take_recorded().ids.numel() == 0 and model["users"].resident_rows == 0


def test_a_delta_of_the_replicas_goes_onto_its_full_checkpoint_or_is_refused():
    def replicas():
        model = torch.nn.ModuleDict({"users": gradsync.DynamicEmbedding(2, capacity=4)})
        return model, ReplicatedRows(model, gradsync.RowSGD(lr=0.1), 0, 2, "raise", lambda: 2, StepMetrics())

    model, written = replicas()
    model["users"].table.lookup(torch.tensor([3, 5, 7]), 0)
    full = written.checkpoint(delta=False)
    model["users"].table.lookup(torch.tensor([9, -1]), 1)
    model["users"].table.evict_ids(torch.tensor([5]))
    delta = written.checkpoint(delta=True)
    _, reader = replicas()
    with pytest.raises(ValueError, match=r"^the checkpoint holds a delta of dynamic table 'users' and names no full"):
        reader.restore([delta], "the checkpoint", None)
    reader.restore([delta], "the checkpoint", lambda: full)
    assert reader.layers["users"].table.state()["ids"].tolist() == [-1, 3, 7, 9]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer, extra, scaled", [("adagrad", [2, 0], False), ("sgd", [1, 2, 0, 2], True)])
def test_allreduce_replicas_match_single_process_training(launch, optimizer, extra, scaled):
    """6 steps of every worker, then each worker's `extra` steps in a join block (the mean over the active ones);
    `scaled`: under a GradScaler (a power of two, so unscaled rows are exact)."""
    steps = 6
    results = launch(train_dynamic, strategy="allreduce", workers=len(extra), args=(optimizer, steps, extra, scaled),
                     step_timeout=60)
    reference, users, bytes_per_step, counters = reference_dynamic(optimizer, steps, extra)
    state, own, sent, error, unchanged = results[0]
    for other in results:  # every replica the same, bit for bit, and the user's module holds it
        for key, value in state.items():
            assert torch.equal(other[0][key], value), key
            assert torch.equal(other[1][key], value), key
        assert other[2][:steps] == bytes_per_step  # the ids and row gradients all-gathered, beside DDP's bytes
    assert list(own) == list(state)
    assert state["users.ids"].tolist() == sorted(users) and state["users.ids"].dtype == torch.int64
    position = {i: k for k, i in enumerate(users)}
    expected_users = reference["users.weight"][[position[i] for i in state["users.ids"].tolist()]]
    tolerance = 1e-5 if optimizer == "sgd" else 1e-6
    torch.testing.assert_close(state["users.weight"], expected_users, rtol=0, atol=tolerance)
    for key in ("head.weight", "head.bias"):
        torch.testing.assert_close(state[key], reference[key], rtol=0, atol=1e-5)
    for table in ("items", "tags"):
        for key in STATE_KEYS:
            assert torch.equal(state[f"{table}.{key}"], reference[f"{table}.{key}"]), (table, key)
        torch.testing.assert_close(state[f"{table}.weight"], reference[f"{table}.weight"], rtol=0, atol=1e-6)
    assert counters["items"]["evicted"] > 0 and counters["items"]["filtered"] > 0
    assert counters["tags"]["evicted"] > 0 and counters["tags"]["filtered"] > 0
    assert "'users' (DynamicEmbedding(dim=4, capacity=1000)): ids must be an integer tensor" in error
    assert unchanged


@pytest.mark.timeout(240)
def test_a_checkpoint_of_the_replicas_resumes_bit_for_bit_on_as_many_workers_and_restores_on_more(launch, tmp_path):
    """RowAdagrad, W = 2, a checkpoint every 2 steps of 8, every second one full (`checkpoint_full_every=2`).
    Resumed from step 4, a delta onto step 2, with W = 2, a job ends where the uninterrupted one ended, bit for
    bit (the rows' Adagrad sums came back: fresh ones would update them otherwise); with W = 3, every worker
    starts from worker 0's tables of step 4 (its delta onto its full part), row optimizer state included, and the
    replicas stay identical."""
    written = tmp_path / "written"
    first = launch(train_resumable, strategy="allreduce", workers=2, args=(8,), step_timeout=60,
                   checkpoint_dir=str(written), checkpoint_every=2, checkpoint_full_every=2)
    kept = tmp_path / "until-4"
    for step in ("step-00000002", "step-00000004"):
        shutil.copytree(written / step, kept / step)
    saved = shard_file.load(str(kept / "step-00000004" / "worker-0.ckpt"))
    full = shard_file.load(str(kept / "step-00000002" / "worker-0.ckpt"))
    assert not any(k.startswith(("users.", "items.", "tags.")) for k in saved["model"])  # once, under "tables"
    assert all("removed" in part for part in saved["tables"].values())
    tables = {name: with_delta(full["tables"][name], part) for name, part in saved["tables"].items()}
    assert tables["users"]["optimizer"].shape == tables["users"]["ids"].shape
    for workers in (2, 3):
        resumed = launch(train_resumable, strategy="allreduce", workers=workers, args=(8,), step_timeout=60,
                         resume=str(kept))
        for result in resumed:
            assert result["first"] == 4
            for name, part in tables.items():
                for key, value in part.items():
                    assert torch.equal(result["start"][name][key], value), (workers, name, key)
            assert list(result["end"]) == list(first[0]["end"])
            for key, value in (first if workers == 2 else resumed)[0]["end"].items():
                assert torch.equal(result["end"][key], value), (workers, key)
    assert tables["tags"]["counters"][2] < first[0]["end"]["tags.counters"][2]  # evictions after step 4
