"""The step timeline (GRADSYNC_TIMELINE): the bytes of a step's lanes add up to the bytes the step moved (the
step metrics' and the closed form from the model's sizes), each piece's events come in order, and the
pipeline's promise shows in the server's events (a piece applied before the next piece's parts are all in),
never in timings."""

import pytest
import torch

import gradsync
from gradsync.metrics import step_metrics
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.metrics.timeline import HEAD, Timeline
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Piece, PipelineHead
from helpers import check_timeline_order, max_diff
from jobs import make_bn_net, make_mlp, reference_bn, reference_mlp, train_with_timeline
from shards import make_pieced_shard, piece_part

FP32 = 4


def test_off_the_timeline_calls_straight_through_and_keeps_nothing():
    timeline, fut = Timeline(on=False), torch.futures.Future()
    assert timeline.timed((0, 0), lambda: fut) is fut
    assert timeline.exchanged(0, 100, lambda: fut) is fut
    timeline.committed(1)
    assert not timeline.steps


def test_a_sharded_steps_all_to_alls_are_exchange_time_neither_compute_nor_commit(monkeypatch):
    """On a clock the test sets: the forward's exchange (1 s) comes out of compute, the step's (2 s, after
    the last gradient, where the commit is timed from) out of commit; the parts add up to the step."""
    clock = [0.0]
    monkeypatch.setattr(step_metrics.time, "perf_counter", lambda: clock[0])
    metrics = StepMetrics()
    metrics.pulled(0.0, 0)  # the forward begins at 0
    clock[0] = 2.0
    metrics.exchanged(1.0, 10, 20)  # a lookup's all-to-all, 1 s to 2 s
    clock[0] = 8.0
    metrics.exchanged(2.0, 30, 40)  # the step's, 6 s to 8 s, after the last gradient at 5 s
    clock[0] = 10.0
    metrics.committed(5.0, 100, 100)
    record = metrics.last()
    assert (record.pull_s, record.exchange_s, record.compute_s, record.commit_s) == (0.0, 3.0, 4.0, 3.0)
    assert record.total_s == 10.0 and (record.bytes_sent, record.bytes_received) == (140, 160)
    assert metrics.summary(skip=0)["exchange_s"] == 3.0


def test_a_server_applies_each_piece_before_the_next_ones_parts_are_all_in():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    stamps = lambda b: rule.stamps.reply(b, None, 0, True)  # noqa: E731
    [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    for b in range(len(shard.buckets)):
        rule.commit_piece(0, 0, Piece(0, b, piece_part(0, b, shard), ()))
        assert stamps(b).arrived is None  # worker 1's part is not in yet
        rule.commit_piece(1, 0, Piece(0, b, piece_part(1, b, shard), ()))
        assert stamps(b).arrived <= stamps(b).applied
        if b:
            assert stamps(b - 1).applied <= stamps(b).arrived
    assert rule.stamps.reply(0, "value", 0, False) == "value"  # a worker that did not ask gets the value alone
    assert rule.stamps.reply(0, None, 1, True) == (None, None, None)  # another step's events are not sent


def test_pieces_that_wait_for_the_whole_step_are_applied_after_the_last_is_in():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="skip")  # a NaN in a later piece would skip the whole step
    [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    for b in range(len(shard.buckets)):
        for w in (0, 1):
            rule.commit_piece(w, 0, Piece(0, b, piece_part(w, b, shard), ()))
    events = [rule.stamps.reply(b, None, 0, True) for b in range(len(shard.buckets))]
    assert len({e.applied for e in events}) == 1 and max(e.arrived for e in events) <= events[0].applied


def _check_pipelined(pieces: list[dict]) -> None:
    """On each server, every piece was applied before the next piece's parts were all in."""
    for server in {p["server"] for p in pieces}:
        served = sorted((p for p in pieces if p["server"] == server and p["arrived"] is not None),
                        key=lambda p: p["arrived"])
        assert len(served) > 1 and all(a["applied"] <= b["arrived"] for a, b in zip(served, served[1:]))


@pytest.mark.job
@pytest.mark.timeout(150)
@pytest.mark.parametrize("bn,transport", [(False, "rpc"), (True, "rpc"), (True, "grpc")])
def test_a_ps_steps_lanes_carry_its_bytes_in_order_and_pipelined(launch, bn, transport):
    """Over gRPC the server's events come back in the reply stream (`PieceStamp`), and the pipeline is on as
    between machines (on one machine gRPC sends steps whole by default)."""
    steps, workers, servers = 4, 2, 2
    results = launch(train_with_timeline, strategy="ps", workers=workers, servers=servers,
                     args=(steps, bn), timeout=140, bucket_cap_mb=0.0002,  # 200-byte pieces
                     transport=transport, pipeline="on")
    model = make_bn_net() if bn else make_mlp()
    gradients = FP32 * sum(p.numel() for p in model.parameters())
    buffers = sum(b.nbytes for b in model.buffers())
    reference = reference_bn(steps, workers) if bn else reference_mlp(steps, workers)
    for state, records, timeline in results:
        assert max_diff(state, reference) <= 1e-5  # the timeline changes nothing of the step
        assert [t["step"] for t in timeline] == list(range(1, steps + 1))
        for record, step in zip(records, timeline):
            pieces = step["pieces"]
            heads = [p for p in pieces if p["bucket"] is HEAD]
            assert len(heads) == servers and sum(p["bytes_sent"] for p in heads) == buffers
            assert sum(p["bytes_sent"] for p in pieces) == record["bytes_sent"] == gradients + buffers
            assert sum(p["bytes_received"] for p in pieces) == record["bytes_received"] == gradients + buffers
            check_timeline_order(pieces)
            _check_pipelined(pieces)


@pytest.mark.job
@pytest.mark.timeout(200)
def test_an_allreduce_steps_buckets_carry_its_bytes_in_order_and_change_nothing(launch):
    steps, workers = 4, 3  # W = 3: the hook the timeline needs must scale by 1 / 3 exactly as DDP's own does
    results = launch(train_with_timeline, strategy="allreduce", workers=workers, args=(steps,), timeout=90)
    untimed = launch(train_with_timeline, strategy="allreduce", workers=workers, args=(steps, False, False),
                     timeout=90)
    elements = sum(p.numel() for p in make_mlp().parameters())
    for (state, records, timeline), (plain, _, nothing) in zip(results, untimed):
        assert not nothing and all(torch.equal(state[k], plain[k]) for k in plain)  # bit for bit
        for record, step in zip(records, timeline):
            pieces = step["pieces"]
            assert len(pieces) == 1 and pieces[0]["server"] is None  # the small MLP is one DDP bucket
            # a ring at W = 3: 2 (W-1)/W of the fp32 gradients through each link, each way
            assert pieces[0]["bytes_sent"] == pieces[0]["bytes_received"] == record["bytes_sent"] == \
                int(2 * 2 / 3 * FP32 * elements)
            check_timeline_order(pieces)
