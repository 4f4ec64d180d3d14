"""Resume onto another shape: a checkpoint written with S servers and W workers resumes with S' and W', the
model, optimizer and row state re-split bit for bit (parameters by element range, rows by r % S'), and
sync training goes on as single-process training from that state."""
import os

import pytest
import torch

import gradsync
from gradsync.core.buckets import ModelSpec, TensorSpec, assign_tensors, join_pieces, plan_buckets
from gradsync.core.optimizer_spec import OptimizerSpec, join_state
from gradsync.tables.row_optim import RowSGD
from gradsync.tables.placement import join_rows
from gradsync.ps import reshard, shard_file
from gradsync.ps.shard import ShardState
from gradsync.ps.table_shard import TableShard
from resumable import by_name, reference_mlp, saved, train_clicks, train_mlp
from helpers import max_diff

PARAMS = {"big": torch.randn(40, 25), "bias": torch.randn(25), "last": torch.randn(7, 3)}
BUFFERS = {"mean": torch.randn(5), "count": torch.tensor(3)}
TABLE, ROWS = TensorSpec("emb", (11, 3), torch.float32), torch.randn(11, 3)
ADAM = OptimizerSpec.one_group(torch.optim.Adam, {"lr": 0.01})


def _layout(servers: int, fill: float | None = None) -> list[ShardState]:
    """Shards of the test model on `servers` servers (parameters cut by element range), the values of
    PARAMS, or all `fill`."""
    spec = ModelSpec.of({n: p.requires_grad_() for n, p in PARAMS.items()}, BUFFERS)
    buckets = plan_buckets(spec.params, servers, cap_bytes=1024, split=True)
    owner = assign_tensors(spec.buffers, servers)
    value = (lambda t: t) if fill is None else (lambda t: torch.full_like(t, fill))  # noqa: E731
    shards = []
    for s in range(servers):
        rows = value(ROWS)[s::servers].clone()
        table = TableShard(TABLE, s, servers, rows, RowSGD(lr=0.1, momentum=0.9))
        shards.append(ShardState(s, [b for b in buckets if b.server == s], {n: value(p) for n, p in PARAMS.items()},
                                 {n: value(b) for n, b in BUFFERS.items() if owner[n] == s}, ADAM,
                                 tables={"emb": table}))
    return shards


def _step(shards: list[ShardState], seed: int) -> None:
    """One step of the same whole gradients on every layout: Adam on the pieces, row momentum on rows 1..9."""
    g = torch.Generator().manual_seed(seed)
    whole = {n: torch.randn(p.shape, generator=g) for n, p in PARAMS.items()}
    rows = torch.randn(11, 3, generator=g)
    for shard in shards:
        grads = [torch.cat([e.piece(whole[e.name]) for e in b.entries]) for b in shard.buckets]
        table = shard.tables["emb"]
        ids = torch.tensor([r // table.num_servers for r in range(1, 10) if r % table.num_servers == table.server])
        global_ids = ids * table.num_servers + table.server
        with shard.lock:
            shard.apply(grads, [set() for _ in grads], None, {"emb": (ids, rows[global_ids])})


def _whole(shards: list[ShardState]) -> dict:
    """The layout's state joined: parameters, buffers, Adam state by name, the table and its momentum rows."""
    states = [shard_file.capture(s) for s in shards]
    entries = [e for s in shards for b in s.buckets for e in b.entries]
    values = join_pieces({k: v for st in states for k, v in st["params"].items()}, [e for e in entries if not e.whole])
    values.update({k: v for st in states for k, v in st["buffers"].items()})
    optimizer = join_state({k: v for st in states for k, v in st["optimizer"]["state"].items()}, entries)
    tables = {s: st["tables"]["emb"] for s, st in enumerate(states)}
    values["emb"] = join_rows({s: t["values"] for s, t in tables.items()}, TABLE.shape, len(shards))
    momentum = {}
    for s, t in tables.items():
        slot = t["state"]["slot"].long()
        momentum[s] = torch.zeros(slot.numel(), 3)
        momentum[s][slot >= 0] = t["state"]["data"][slot[slot >= 0]]
    values["emb momentum"] = join_rows(momentum, TABLE.shape, len(shards))
    return {"values": values, "optimizer": optimizer, "versions": {st["version"] for st in states}}


def _same(a: dict, b: dict) -> None:
    assert a["values"].keys() == b["values"].keys() and a["optimizer"].keys() == b["optimizer"].keys()
    for name, value in a["values"].items():
        assert torch.equal(value, b["values"][name]), name
    for name, state in a["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"][name][key]), (name, key)
    assert a["versions"] == b["versions"]


@pytest.mark.parametrize("servers", [1, 2, 3, 4])
def test_a_checkpoint_of_2_servers_restores_onto_any_number_bit_for_bit(servers, tmp_path):
    written = _layout(2)
    for seed in range(2):
        _step(written, seed)
    for shard in written:
        shard_file.save(shard, str(tmp_path))
    assert any(not e.whole for s in written for b in s.buckets for e in b.entries)  # a parameter was cut
    resumed = _layout(servers, fill=0.0)
    for shard in resumed:
        reshard.restore_folder(shard, str(tmp_path), 2)
    _same(_whole(resumed), _whole(written))
    _step(written, 7)  # and the restored state steps alike
    _step(resumed, 7)
    _same(_whole(resumed), _whole(written))


def test_the_same_layout_reads_its_own_file_alone(tmp_path, monkeypatch):
    written = _layout(3)
    _step(written, 0)
    for shard in written:
        shard_file.save(shard, str(tmp_path))
    read = []
    load = shard_file.load
    monkeypatch.setattr(shard_file, "load", lambda path: read.append(os.path.basename(path)) or load(path))
    resumed = _layout(3, fill=0.0)
    reshard.restore_folder(resumed[1], str(tmp_path), 3)
    assert read == ["shard-1.ckpt"]


def test_a_checkpoint_without_the_shards_tensors_is_refused(tmp_path):
    written = _layout(2)
    state = shard_file.capture(written[0])
    with pytest.raises(ValueError, match=r"the checkpoint holds \d+ of the \d+ elements of parameter '\w+' that "
                                         r"server 0 needs: it was written by another model.*start without --resume"):
        reshard.restore(_layout(1, fill=0.0)[0], [state])


def _launch(fn, strategy: str, servers: int, workers: int, args: tuple, **settings) -> list:
    return gradsync.launch(fn, strategy=strategy, workers=workers, servers=servers, args=args, step_timeout=30,
                           timeout=120, **settings)


STEPS, EVERY, ON = 10, 5, 14


@pytest.mark.job
@pytest.mark.timeout(300)
def test_a_checkpoint_of_2_servers_and_4_workers_resumes_with_1_and_2_and_with_3_and_3(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _launch(train_mlp, "ps", 2, 4, (STEPS,), checkpoint_dir=directory, checkpoint_every=EVERY)
    written = saved(os.path.join(directory, "step-00000010"))
    for servers, workers in [(1, 2), (3, 3)]:
        out = tmp_path / f"{servers}-{workers}"
        out.mkdir()
        resumed = _launch(train_mlp, "ps", servers, workers, (ON, str(out)), resume=directory)
        start = torch.load(out / "start.pt")
        names = list(start["model"])
        assert max_diff(start["model"], {k: written["model"][k] for k in start["model"]}) == 0  # bit for bit
        for name, state in by_name(start["optimizer"], names).items():
            assert state.keys() == written["optimizer"][name].keys()
            assert all(torch.equal(v, written["optimizer"][name][k]) for k, v in state.items()), name
        reference = reference_mlp(start, STEPS, ON, workers)
        for first, state in resumed:
            assert first == STEPS
            assert max_diff(state, reference) <= 1e-5  # sync parity from the checkpoint's state


@pytest.mark.job
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,transport,before,after", [
    ("hybrid", "rpc", (2, 3), (3, 2)), ("allreduce", "rpc", (0, 2), (0, 3)), ("ps", "grpc", (2, 2), (1, 3))])
def test_tables_and_replicas_resume_onto_other_servers_and_workers(strategy, transport, before, after, tmp_path):
    """Hybrid: table rows re-homed from 2 servers to 3, the dense part from 3 workers to 2; allreduce: 2
    workers to 3 (the new worker takes worker 0's model and optimizer, which every worker holds alike); a
    gRPC job from 2 servers to 1."""
    directory, out = str(tmp_path / "checkpoints"), str(tmp_path)
    _launch(train_clicks, strategy, *before, (STEPS,), transport=transport, checkpoint_dir=directory,
            checkpoint_every=EVERY)
    written = saved(os.path.join(directory, "step-00000010"))
    resumed = _launch(train_clicks, strategy, *after, (ON, None, out), transport=transport, resume=directory)
    start = torch.load(os.path.join(out, "start.pt"))
    assert max_diff(start["model"], {k: written["model"][k] for k in start["model"]}) == 0
    for first, state in resumed:
        assert first == STEPS and max_diff(state, start["model"]) > 1e-3
    assert max_diff(resumed[0][1], resumed[-1][1]) == 0  # the replicas agree
