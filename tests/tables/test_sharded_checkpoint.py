"""Checkpoints of the sharded strategy: each worker saves its rows with their row optimizer state, and a resume
re-homes them by the row partition of the resuming job's workers (in one process: W = 2 -> 3, 4 -> 2, 3 -> 3,
exact rows and state); a dynamic table's delta goes onto its full checkpoint; a job with a dynamic table too,
resumed from step K (a delta) onto the same W, ends bit for bit where the uninterrupted run ends, onto another
W with the dynamic table's decisions bit for bit and its values to float noise; a sharded checkpoint under
another strategy is refused naming both."""
import json
import os
import shutil

import pytest
import torch
from torch import nn

import gradsync
from gradsync.config import ConfigError, JobConfig
from gradsync.ps import shard_file
from gradsync.runtime import checkpoints
from gradsync.tables.id_hash import server_of
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.worker.rows.sharded_dynamic import ShardedDynamic
from gradsync.worker.rows.sharded_tables import ShardedTables
from helpers import max_diff
from sharded_models import SeenNet, train_resumed

ROWS, DIM = 50, 3
OPTIMIZERS = {"acc": gradsync.RowAdagrad(lr=0.1), "momentum": gradsync.RowSGD(lr=0.1, momentum=0.9)}


def _tables(worker: int, workers: int) -> ShardedTables:
    """Worker `worker`'s rows of one table per row optimizer, built on the meta device (no collective)."""
    modules = {f"{name}.weight": nn.Embedding(ROWS, DIM, device="meta") for name in OPTIMIZERS}
    rows = {f"{n}.weight": (o, None) for n, o in OPTIMIZERS.items()}
    tables = ShardedTables(modules, rows, worker, workers, 1.0, StepMetrics())
    tables.take_rows({name: module.weight for name, module in modules.items()})
    return tables


def _trained(worker: int, workers: int) -> ShardedTables:
    """A writer whose row r holds r + the column, after one row optimizer step on the even rows it owns
    (gradient: r / 10 in every column): state for some rows, none for the others."""
    tables = _tables(worker, workers)
    for shard in tables.shards.values():
        shard.values[:] = shard.owned.unsqueeze(1).float() + torch.arange(DIM)
        local = (shard.owned % 2 == 0).nonzero().view(-1)
        grads = shard.owned[local].unsqueeze(1).float().expand(-1, DIM) / 10
        shard.optimizer.step(shard.values, shard.state, local, grads)
    return tables


def _whole(tables: list[ShardedTables]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per table, (values, the row optimizer's state of each row) of the whole table; a row without momentum
    state reads NaN."""
    out = {}
    for name in tables[0].shards:
        values, state = torch.empty(ROWS, DIM), torch.full((ROWS, DIM), float("nan"))
        for t in tables:
            shard = t.shards[name]
            values[shard.owned] = shard.values
            if isinstance(shard.state, torch.Tensor):
                state[shard.owned] = shard.state.unsqueeze(1).expand(-1, DIM)
            else:
                has = shard.state.slot >= 0
                state[shard.owned[has]] = shard.state.data[shard.state.slot[has].long()]
        out[name] = (values, state)
    return out


@pytest.mark.parametrize("written,resumed", [(2, 3), (4, 2), (3, 3)])
def test_a_resume_rehomes_every_row_with_its_state_by_the_new_partition(written, resumed):
    writers = [_trained(w, written) for w in range(written)]
    files = [t.checkpoint() for t in writers]
    readers = []
    for w in range(resumed):
        reader, read = _tables(w, resumed), []
        own = w if w < written else 0
        order = [own, *(k for k in range(written) if k != own)]
        reader.restore((read.append(k) or files[k] for k in order), "the checkpoint")
        if written == resumed:
            assert read == [own]  # the same W: its own file alone
        readers.append(reader)
    for name, (values, state) in _whole(writers).items():
        got_values, got_state = _whole(readers)[name]
        assert torch.equal(got_values, values)
        assert torch.equal(got_state.isnan(), state.isnan())
        assert torch.equal(got_state.nan_to_num(), state.nan_to_num())
        if name == "momentum.weight":  # momentum for the rows stepped alone
            assert torch.equal(~state.isnan().any(1), torch.arange(ROWS) % 2 == 0)


def test_a_checkpoint_missing_rows_is_refused_naming_the_table():
    files = [_trained(w, 2).checkpoint() for w in range(2)]
    with pytest.raises(ValueError, match=r"^the checkpoint holds \d+ of the \d+ rows of table 'acc.weight' that "
                                         r"worker 0 owns: it was written by another model"):
        _tables(0, 3).restore(iter(files[:1]), "the checkpoint")


def _dynamic(worker: int, workers: int, ids: torch.Tensor | None = None) -> ShardedDynamic:
    """Worker `worker`'s part of a dynamic table '0'; with `ids`, holding its ids of them (row: id / 2^60) at
    step 7 (no collective)."""
    model = nn.Sequential(gradsync.DynamicEmbedding(DIM, capacity=100))
    tables = ShardedTables({}, {}, worker, workers, 1.0, StepMetrics(), ["0"])
    dynamic = ShardedDynamic(model, gradsync.RowAdagrad(lr=0.1), "sync", worker, workers, 1.0, tables, None)
    if ids is not None:
        mine = ids[server_of(ids, workers) == worker]
        dynamic.parts["0"].table.load({"ids": mine, "weight": mine.unsqueeze(1).expand(-1, DIM) / 2**60, "step": 7})
    return dynamic


@pytest.mark.parametrize("written,resumed", [(2, 3), (3, 2), (2, 2)])
def test_a_resume_rehomes_every_dynamic_id_by_the_id_hash(written, resumed):
    ids = torch.tensor([0x5DEECE66D * (i + 1) ** 3 - 2**62 for i in range(40)])
    files = [_dynamic(w, written, ids).checkpoint() for w in range(written)]
    for w in range(resumed):
        reader, read = _dynamic(w, resumed), []
        own = w if w < written else 0
        order = [own, *(k for k in range(written) if k != own)]
        reader.restore((read.append(k) or files[k] for k in order), "the checkpoint")
        state = reader.parts["0"].table.state()
        mine = ids[server_of(ids, resumed) == w].sort().values
        assert torch.equal(state["ids"], mine) and reader.step == 7
        assert torch.equal(state["weight"], mine.unsqueeze(1).expand(-1, DIM) / 2**60)
        if written == resumed:
            assert read == [own]  # the same W: its own file alone


@pytest.mark.parametrize("written,resumed", [(2, 2), (2, 3)])
def test_a_delta_goes_onto_its_full_checkpoint_at_a_resume(written, resumed):
    """Each worker writes its full part, then its table changes (ids evicted, ids created, rows updated) and it
    writes a delta: resumed from the deltas, each worker holds exactly its ids of the changed table with their
    rows, state and counters (onto the same W: its writer's checkpoint, bit for bit); deltas with no full
    checkpoint to go onto are refused."""
    ids = torch.tensor([0x5DEECE66D * (i + 1) ** 3 - 2**62 for i in range(40)])
    new = torch.tensor([0xB * (i + 1) ** 5 + 2**61 for i in range(12)])
    writers = [_dynamic(w, written, ids) for w in range(written)]
    fulls = [d.checkpoint() for d in writers]
    for w, d in enumerate(writers):
        part = d.parts["0"]
        part.table.evict_ids(ids[:10])
        created = new[server_of(new, written) == w].sort().values
        part.lookup(created, torch.ones_like(created), 7)
        updated = torch.cat([ids[10:20][server_of(ids[10:20], written) == w], created]).sort().values
        part.apply(updated, updated.unsqueeze(1).expand(-1, DIM).float() / 2**62)
    deltas = [d.checkpoint(full=False) for d in writers]
    assert all("removed" in p["0"] for p in deltas)
    states = [d.parts["0"].table.checkpoint() for d in writers]
    whole = {k: torch.cat([s[k] for s in states]) for k in ("ids", "weight", "optimizer", "lookups", "last_step")}
    for w in range(resumed):
        reader = _dynamic(w, resumed)
        own = w if w < written else 0
        reader.restore((deltas[k] for k in [own, *(k for k in range(written) if k != own)]), "the checkpoint",
                       full=lambda k: fulls[k])
        got = reader.parts["0"].table.checkpoint()
        if written == resumed:
            assert all(torch.equal(got[k], states[w][k]) for k in states[w])
        mine = server_of(whole["ids"], resumed) == w
        order = torch.argsort(whole["ids"][mine])
        assert all(torch.equal(got[k], v[mine][order]) for k, v in whole.items())
    with pytest.raises(ValueError, match=r"^the checkpoint holds a delta of dynamic table '0' and names no full "
                                         r"checkpoint to put it onto"):
        _dynamic(0, written).restore(iter(deltas), "the checkpoint")


def test_a_checkpoint_missing_a_dynamic_part_is_refused_naming_the_table():
    files = [_dynamic(w, 2, torch.arange(10)).checkpoint() for w in range(2)]
    with pytest.raises(ValueError, match=r"^the checkpoint holds 1 workers' parts of dynamic table '0', not every "
                                         r"part worker 0 takes its ids from"):
        _dynamic(0, 3).restore(iter(files[:1]), "the checkpoint")


def test_a_sharded_checkpoint_resumed_under_another_strategy_is_refused_naming_both(tmp_path):
    path = checkpoints.step_dir(str(tmp_path), 4)
    files = {name: shard_file.stored_digest(shard_file.write(os.path.join(path, name), {"step": 4}))
             for name in checkpoints.needed_files(0, [0, 1])}
    with open(os.path.join(path, checkpoints.MANIFEST), "w") as f:
        json.dump(dict(run="run-a", step=4, strategy="sharded", servers=0, workers=2, written=[0, 1], model={},
                       files=files), f)
    with pytest.raises(ConfigError, match=r"written by a job with strategy='sharded', and this job has "
                                          r"strategy='allreduce': resume with --strategy sharded"):
        checkpoints.decide(JobConfig(strategy="allreduce", servers=0, world_size=2, resume=str(tmp_path)))


@pytest.mark.job
@pytest.mark.timeout(200)
def test_a_sharded_job_resumed_from_step_k_ends_where_the_uninterrupted_run_ends(tmp_path):
    """SeenNet: fixed tables and a dynamic one (4 rows of 12 ids, LRU, admitted at the second sighting), W = 2,
    a checkpoint after each of 4 steps, every second one full (`checkpoint_full_every=2`); resumed from step 2,
    a delta onto step 1. Onto W = 2 every value ends bit for bit where the uninterrupted run's does; onto W = 3
    the dynamic table's decisions (resident and waiting ids, last steps, lookups, sightings, step, counters: the
    same global batch, so the same ones) bit for bit, every value to float noise (other sums of the workers'
    gradients)."""
    steps, resumed_at = 4, 2
    directory = str(tmp_path / "checkpoints")
    job = dict(step_timeout=60, timeout=120)
    (start, uninterrupted), _ = gradsync.launch(train_resumed, strategy="sharded", workers=2, args=(steps,),
                                                checkpoint_dir=directory, checkpoint_every=1, checkpoint_full_every=2,
                                                **job)
    fixed = {k: v for k, v in uninterrupted.items() if not k.startswith("seen.")}
    assert start == 0 and max_diff(fixed, {k: v for k, v in SeenNet().state_dict().items() if k in fixed}) > 1e-2
    folder = checkpoints.step_dir(directory, resumed_at)
    with open(os.path.join(folder, checkpoints.MANIFEST)) as f:
        assert json.load(f)["base"] == os.path.basename(checkpoints.step_dir(directory, 1))
    parts = [shard_file.load(os.path.join(folder, f"worker-{w}.ckpt"))["dynamic"] for w in range(2)]
    assert [p["seen"]["num_servers"] for p in parts] == [2, 2] and all("removed" in p["seen"] for p in parts)
    kept = sum(p["seen"]["counters"] for p in parts)
    ended = uninterrupted["seen.counters"]
    assert (kept < ended).all() and kept[0] > 0  # rows admitted before it; admitted, filtered, evicted after
    assert uninterrupted["seen.ids"].numel() == 4 and uninterrupted["seen.waiting_ids"].numel() > 0
    for step in range(resumed_at + 1, steps + 1):  # resume from step `resumed_at`
        shutil.rmtree(checkpoints.step_dir(directory, step))
    decisions = [k for k in uninterrupted if k.startswith("seen.") and k != "seen.weight"]
    for workers in (2, 3):
        results = gradsync.launch(train_resumed, strategy="sharded", workers=workers, args=(steps,),
                                  resume=directory, **job)
        for start, state in results:
            assert start == resumed_at and list(state) == list(uninterrupted)
            if workers == 2:
                assert all(torch.equal(state[k], uninterrupted[k]) for k in uninterrupted)  # bit for bit
            else:  # other sums of the workers' gradients: float noise
                assert all(torch.equal(state[k], uninterrupted[k]) for k in decisions)
                assert max_diff(state, uninterrupted) <= 1e-5
