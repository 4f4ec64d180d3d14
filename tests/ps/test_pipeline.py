"""The pipelined sync step: a server applies a piece once every worker's part of it is in and answers it
at once, while later pieces are still on their way (checked by events, never by timings); a step whose
pieces are smaller than a parameter ends where single-process training ends."""
from types import SimpleNamespace

import pytest
import torch

import gradsync
from gradsync.core.errors import GradientError
from gradsync.transport.base import window
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Piece, PipelineHead, Push
from jobs import reference_mlp, train_mlp
from shards import make_pieced_shard, piece_part
from helpers import max_diff


def test_the_plan_cuts_the_parameters_into_pieces():
    shard = make_pieced_shard()
    assert len(shard.buckets) == 4 and all(b.numel <= 8 for b in shard.buckets)


def test_a_piece_is_applied_and_answered_before_the_next_pieces_pushes_are_all_in():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    before = [f.clone() for f in shard.flats]
    heads = [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    pieces = {(w, b): rule.commit_piece(w, 0, Piece(0, b, piece_part(w, b, shard), ())) for w in (0, 1) for b in (0, 1)}
    # worker 1's part of piece 2 not yet in
    pieces[(0, 2)] = rule.commit_piece(0, 0, Piece(0, 2, piece_part(0, 2, shard), ()))
    for b in (0, 1):
        expected = before[b] - 0.5 * (piece_part(0, b, shard) + piece_part(1, b, shard)) / 2
        assert pieces[(0, b)].done() and pieces[(1, b)].done()
        assert torch.equal(pieces[(0, b)].wait(), expected) and torch.equal(shard.flats[b], expected)
    assert not pieces[(0, 2)].done() and torch.equal(shard.flats[2], before[2])
    assert not any(h.done() for h in heads) and shard.version == 0  # the step is not over
    rule.commit_piece(1, 0, Piece(0, 2, piece_part(1, 2, shard), ()))
    assert pieces[(0, 2)].done() and not any(h.done() for h in heads)
    last = [rule.commit_piece(w, 0, Piece(0, 3, piece_part(w, 3, shard), ())) for w in (0, 1)]
    assert [h.wait().version for h in heads] == [1, 1] and all(f.done() for f in last) and shard.version == 1


def test_pieces_are_held_for_the_whole_step_when_a_nan_must_skip_it():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="skip")
    before = [f.clone() for f in shard.flats]
    heads = [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    first = [rule.commit_piece(w, 0, Piece(0, 0, piece_part(w, 0, shard), ())) for w in (0, 1)]
    assert not any(f.done() for f in first)  # not applied early: a later piece may still skip the step
    bad = piece_part(1, 1, shard)
    bad[3] = float("nan")
    for b in (1, 2, 3):
        for w in (0, 1):
            rule.commit_piece(w, 0, Piece(0, b, bad if (w, b) == (1, 1) else piece_part(w, b, shard), ()))
    assert [h.wait().version for h in heads] == [0, 0] and shard.stats.steps_skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(shard.flats, before))
    assert torch.equal(first[0].wait(), before[0])


def test_a_nan_piece_names_the_parameter_and_the_worker():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    heads = [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    bad = piece_part(1, 3, shard)
    bad[0] = float("inf")
    rule.commit_piece(0, 0, Piece(0, 3, piece_part(0, 3, shard), ()))
    with pytest.raises(GradientError, match=r"'w'.*worker 1|worker 1.*'w'"):
        rule.commit_piece(1, 0, Piece(0, 3, bad, ())).wait()
    with pytest.raises(GradientError):
        heads[0].wait()


def test_a_piece_sent_twice_is_refused():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    rule.commit(0, 0, PipelineHead())
    rule.commit_piece(0, 0, Piece(0, 1, piece_part(0, 1, shard), ()))
    with pytest.raises(GradientError, match="worker 0 sent bucket 1 twice"):
        rule.commit_piece(0, 0, Piece(0, 1, piece_part(0, 1, shard), ())).wait()


@pytest.mark.job
@pytest.mark.timeout(180)
@pytest.mark.parametrize("servers", [1, 2])
def test_pieces_smaller_than_a_parameter_match_single_process_training(launch, servers):
    states = launch(train_mlp, strategy="ps", workers=2, servers=servers, args=(10,), timeout=170,
                    bucket_cap_mb=0.001)  # 1 KB pieces: every weight in several
    reference = reference_mlp(10, 2)
    for state in states:
        assert max_diff(state, reference) <= 1e-5


def test_pieces_answered_at_the_steps_end_are_never_held_back_by_a_window():
    buckets = {0: [SimpleNamespace(nbytes=2**20) for _ in range(7)], 1: [SimpleNamespace(nbytes=2**20)]}
    assert window(buckets, workers=2) == 2  # answered as they are applied: two pieces in flight suffice
    assert window(buckets, workers=2, early=False) == 7  # answered once the last is in: all of them


@pytest.mark.job
@pytest.mark.timeout(120)
def test_a_step_that_a_nan_may_skip_goes_as_more_pieces_than_a_window(launch):
    states = launch(train_mlp, strategy="ps", workers=2, servers=1, args=(4, 0.1, 0.9, 512), timeout=100,
                    bucket_cap_mb=0.25, nonfinite="skip", step_timeout=20)  # 1 MB: 5 pieces, held to the step's end
    reference = reference_mlp(4, 2, hidden=512)
    assert all(max_diff(state, reference) <= 1e-5 for state in states)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["frozen", "unused", "one_worker", "adam_unused", "tied"])
def test_edge_models_with_pieces_smaller_than_a_parameter_match_single_process(launch, case):
    """Frozen and unused parameters, a branch one worker never takes, Adam, tied weights: every piece of a
    parameter without a gradient is still told to its server, which leaves it alone."""
    from edge_models import check_parity, train_edge

    steps = 10
    states = launch(train_edge, strategy="ps", workers=2, servers=2, args=(case, steps), step_timeout=30,
                    timeout=100, bucket_cap_mb=0.0005)  # 512-byte pieces
    check_parity(case, states, 2, steps)


def test_a_replaced_workers_parts_of_the_step_in_flight_are_forgotten_and_the_closed_step_kept():
    shard = make_pieced_shard()
    shard.keep_before = True
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    start = [f.clone() for f in shard.flats]
    heads = [rule.commit(w, 0, PipelineHead()) for w in (0, 1)]
    for w in (0, 1):  # bucket 0 applied with both; worker 1 dies having sent bucket 1 too
        rule.commit_piece(w, 0, Piece(0, 0, piece_part(w, 0, shard), (), seq=5))
    rule.commit_piece(1, 0, Piece(0, 1, piece_part(1, 1, shard), (), seq=6))
    closed, begun, before, partial, options = rule.worker_restarted(1)
    assert (closed, begun, before, partial) == (0, None, None, None) and options[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="worker 1 died"):
        heads[1].wait()
    # its replacement's first step goes whole (`PSStrategy._push_rejoined`): bucket 0 counts once
    heads[1] = rule.commit(1, 0, Push([piece_part(1, b, shard) for b in range(4)], [()] * 4))
    others = [rule.commit_piece(0, 0, Piece(0, b, piece_part(0, b, shard), ())) for b in (1, 2, 3)]
    assert [h.wait().version for h in heads] == [1, 1] and all(f.done() for f in others)
    expected = [s - 0.5 * (piece_part(0, b, shard) + piece_part(1, b, shard)) / 2 for b, s in enumerate(start)]
    assert all(torch.equal(f, e) for f, e in zip(shard.flats, expected))  # each bucket once, both workers' parts
    closed, begun, before, _, _ = rule.worker_restarted(0)
    assert closed == 1 and begun is None and all(torch.equal(a, b) for a, b in zip(before.flats, start))


def test_a_shard_keeps_the_options_its_step_began_with_for_a_replacement():
    """A schedule's change applied in the step in flight: a replacement's first push changes the options from
    those the step began with, as every worker's push does (`ShardState.began_options`)."""
    shard = make_pieced_shard()
    shard.keep_before = True
    assert shard.began_options()[0]["lr"] == 0.5
    shard.set_options({0: {"lr": 0.25}})  # the step in flight's push changed the lr
    assert shard.began_options()[0]["lr"] == 0.5 and shard.optimizer.param_groups[0]["lr"] == 0.25
    shard.skipped_step()  # the step closes
    assert shard.before_options[0]["lr"] == 0.5 and shard.began_options()[0]["lr"] == 0.25


def test_with_drop_a_dead_workers_part_leaves_the_step_which_averages_the_others():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=3, nonfinite="raise", drop=True)
    start = [f.clone() for f in shard.flats]
    heads = {w: rule.commit(w, 0, PipelineHead()) for w in (0, 1, 2)}
    parts = {(w, b): rule.commit_piece(w, 0, Piece(0, b, piece_part(w, b, shard), ())) for w in (0, 2) for b in range(4)}
    rule.commit_piece(1, 0, Piece(0, 0, piece_part(1, 0, shard), ()))  # worker 1's first piece, then it dies
    assert not any(f.done() for f in parts.values())  # under drop nothing is applied before the step closes
    rule.worker_left(1, None)
    assert heads[0].wait().version == heads[2].wait().version == 1 and shard.stats.steps_without == {0: [1]}
    expected = [s - 0.5 * (piece_part(0, b, shard) + piece_part(2, b, shard)) / 2 for b, s in enumerate(start)]
    assert all(torch.equal(f, e) for f, e in zip(shard.flats, expected))
    with pytest.raises(GradientError, match="worker 1 left the job"):
        rule.commit(1, 1, PipelineHead()).wait()


def test_with_drop_a_replacement_joins_at_the_step_every_server_takes_it_at():
    shard = make_pieced_shard()
    rule = SyncRule(shard, num_workers=3, nonfinite="raise", drop=True)

    def push(workers, seq=0):
        heads = {w: rule.commit(w, shard.version, PipelineHead()) for w in workers}
        for w in workers:
            for b in range(4):
                rule.commit_piece(w, shard.version, Piece(0, b, piece_part(w, b, shard), (), seq))
        return heads

    rule.commit_piece(1, 0, Piece(0, 0, piece_part(1, 0, shard), (), 7))  # numbered 7, then its process died
    rule.worker_left(1, None)
    assert rule.readmit(1, 2, 1) == (False, -1)  # a second death this server has not heard of
    push((0, 2))
    assert rule.readmit(1, 1, 0) == (False, 1)  # step 0 is closed here: the replacement asks from a later one
    assert rule.readmit(1, 1, 2) == (True, 1)  # taken from step 2 on; step 1 still goes without it
    assert shard.stats.workers_replaced == {1: 1}  # in gradsync status
    assert all(h.done() for h in push((0, 2)).values())
    assert rule.readmit(1, 1, 2) == (True, 2)  # step 2 has begun: it waits for the replacement
    start = [f.clone() for f in shard.flats]
    heads = push((0, 2))
    assert not any(h.done() for h in heads.values())
    heads |= push((1,), seq=1)  # the replacement numbers its pieces from the start
    assert all(h.done() for h in heads.values()) and all(h.wait().version == 3 for h in heads.values()) and sorted(shard.stats.steps_without) == [0, 1]
    expected = [s - 0.5 * sum(piece_part(w, b, shard) for w in range(3)) / 3 for b, s in enumerate(start)]
    assert all(torch.equal(f, e) for f, e in zip(shard.flats, expected))  # the mean over all three again
    heads = push((0, 2))
    assert rule.readmit(1, 1, 4) == (True, 3)  # moved to step 4 (another server had closed 3): 3 goes without it
    assert all(h.done() for h in heads.values()) and shard.stats.steps_without[3] == [1]
    rule.worker_left(1, None)  # the replacement died before step 4: the servers no longer wait for it
    assert rule.readmit(1, 1, 4) == (False, -1)  # the process that asked is dead
    assert all(h.done() for h in push((0, 2)).values()) and shard.stats.steps_without[4] == [1]
