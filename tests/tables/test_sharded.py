"""The sharded strategy matches single-process training on the joint batch (an EmbeddingBag with offsets and
an Embedding under row optimizers, dense layers under AdamW), on uneven batches (a worker with no id of some
owner, one with no bag id at all); the trainer's and the user's module's state_dict hold the whole tables; an
id out of a table is refused by every worker with one error and nothing applied. Each all-to-all is a lane of
the step timeline carrying the bytes the batches imply, and its time is the step's exchange, not its pull.
Dynamic tables split over the workers by the id hash train as the single-process DynamicEmbedding does."""
import dataclasses

import pytest
import torch

import gradsync
from gradsync.tables.row_partition import owners
from gradsync.worker.rows import pending_rows, sharded_tables
from gradsync.worker.rows.sharded_tables import HEADER, ID_CAPACITY
from helpers import check_timeline_order, max_diff
from dynamic_models import TABLES, dyn_batch, reference_dynamic, reference_first_sight, train_sharded
from sharded_models import DIM, ROWS_EMB, BagNet, Case, bag_batch, reference_bags, train_bags

pytestmark = pytest.mark.job  # every test here starts processes

STEPS = 6
INT64, FP32 = 8, 4
LOOKUPS = (("bag.weight", 0), ("emb.weight", 2))  # BagNet's lookups in model order, each's ids in `bag_batch`


def _exchanges(step: int, me: int, workers: int, capacity: int, most: int, batch: int
               ) -> tuple[list[tuple[str, int, int]], int]:
    """Worker `me`'s all-to-alls of `step` (lane, bytes to the other workers, bytes from them) from the
    batches, when its tagged exchanges carry `capacity` ids per worker at first (each HEADER int64s and the
    capacity to each other worker; it grows to at most `most`), and the capacity after them. The forward's
    lookups wait until it uses one, then go `batch` at a time: the counts with the first ids of each block
    (every lookup's ids a worker sends an owner), the rest of every block when some worker's did not fit (the
    capacity then grows to the largest block), and every lookup's rows back; the forward's end; at the step
    the flags, then one exchange of every table's gradients of those rows (no ids: the forward's route)."""
    batches = [bag_batch(step, w) for w in range(workers)]
    others = [w for w in range(workers) if w != me]
    lanes, grads_out, grads_in = [], 0, 0
    for first in range(0, len(LOOKUPS), batch):
        group = LOOKUPS[first:first + batch]
        blocks = [[0] * workers for _ in range(workers)]  # blocks[v][w]: id elements worker v sends owner w
        rows_out = rows_in = 0
        for _, at in group:
            owned = [torch.bincount(owners(b[at].unique(), workers), minlength=workers).tolist() for b in batches]
            blocks = [[blocks[v][w] + owned[v][w] for w in range(workers)] for v in range(workers)]
            rows_out += DIM * FP32 * sum(owned[w][me] for w in others)
            rows_in += DIM * FP32 * sum(owned[me][w] for w in others)
        names = "+".join(name for name, _ in group)
        tagged = INT64 * (HEADER + capacity) * (workers - 1)
        lanes.append((f"a2a {names} ids", tagged, tagged))
        if (largest := max(max(b) for b in blocks)) > capacity:
            lanes.append((f"a2a {names} more ids", INT64 * sum(max(0, blocks[me][w] - capacity) for w in others),
                          INT64 * sum(max(0, blocks[w][me] - capacity) for w in others)))
            capacity = max(capacity, min(largest, most))
        lanes.append((f"a2a {names} rows", rows_out, rows_in))
        grads_out, grads_in = grads_out + rows_in, grads_in + rows_out
    tagged = INT64 * (HEADER + capacity) * (workers - 1)
    return lanes + [("a2a forward end", tagged, tagged), ("a2a grad flags", tagged, tagged),
                    ("a2a row grads", grads_out, grads_in)], capacity


def _check_lanes(result: dict, case: Case, me: int, workers: int, most: int, batch: int = 2) -> None:
    """Worker `me`'s timeline and records of `train_bags`: each step's all-to-alls as `_exchanges` says (the
    capacity carried from the step before; after a step with refusals or two half-batches, read off its first
    lane), their bytes the record's, their time exchange."""
    capacity = 0  # the job's first tagged exchange carries no ids
    for record, timed in zip(result["records"], result["timeline"]):
        step, pieces = timed["step"] - 1, timed["pieces"]
        lanes = [(p["lane"], p["bytes_sent"], p["bytes_received"]) for p in pieces if p["exchange"]]
        if step == case.accumulate_at:  # two half-batches: two lookups of each table, their gradients at once
            assert [lane for lane, _, _ in lanes].count("a2a bag.weight+emb.weight ids") == 2
            assert [lane for lane, _, _ in lanes].count("a2a row grads") == 1
            capacity = None
        elif step == case.bad_at:  # the refused lookups' exchanges count in that step too
            capacity = None
        else:  # after a step not checked here, the capacity its first exchange carried
            start = lanes[0][1] // (INT64 * (workers - 1)) - HEADER if capacity is None else capacity
            expected, capacity = _exchanges(step, me, workers, start, most, batch)
            assert lanes == expected
        assert sum(p["bytes_sent"] for p in pieces) == record["bytes_sent"]  # with DDP's bucket lanes
        assert sum(p["bytes_received"] for p in pieces) == record["bytes_received"]
        assert record["pull_s"] == 0 < record["exchange_s"]  # its own column: neither pull nor compute
        check_timeline_order(pieces)


CASES = [(2, Case("sgd", skip_at=4)), (4, Case("adagrad", max_norm=0.5, accumulate_at=4, meta=True))]


def _refusals(me: int) -> list[str]:
    """What worker `me` raises at `Case.bad_at`: the id out of the Embedding; worker 1's forward that skips the
    EmbeddingBag (it fetches the Embedding's lookup, every other worker both); worker 1's forward that skips the
    Embedding (it fetches the EmbeddingBag's lookup, every other worker both)."""
    other = 0 if me == 1 else 1
    out = [f"table 'emb.weight' has rows 0..{ROWS_EMB - 1}, but a batch looked up id {ROWS_EMB + 3} on worker 1: "
           "fix the input ids (nothing was looked up or applied)"]
    for skipper in ("a lookup of table 'emb.weight'", "a lookup of table 'bag.weight'"):
        at = {w: skipper if w == 1 else "a lookup of tables 'bag.weight', 'emb.weight'" for w in (me, other)}
        out.append(f"worker {me} is at {at[me]} and worker {other} at {at[other]}: every worker must look up every "
                   "sharded table in every forward, in the same order (each lookup is an exchange with every "
                   "worker); call a table with an empty batch where a worker has no ids for it (nothing was looked "
                   "up or applied)")
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,case", CASES)
def test_sharded_tables_match_single_process(workers, case):
    results = gradsync.launch(train_bags, strategy="sharded", workers=workers, args=(case, STEPS), step_timeout=60,
                              timeout=140)
    initial = results[0]["initial"]
    reference = reference_bags(case, STEPS, workers, initial)
    for me, r in enumerate(results):
        _check_lanes(r, case, me, workers, ID_CAPACITY)
        assert all(torch.equal(r["initial"][k], v) for k, v in initial.items())
        assert list(r["state"]) == list(reference) == list(r["module"])  # keyed as model.state_dict()
        assert max_diff(r["state"], reference) <= 1e-5
        assert max_diff(r["module"], reference) <= 1e-5  # the user's module gathers the whole tables
        assert r["refused"] == _refusals(me)
        assert r["unchanged"]
        assert r["sizes"]["sharded_tables"] == 2
        if case.skip_at is not None:  # the scaler skipped the step of worker 1's Inf and halved its scale
            assert r["scales"] == [16.0] * case.skip_at + [8.0] * (STEPS - case.skip_at)
    trained = BagNet()
    trained.load_state_dict(reference)
    with torch.no_grad():
        expected = trained(*bag_batch(STEPS, 0)[:4])
    assert (results[0]["evaluated"] - expected).abs().max() <= 1e-4  # evaluation on worker 0 alone
    for key in ("bag.weight", "emb.weight", "mlp.0.weight"):
        assert (results[0]["state"][key] - initial[key]).abs().max() > 1e-3  # it trained
    if case.meta:  # the owners initialised the Embedding N(0, 1), as nn.Embedding does
        emb = initial["emb.weight"]
        assert emb.isfinite().all() and 0.5 < emb.std() < 1.5 and not torch.equal(emb, BagNet().emb.weight)
    for other in (dataclasses.replace(case, max_norm=None), dataclasses.replace(case, skip_at=None)):
        if other != case:  # the clipping and the skipped step matter: without them the reference lands elsewhere
            assert max_diff(reference_bags(other, STEPS, workers, initial), reference) > 1e-3


CAPPED = 2


def _train_capped(case: Case, steps: int) -> dict:
    """`train_bags` with at most CAPPED ids per worker in a tagged exchange (most lookups' blocks are larger)
    and one lookup per exchange (the first flushed alone when the second is made)."""
    sharded_tables.ID_CAPACITY = CAPPED  # this rank's own module: it ends with the job
    pending_rows.LOOKUPS_PER_EXCHANGE = 1
    return train_bags(case, steps)


@pytest.mark.timeout(150)
def test_ids_that_do_not_fit_the_tagged_exchange_take_a_second_one():
    """With the tagged exchanges capped at CAPPED ids per worker, a block larger than that sends its first ids
    there and the rest in a second exchange of every block's rest, every step; with one lookup per exchange,
    each table's lookup travels alone: the same training (to 1e-5), the lanes and bytes the batches imply."""
    case = Case("sgd")
    results = gradsync.launch(_train_capped, strategy="sharded", workers=2, args=(case, STEPS), step_timeout=60,
                              timeout=140)
    reference = reference_bags(case, STEPS, 2, results[0]["initial"])
    for me, r in enumerate(results):
        _check_lanes(r, case, me, 2, CAPPED, batch=1)
        assert max_diff(r["state"], reference) <= 1e-5
    assert "a2a emb.weight more ids" in [p["lane"] for p in results[0]["timeline"][-1]["pieces"]]


DYNAMIC_STEPS, DYNAMIC_WORKERS = 8, 3


@pytest.mark.timeout(150)
def test_dynamic_tables_split_over_the_workers_train_as_in_one_process():
    """DynNet (an unbounded table, an LRU bag of 6 rows and an LFU table of 5 with TTL, both admitting at the
    second sighting) under sharded, W = 3, RowSGD: every worker's trainer.state_dict() and module state_dict()
    hold the single-process tables' resident ids, admission and eviction state bit for bit and their rows to
    1e-6; resident_rows and the counters are the whole table's; worker 0's evaluation alone reads the owners."""

    results = gradsync.launch(train_sharded, strategy="sharded", workers=DYNAMIC_WORKERS, servers=0,
                              args=("sgd", DYNAMIC_STEPS), step_timeout=60, timeout=140)
    no_join = [0] * DYNAMIC_WORKERS  # every worker in every step: the steps before the join block and one after
    reference = reference_dynamic("sgd", DYNAMIC_STEPS - 1, no_join)
    expected = reference.state_dict()
    for result in results:
        for state in (result["trainer"], result["module"]):
            assert list(state) == list(expected)
            for key, value in expected.items():
                if value.is_floating_point():  # rows and the head
                    torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6)
                else:
                    assert torch.equal(state[key], value), key
        for name in TABLES:
            table = getattr(reference, name)
            assert result["tables"][name] == (table.resident_rows, table.counters)
    counters = {n: results[0]["tables"][n][1] for n in TABLES}
    assert counters["lru"]["evicted"] > 0 and counters["lfu"]["evicted"] > 0 and counters["lru"]["filtered"] > 0
    for result in results:  # each step's end, after its commit, in that step's exchange and lanes
        for record, timed in zip(result["records"], result["timeline"]):
            ends = [p for p in timed["pieces"] if p["lane"] == "all-gather end"]
            assert len(ends) == 1 and ends[0]["bytes_sent"] == ends[0]["bytes_received"] > 0
            assert sum(p["bytes_sent"] for p in timed["pieces"]) == record["bytes_sent"]
            assert sum(p["bytes_received"] for p in timed["pieces"]) == record["bytes_received"]
            assert ends[0]["back"] >= ends[0]["left"]
    ids, rows = reference_first_sight(DYNAMIC_STEPS - 1, no_join)
    assert torch.equal(results[0]["trainer"]["big.ids"], ids)
    torch.testing.assert_close(results[0]["trainer"]["big.weight"], rows, rtol=0, atol=1e-6)
    with torch.no_grad():
        evaluated = reference(*dyn_batch(DYNAMIC_STEPS, 1)[:3])
