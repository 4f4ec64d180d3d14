"""Dynamic tables under ps (S = 1, 2) and hybrid, sync, W = 2: the rows on the servers train as in one process,
through a `trainer.join()` block (worker 1 takes more steps in it) and a step after it.
Each job checks the unbounded table against an nn.Embedding holding init(id) in order of first sight (SGD), or
against the single-process DynamicEmbedding (RowAdagrad); the small LRU and LFU tables, with admission, end
with the ids the single-process rule keeps, bit for bit, and the same rows; trainer.state_dict(), the module's
own state_dict, its resident_rows and counters and the servers' stats agree. Checkpoints, full and delta,
resume onto other numbers of servers bit for bit; under async each server bounds its share of the table. A
dynamic table's lookups count as pull (hybrid pulls nothing else), never as compute."""
import json
import shutil

import pytest
import torch

import gradsync
from dynamic_models import TABLES, DynNet, reference_dynamic, reference_first_sight, train_dynamic, train_resumable
from gradsync.ps import shard_file
from gradsync.tables.dynamic_checkpoint import rehomed

pytestmark = pytest.mark.job

STEPS, EXTRA = 5, [1, 3]  # the steps every worker takes, then each one's in the join block
KEYS = ("ids", "weight", "last_step", "lookups", "waiting_ids", "waiting_sightings", "waiting_last_step", "step",
        "counters")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy,servers,optimizer", [("ps", 1, "sgd"), ("ps", 2, "adagrad"),
                                                        ("hybrid", 2, "sgd")])
def test_dynamic_tables_on_the_servers_train_as_in_one_process(strategy, servers, optimizer):
    results = gradsync.launch(train_dynamic, strategy=strategy, workers=len(EXTRA), servers=servers,
                              args=(optimizer, STEPS, EXTRA), step_timeout=60, timeout=140)
    reference = reference_dynamic(optimizer, STEPS, EXTRA)
    expected = reference.state_dict()
    for result in results:
        state, module = result["trainer"], result["module"]
        assert [k for k in state if k.startswith("big.")] == [f"big.{k}" for k in KEYS]
        for name in TABLES:
            for key in ("ids", "last_step", "lookups", "waiting_ids", "waiting_sightings", "step", "counters"):
                assert torch.equal(state[f"{name}.{key}"], expected[f"{name}.{key}"]), (name, key)
                assert torch.equal(module[f"{name}.{key}"], expected[f"{name}.{key}"]), (name, key)
            torch.testing.assert_close(state[f"{name}.weight"], expected[f"{name}.weight"], rtol=0, atol=1e-5)
            assert torch.equal(module[f"{name}.weight"], state[f"{name}.weight"])
            table = getattr(reference, name)
            assert result["tables"][name] == (table.resident_rows, table.counters)
        torch.testing.assert_close(state["head.weight"], expected["head.weight"], rtol=0, atol=1e-5)
    counters = {n: results[0]["tables"][n][1] for n in TABLES}
    assert counters["lru"]["evicted"] > 0 and counters["lfu"]["evicted"] > 0 and counters["lru"]["filtered"] > 0
    assert all(len(expected[f"{n}.ids"]) <= c for n, c in (("lru", 6), ("lfu", 5)))
    for name in TABLES:  # the servers' stats: resident rows and counters, summed over the servers
        per = [results[0]["stats"][s][name] for s in range(servers)]
        assert sum(t["rows"] for t in per) == results[0]["tables"][name][0]
        assert [sum(t[k] for t in per) for k in ("admitted", "filtered", "evicted")] == \
            list(counters[name].values())
    if strategy == "hybrid":
        assert all(pulled > 0 for pulled in results[0]["pull_s"]), results[0]["pull_s"]
    if optimizer == "sgd":
        ids, rows = reference_first_sight(STEPS, EXTRA)
        assert torch.equal(results[0]["trainer"]["big.ids"], ids)
        torch.testing.assert_close(results[0]["trainer"]["big.weight"], rows, rtol=0, atol=1e-5)


@pytest.mark.timeout(200)
def test_full_and_delta_checkpoints_resume_onto_1_and_3_servers_bit_for_bit(tmp_path):
    """ps, 2 servers, RowAdagrad, a checkpoint every 2 steps, every 3rd full: steps 2 and 8 full, 4, 6 and 10
    deltas. Resumed from step 6 (a delta onto step 2, whose small tables had no row yet) with 1 server and with
    3, a job ends where the uninterrupted one ended, bit for bit: every row, the admission and eviction state
    (and so the row optimizer's state, which the rows' last 4 steps depend on)."""
    written = tmp_path / "written"
    first = gradsync.launch(train_resumable, strategy="ps", workers=2, servers=2, args=(10,), step_timeout=60,
                            timeout=140, checkpoint_dir=str(written), checkpoint_every=2, checkpoint_full_every=3)
    bases = {step: json.loads((written / f"step-{step:08d}" / "MANIFEST.json").read_text()).get("base")
             for step in (2, 4, 6, 8, 10)}
    assert bases == {2: None, 4: "step-00000002", 6: "step-00000002", 8: None, 10: "step-00000008"}
    kept = tmp_path / "until-6"
    for step in (2, 4, 6):
        shutil.copytree(written / f"step-{step:08d}", kept / f"step-{step:08d}")
    for servers in (1, 3):
        for result in gradsync.launch(train_resumable, strategy="ps", workers=2, servers=servers, args=(10,),
                                      step_timeout=60, timeout=140, resume=str(kept)):
            assert result["first"] == 6 and all(result["start"][f"{n}.step"] == 6 for n in TABLES)
            assert list(result["end"]) == list(first[0]["end"])
            for key, value in first[0]["end"].items():
                assert torch.equal(result["end"][key], value), (servers, key)
            assert result["end"]["lru.counters"][2] > result["start"]["lru.counters"][2]  # evictions after 6


def _tables_of(folder) -> list[dict[str, dict]]:
    """Each server's checkpoint parts of the dynamic tables in a step folder, in server order."""
    servers = json.loads((folder / "MANIFEST.json").read_text())["servers"]
    return [shard_file.load(str(folder / f"shard-{s}.ckpt"))["tables"] for s in range(servers)]


@pytest.mark.timeout(200)
def test_async_servers_bound_their_share_and_keep_weights_and_optimizer_state_on_the_same_ids(tmp_path):
    """ps --mode async, 2 servers, W = 2, RowAdagrad, 8 steps, a checkpoint every 4; resumed from step 4 on 1
    server. In each checkpoint every server holds at most its share of each table's capacity (lru 6: 3 + 3;
    lfu 5: 3 + 2; 1 server: all of it), one Adagrad sum per row, and a row differs from init(id) exactly where
    its sum grew: a sum lost or misplaced (fresh after the restore, say) would show as a row updated before
    and not since with no sum."""
    written, kept = tmp_path / "written", tmp_path / "until-4"
    gradsync.launch(train_resumable, strategy="ps", mode="async", workers=2, servers=2, args=(8,), step_timeout=60,
                    timeout=140, checkpoint_dir=str(written), checkpoint_every=4)
    shutil.copytree(written / "step-00000004", kept / "step-00000004")
    resumed = gradsync.launch(train_resumable, strategy="ps", mode="async", workers=2, servers=1, args=(8,),
                              step_timeout=60, timeout=140, resume=str(kept), checkpoint_dir=str(kept),
                              checkpoint_every=4)
    model = DynNet()
    capacities = {name: getattr(model, name).table.capacity for name in TABLES}
    for folder, shares in ((written / "step-00000004", {"lru": [3, 3], "lfu": [3, 2]}),
                           (written / "step-00000008", {"lru": [3, 3], "lfu": [3, 2]}),
                           (kept / "step-00000008", {"lru": [6], "lfu": [5]})):
        parts = _tables_of(folder)
        for name in TABLES:
            for server, part in enumerate(parts):
                assert part[name]["ids"].numel() <= shares.get(name, [capacities[name]] * 2)[server], (folder, name)
            whole = rehomed([part[name] for part in parts], 0, 1)
            assert whole["optimizer"].shape == whole["ids"].shape
            updated = (whole["weight"] != getattr(model, name).table.init(whole["ids"])).any(1)
            assert torch.equal(updated, whole["optimizer"] > 0), (folder, name)
            assert updated.any() or name == "lfu", (folder, name)  # lfu: TTL 3 server steps leaves 0-2 rows
    final = rehomed([part["lru"] for part in _tables_of(written / "step-00000008")], 0, 1)
    assert final["counters"][2] > 0 and rehomed([p["lfu"] for p in _tables_of(kept / "step-00000008")], 0, 1)[
        "counters"][2] > 0  # evictions, in both jobs
    assert all(result["first"] == 4 for result in resumed)
