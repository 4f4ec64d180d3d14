"""A dynamic table spread over servers (`ps.dynamic_shard`, `tables.global_eviction`), in one process: the
servers' parts, driven as W workers drive them in a sync step, hold exactly what one `DynamicTable` holds
after the same steps (ids, rows, counts, waiting ids, counters), whatever the number of servers; ids spread
by their hash; bad calls change nothing; the worker side refuses bad ids before any call. Async: each server
steps its part alone, over its share of capacity, and a stale push never reaches a row created again.""" 
import dataclasses
import json
import math
import random

import pytest
import torch
from torch import nn

import gradsync
from gradsync.worker.module.plain_module import Attachments
from gradsync.core import malloc
from gradsync.core.buckets import ModelSpec
from gradsync.core.errors import GradientError
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.proto import gradsync_pb2 as pb
from gradsync.ps import dynamic_shard
from gradsync.ps.dynamic_shard import DynamicShard
from gradsync.ps.messages import (DynamicSetup, EndStep, Evict, FirstToGo, Lookups, Setup, TableCall,
                                   TablesCounts)
from gradsync.ps.server import ParameterServer
from gradsync.tables import global_eviction
from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.id_hash import keyed, server_of, unit_interval
from gradsync.tables.placement import merge_rows
from gradsync.tables.row_init import HashedUniform
from gradsync.cli.job_status import final_status_table
from gradsync.tables.dynamic_checkpoint import rehomed, with_delta
from gradsync.worker.rows import served_dynamic
from gradsync.worker.rows.served_dynamic import ServedDynamic

DIM, WORKERS = 3, 2
_RNG = random.Random(5)
IDS = [_RNG.randrange(-2**63, 2**63) for _ in range(40)]


def settings(**rules) -> dict:
    return dict(dim=DIM, init=HashedUniform(DIM, seed=3), **rules)


def batch(step: int, worker: int) -> torch.Tensor:
    """Worker `worker`'s ids at `step`: a skewed draw (some ids often, many rarely), with repeats."""
    g = random.Random(100 * step + worker)
    return torch.tensor([IDS[min(int(g.expovariate(0.15)), len(IDS) - 1)] for _ in range(7)])


def grads_of(ids: torch.Tensor, step: int, worker: int) -> torch.Tensor:
    """A worker's gradient of each distinct id it looked up: a fixed function of (id, step, worker)."""
    return unit_interval(keyed(ids.reshape(-1, 1), step, worker, torch.arange(DIM))).float() - 0.5


class Servers:
    """S `DynamicShard`s of one table, called as a transport calls them (`ParameterServer.table_call`), and as
    `global_eviction.Holders`; `calls`: the name of each call's message."""

    def __init__(self, num_servers: int, optimizer, **rules):
        setup = DynamicSetup(settings(**rules), optimizer)
        self.shards = {s: DynamicShard("t", setup, s, num_servers) for s in range(num_servers)}
        self.calls: list[str] = []

    def table_calls(self, calls: dict[int, TableCall]) -> dict[int, object]:
        self.calls.append(type(next(iter(calls.values()))).__name__)
        return {s: dynamic_shard.respond({"t": self.shards[s]}, call, f"server {s}") for s, call in calls.items()}

    def end(self, step: int) -> dict[int, dict]:
        return self.table_calls({s: EndStep(step) for s in self.shards})

    def first_to_go(self, step: int, counts: dict) -> dict[int, dict]:
        return self.table_calls({s: FirstToGo(step, c) for s, c in counts.items()})

    def evict(self, step: int, plans: dict) -> None:
        self.table_calls({s: Evict(step, plan) for s, plan in plans.items()})

    def state(self) -> dict[str, torch.Tensor]:
        return rehomed([self.shards[s].table.state() for s in sorted(self.shards)], 0, 1)


def sync_step(servers: Servers, step: int, capacity: int, update: bool = True, ends: bool = True) -> None:
    """One sync step as W workers drive it: each looks up its distinct ids with their counts on their servers,
    the servers average the admitted ids' gradients over the workers and apply them (not with `update`
    False: a step skipped), then every worker ends the step (the later ones repeat the first one's calls)."""
    num = len(servers.shards)
    pushes: dict[int, list] = {s: [] for s in range(num)}
    for w in range(WORKERS):
        ids, counts = torch.unique(batch(step, w), return_counts=True)
        owner = server_of(ids, num)
        for s in range(num):
            at = owner == s
            if at.any():
                _, admitted = servers.shards[s].lookup(ids[at], counts[at], step)
                mine = ids[at][admitted]
                if mine.numel():
                    pushes[s].append((mine, grads_of(mine, step, w)))
    for s, per in pushes.items():
        if per and update:
            ids, mean = merge_rows(per, 1.0 / WORKERS)
            servers.shards[s].check_push(0, ids, mean)
            servers.shards[s].apply(ids, mean)
    for _ in range(WORKERS if ends else 0):
        global_eviction.end_step(step, {"t": capacity}, list(range(num)), servers)


def single_step(table: DynamicTable, optimizer, step: int) -> None:
    """The same step on one table: the joint batch's lookups, the mean of the workers' gradients, end_step."""
    joint = torch.cat([batch(step, w) for w in range(WORKERS)])
    slots = table.lookup(joint, step)
    pushes = []
    for w in range(WORKERS):
        ids = torch.unique(batch(step, w))
        mine = ids[table.find(ids) >= 0]
        if mine.numel():
            pushes.append((mine, grads_of(mine, step, w)))
    if pushes:
        ids, mean = merge_rows(pushes, 1.0 / WORKERS)
        table.apply(optimizer, table.find(ids), mean)
    assert slots.numel() == joint.numel()
    table.end_step(step)


RULES = [
    dict(capacity=8, evict="lru"),
    dict(capacity=6, evict="lfu", admit_after=2),
    dict(capacity=7, evict="lru", admit_after=3, ttl_steps=4),
    dict(capacity=5, evict="lfu", admit_after=2, admit_probability=0.6),
    dict(capacity=1000, evict="lru"),
]


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_servers_hold_what_one_table_holds(rules, num_servers):
    optimizer = gradsync.RowAdagrad(lr=0.1)
    servers = Servers(num_servers, optimizer, **rules)
    single = DynamicTable(**settings(**rules))
    evictions = 0
    for step in range(14):
        sync_step(servers, step, rules["capacity"])
        single_step(single, optimizer, step)
        got, want = servers.state(), single.state()
        assert got["ids"].tolist() == want["ids"].tolist(), f"step {step}"
        assert torch.equal(got["weight"], want["weight"])
        for key in ("last_step", "lookups", "waiting_ids", "waiting_sightings", "waiting_last_step", "counters"):
            assert torch.equal(got[key], want[key]), (step, key)
        assert len(got["ids"]) <= rules["capacity"] and len(got["waiting_ids"]) <= rules["capacity"]
        evictions = int(want["counters"][2])
    if rules["capacity"] < len(IDS):
        assert evictions > 0  # the bound was reached: eviction was exercised
    # a step under capacity costs the one exchange of counts per worker; one over capacity two, three where the
    # candidates fell short; a server that holds the whole table evicts by itself in the first
    assert set(servers.calls) <= ({"EndStep"} if num_servers == 1 else {"EndStep", "FirstToGo", "Evict"})


@pytest.mark.parametrize("rules", RULES[:2], ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
@pytest.mark.parametrize("num_servers", [2, 3])
def test_few_candidates_choose_what_the_rule_chooses(rules, num_servers, monkeypatch):
    """With as few candidates from `end` as each server expects to lose (and one), some steps' choice is
    decided by them and others ask for each server's own first (`smallest`): both keep the rule's ids."""
    monkeypatch.setattr(dynamic_shard, "CANDIDATE_SHARE", 1.0)
    monkeypatch.setattr(dynamic_shard, "CANDIDATE_MARGIN", 1)
    optimizer = gradsync.RowAdagrad(lr=0.1)
    servers = Servers(num_servers, optimizer, **rules)
    single = DynamicTable(**settings(**rules))
    for step in range(14):
        sync_step(servers, step, rules["capacity"])
        single_step(single, optimizer, step)
        got, want = servers.state(), single.state()
        for key in ("ids", "weight", "last_step", "lookups", "waiting_ids", "waiting_sightings", "counters"):
            assert torch.equal(got[key], want[key]), (step, key)
    asked, evicted = servers.calls.count("FirstToGo"), servers.calls.count("Evict")
    assert 0 < asked < evicted  # decided by the candidates at some steps' ends, asked at others


def test_eviction_is_global_not_per_server():
    """With the same capacity on each of 2 servers a per-server bound keeps another set than the rule."""
    optimizer = gradsync.RowSGD(lr=0.1)
    rules = dict(capacity=6, evict="lru")
    servers, single = Servers(2, optimizer, **rules), DynamicTable(**settings(**rules))
    per_server = [DynamicTable(**settings(**rules)) for _ in range(2)]
    for step in range(10):
        sync_step(servers, step, 6)
        single_step(single, optimizer, step)
        joint = torch.unique(torch.cat([batch(step, w) for w in range(WORKERS)]))
        for s, table in enumerate(per_server):
            table.lookup(joint[server_of(joint, 2) == s], step)
            table.end_step(step)
    local = sorted(i for t in per_server for i in t.state()["ids"].tolist())
    assert servers.state()["ids"].tolist() == single.state()["ids"].tolist() != local


def test_the_first_answer_of_a_step_is_every_worker_answer():
    """A worker that ends the step after another has evicted (and looked up the next step) sees the same keys
    and evicts nothing more."""
    servers = Servers(2, gradsync.RowSGD(lr=0.1), capacity=3, evict="lru")
    for step in range(2):
        sync_step(servers, step, 3)
    before = servers.state()
    shard = servers.shards[0]
    first = shard.smallest(1, 2, 0)
    shard.lookup(torch.tensor([i for i in IDS if int(server_of(torch.tensor([i]), 2)) == 0][:1]),
                 torch.tensor([1]), 2)  # the next step's lookup, on a server that has ended step 1
    assert all(torch.equal(a, b) for a, b in zip(shard.smallest(1, 5, 5), first))
    shard.evict(1, first[0], first[2])
    assert servers.state()["counters"][2] == before["counters"][2]  # step 1's eviction was done: nothing more


def test_ids_spread_over_servers_by_their_hash():
    for stride in (1, 2, 4, 2**32):
        ids = torch.arange(4000) * stride
        for num in (2, 3, 4):
            held = torch.bincount(server_of(ids, num), minlength=num)
            assert held.sum() == 4000 and int(held.min()) > 0.9 * 4000 / num, (stride, num, held.tolist())
    assert server_of(torch.tensor([-2**63, 2**63 - 1, -1]), 3).tolist() == \
        server_of(torch.tensor([-2**63, 2**63 - 1, -1]), 3).tolist()  # fixed: no per-process salt
    assert int(server_of(torch.tensor([-2**63, -1, 2**63 - 1]), 5).min()) >= 0


def test_bad_calls_name_the_table_and_change_nothing():
    servers = Servers(2, gradsync.RowSGD(lr=0.1), capacity=10)
    sync_step(servers, 0, 10)
    before = servers.state()
    shard = servers.shards[0]
    mine = before["ids"][server_of(before["ids"], 2) == 0]
    theirs = before["ids"][server_of(before["ids"], 2) == 1]
    with pytest.raises(GradientError, match=r"dynamic table 't' repeats ids"):
        shard.lookup(torch.cat([mine[:1], mine[:1]]), torch.tensor([1, 1]), 1)
    with pytest.raises(GradientError, match=rf"id {int(theirs[0])} of dynamic table 't' is on server 1, not 0"):
        shard.lookup(theirs[:1], torch.tensor([1]), 1)
    with pytest.raises(GradientError, match=r"1-D int64"):
        shard.lookup(torch.tensor([1.5]), torch.tensor([1]), 1)
    absent = next(i for i in range(10**6) if int(server_of(torch.tensor([i]), 2)) == 0 and i not in IDS)
    with pytest.raises(GradientError, match=rf"worker 1: a push of dynamic table 't' has id {absent}, which is not "):
        shard.check_push(1, torch.tensor([mine[0].item(), absent]), torch.zeros(2, DIM))
    with pytest.raises(GradientError, match=r"row gradients of dynamic table 't' are \(1, 2\)"):
        shard.check_push(1, mine[:1], torch.zeros(1, 2))
    after = servers.state()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("keys", [2, 3])
def test_the_first_overall_are_each_servers_first_by_key_as_sorting_them_all_would_choose(keys):
    """`first_overall` over 3 servers' candidates in key order (many ties in the first keys, ids distinct):
    the `count` smallest keys of all, by server, for every count; undecided (None) where a server that sent
    only part of what it holds has all of it chosen."""
    g = torch.Generator().manual_seed(keys)
    ids = torch.randperm(300, generator=g) - 150
    parts, flat = {}, []
    for s, chunk in enumerate(ids.split([90, 110, 100])):
        first = torch.randint(0, 3, (chunk.numel(), keys - 1), generator=g)
        rows = sorted(zip(*first.t().tolist(), chunk.tolist()))
        key = torch.tensor(rows)
        parts[s] = ((key[:, -1].clone(), key), chunk.numel())
        flat += [(row, s) for row in rows]
    flat.sort()
    for count in (0, 1, 2, 57, 150, 299, 300):
        chosen = global_eviction.first_overall(parts, count)
        assert {s: chosen[s].tolist() for s in parts} == {
            s: [row[-1] for row, owner in flat[:count] if owner == s] for s in parts}, count
    assert global_eviction.first_overall(parts, 301) is None
    partial = {**parts, 0: (parts[0][0], 200)}  # server 0 holds more than it sent
    everything_of_0 = sum(1 for _, owner in flat if owner == 0)
    last_of_0 = max(i for i, (_, owner) in enumerate(flat) if owner == 0)
    assert global_eviction.first_overall(partial, last_of_0 + 1) is None
    assert global_eviction.first_overall(partial, last_of_0)[0].numel() == everything_of_0 - 1


def test_a_push_updates_the_rows_a_probe_finds_whether_or_not_its_lookups_found_them():
    """A sync push updates the rows its ids hold now, whichever lookup of the step (or an earlier step) found
    them; an id evicted since its lookup is refused, also once another id took its slot."""
    lr = 0.5
    shard = DynamicShard("t", DynamicSetup(settings(capacity=100), gradsync.RowSGD(lr=lr)), 0, 1)
    shard.lookup(torch.tensor([3, 11, 20]), torch.ones(3, dtype=torch.int64), 0)
    shard.end(0)
    for ids in ([2, 7], [4, 9, 10], [30, 8, 5]):  # the last one not ascending: its ids' slots by a probe
        shard.lookup(torch.tensor(ids), torch.ones(len(ids), dtype=torch.int64), 1)
    pushed = torch.tensor([2, 3, 4, 5, 7, 9, 11])
    probed = shard.table.find(pushed)
    before = shard.table.weight.clone()
    grads = torch.arange(7 * DIM, dtype=torch.float32).view(7, DIM)
    shard.check_push(0, pushed, grads)
    shard.apply(pushed, grads)
    expected = before.clone()
    expected[probed] -= lr * grads
    assert torch.equal(shard.table.weight, expected)
    shard.apply(torch.tensor([5, 9]), grads[:2])  # fewer ids than a lookup: searched in it
    expected[probed[[3, 5]]] -= lr * grads[:2]
    assert torch.equal(shard.table.weight, expected)
    shard.evict(1, torch.tensor([9]), torch.zeros(0, dtype=torch.int64))  # 9's slot is free: no push may reach it
    shard.evict(0, torch.tensor([4]), torch.zeros(0, dtype=torch.int64))  # an earlier step's, late: nothing
    shard.evict(1, torch.tensor([4]), torch.zeros(0, dtype=torch.int64))  # the same step's again: nothing
    assert int(shard.table.find(torch.tensor([4]))) >= 0
    with pytest.raises(GradientError, match=r"has id 9, which is not resident"):
        shard.check_push(0, torch.tensor([4, 9]), torch.zeros(2, DIM))
    shard.lookup(torch.tensor([12, 13]), torch.ones(2, dtype=torch.int64), 2)  # 13 takes 9's slot
    assert int(shard.table.find(torch.tensor([13]))) == int(probed[5])
    with pytest.raises(GradientError, match=r"has id 9, which is not resident"):
        shard.check_push(0, torch.tensor([4, 9]), torch.zeros(2, DIM))


def test_a_sync_push_reply_ends_the_step_and_the_workers_call_no_end():
    """Once every worker's push of a step is in, the server ends the step on its dynamic tables (a single server
    evicts there too) and the push's reply carries `end`'s answer; a worker given every server's answer for its
    step calls only `evict`, one given none or another step's calls `end` too: the tables as after calling it."""
    from gradsync.core.optimizer_spec import OptimizerSpec
    from gradsync.ps.messages import Push, RowGrads, Snapshot
    from gradsync.ps.shard import ShardState
    from gradsync.ps.sync_rule import SyncRule

    rules, optimizer = dict(capacity=4, evict="lru"), gradsync.RowSGD(lr=0.1)
    shard = DynamicShard("t", DynamicSetup(settings(**rules), optimizer), 0, 1)
    reference = Servers(1, optimizer, **rules)
    rule = SyncRule(ShardState(0, [], {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 1.0}),
                               tables={"t": shard}), num_workers=WORKERS, nonfinite="raise")
    for step in range(3):
        replies = []
        for w in range(WORKERS):
            ids, counts = torch.unique(batch(step, w), return_counts=True)
            _, admitted = shard.lookup(ids, counts, step)
            replies.append(rule.commit(w, step, Push([], [], {}, {"t": RowGrads(
                step, ids[admitted], grads_of(ids[admitted], step, w))})))
        sync_step(reference, step, rules["capacity"])
        answers = [r.wait().ended for r in replies]
        assert answers[0][0] == answers[1][0] == step and shard.table.step == step + 1
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(answers[0][1]["t"], reference.shards[0].end(step)))
        assert all(torch.equal(v, reference.shards[0].table.state()[k]) for k, v in shard.table.state().items())

    model = nn.ModuleDict({"t": gradsync.DynamicEmbedding(DIM, capacity=3, evict="lru")})
    for carried, calls in [(0, ["Evict"]), (None, ["EndStep", "Evict"]), (5, ["EndStep", "Evict"])]:
        servers, reference = Servers(2, optimizer, capacity=3, evict="lru"), Servers(2, optimizer, capacity=3,
                                                                                     evict="lru")
        sync_step(servers, 0, 3, ends=False)
        sync_step(reference, 0, 3)
        served = ServedDynamic(model, 2, optimizer, "sync", servers, None)
        ended = {s: dynamic_shard.step_end({"t": shard}) for s, shard in servers.shards.items()}
        served.end_step({s: Snapshot(1, [], {}, None if carried is None else (carried, e[1]))
                         for s, e in ended.items()})
        assert servers.calls == calls[:-1] and served.step == 1  # the evictions wait for the next call
        served.send_evictions()
        assert servers.calls == calls
        assert all(torch.equal(v, reference.state()[k]) for k, v in servers.state().items())


class _Recording:
    """A transport that answers lookups with rows of their ids (the id in every element), every id admitted, and
    keeps each call's args."""

    def __init__(self):
        self.calls: list[dict[int, TableCall]] = []

    def table_calls(self, calls: dict[int, TableCall]) -> dict[int, object]:
        self.calls.append(calls)
        return {s: (0, [(ids.float().unsqueeze(1).expand(-1, DIM).clone(), ids >= 0) for _, ids, _ in c.lookups])
                if isinstance(c, Lookups) else {"t": (0, [0, 0, 0])} if isinstance(c, TablesCounts) else None
                for s, c in calls.items()}


def _waiting(model, name, ids):
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    return served_dynamic._Waiting(name, model[name], unique, counts, inverse, (None, None), 1)


def test_a_forwards_lookups_and_the_last_steps_evictions_go_to_every_server_in_one_call():
    """Sync, S = 3: the evictions `end_step` decides wait; the forward's lookups wait until one is used, then
    go in one call per server with each server's evictions (an empty list of lookups to the server holding none
    of the batch's ids); each result is its table's forward on the rows answered; a counters call sends waiting
    evictions first."""
    model = nn.ModuleDict({"t": gradsync.DynamicEmbedding(DIM, capacity=3),
                           "u": gradsync.DynamicEmbedding(DIM, capacity=3, mode="sum")})
    transport = _Recording()
    served = ServedDynamic(model, 3, gradsync.RowSGD(lr=0.1), "sync", transport, None)
    plan = {s: {"t": (torch.tensor([s]), torch.zeros(0, dtype=torch.int64))} for s in range(3)}
    served.evict(0, plan)
    ids = torch.tensor([i for i in range(100) if int(server_of(torch.tensor([i]), 3)) != 2][:6])
    first = served._recording(_waiting(model, "t", ids))
    bags = served._recording(_waiting(model, "u", ids.view(2, 3)))
    assert transport.calls == [] and first.shape == (6, DIM) and bags.shape == (2, DIM)
    torch.testing.assert_close(first * 1, ids.float().unsqueeze(1).expand(-1, DIM))
    (calls,) = transport.calls
    assert sorted(calls) == [0, 1, 2] and calls[2] == Lookups((), 0, Evict(0, plan[2]))
    assert all([name for name, _, _ in calls[s].lookups] == ["t", "u"] and calls[s].evictions == Evict(0, plan[s])
               for s in (0, 1))
    torch.testing.assert_close(bags * 1, ids.view(2, 3).float().sum(1, keepdim=True).expand(-1, DIM))
    assert len(served._lookups[1]) == 2 and all(lk.leaf.requires_grad for lk in served._lookups[1])
    served._recording(_waiting(model, "t", ids)).sum()
    assert sorted(transport.calls[1]) == [0, 1] and all(c.evictions is None for c in transport.calls[1].values())
    served.evict(0, plan)
    served.counters("t")
    kinds = [{type(c).__name__ for c in calls.values()} for calls in transport.calls[2:]]
    assert kinds == [{"Evict"}, {"TablesCounts"}] and transport.calls[2] == {s: Evict(0, p) for s, p in plan.items()}
    served.counters("t")
    assert [{type(c).__name__ for c in calls.values()} for calls in transport.calls[4:]] == [{"TablesCounts"}]


@pytest.mark.parametrize("mode,shape,offsets", [(None, (2, 3), None), (None, (5,), None), ("sum", (2, 3), None),
                                                ("mean", (6,), [0, 2, 2])])
def test_a_pending_dynamic_lookup_has_the_shape_of_the_tables_forward(mode, shape, offsets):
    table = gradsync.DynamicEmbedding(DIM, capacity=8, mode=mode)
    ids = torch.arange(6)[:math.prod(shape)].view(shape)
    offsets = None if offsets is None else torch.tensor(offsets)
    assert table.output_shape(ids, offsets) == table(ids, offsets).shape


class _NoCalls:
    def table_calls(self, calls):
        raise AssertionError(f"{calls} reached the servers")


@pytest.mark.parametrize("ids,error,match", [
    (torch.tensor([1.0, 2.0]), TypeError, r"capacity=4\): ids must be an integer tensor"),
    (torch.tensor([1, 2], dtype=torch.uint64), TypeError, r"ids must be an integer tensor .* two's-complement"),
])
def test_a_served_table_refuses_bad_ids_before_any_call(ids, error, match):
    model = nn.Sequential(gradsync.DynamicEmbedding(2, capacity=4))
    served = ServedDynamic(model, 2, gradsync.RowSGD(lr=0.1), "sync", _NoCalls(), None)
    served.take_over(Attachments())
    with pytest.raises(error, match=match):
        model(ids)


@pytest.mark.parametrize("mode,capacity,opt,match", [
    ("ssp", 2, gradsync.RowSGD(lr=0.1), r"'0' is a gradsync.DynamicEmbedding of capacity=2, which --mode ssp "
                                        r"splits among the 3 servers.*pass capacity >= 3"),
    ("sync", 4, None, r"table_optimizer=gradsync.RowSGD"),
])
def test_what_a_served_dynamic_table_refuses(mode, capacity, opt, match):
    model = nn.Sequential(gradsync.DynamicEmbedding(2, capacity=capacity))
    with pytest.raises(ValueError, match=match):
        ServedDynamic(model, 3, opt, mode, None, None)
    ServedDynamic(model, 3, gradsync.RowSGD(lr=0.1), "sync", None, None)  # sync bounds the whole table: any capacity
    ServedDynamic(model, 2, gradsync.RowSGD(lr=0.1), mode, None, None)


def test_status_and_get_stats_show_each_server_part_and_the_whole_table(tmp_path):
    servers = Servers(2, gradsync.RowAdagrad(lr=0.1), capacity=5, evict="lru", admit_after=2)
    for step in range(6):
        sync_step(servers, step, 5)
    parts = {s: dataclasses.asdict(shard.stats) for s, shard in servers.shards.items()}
    whole = servers.state()
    assert sum(p["rows"] for p in parts.values()) == len(whole["ids"]) == 5
    assert [sum(p[k] for p in parts.values()) for k in ("admitted", "filtered", "evicted")] == \
        whole["counters"].tolist()
    assert sum(p["bytes"] for p in parts.values()) == 5 * DIM * 4 + 5 * 4  # rows and one Adagrad sum per row
    message = pb.TableStats(name="t", **parts[0])  # GetStats carries them
    assert (message.admitted, message.evicted) == (parts[0]["admitted"], parts[0]["evicted"])
    stats = {s: {"version": 6, "workers_seen": [0, 1], "pushes_applied": 6, "pushes_rejected": 0, "steps_skipped": 0,
                 "max_staleness": 0, "staleness_histogram": {}, "bytes_in": 0, "bytes_out": 0, "tables": {"t": p}}
             for s, p in parts.items()}
    for s, st in stats.items():
        (tmp_path / f"stats-{s}.json").write_text(json.dumps(st))
    lines = final_status_table(str(tmp_path)).splitlines()
    total = next(line for line in lines if line.startswith("| t | all |")).split(" | ")
    assert total[2] == "5" and total[-3:] == [str(c) for c in whole["counters"].tolist()[:2]] + \
        [f"{whole['counters'][2].item()} |"]


def whole(servers: Servers) -> dict[str, torch.Tensor]:
    """The whole table with its row optimizer state, from a full checkpoint of every server."""
    return rehomed([servers.shards[s].checkpoint(True) for s in sorted(servers.shards)], 0, 1)


@pytest.mark.parametrize("optimizer,rules,full_at", [
    (gradsync.RowAdagrad(lr=0.1), dict(capacity=6, evict="lfu", admit_after=2, ttl_steps=4), 4),
    (gradsync.RowSGD(lr=0.1, momentum=0.9), dict(capacity=12, evict="lru", admit_after=3), 4),
    (gradsync.RowAdagrad(lr=0.1), dict(capacity=12, evict="lru", admit_after=3), 0),  # full: no row yet
], ids=["adagrad-lfu-ttl", "momentum-lru", "adagrad-full-before-any-row"])
def test_a_full_and_a_delta_checkpoint_restore_onto_any_number_of_servers(optimizer, rules, full_at):
    """Full at step 4, a delta at step 9 (rows created, looked up, updated, evicted, ids waiting and forgotten
    meanwhile):
    put together and re-homed onto 1, 2 or 3 servers they hold what the servers that wrote them hold, optimizer
    state included, and the next steps make the same decisions bit for bit."""
    servers = Servers(2, optimizer, **rules)
    for step in range(full_at + 1):
        sync_step(servers, step, rules["capacity"])
    full = [servers.shards[s].checkpoint(True) for s in range(2)]
    for step in range(full_at + 1, 10):
        sync_step(servers, step, rules["capacity"], update=step < 7)  # steps 7-9 look ids up, update no row
    delta = [servers.shards[s].checkpoint(False) for s in range(2)]
    parts = [{**with_delta(f, d), "server": d["server"], "num_servers": 2} for f, d in zip(full, delta)]
    expected = []  # the uninterrupted servers' table before each of steps 10 .. 14, and after them
    for step in range(10, 16):
        expected.append(whole(servers))
        if step < 15:
            sync_step(servers, step, rules["capacity"])
    for num in (1, 2, 3):
        restored = Servers(num, optimizer, **rules)
        for shard in restored.shards.values():
            shard.restore(parts)
        for step, want in zip(range(10, 16), expected):
            got = whole(restored)
            assert list(got) == list(want) and "optimizer" in got, (num, step)
            for key in want:
                assert torch.equal(got[key], want[key]), (num, step, key)
            assert len(got["optimizer"]) == len(got["ids"])
            if step < 15:
                sync_step(restored, step, rules["capacity"])
    assert int(expected[0]["counters"][2]) > int(full[0]["counters"][2] + full[1]["counters"][2])  # evicted between


class AsyncServers:
    """S `DynamicShard`s of one table stepping alone (async, ssp), each with its version, driven as the server
    drives them: `lookup` at the server's version, `push` through `current`, the update and `pushed_alone`."""

    def __init__(self, num_servers: int, optimizer, **rules):
        setup = DynamicSetup(settings(**rules), optimizer)
        self.shards = {s: DynamicShard("t", setup, s, num_servers, alone=True) for s in range(num_servers)}
        self.versions = dict.fromkeys(self.shards, 0)

    def lookup(self, ids: torch.Tensor) -> dict[int, tuple[int, torch.Tensor]]:
        """One worker's lookup of its batch: per server, (version, ids admitted)."""
        ids, counts = torch.unique(ids, return_counts=True)
        owner, out = server_of(ids, len(self.shards)), {}
        for s, shard in self.shards.items():
            at = owner == s
            _, admitted = shard.lookup(ids[at], counts[at], -1, self.versions[s])  # a worker's step: ignored
            out[s] = (self.versions[s], ids[at][admitted])
        return out

    def push(self, looked_up: dict[int, tuple[int, torch.Tensor]], grads) -> None:
        """The worker's push to every server: `grads(ids)` for the ids it looked up there."""
        for s, (version, ids) in looked_up.items():
            shard = self.shards[s]
            shard.check_push(0, ids, grads(ids))
            shard.apply(*shard.current(version, ids, grads(ids)))
            shard.pushed_alone()
            self.versions[s] += 1


def test_async_servers_bound_their_share_and_keep_weights_and_optimizer_state_on_the_same_ids():
    """Random interleavings of 3 workers' lookups and pushes (RowAdagrad): after every push each server holds
    at most its share of capacity (7 = 3 + 2 + 2), between pushes at most that plus the ids created since; a
    row differs from init(id) exactly where its Adagrad sum grew, after every event; the checkpoints restore
    the same ids and Adagrad sums onto 1, 2 and 3 servers."""
    optimizer, init = gradsync.RowAdagrad(lr=0.5), HashedUniform(DIM, seed=3)
    for rules in (dict(evict="lru"), dict(evict="lfu", admit_after=2, ttl_steps=3)):
        servers = AsyncServers(3, optimizer, capacity=7, **rules)
        assert [shard.table.capacity for shard in servers.shards.values()] == [3, 2, 2]
        rng, pending, seen = random.Random(1), {}, set()
        created_before = {s: 0 for s in servers.shards}  # rows created before the server's last push
        for event in range(60):
            worker = rng.randrange(3)
            if worker in pending:
                servers.push(pending.pop(worker), lambda ids: grads_of(ids, event, worker))
                assert all(len(shard.table) <= shard.table.capacity for shard in servers.shards.values())
                created_before = {s: shard.table.counters["admitted"] for s, shard in servers.shards.items()}
            else:
                pending[worker] = servers.lookup(batch(event, worker))
            for s, shard in servers.shards.items():
                created = shard.table.counters["admitted"] - created_before[s]
                assert len(shard.table) <= shard.table.capacity + created
            whole = rehomed([shard.checkpoint() for shard in servers.shards.values()], 0, 1)
            updated = (whole["weight"] != init(whole["ids"])).any(1)
            assert torch.equal(updated, whole["optimizer"] > 0)
            seen.update(updated.tolist())
        assert seen == {False, True}  # rows not updated yet, and updated ones
        evicted = sum(shard.table.counters["evicted"] for shard in servers.shards.values())
        assert evicted > 0
        parts = [shard.checkpoint() for shard in servers.shards.values()]
        for num_servers in (1, 2, 3):
            restored = AsyncServers(num_servers, optimizer, capacity=7, **rules)
            for shard in restored.shards.values():
                shard.restore(parts)
            merged = rehomed([shard.checkpoint() for shard in restored.shards.values()], 0, 1)
            assert torch.equal(merged["ids"], rehomed(parts, 0, 1)["ids"])
            assert torch.equal(merged["optimizer"], rehomed(parts, 0, 1)["optimizer"])


def test_an_evicted_id_looked_up_again_starts_fresh_and_a_stale_push_leaves_it_so():
    """One server, capacity 1: worker 0 looks x up, worker 1 looks y up and pushes, which evicts x (the
    smaller key); worker 2 looks x up: init(x) with a fresh Adagrad sum; worker 0's push, computed on the old
    row, reaches neither that row nor its state (and worker 1's stale push of the evicted y changes nothing)."""
    optimizer, init = gradsync.RowAdagrad(lr=0.5), HashedUniform(DIM, seed=3)
    servers = AsyncServers(1, optimizer, capacity=1)
    x, y = torch.tensor([-5]), torch.tensor([9])
    first = servers.lookup(x)
    servers.push(servers.lookup(y), lambda ids: torch.ones(ids.numel(), DIM))
    table = servers.shards[0].table
    assert table.state()["ids"].tolist() == [9] and table.counters["evicted"] == 1
    again = servers.lookup(x)
    servers.push(first, lambda ids: torch.ones(ids.numel(), DIM))  # ends the step: y, last looked up before, goes
    state = servers.shards[0].checkpoint()
    assert state["ids"].tolist() == [-5] and torch.equal(state["weight"], init(x))
    assert state["optimizer"].tolist() == [0.0]
    servers.push(again, lambda ids: torch.ones(ids.numel(), DIM))  # its own lookup's push: applied
    state = servers.shards[0].checkpoint()
    assert not torch.equal(state["weight"], init(x)) and state["optimizer"].tolist() == [1.0]


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_server_fixes_its_mmap_threshold_only_when_it_holds_a_dynamic_table(dynamic, monkeypatch):
    """Its RSS then follows the rows it holds (core/malloc.py); a server without one, like every worker, keeps
    glibc's own threshold."""
    fixed = []
    monkeypatch.setattr(malloc, "fix_mmap_threshold", lambda: fixed.append(True))
    tables = {"t": DynamicSetup(settings(capacity=8), gradsync.RowSGD(lr=0.1))} if dynamic else {}
    setup = Setup.of([], {}, {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 0.1}), tables)
    server = ParameterServer(0, 1, "sync", "raise")
    server.register(0, ModelSpec.of({}, {}), setup).wait()
    assert server.ready.is_set() and fixed == ([True] if dynamic else [])
    gradsync.DynamicEmbedding(4, capacity=8)  # a worker's module: no change
    assert fixed == ([True] if dynamic else [])

