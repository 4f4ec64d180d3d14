"""A shard's replica in one process: the primary's step records replayed on a copy built alike leave it bit for
bit the primary, and each copy tells a step it closed already from the next one (`ps.replica`)."""
import torch

from gradsync.ps.messages import Agreement, Push
from gradsync.ps.replica import StepJournal, replay
from gradsync.ps.sync_rule import SyncRule

from shards import grads_of, make_pieced_shard

ALL = [()] * 4
"""No absent entries in any of the pieced shard's four buckets."""


def _pair():
    """(primary, replica): two shards of the same values and AdamW (four buckets, each stepped as it is averaged), the primary's closed steps replayed on the
    replica as they close; and the records sent."""
    sent = []
    primary, replica = (make_pieced_shard(torch.optim.AdamW) for _ in range(2))
    replica.journal = StepJournal(None)

    def send(record):
        sent.append(record)
        with replica.lock:
            replay(replica, record)

    primary.journal = StepJournal(send)
    return primary, replica, sent


def _grads(worker, shard, step):
    return [g * (step + 1) for g in grads_of(worker + 10 * step, shard)]


def test_a_replica_replays_every_kind_of_step_bit_for_bit():
    primary, replica, sent = _pair()
    rule = SyncRule(primary, num_workers=2, nonfinite="skip")
    held = Agreement(2.0, True)
    steps = [  # (the push's options, agreement, the workers' word on a held step)
        ({}, None, None), ({0: {"lr": 0.05}}, None, None), ({}, held, 0.5), ({}, held, None), ({}, None, None)]
    for step, (options, agree, word) in enumerate(steps):
        futures = [rule.commit(w, primary.version, Push(_grads(w, primary, step), ALL, options=options, agree=agree))
                   for w in (1, 0)]
        for f in futures:
            f.wait()
        if agree is not None:
            version = primary.version
            for w in (0, 1):
                rule.finish(w, version, word).wait()
    nonfinite = [torch.full_like(g, float("nan")) for g in grads_of(0, primary)]
    for f in [rule.commit(0, primary.version, Push(nonfinite, ALL)), rule.commit(1, primary.version,
                                                                                 Push(grads_of(1, primary), ALL))]:
        f.wait()  # skipped for the NaN
    assert primary.closed == replica.closed == 6 and primary.version == replica.version == 4
    assert len(sent) == 6 and [r.workers for r in sent] == [(0, 1)] * 6
    assert all(a.equal(b) for a, b in zip(primary.flats, replica.flats))
    mine, theirs = primary.optimizer_state(), replica.optimizer_state()
    assert mine["groups"] == theirs["groups"] and mine["groups"][0]["lr"] == 0.05
    assert all(torch.equal(v, theirs["state"][k][n]) for k, s in mine["state"].items() for n, v in s.items()
               if isinstance(v, torch.Tensor))
    assert replica.stats.steps_skipped == 2 and replica.journal.taken == {0: 6, 1: 6}


def test_a_copy_tells_a_closed_step_from_the_next():
    journal = StepJournal(None)
    for _ in range(3):
        journal.closing([0, 2], None)
        journal.closed(None)
    assert journal.took(0, 2) and not journal.took(0, 3)  # answered 2 steps: its third closed here already
    assert not journal.took(1, 0) and not journal.took(0, None)  # a worker of no step; a job without replicas
