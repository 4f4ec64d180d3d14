"""examples/charlm.py, tiny config: trained under gradsync (ps and allreduce, two workers) it ends where
single-process training on the joint batch ends, within the float noise of that training itself, and it
learns."""
import dataclasses
import os
import statistics
import sys

import pytest

import gradsync
from helpers import ROOT, max_diff
from real_loops import noise_bound

sys.path.insert(0, os.path.join(ROOT, "examples"))
import charlm  # noqa: E402

WORKERS = 2


@pytest.fixture(scope="module")
def reference():
    """Single-process training on the joint batch, and the noise of AdamW there: the largest parameter
    difference from the same training with the joint loss computed as the mean of per-worker losses."""
    joint = charlm.train_reference(charlm.TINY, WORKERS)
    per_worker = charlm.train_reference(charlm.TINY, WORKERS, per_worker_losses=True)
    return joint, max_diff(joint["state"], per_worker["state"])


def test_the_tiny_model_learns_and_clipping_bites(reference):
    joint, noise = reference
    losses, steps = joint["losses"], charlm.TINY.steps_per_epoch
    assert statistics.fmean(losses[-steps:]) < statistics.fmean(losses[:steps]) - 0.1
    assert joint["val_losses"][-1] < joint["val_losses"][0] - 0.05
    assert sum(n > 1.0 for n in joint["norms"]) >= len(joint["norms"]) // 2  # clipping at 1.0 changes steps
    assert 0 < noise < 1e-4
    untrained = charlm.make_model(charlm.TINY, len(charlm.Corpus().chars)).state_dict()
    assert max_diff(untrained, joint["state"]) > 100 * noise_bound(noise)  # the bound below tells training apart


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers", [("ps", 2), ("allreduce", 0)])
def test_gradsync_matches_single_process_training_on_the_joint_batch(launch, strategy, servers, reference):
    joint, noise = reference
    results = launch(charlm.train, strategy=strategy, workers=WORKERS, servers=servers,
                     args=(charlm.TINY,), timeout=280)
    for r in results:
        assert list(r["state"]) == list(joint["state"])
        assert max_diff(r["state"], joint["state"]) <= noise_bound(noise)
        assert r["norms"] == pytest.approx(joint["norms"], rel=1e-5)  # the joint norm, before clipping
        assert r["val_losses"] == pytest.approx(joint["val_losses"], abs=1e-5)  # evaluated on the user's module
        assert r["val_losses"][-1] < r["val_losses"][0] - 0.05
    assert max_diff(results[0]["state"], results[1]["state"]) == 0.0
    # each worker's loss is over its own slice; their mean is the joint batch's loss
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(joint["losses"], abs=1e-5)


@pytest.mark.job
@pytest.mark.timeout(300)
def test_with_row_tables_hybrid_trains_what_ps_trains(launch, reference):
    """--row-tables serves both embeddings with RowAdagrad (no single-process form), which hybrid needs:
    hybrid (the rest in DDP) and ps (the rest on the servers) then compute the same steps."""
    joint, noise = reference
    rows = dataclasses.replace(charlm.TINY, row_tables=True)
    hybrid = launch(charlm.train, strategy="hybrid", workers=WORKERS, servers=2, args=(rows,), timeout=280)
    ps = launch(charlm.train, strategy="ps", workers=WORKERS, servers=2, args=(rows,), timeout=280)
    for h, p in zip(hybrid, ps):
        assert max_diff(h["state"], p["state"]) <= noise_bound(noise)
        assert h["norms"] == pytest.approx(p["norms"], rel=1e-5)
        assert h["val_losses"][-1] < h["val_losses"][0] - 0.05
        assert max_diff(h["state"], joint["state"]) > 100 * noise_bound(noise)  # the tables had RowAdagrad, not AdamW
