"""Gradients that leave during the backward (`gradsync.worker.pipeline.streaming`): a bucket's piece leaves once the
backward has produced every entry's gradient; a numbered piece supersedes the same bucket's earlier ones, the
step's head names the one that counts and a whole push voids them; and a loop whose steps change shape (two
backwards, no_sync, a skipped step, a GradScaler) still ends where single-process training ends."""
import pytest
import torch
from torch import nn

import gradsync
from gradsync.core.buckets import ModelSpec, by_server, plan_buckets
from gradsync.ps.messages import Piece, PipelineHead, Push, Setup
from gradsync.ps.server import ParameterServer
from gradsync.core.futures import resolved
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.ps.staging import Staging
from gradsync.ps.sync_rule import SyncRule
from gradsync.worker.pipeline.streaming import GradientStream
from helpers import max_diff
from shards import make_pieced_shard, piece_part
from streaming_loops import PATTERN, reference_shapes, train_shapes


def _mean(shard, b, parts, before):
    return before[b] - 0.5 * sum(parts) / len(parts)


def test_a_later_piece_supersedes_an_earlier_one_and_the_head_names_the_one_that_counts():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    before = [f.clone() for f in shard.flats]
    wrong = torch.full((shard.buckets[0].numel,), 1e3)
    first = rule.commit_piece(0, 0, Piece(0, 0, wrong, (), seq=5))  # left during a backward another followed
    again = rule.commit_piece(0, 0, Piece(0, 0, piece_part(0, 0, shard), (), seq=9))
    assert first.wait() is None and not again.done()
    stale = rule.commit_piece(0, 0, Piece(0, 0, wrong, (), seq=7))  # came late: older than the one here
    assert stale.wait() is None
    named = (9, 10, 11, 12)
    heads = [rule.commit(0, 0, PipelineHead(pieces=named)), rule.commit(1, 0, PipelineHead())]
    for b in range(1, 4):
        rule.commit_piece(0, 0, Piece(0, b, piece_part(0, b, shard), (), seq=named[b]))
    for b in range(4):
        rule.commit_piece(1, 0, Piece(0, b, piece_part(1, b, shard), ()))
    assert [h.wait().version for h in heads] == [1, 1]
    assert torch.equal(again.wait(), _mean(shard, 0, [piece_part(0, 0, shard), piece_part(1, 0, shard)], before))


def test_a_bucket_waits_for_the_piece_its_head_names():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=1, nonfinite="raise")
    before = [f.clone() for f in shard.flats]
    rule.commit_piece(0, 0, Piece(0, 0, torch.full((shard.buckets[0].numel,), 1e3), (), seq=3))
    head = rule.commit(0, 0, PipelineHead(pieces=(4, 5, 6, 7)))
    for b in range(1, 4):
        rule.commit_piece(0, 0, Piece(0, b, piece_part(0, b, shard), (), seq=5 + b - 1))
    assert not head.done() and torch.equal(shard.flats[0], before[0])  # the piece here is not the one named
    named = rule.commit_piece(0, 0, Piece(0, 0, piece_part(0, 0, shard), (), seq=4))
    assert head.wait().version == 1 and torch.equal(named.wait(), _mean(shard, 0, [piece_part(0, 0, shard)], before))


def test_a_whole_push_voids_the_pieces_numbered_before_it():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=1, nonfinite="raise")
    before = [f.clone() for f in shard.flats]
    early = rule.commit_piece(0, 0, Piece(0, 1, torch.full((shard.buckets[1].numel,), 1e3), (), seq=3))
    grads = [piece_part(0, b, shard) for b in range(4)]
    push = rule.commit(0, 0, Push(grads, [()] * 4, seq=8))
    assert early.wait() is None and push.wait().version == 1
    late = rule.commit_piece(0, 1, Piece(0, 2, torch.full((shard.buckets[2].numel,), 1e3), (), seq=4))
    assert late.wait() is None  # left before the push, arrived after it: void, not the next step's
    assert all(torch.equal(shard.flats[b], _mean(shard, b, [grads[b]], before)) for b in range(4))


def test_pieces_left_by_a_worker_that_pushed_no_step_are_answered_when_the_step_closes():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    left = rule.commit_piece(1, 0, Piece(0, 0, piece_part(1, 0, shard), (), seq=3))
    rule.worker_joined(1)  # worker 1 ran out of data after that backward (trainer.join())
    head = rule.commit(0, 0, PipelineHead())
    for b in range(4):
        rule.commit_piece(0, 0, Piece(0, b, piece_part(0, b, shard), ()))
    assert head.wait().version == 1 and left.wait() is None


class _Window:
    """A pipeline whose window holds `room` pieces; records what was sent."""

    def __init__(self, room: int):
        self.left, self.sent = room, []

    def room(self, server):
        return self.left > 0

    def send(self, piece):
        self.left -= 1
        self.sent.append(piece)


def _streamed(room=100, quiet=lambda: False, pipeline=True):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    unused = nn.Linear(2, 2)  # an unused branch: its bucket never completes during the backward
    params = {f"{name}.{n}": p for name, m in (("net", net), ("unused", unused)) for n, p in m.named_parameters()}
    buckets = by_server(plan_buckets(ModelSpec.of(params, {}).params, 2, 40, split=True), 2)
    window = _Window(room) if pipeline else None
    grads = lambda: {p: p.grad for p in params.values() if p.grad is not None}  # noqa: E731 (the context's)
    stream = GradientStream(params, buckets, grads, lambda flat, bucket: flat, window, quiet)
    return net, params, buckets, window, stream


def _expected(params, buckets, key):
    s, b = key
    return buckets[s][b].pack([e.piece(params[e.name].grad) for e in buckets[s][b].entries])[0]


def test_a_bucket_leaves_once_the_backward_produced_all_its_entries_in_the_order_they_complete():
    net, params, buckets, window, stream = _streamed()
    order = []
    for name, p in params.items():
        p.register_hook(lambda g, name=name: order.append(name))
    net(torch.randn(5, 3)).square().sum().backward()
    sent = stream.close()
    names = lambda key: {e.name for e in buckets[key[0]][key[1]].entries}  # noqa: E731
    complete = {(s, b) for s, per in buckets.items() for b in range(len(per)) if all(
        n.startswith("net.") for n in names((s, b)))}
    last = {key for key in complete if order[-1] in names(key)}  # completed by the last hook: with the step
    assert set(sent) == complete - last and len(window.sent) == len(sent) and sent and last
    for key, piece in sent.items():
        assert piece.absent == () and torch.equal(piece.payload, _expected(params, buckets, key))
    left = [(p.server, p.bucket) for p in window.sent]
    last_layer = {k for k in complete if any(n.startswith("net.2.") for n in names(k))}
    assert set(left[:len(last_layer)]) == last_layer  # the backward produces the last layer first
    assert [p.seq for p in window.sent] == sorted(p.seq for p in window.sent)


def test_a_second_backward_makes_its_buckets_travel_with_the_step():
    net, params, buckets, window, stream = _streamed()
    net(torch.randn(5, 3)).square().sum().backward()
    net[2](torch.randn(5, 4)).sum().backward()  # adds to the last layer only
    sent = stream.close()
    assert stream.resend and all(any(e.name.startswith("net.2.") for e in buckets[s][b].entries)
                                 for s, b in stream.resend)
    assert set(sent) == {(p.server, p.bucket) for p in window.sent} - stream.resend


def test_no_sync_and_a_full_window_send_nothing_ahead():
    quiet = [True]
    net, params, buckets, window, stream = _streamed(quiet=lambda: quiet[0])
    net(torch.randn(5, 3)).square().sum().backward()
    quiet[0] = False
    net(torch.randn(5, 3)).square().sum().backward()
    assert stream.close() == {} and window.sent == []
    net, params, buckets, window, stream = _streamed(room=1)
    net(torch.randn(5, 3)).square().sum().backward()
    assert len(stream.close()) == 1 == len(window.sent)  # the rest travel with the step
    net, params, buckets, window, stream = _streamed(pipeline=False)  # watching only
    net(torch.randn(5, 3)).square().sum().backward()
    assert stream.close() == {} and not stream.resend


@pytest.mark.job
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,workers", [("sync", 2), ("async", 1), ("ssp", 1)])
def test_a_loop_whose_steps_change_shape_ends_where_single_process_training_ends(launch, mode, workers):
    """Sync at W = 2 against the joint batch; async and ssp with one worker are sync training, bit for bit."""
    steps = len(PATTERN)
    results = launch(train_shapes, strategy="ps", workers=workers, servers=2, mode=mode, args=(steps,),
                     timeout=180, bucket_cap_mb=0.0002)  # 200-byte pieces, parameters split across them
    reference = reference_shapes(steps, workers)
    taken = [shape for shape in PATTERN if shape != "skip"]
    for r in results:
        assert max_diff(r["state"], reference) <= (1e-5 if workers > 1 else 0.0)
        assert max_diff(r["state"], results[0]["state"]) == 0.0
        every = r["buckets"]
        pieces = len(r["early"][1])  # all but the last the backward completes, which goes with the step
        assert every > 4 and every - 3 <= pieces < every
        # which steps' pieces left during the backward: from the second step on, after a step that needed
        # neither a second backward, no_sync nor a GradScaler (a second backward's first hook sends the last
        # one of the first); a sync step that travelled whole (held for the GradScaler) has no lanes, an async
        # one goes as fresh pieces that supersede those
        scaled = None if mode == "sync" else pieces
        streamed = [0, pieces, every, 0, pieces, pieces, scaled, 0, pieces, 0, 0, pieces]
        assert len(r["early"]) == len(taken) == len(streamed)
        assert [None if e is None else len(e) for e in r["early"]] == streamed


def test_an_async_push_waits_on_its_server_for_the_pieces_it_names():
    shard = make_pieced_shard()
    committed = []
    staging = Staging(len(shard.buckets), lambda w, v, push: committed.append((w, v, push)) or resolved("applied"))
    part = lambda b, x: Piece(0, b, torch.full((shard.buckets[b].numel,), float(x)), (), seq=10 + b)  # noqa: E731
    early = [staging.piece(0, part(b, b)) for b in (0, 1)]
    superseded = staging.piece(0, Piece(0, 1, torch.zeros(shard.buckets[1].numel), (), seq=5))
    assert superseded.wait() is None  # older than the piece of bucket 1 already here
    head = staging.head(0, 3, PipelineHead(pieces=(10, 11, 12, 13)))
    late = staging.piece(0, part(2, 2))
    assert not head.done() and not committed
    # each piece is answered as it is kept, before its push is whole: a worker sends its later pieces only as
    # the earlier ones are answered (its window), so a piece that waited for the push would wait for itself
    assert all(f.done() and f.wait() is None for f in early + [late])
    staging.piece(1, part(3, 7))  # another worker's piece is not this one's
    last = staging.piece(0, part(3, 3))
    assert head.wait() == "applied" and last.wait() is None
    ((worker, version, push),) = committed
    assert (worker, version, push.pieces) == (0, 3, None)
    assert [p[0].item() for p in push.payloads] == [0.0, 1.0, 2.0, 3.0] and push.absent == [()] * 4
    staging.void(1, 20)  # worker 1's push came whole: its piece is void, and so is one still on its way
    assert staging.piece(1, part(3, 7)).wait() is None and not committed[1:]


@pytest.mark.timeout(60)
def test_an_async_server_refuses_a_head_that_names_no_pieces():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, requires_grad=True)}
    spec = ModelSpec.of(params, {})
    buckets = plan_buckets(spec.params, 1, 10**9)
    server = ParameterServer(0, 1, "async", "raise")
    setup = Setup.of(buckets, params, {}, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 0.1}), {}, 1)
    server.register(0, spec, setup).wait()
    with pytest.raises(Exception, match="named no piece for each of its 1 buckets"):
        server.push(0, 0, PipelineHead()).wait()
