"""Embedding tables in one process: which modules are served, row placement, row optimizers, the
worker's lookups and the servers' sync/async rules for rows."""
import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

import gradsync
from gradsync.worker.module.plain_module import Attachments
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.core.buckets import TensorSpec
from gradsync.core.errors import GradientError
from gradsync.tables.row_optim import LazyRows, RowAdagrad, RowSGD, exact_row_optimizer, no_row_form
from gradsync.tables.placement import check_ids, find_tables, merge_rows, rows_on, split_ids
from gradsync.ps.async_rules import AsyncRule
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Push, RowGrads
from gradsync.ps.shard import ShardState
from gradsync.ps.table_shard import TableShard
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.worker.rows.served_tables import ServedTables


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.served = nn.Embedding(10, 3)
        self.bag = nn.EmbeddingBag(7, 3)
        self.frozen = nn.Embedding(5, 3).requires_grad_(False)
        self.tied = nn.Embedding(6, 3)
        self.out = nn.Linear(3, 6)
        self.out.weight = self.tied.weight


def test_find_tables_serves_plain_embeddings_and_keeps_tied_and_frozen_dense():
    assert list(find_tables(Mixed())) == ["served.weight", "bag.weight"]
    assert list(find_tables(nn.Embedding(4, 2))) == ["weight"]


def test_rows_are_placed_round_robin_and_split_back():
    assert [rows_on(10, s, 3) for s in range(3)] == [4, 3, 3]
    ids = torch.tensor([0, 1, 5, 7, 9])
    parts = split_ids(ids, 3)
    assert {s: (p.tolist(), local.tolist()) for s, (p, local) in parts.items()} == {
        0: ([0, 4], [0, 3]), 1: ([1, 3], [0, 2]), 2: ([2], [1])}
    assert list(split_ids(ids, 1)) == [0] and split_ids(ids, 1)[0][1].equal(ids)


@pytest.mark.parametrize("ids,match", [
    (torch.tensor([1, 10]), r"table 't' has rows 0..9, but a batch looked up id 10"),
    (torch.tensor([-1, 3]), r"looked up id -1"),
    (torch.tensor([1.0]), r"torch.float32 ids: pass an integer tensor"),
])
def test_bad_ids_name_the_table_and_the_id(ids, match):
    with pytest.raises((IndexError, TypeError), match=match):
        check_ids("t", ids, 10)


def test_merge_rows_sums_duplicates_and_scales():
    ids, grads = merge_rows([(torch.tensor([3, 1]), torch.tensor([[1.0], [2.0]])),
                             (torch.tensor([1, 5]), torch.tensor([[4.0], [8.0]]))], 0.5)
    assert ids.tolist() == [1, 3, 5] and grads.view(-1).tolist() == [3.0, 0.5, 4.0]


def test_row_sgd_equals_torch_sgd_when_every_row_is_in_every_step():
    torch.manual_seed(0)
    table, grads = torch.randn(6, 4), [torch.randn(6, 4) for _ in range(4)]
    dense = table.clone().requires_grad_(True)
    opt = torch.optim.SGD([dense], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    rows, row_opt = table.clone(), RowSGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    state = row_opt.new_state(6, 4, torch.float32)
    for g in grads:
        dense.grad = g.clone()
        opt.step()
        row_opt.step(rows, state, torch.arange(6), g)
    assert torch.allclose(rows, dense.detach(), atol=1e-6)


def test_row_sgd_momentum_is_lazy_rows_outside_a_step_do_not_move():
    table = torch.zeros(5, 2)
    opt = RowSGD(lr=1.0, momentum=0.5)
    state = opt.new_state(5, 2, torch.float32)
    opt.step(table, state, torch.tensor([1, 3]), torch.ones(2, 2))
    opt.step(table, state, torch.tensor([3]), torch.ones(1, 2))
    assert table[:, 0].tolist() == [0.0, -1.0, 0.0, -2.5, 0.0]  # row 1 kept its momentum but did not move
    assert state.used == 2 and state.slot.tolist() == [-1, 0, -1, 1, -1]


def test_lazy_rows_grow_past_their_capacity():
    state = LazyRows(5000, 2, torch.float32)
    first = state.slots(torch.arange(0, 3000, 2))
    again = state.slots(torch.tensor([4, 4999]))
    assert first.tolist() == list(range(1500)) and again.tolist() == [2, 1500]
    assert state.data.shape[0] >= 1501


def test_row_adagrad_formula():
    table = torch.ones(3, 2)
    opt = RowAdagrad(lr=0.5, eps=0.0)
    acc = opt.new_state(3, 2, torch.float32)
    opt.step(table, acc, torch.tensor([2]), torch.tensor([[3.0, 4.0]]))
    assert acc.tolist() == [0.0, 0.0, 12.5]  # mean(9, 16)
    expected = 1 - 0.5 * torch.tensor([3.0, 4.0]) / 12.5 ** 0.5
    assert torch.allclose(table[2], expected) and table[:2].eq(1).all()


@pytest.mark.parametrize("kwargs", [dict(lr=0.0), dict(lr=-1.0), dict(lr=0.1, momentum=-0.5)])
def test_row_optimizer_refuses_bad_values(kwargs):
    with pytest.raises(ValueError, match="RowSGD"):
        RowSGD(**kwargs)


def test_exact_row_optimizer_only_for_plain_sgd():
    assert exact_row_optimizer(torch.optim.SGD, {"lr": 0.3, "foreach": True, "momentum": 0}) == RowSGD(lr=0.3)
    assert exact_row_optimizer(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) is None
    assert exact_row_optimizer(torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01}) is None
    assert exact_row_optimizer(torch.optim.SGD, {"lr": 0.1, "maximize": True}) is None
    assert exact_row_optimizer(torch.optim.Adam, {"lr": 0.1}) is None
    refusal = no_row_form(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": None}, "t")
    assert "table 't' has no exact row-wise form under SGD(lr=0.1, momentum=0.9)" in refusal
    assert "table_optimizer=gradsync.RowSGD" in refusal and "tables='dense'" in refusal


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(tables="row"), ValueError, r"tables='row': expected 'auto'"),
    (dict(table_optimizer=torch.optim.SGD), TypeError, r"table_optimizer must be gradsync.RowSGD"),
])
def test_trainer_refuses_bad_table_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        gradsync.Trainer(nn.Embedding(3, 2), torch.optim.SGD, lr=0.1, **kwargs)


class FakeTransport:
    """Serves rows of whole tables held here, as S servers would (row r on server r % S)."""

    def __init__(self, tables: dict[str, torch.Tensor], servers: int):
        self.tables, self.servers, self.calls, self.batches = tables, servers, 0, []

    def pull_rows(self, table, ids):
        self.calls += len(ids)
        return {s: (7, self.tables[table][local * self.servers + s].clone()) for s, local in ids.items()}

    def pull_rows_many(self, lookups, before=frozenset()):
        assert not before  # no replacement here
        self.batches.append([table for table, _ in lookups])
        return [self.pull_rows(table, ids) for table, ids in lookups]


def lookups(emb: nn.Module, bag: nn.Module) -> torch.Tensor:
    """A forward that looks `emb` up twice (repeated and padding ids) and `bag` once, with offsets."""
    ids, bag_ids, offsets = torch.tensor([[4, 2, 2], [8, 4, 1]]), torch.tensor([5, 0, 5, 3]), torch.tensor([0, 1])
    return emb(ids).sum() + emb(torch.tensor([2])).pow(2).sum() + bag(bag_ids, offsets).pow(2).sum()


@pytest.mark.parametrize("servers", [1, 2])
def test_lookups_match_the_dense_modules_and_sum_duplicate_rows(servers):
    torch.manual_seed(0)
    emb, bag = nn.Embedding(9, 3, padding_idx=4), nn.EmbeddingBag(6, 3, mode="sum")
    reference = copy.deepcopy(emb), copy.deepcopy(bag)
    expected = lookups(*reference)
    expected.backward()
    transport = FakeTransport({"emb": emb.weight.detach().clone(), "bag": bag.weight.detach().clone()}, servers)
    served = ServedTables({"emb": emb, "bag": bag}, servers, StepMetrics(), transport)
    served.take_over(Attachments())
    assert emb.weight is None and not list(emb.parameters())  # the worker holds no table
    try:
        dist_autograd._init(0)
    except RuntimeError:  # already initialised in this process
        pass
    with dist_autograd.context() as cid:
        out = lookups(emb, bag)
        dist_autograd.backward(cid, [out])
        pushes = served.row_grads(cid, dist_autograd.get_gradients(cid))
    assert torch.allclose(out, expected)
    for name, module in zip(("emb", "bag"), reference):
        got = torch.zeros_like(module.weight)
        for s, per in pushes.items():
            rows = per[name]
            # one row each, duplicates summed
            assert rows.version == 7 and rows.ids.unique().numel() == rows.ids.numel()
            got[rows.ids * servers + s] = rows.grads
        assert torch.allclose(got, module.weight.grad)
    # ids 1 2 4 8
    assert pushes[0]["emb"].grads.shape[0] + (pushes[1]["emb"].grads.shape[0] if servers == 2 else 0) == 4
    assert served.transport.batches == [["emb"], ["emb"], ["bag"]]  # each lookup used before the next
    with dist_autograd.context() as cid:  # lookups used together are pulled together
        together = torch.cat([emb(torch.tensor([1, 2])), bag(torch.tensor([0, 5]), torch.tensor([0]))])
        assert served.transport.batches[3:] == [["emb", "bag"]]
        assert torch.equal(together, torch.cat([reference[0](torch.tensor([1, 2])),
                                                reference[1](torch.tensor([0, 5]), torch.tensor([0]))]))


def table_shard(optimizer=RowSGD(lr=1.0)) -> ShardState:
    """A shard of server 1 of 2 with no dense parameters and one 7 x 2 table (its rows 1, 3, 5)."""
    values = torch.arange(14.0).view(7, 2)[1::2].clone()
    table = TableShard(TensorSpec("t", (7, 2), torch.float32), 1, 2, values, optimizer)
    return ShardState(1, [], {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 1.0}), tables={"t": table})


def test_sync_rows_are_averaged_over_all_workers_absent_rows_count_zero():
    shard = table_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    first = rule.commit(0, 0, Push([], [], rows={"t": RowGrads(0, torch.tensor([0, 2]),
                                                               torch.tensor([[2.0, 2.0], [4.0, 4.0]]))}))
    assert not first.done()
    second = rule.commit(1, 0, Push([], [], rows={"t": RowGrads(0, torch.tensor([2]), torch.tensor([[6.0, 6.0]]))}))
    assert first.wait().version == second.wait().version == 1
    # rows 1, 3, 5 were [2, 3], [6, 7], [10, 11]: row 1 gets 2 / 2, row 5 (4 + 6) / 2, row 3 nothing
    assert shard.tables["t"].values.tolist() == [[1.0, 2.0], [6.0, 7.0], [5.0, 6.0]]
    assert shard.tables["t"].stats.rows_pushed == 2


@pytest.mark.parametrize("rows,match", [
    ({"t": RowGrads(0, torch.tensor([3]), torch.ones(1, 2))}, r"names local row 3, this server holds 0..2"),
    ({"t": RowGrads(0, torch.tensor([1, 1]), torch.ones(2, 2))}, r"repeats row ids"),
    ({"t": RowGrads(0, torch.tensor([1]), torch.ones(1, 3))}, r"are \(1, 3\) torch.float32, expected \(1, 2\)"),
    ({"u": RowGrads(0, torch.tensor([1]), torch.ones(1, 2))}, r"table 'u', which server 1 does not hold"),
    ({"t": RowGrads(5, torch.tensor([1]), torch.ones(1, 2))}, r"version 5 .* from the future"),
])
def test_bad_row_push_is_refused_and_changes_nothing(rows, match):
    shard = table_shard()
    before = shard.tables["t"].values.clone()
    for rule in (SyncRule(shard, 2, "raise"), AsyncRule(shard, 2, "raise")):
        with pytest.raises(GradientError, match=match):
            rule.commit(0, 0, Push([], [], rows=rows)).wait()
    assert shard.tables["t"].values.equal(before) and shard.version == 0


def test_nonfinite_row_gradient_names_table_and_worker():
    shard = table_shard()
    rule = SyncRule(shard, 2, "raise")
    rule.commit(0, 0, Push([], [], rows={"t": RowGrads(0, torch.tensor([1]), torch.ones(1, 2))}))
    with pytest.raises(GradientError, match=r"parameter 't' from worker 1"):
        rule.commit(1, 0, Push([], [], rows={"t": RowGrads(0, torch.tensor([0]),
                                                           torch.tensor([[1.0, float("nan")]]))})).wait()
    assert shard.version == 0


def test_async_rows_record_staleness_per_table():
    shard = table_shard(RowAdagrad(lr=0.1))
    rule = AsyncRule(shard, 2, "raise")
    for version in (0, 1, 0):
        rule.commit(0, version, Push([], [], rows={"t": RowGrads(version, torch.tensor([1]), torch.ones(1, 2))})).wait()
    assert shard.version == 3 and shard.tables["t"].stats.max_staleness == 2


def test_table_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setattr("gradsync.ps.table_shard.available_memory", lambda: 2**30)
    spec = TensorSpec("big", (10**7, 64), torch.float32)
    with pytest.raises(MemoryError, match=r"table 'big' needs 1\.21 GiB on server 0 \(5,000,000 rows x 64 float32 "
                                          r"plus the row optimizer's state\), but only 1\.00 GiB are free"):
        TableShard(spec, 0, 2, None, RowAdagrad(lr=0.1))


def test_max_norm_is_refused_clearly():
    with pytest.raises(ValueError,
                       match=r"table 'e' has max_norm=1.0: .* build it without max_norm, or .*tables='dense'"):
        ServedTables({"e": nn.Embedding(3, 2, max_norm=1.0)}, 1, StepMetrics(), None)


@pytest.mark.parametrize("optimizer", [RowSGD(lr=1.0, momentum=0.5), RowAdagrad(lr=0.1)])
def test_table_rows_and_row_state_survive_a_checkpoint(optimizer, tmp_path):
    from gradsync.ps import reshard, shard_file

    shard, fresh = table_shard(optimizer), table_shard(optimizer)
    rule = AsyncRule(shard, 1, "raise")
    for version, ids in enumerate(([0, 2], [2])):
        rule.commit(0, version, Push([], [], rows={"t": RowGrads(version, torch.tensor(ids),
                                                                 torch.ones(len(ids), 2))})).wait()
    path, version = shard_file.save(shard, str(tmp_path))
    reshard.restore(fresh, [shard_file.load(path)])
    assert version == fresh.version == 2 and fresh.tables["t"].values.equal(shard.tables["t"].values)
    for done in (shard, fresh):  # the same next step: the row state came back too
        AsyncRule(done, 1, "raise").commit(0, 2, Push([], [], rows={"t": RowGrads(2, torch.tensor([0]),
                                                                                  torch.ones(1, 2))})).wait()
    assert fresh.tables["t"].values.equal(shard.tables["t"].values)


def test_pull_rows_over_grpc_refuses_misrouted_ids_unknown_tables_and_a_wrong_table():
    import grpc

    from gradsync.core.buckets import ModelSpec
    from gradsync.proto import gradsync_pb2 as pb
    from gradsync.ps.messages import Setup, TableSetup
    from gradsync.ps.server import ParameterServer
    from grpc_harness import served

    values = torch.arange(14.0).view(7, 2)
    spec = TensorSpec("t", (7, 2), torch.float32)
    setup = Setup.of([], {}, {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 1.0}),
                     {"t": TableSetup(spec, values[1::2].clone(), None, RowSGD(lr=1.0), None)}, 2)
    server = ParameterServer(1, 1, "sync", "raise")
    server.register(0, ModelSpec((), (), (), (spec,)), setup).wait()
    with served(server) as (_, client):
        call = lambda **kw: list(client._pull_rows[0](pb.PullRowsRequest(**kw), timeout=5,  # noqa: E731
                                                       metadata=client.metadata))
        assert client.health()[0]["tables"] == {"t": {"shape": (7, 2), "dtype": "float32", "num_servers": 2,
                                                      "rows_held": 3}}
        for request, code, match in [
            (dict(table="t", ids=[3, 4]), grpc.StatusCode.INVALID_ARGUMENT, "row 4 of table 't' is on server 0"),
            (dict(table="t", ids=[9]), grpc.StatusCode.INVALID_ARGUMENT, "has rows 0..6, not 9"),
            (dict(table="u", ids=[1]), grpc.StatusCode.NOT_FOUND, "holds no table 'u'"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                call(**request)
            assert refused.value.code() == code and match in refused.value.details()
        assert client.stats()[0]["tables"]["t"]["rows_pulled"] == 0  # nothing was read


ROW_FIX = ("Fix: give the tables a row optimizer, Trainer(..., table_optimizer=gradsync.RowSGD(lr=..., "
           "momentum=...)) or gradsync.RowAdagrad(lr=...); or use --strategy allreduce")


def test_hybrid_and_sharded_refuse_a_model_without_a_table_to_serve_naming_why_and_the_fix_once(capsys):
    from types import SimpleNamespace

    from gradsync.core.errors import NoTablesToServe
    from gradsync.worker.strategies.hybrid_strategy import HybridStrategy
    from gradsync.worker.strategies.sharded_strategy import ShardedStrategy

    model = nn.Sequential(nn.Embedding(400, 8), nn.Linear(8, 300))  # the table: over a tenth of the model
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cluster = SimpleNamespace(config=SimpleNamespace(worker_rank=0, mode="sync", servers=1, transport="rpc"))
    why = f"every table of this model stays dense: '0.weight' (400, 8) trains with SGD(momentum=0.9), which has " \
          f"no exact row-wise form. {ROW_FIX}"
    with pytest.raises(NoTablesToServe) as hybrid:
        HybridStrategy(cluster, model, momentum)
    assert str(hybrid.value) == f"the hybrid strategy serves embedding tables from the parameter servers, and {why}"
    with pytest.raises(NoTablesToServe) as sharded:
        ShardedStrategy(cluster, model, momentum)
    assert str(sharded.value) == f"the sharded strategy splits embedding tables across the workers, and {why}"
    assert capsys.readouterr().out == ""  # said in the refusal only, not also in worker 0's line on a dense table
    assert isinstance(model[0].weight, nn.Parameter) and momentum.param_groups[0]["params"][0] is model[0].weight


def test_why_every_table_stays_dense_names_each_table_and_each_cause():
    from gradsync.worker.rows.choice import why_dense

    mixed = Mixed()
    spec = OptimizerSpec.of(torch.optim.SGD(mixed.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4), mixed)
    assert why_dense(mixed, "auto", spec, None) == (
        "every table of this model stays dense: 'served.weight' (10, 3) trains with SGD(momentum=0.9, "
        "weight_decay=0.0001), which has no exact row-wise form; 'bag.weight' (7, 3) trains with SGD(momentum=0.9, "
        "weight_decay=0.0001), which has no exact row-wise form; 'frozen.weight' (5, 3) is frozen "
        "(requires_grad=False): nothing trains it; 'tied.weight' (6, 3) is tied to 'out.weight', which trains it in "
        f"the dense path. {ROW_FIX}")
    adam = OptimizerSpec.of(torch.optim.Adam(mixed.parameters()), mixed)
    assert "'served.weight' (10, 3) trains with Adam, which has no exact row-wise form" in why_dense(
        mixed, "auto", adam, None)
    assert why_dense(mixed, "auto", spec, RowSGD(lr=0.1)) is None  # served and bag get the row optimizer
    plain = OptimizerSpec.of(torch.optim.SGD(mixed.parameters(), lr=0.1), mixed)
    assert why_dense(mixed, "auto", plain, None) is None  # plain SGD is exact row by row
    assert why_dense(mixed, "dense", plain, None) == (
        "tables='dense' keeps every table of this model dense ('served.weight' (10, 3), 'bag.weight' (7, 3), "
        "'frozen.weight' (5, 3), 'tied.weight' (6, 3)). Fix: build the Trainer with tables='auto' (the default); "
        "or use --strategy allreduce")
    linear = nn.Linear(3, 3)
    assert why_dense(linear, "auto", OptimizerSpec.of(torch.optim.SGD(linear.parameters(), lr=0.1), linear),
                     None) == ("this model has no embedding table (nn.Embedding, nn.EmbeddingBag, "
                               "gradsync.DynamicEmbedding): use --strategy allreduce")


@pytest.mark.parametrize("rows,said", [(400, True), (20, False)])
def test_a_table_left_dense_is_named_only_when_it_is_a_tenth_of_the_model_or_more(capsys, rows, said):
    from gradsync.worker.rows.choice import WORTH_SERVING_SHARE, choose_tables

    model = nn.Sequential(nn.Embedding(rows, 8), nn.Linear(8, 300))  # 2,700 parameters beside the table
    share = rows * 8 / sum(p.numel() for p in model.parameters())
    assert (share >= WORTH_SERVING_SHARE) == said  # 400 rows: 54% of the model; 20 rows: 6%
    spec = OptimizerSpec.of(torch.optim.AdamW(model.parameters()), model)
    chosen, _ = choose_tables(model, "auto", spec, None, say=True)
    assert not chosen  # AdamW has no exact row-wise form: the table stays dense either way
    out = capsys.readouterr().out
    assert out.count("embedding table '0.weight'") == (1 if said else 0)
