"""gradsync.DynamicEmbedding in one process: the id hash and index, the admission and eviction rules against a
plain Python implementation of the documented rule, fresh rows after readmission, parity with nn.Embedding and
nn.EmbeddingBag, the whole int64 range, state_dict and bad input."""
import random

import pytest
import torch
from torch import nn

import gradsync
from gradsync.tables.id_hash import keyed, mix64, server_of, unit_interval
from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables import _table_loops
from gradsync.tables.id_index import IdIndex
from gradsync.tables.recency_log import MIN_ROOM
from gradsync.tables.row_init import HashedUniform

LOW, HIGH = -2**63, 2**63 - 1
MASK = 2**64 - 1


def py_mix64(x: int) -> int:
    """SplitMix64's finaliser on Python ints, as published."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_keyed(x: int, *words: int) -> int:
    h = py_mix64(x & MASK)
    for w in words:
        h = py_mix64(h ^ (w & MASK))
    return h


def py_unit(h: int) -> float:
    return (h >> 11) * 2.0 ** -53


def signed(h: int) -> int:
    return h - 2**64 if h >> 63 else h


def test_mix64_is_splitmix64_on_every_bit_pattern():
    assert signed(0xE220A8397B1DCDAF) == int(mix64(torch.tensor([0]))[0])  # SplitMix64's first output from 0
    values = [LOW, HIGH, -1, 0, 1, 2**62] + [random.Random(1).randrange(LOW, HIGH) for _ in range(200)]
    got = mix64(torch.tensor(values)).tolist()
    assert got == [signed(py_mix64(v & MASK)) for v in values]
    words = keyed(torch.tensor(values), 7, torch.tensor(3)).tolist()
    assert words == [signed(py_keyed(v, 7, 3)) for v in values]
    for servers in (1, 2, 3, 7):  # keyed(id, b"server")'s top 63 bits modulo the servers
        assert server_of(torch.tensor(values), servers).tolist() == \
            [(py_keyed(v, 0x736572766572) >> 1) % servers for v in values]


def test_default_init_is_the_documented_function_of_the_id():
    ids = [LOW, -1, 0, 5, HIGH]
    rows = HashedUniform(3, seed=11)(torch.tensor(ids))
    expected = [[(2 * py_unit(py_keyed(i, 11, 0x696E6974, j)) - 1) / 3 ** 0.5 for j in range(3)] for i in ids]
    assert rows.dtype == torch.float32
    assert torch.equal(rows, torch.tensor(expected, dtype=torch.float64).float())  # rounded from float64
    assert torch.equal(HashedUniform(3, seed=11, dtype=torch.float64)(torch.tensor(ids)),
                       torch.tensor(expected, dtype=torch.float64))
    assert rows.abs().max() <= 1 / 3 ** 0.5
    assert not torch.equal(rows, HashedUniform(3, seed=12)(torch.tensor(ids)))
    weight, slots = torch.zeros(8, 3), torch.tensor([6, 0, 3, 7, 2])  # a table's rows, written in place
    assert HashedUniform(3, seed=11).writes(weight) and not HashedUniform(4, seed=11).writes(weight)
    HashedUniform(3, seed=11).write(torch.tensor(ids), weight, slots)
    assert torch.equal(weight[slots], rows) and not weight[[1, 4, 5]].any()


def test_id_index_matches_a_dict_through_inserts_removals_and_rebuilds():
    index, reference = IdIndex(), {}
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        ids = torch.unique(torch.cat([torch.randint(LOW, HIGH, (40,), generator=g),
                                      torch.randint(-20, 20, (20,), generator=g), torch.tensor([LOW, HIGH])]))
        found = index.find(ids)
        assert found.tolist() == [reference.get(i, -1) for i in ids.tolist()]
        new = ids[found < 0]
        values = torch.randint(0, 1000, (new.numel(),), generator=g)
        index.insert(new, values)
        reference.update(zip(new.tolist(), values.tolist()))
        gone = ids[torch.randperm(ids.numel(), generator=g)[:30]]
        index.remove(gone)
        for i in gone.tolist():
            reference.pop(i, None)
        keys, values = index.items()
        assert len(index) == len(reference) and dict(zip(keys.tolist(), values.tolist())) == reference
    assert index.buckets.shape[0] > 64 and int((index.buckets[:, 1] >= 0).sum()) == len(index)  # grew; none left


def test_id_index_removals_move_back_the_ids_whose_probes_pass_them():
    """Ids crowded onto a few home buckets of a 64-bucket index (runs that wrap past the last bucket), removed
    in every order a seeded shuffle gives: the others are found after each removal."""
    homes = mix64(torch.arange(20000)) & 63
    crowded = torch.cat([torch.arange(20000)[homes == h][:6] for h in (61, 62, 63, 0, 5)])
    for seed in range(20):
        index = IdIndex()
        index.insert(crowded, crowded * 10)
        assert index.buckets.shape[0] == 64
        left = dict(zip(crowded.tolist(), (crowded * 10).tolist()))
        for i in torch.randperm(crowded.numel(), generator=torch.Generator().manual_seed(seed)).tolist():
            assert index.remove(crowded[i:i + 1]).tolist() == [left.pop(int(crowded[i]))]
            assert index.find(crowded).tolist() == [left.get(k, -1) for k in crowded.tolist()]
        assert len(index) == 0 and bool((index.buckets[:, 1] == -1).all())


def test_the_recency_log_orders_a_segment_by_step_then_id_merging_its_runs():
    """`order` sorts the entries from start to end by (step, id of the slot), leaving the others alone: runs
    appended in id order (as lookups append them), a shuffled segment, one already in order, one entry."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randperm(1000, generator=g) * 7919 - 10**6  # the id in each slot
    for runs in (1, 2, 3, 17, 400):
        slots = torch.randperm(1000, generator=g)[:400].to(torch.int32)
        steps = torch.sort(torch.randint(0, 4, (400,), generator=g)).values
        parts = [torch.sort(ids[part.long()]).indices for part in slots.chunk(runs)]  # each run in id order
        slots = torch.cat([part[order] for part, order in zip(slots.chunk(runs), parts)])
        if runs == 400:
            steps = torch.randint(0, 4, (400,), generator=g)
        log_slots, log_steps = torch.cat([slots, slots[:5]]), torch.cat([steps, steps[:5]])
        _table_loops.order(log_slots.numpy(), log_steps.numpy(), 3, 400, ids.numpy())
        expected = sorted(zip(steps[3:].tolist(), ids[slots[3:].long()].tolist()))
        assert list(zip(log_steps[3:400].tolist(), ids[log_slots[3:400].long()].tolist())) == expected
        assert torch.equal(log_slots[:3], slots[:3]) and torch.equal(log_slots[400:], slots[:5])


def test_compiled_loops_refuse_arrays_that_do_not_fit_together():
    index = IdIndex()
    buckets = index.buckets.numpy()
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="ids and out must be int64 arrays of one length"):
        _table_loops.find(buckets, ids.numpy(), torch.empty(3, dtype=torch.int64).numpy())
    with pytest.raises(ValueError, match="a power of two"):
        _table_loops.find(buckets[:48], ids.numpy(), torch.empty(4, dtype=torch.int64).numpy())
    with pytest.raises(ValueError, match="ids and values must be int64 arrays of one length"):
        _table_loops.insert(buckets, ids.numpy(), ids[:2].numpy())
    with pytest.raises(ValueError, match="values must be >= 0"):
        _table_loops.insert(buckets, ids.numpy(), torch.full((4,), -1).numpy())
    assert len(index) == 0 and index.find(ids).tolist() == [-1] * 4


class ReferenceTable:
    """The documented rule, one id at a time in plain Python (gradsync/tables/dynamic_table.py's docstring)."""

    def __init__(self, dim, capacity, admit_after, admit_probability, evict, ttl_steps, seed, lr):
        self.init = HashedUniform(dim, seed)
        self.capacity, self.admit_after, self.p, self.evict = capacity, admit_after, admit_probability, evict
        self.ttl, self.seed, self.lr = ttl_steps, seed, lr
        self.rows, self.waiting = {}, {}  # id -> [row, last step, lookups]; id -> [sightings, last step]
        self.counters = {"admitted": 0, "filtered": 0, "evicted": 0}

    def admitted(self, i, n):
        return n >= self.admit_after and (self.p is None or py_unit(py_keyed(i, self.seed, 0x61646D6974, n)) < self.p)

    def step(self, t, ids, weights):
        """One step: lookups of `ids` (a flat list), loss sum(out[k] * weights[k]), SGD, end of step."""
        counts = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
        for i, c in counts.items():
            if i in self.rows:
                self.rows[i][1], self.rows[i][2] = t, self.rows[i][2] + c
                continue
            n = self.waiting.get(i, [0])[0] + 1
            if self.admitted(i, n):
                self.waiting.pop(i, None)
                self.rows[i] = [self.init(torch.tensor([i]))[0], t, c]
                self.counters["admitted"] += 1
            else:
                self.waiting[i] = [n, t]
                self.counters["filtered"] += c
        grads = {}
        for i, w in zip(ids, weights):
            if i in self.rows:
                grads[i] = grads.get(i, 0) + w
        for i, g in grads.items():
            self.rows[i][0] = self.rows[i][0] - self.lr * g
        if self.ttl is not None:
            for i in [i for i, r in self.rows.items() if r[1] <= t - self.ttl]:
                del self.rows[i]
                self.counters["evicted"] += 1
        def key(i):
            return (self.rows[i][1], i) if self.evict == "lru" else (self.rows[i][2], self.rows[i][1], i)

        while len(self.rows) > self.capacity:
            del self.rows[min(self.rows, key=key)]
            self.counters["evicted"] += 1
        while len(self.waiting) > self.capacity:
            del self.waiting[min(self.waiting, key=lambda i: (self.waiting[i][1], i))]


RULES = [dict(evict=e, ttl_steps=ttl, admit_after=a, admit_probability=p)
         for e in ("lru", "lfu") for ttl in (None, 2) for a, p in ((1, None), (2, None), (3, None), (1, 0.4), (2, 0.6))]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_admission_and_eviction_follow_the_documented_rule(rule):
    for seed in range(12):
        rng = random.Random(seed)
        pool = [LOW, HIGH, -1, 0, 1] + [rng.randrange(LOW, HIGH) for _ in range(7)]
        dim, capacity, lr = 3, rng.randint(1, 6), 0.5
        table = gradsync.DynamicEmbedding(dim, capacity=capacity, seed=seed, **rule)
        reference = ReferenceTable(dim, capacity, seed=seed, lr=lr, **rule)
        for t in range(14):
            batches = [[rng.choice(pool) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 2))]
            weights = [[rng.choice([-1, -0.5, 0.25, 1]) for _ in b] for b in batches]
            loss = sum((table(torch.tensor(b)) * torch.tensor(w).unsqueeze(1)).sum() for b, w in zip(batches, weights))
            loss.backward()
            table.step(gradsync.RowSGD(lr=lr))
            reference.step(t, sum(batches, []), sum(weights, []))
            state = table.state_dict()
            assert state["ids"].tolist() == sorted(reference.rows), (seed, t)
            assert table.resident_rows == len(reference.rows) <= capacity
            rows = [reference.rows[i][0] for i in sorted(reference.rows)]
            torch.testing.assert_close(state["weight"], torch.stack(rows) if rows else torch.zeros(0, dim),
                                       rtol=0, atol=1e-6)
            assert state["lookups"].tolist() == [reference.rows[i][2] for i in sorted(reference.rows)]
            assert state["waiting_ids"].tolist() == sorted(reference.waiting)
            assert state["waiting_sightings"].tolist() == [reference.waiting[i][0] for i in sorted(reference.waiting)]
            assert table.counters == reference.counters


@pytest.mark.parametrize("evict", ["lru", "lfu"])
def test_a_long_stream_keeps_what_the_rule_keeps_and_the_recency_log_stays_small(evict):
    """LRU candidates, ttl and forgotten waiting ids come from the recency log (tables/recency_log.py): over a
    stream long enough to compact it many times, with slots freed and reused, the table keeps what the plain
    rule keeps, each step's candidates are the rule's first, and the log holds about two entries per id."""
    rule = dict(evict=evict, ttl_steps=25, admit_after=2, admit_probability=None)
    table = DynamicTable(2, capacity=150, init=HashedUniform(2), seed=0, **rule)
    reference = ReferenceTable(2, 150, seed=0, lr=0.0, **rule)
    g = torch.Generator().manual_seed(3)
    for t in range(80):
        ids = torch.randint(0, 600, (200,), generator=g) * 7919 - 10**6
        table.lookup(ids, t)
        reference.step(t, ids.tolist(), [0.0] * ids.numel())
        state = table.state()
        for count in (1, 40, len(table) - 1):
            candidates, keys = table.smallest_rows(count)
            order = (sorted(zip(state["last_step"].tolist(), state["ids"].tolist())) if evict == "lru" else
                     sorted(zip(state["lookups"].tolist(), state["last_step"].tolist(), state["ids"].tolist())))
            assert list(map(tuple, keys.tolist())) == order[:count]  # in key order
            assert keys[:, -1].tolist() == candidates.tolist()
        waiting, keys = table.smallest_waiting(30)
        assert list(map(tuple, keys.tolist())) == sorted(zip(state["waiting_last_step"].tolist(),
                                                            state["waiting_ids"].tolist()))[:30]
        table.end_step(t)
        state = table.state()
        assert state["ids"].tolist() == sorted(reference.rows), t
        assert state["lookups"].tolist() == [reference.rows[i][2] for i in sorted(reference.rows)]
        assert state["waiting_ids"].tolist() == sorted(reference.waiting)
        assert table.counters == reference.counters
        for columns in (table.rows, table.waiting):
            assert len(columns.log) <= max(MIN_ROOM, 2 * (len(columns) + 200)), t


def test_lfu_evicts_rows_loaded_without_their_lookup_counts_first():
    """Rows loaded from ids and weights alone count zero lookups: LFU takes them first, by (last step, id)."""
    table = DynamicTable(2, capacity=3, init=HashedUniform(2), evict="lfu")
    table.load({"ids": torch.tensor([40, 10, 30]), "weight": torch.zeros(3, 2), "step": 5})
    table.lookup(torch.tensor([10, 7, 7]), 5)
    ids, keys = table.smallest_rows(3)
    assert sorted(map(tuple, keys.tolist())) == [(0, 4, 30), (0, 4, 40), (1, 5, 10)]
    table.end_step(5)
    assert table.state()["ids"].tolist() == [7, 10, 40]


def test_rows_exceed_capacity_only_within_a_step_by_its_new_ids():
    table = gradsync.DynamicEmbedding(2, capacity=10)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        before = table.resident_rows
        ids = torch.randint(-10**6, 10**6, (25,), generator=g)
        table(ids).sum().backward()
        assert table.resident_rows <= before + ids.unique().numel()
        table.step(gradsync.RowSGD(lr=0.1))
        assert table.resident_rows == 10
    assert table.counters["evicted"] == table.counters["admitted"] - 10


@pytest.mark.parametrize("optimizer", [gradsync.RowAdagrad(lr=0.3, initial_accumulator_value=0.1),
                                       gradsync.RowSGD(lr=0.3, momentum=0.9)], ids=["adagrad", "momentum"])
def test_an_evicted_id_seen_again_starts_with_init_and_fresh_optimizer_state(optimizer):
    def train(table, ids_per_step):
        for ids in ids_per_step:
            out = table(torch.tensor(ids))
            (out * torch.arange(1.0, 3.0)).sum().backward()
            table.step(optimizer)
        return out.detach()

    table = gradsync.DynamicEmbedding(2, capacity=1)
    train(table, [[7], [7], [7], [8]])  # 7 builds optimizer state, then 8 evicts it
    assert table.state_dict()["ids"].tolist() == [8]
    first_read = train(table, [[7]])  # 7 comes back into 7's old slot
    assert table.state_dict()["ids"].tolist() == [7] and table.counters["evicted"] == 2
    fresh = gradsync.DynamicEmbedding(2, capacity=1)
    fresh_read = train(fresh, [[7]])
    torch.testing.assert_close(first_read, HashedUniform(2)(torch.tensor([7])))
    torch.testing.assert_close(first_read, fresh_read)
    train(table, [[7]])
    train(fresh, [[7]])
    torch.testing.assert_close(table.state_dict()["weight"], fresh.state_dict()["weight"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("optimizer", [gradsync.RowSGD(lr=0.1, momentum=0.5), gradsync.RowAdagrad(lr=0.1)],
                         ids=["sgd", "adagrad"])
def test_training_equals_nn_embedding_holding_init_of_each_id_in_order_of_first_sight(optimizer):
    g = torch.Generator().manual_seed(3)
    pool = torch.cat([torch.tensor([LOW, HIGH, 0]), torch.randint(LOW, HIGH, (20,), generator=g)])
    stream = [pool[torch.randint(0, pool.numel(), (4, 3), generator=g)] for _ in range(12)]
    targets = [torch.randn(4, 3, 5, generator=g) for _ in stream]
    first_sight = list(dict.fromkeys(torch.cat([s.reshape(-1) for s in stream]).tolist()))
    position = {i: k for k, i in enumerate(first_sight)}
    init = HashedUniform(5)
    dense = nn.Embedding(len(first_sight), 5)
    dense.weight.data.copy_(init(torch.tensor(first_sight)))
    state = optimizer.new_state(len(first_sight), 5, torch.float32)
    table = gradsync.DynamicEmbedding(5, capacity=1000)
    for ids, target in zip(stream, targets):
        nn.functional.mse_loss(table(ids), target).backward()
        table.step(optimizer)
        rows = torch.tensor([position[i] for i in ids.reshape(-1).tolist()]).reshape(ids.shape)
        dense.weight.grad = None
        nn.functional.mse_loss(dense(rows), target).backward()
        touched = rows.unique()
        optimizer.step(dense.weight.data, state, touched, dense.weight.grad[touched])
    saved = table.state_dict()
    assert saved["ids"].tolist() == sorted(first_sight)
    expected = dense.weight.data[torch.tensor([position[i] for i in saved["ids"].tolist()])]
    torch.testing.assert_close(saved["weight"], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_modes_equal_nn_embedding_bag(mode):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(-50, 50, (6, 4), generator=g)
    flat, offsets = ids.reshape(-1)[:17], torch.tensor([0, 3, 3, 9, 12])
    weights = torch.rand(17, generator=g) if mode == "sum" else None
    table = gradsync.DynamicEmbedding(4, capacity=1000, mode=mode)
    unique = torch.cat([ids.reshape(-1), flat]).unique()
    bag = nn.EmbeddingBag(unique.numel(), 4, mode=mode)
    bag.weight.data.copy_(HashedUniform(4)(unique))
    out_2d, out_1d = table(ids), table(flat, offsets, weights)
    ref_2d, ref_1d = bag(torch.searchsorted(unique, ids)), bag(torch.searchsorted(unique, flat), offsets, weights)
    torch.testing.assert_close(out_2d, ref_2d)
    torch.testing.assert_close(out_1d, ref_1d)
    (out_2d.sum() + (out_1d ** 2).sum()).backward()
    (ref_2d.sum() + (ref_1d ** 2).sum()).backward()
    table.step(gradsync.RowSGD(lr=0.5))
    saved = table.state_dict()
    assert torch.equal(saved["ids"], unique)
    torch.testing.assert_close(saved["weight"], bag.weight.data - 0.5 * bag.weight.grad, rtol=0, atol=1e-6)


def test_ids_not_admitted_read_zeros_and_get_no_update():
    table = gradsync.DynamicEmbedding(3, capacity=10, admit_after=2, mode="mean")
    out = table(torch.tensor([[HIGH, HIGH, 5]]))  # one step, one sighting each, however many lookups
    torch.testing.assert_close(out, torch.zeros(1, 3))
    out.sum().backward()
    table.step(gradsync.RowSGD(lr=1.0))
    out = table(torch.tensor([[HIGH, HIGH, 7]]))  # HIGH's second sighting admits it; 7 waits
    row = HashedUniform(3)(torch.tensor([HIGH]))[0]
    torch.testing.assert_close(out[0], 2 * row / 3)
    out.sum().backward()
    table.step(gradsync.RowSGD(lr=1.0))
    assert table.state_dict()["ids"].tolist() == [HIGH]
    torch.testing.assert_close(table.state_dict()["weight"][0], row - 2 / 3)
    assert table.state_dict()["waiting_ids"].tolist() == [5, 7]
    assert table.counters == {"admitted": 1, "filtered": 4, "evicted": 0}
    table.eval()
    torch.testing.assert_close(table(torch.tensor([[5, LOW]])), torch.zeros(1, 3))
    assert table.resident_rows == 1 and table.counters["filtered"] == 4  # evaluation reads only


def test_ids_span_the_whole_int64_range():
    table = gradsync.DynamicEmbedding(2, capacity=8)
    ids = torch.tensor([HIGH, LOW, 0, -1, LOW + 1, HIGH - 1])
    out = table(ids)
    torch.testing.assert_close(out, HashedUniform(2)(ids))
    assert table.state_dict()["ids"].tolist() == [LOW, LOW + 1, -1, 0, HIGH - 1, HIGH]
    assert table(torch.tensor([LOW, HIGH], dtype=torch.int64)).shape == (2, 2)
    torch.testing.assert_close(table(ids.int()[2:4]), HashedUniform(2)(torch.tensor([0, -1])))  # int32 ids too


def test_state_dict_round_trip_continues_as_if_uninterrupted(tmp_path):
    def run(table, steps):
        for t in steps:
            g = torch.Generator().manual_seed(t)
            (table(torch.randint(-30, 30, (12,), generator=g)) * torch.randn(12, 2, generator=g)).sum().backward()
            table.step(gradsync.RowSGD(lr=0.2))

    options = dict(capacity=6, admit_after=2, admit_probability=0.7, evict="lfu", ttl_steps=3)
    whole, first = gradsync.DynamicEmbedding(2, **options), gradsync.DynamicEmbedding(2, **options)
    run(whole, range(20))
    run(first, range(10))
    torch.save(nn.ModuleDict({"emb": first}).state_dict(), tmp_path / "state.pt")
    resumed = gradsync.DynamicEmbedding(2, **options)
    nn.ModuleDict({"emb": resumed}).load_state_dict(torch.load(tmp_path / "state.pt"))
    run(resumed, range(10, 20))
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    assert len(whole.state_dict()["waiting_ids"]) > 0 and whole.counters["evicted"] > 0


def test_load_state_dict_with_only_ids_and_weight():
    table = gradsync.DynamicEmbedding(2, capacity=4)
    table.load_state_dict({"ids": torch.tensor([HIGH, LOW]), "weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})
    assert table.state_dict()["ids"].tolist() == [LOW, HIGH]
    torch.testing.assert_close(table.eval()(torch.tensor([HIGH, 3])), torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    with pytest.raises(RuntimeError, match="Missing key.*weight"):
        table.load_state_dict({"ids": torch.tensor([1])})


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=0), r"capacity=0 .*int >= 1"),
    (dict(capacity=4, evict="fifo"), r"evict='fifo' .*'lru' or 'lfu'"),
    (dict(capacity=4, mode="max"), r"mode='max' .*'sum' or 'mean'"),
    (dict(capacity=4, admit_after=0), r"admit_after=0"),
    (dict(capacity=4, admit_probability=0.0), r"admit_probability=0.0 .*\(0, 1\]"),
    (dict(capacity=4, ttl_steps=0), r"ttl_steps=0"),
    (dict(capacity=4, dtype=torch.int64), r"dtype=torch.int64 .*floating"),
])
def test_bad_settings_are_refused_naming_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradsync.DynamicEmbedding(2, **kwargs)


def test_bad_ids_and_init_results_are_refused_and_change_nothing():
    table = gradsync.DynamicEmbedding(2, capacity=4)
    for ids in (torch.tensor([1.0]), torch.tensor([True]), [1, 2]):
        with pytest.raises(TypeError, match="ids must be an integer tensor.*torch.int64"):
            table(ids)
    for init, got in ((lambda ids: torch.zeros(ids.numel(), 3), r"a tensor of shape \[1, 3\] and dtype torch.float32"),
                      (lambda ids: torch.zeros(ids.numel(), 2, dtype=torch.float64),
                       r"a tensor of shape \[1, 2\] and dtype torch.float64"),
                      (lambda ids: None, "a NoneType")):
        bad = gradsync.DynamicEmbedding(2, capacity=4, init=init, admit_after=2)
        bad(torch.tensor([5]))  # one sighting: waits
        bad.step(gradsync.RowSGD(lr=0.1))
        expected = f"init\\(1 ids\\) returned {got}.*shape \\[1, 2\\] and dtype torch.float32"
        with pytest.raises(ValueError, match=expected):
            bad(torch.tensor([5]))
        assert bad.resident_rows == 0 and bad.state_dict()["waiting_sightings"].tolist() == [1]
    with pytest.raises(TypeError, match="row optimizer, got SGD"):
        table(torch.tensor([1])).sum().backward()
        table.step(torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(ValueError, match="offsets and per_sample_weights are for mode='sum'"):
        table(torch.tensor([1, 2]), torch.tensor([0]))


def test_a_sharded_owner_looks_up_every_workers_ids_at_once_and_updates_only_the_admitted():
    """The owner's side under sharded, in one process: the (id, count) rows several workers sent, an id sent by
    two of them counting one sighting and their lookups summed, give the rows and state of one lookup of the
    joint batch; of the step's gradients only the admitted ids' are kept."""
    import gradsync
    from gradsync.metrics.step_metrics import StepMetrics
    from gradsync.worker.rows.sharded_dynamic import ShardedDynamic
    from gradsync.worker.rows.sharded_tables import ShardedTables

    model = torch.nn.Sequential(gradsync.DynamicEmbedding(3, capacity=8, admit_after=2, evict="lfu"))
    metrics = StepMetrics()
    tables = ShardedTables({}, {}, 0, 1, 10.0, metrics, ["0"])
    owner = ShardedDynamic(model, gradsync.RowSGD(lr=0.1), "sync", 0, 1, 10.0, tables, metrics)
    reference = gradsync.DynamicEmbedding(3, capacity=8, admit_after=2, evict="lfu").table
    first = torch.tensor([[5, 1], [-7, 2], [9, 1]])  # step 0: worker 0's (id, count) rows, then worker 1's
    asked = torch.cat([first, torch.tensor([[-7, 3], [11, 1]])])
    for step, sent in enumerate([asked, torch.tensor([[5, 2], [-7, 1], [9, 1], [12, 1], [9, 4]])]):
        owner.step = step
        keys, rows = owner._look_up("0", sent)
        reference.lookup(sent[:, 0].repeat_interleave(sent[:, 1]), step)  # the joint batch, each occurrence
        slots = reference.find(sent[:, 0])
        expected = torch.where((slots >= 0)[:, None], reference.weight[slots.clamp(min=0)], 0.0)
        assert torch.equal(keys, sent[:, 0]) and torch.equal(rows, expected)
        owner.parts["0"].end(step)
        reference.expire(step)
    state, expected = owner.parts["0"].table.state(), reference.state()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert state["ids"].tolist() == [-7, 5, 9] and state["lookups"].tolist() == [1, 2, 5]
    grads = torch.ones(4, 3)
    kept = owner.admitted({"0": (torch.tensor([-7, 5, 11, 12]), grads)})["0"]
    assert kept[0].tolist() == [-7, 5] and torch.equal(kept[1], grads[:2])


@pytest.mark.parametrize("optimizer,state_bytes", [(gradsync.RowAdagrad(lr=0.1), 4),
                                                   (gradsync.RowSGD(lr=0.1, momentum=0.9), 16 * 4)],
                         ids=["adagrad", "momentum"])
def test_a_delta_checkpoint_is_within_1_1x_of_its_changed_rows(optimizer, state_bytes):
    """4000 rows of dim 16, a full checkpoint, then a step that updates 800 of them and admits 200 new ids
    (evicting 200): the delta holds those 1000 rows and the 200 ids evicted; its bytes as saved (torch.save, as
    in a shard file: about 4 KB for its dozen tensors) are within 1.1x of 1000 rows x (id, row, row optimizer
    state, last step, lookup count) plus 8 bytes per evicted id."""
    import io

    dim, g = 16, torch.Generator().manual_seed(3)
    table = gradsync.DynamicEmbedding(dim, capacity=4000).table
    ids = torch.randint(-2**63, 2**63 - 1, (4200,), generator=g).unique()[:4200]
    table.lookup(ids[:4000], 0)
    table.apply(optimizer, table.find(ids[:4000]), torch.randn(4000, dim, generator=g))
    table.end_step(0)
    full = table.checkpoint(True)
    table.lookup(torch.cat([ids[:800], ids[4000:]]), 1)
    table.apply(optimizer, table.find(ids[:800]), torch.randn(800, dim, generator=g))
    table.end_step(1)
    delta = table.checkpoint(False)
    assert torch.equal(delta["ids"], torch.cat([ids[:800], ids[4000:]]).sort().values)
    assert len(delta["removed"]) == 200 and len(full["ids"]) == 4000
    row_bytes = 8 + dim * 4 + state_bytes + 8 + 8
    changed = 1000 * row_bytes + 200 * 8

    def saved(part) -> int:
        buffer = io.BytesIO()
        torch.save(part, buffer)
        return len(buffer.getvalue())

    assert changed <= saved(delta) <= 1.1 * changed
    assert saved(full) >= 4000 * row_bytes > 3.5 * saved(delta)
