"""Allreduce with sparse table gradients (`nn.Embedding(..., sparse=True)`: DDP exchanges only the touched
rows) matches single-process training, with SGD and with torch's Adagrad, and examples/ctr.py's
`--sparse-grad` runs it. This is the baseline bench/sparse.py measures ps and hybrid against."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import gradsync
from sparse_models import (DIM, LR, ROWS_BAG, ROWS_EMB, TABLES, ClickNet, click_batch, click_loop, reference_clicks,
                           train_clicks)
from helpers import ROOT, max_diff, run_cli

pytestmark = pytest.mark.job  # every test here starts processes

STEPS = 10


def train_sparse_adagrad(steps: int) -> tuple[dict, list[bool], list[int]]:
    """torch's Adagrad over the whole model, tables with sparse gradients; returns the final state,
    whether each table's averaged gradient reached the optimizer sparse, and the bytes sent at each step."""
    trainer = gradsync.Trainer(ClickNet(sparse=True), torch.optim.Adagrad, lr=LR)
    click_loop(trainer, steps)
    module = trainer.model.module
    sent = [r.bytes_sent for r in trainer.metrics.records]
    assert trainer._strategy.model_sizes(1000) == {"dense": 1000 - (ROWS_BAG + ROWS_EMB) * DIM,
                                                    "tables": (ROWS_BAG + ROWS_EMB) * DIM, "sparse_tables": 2,
                                                    "dense_tables": 0}
    return trainer.state_dict(), [module.bag.weight.grad.is_sparse, module.emb.weight.grad.is_sparse], sent


def expected_bytes(step: int, worker: int, workers: int) -> int:
    """A worker's bytes of one step: the ring's 2 (W-1)/W of the dense fp32 gradients, and its distinct
    rows (4-byte values, one 8-byte index each; the padding row has no gradient) to each of W-1 peers."""
    bag, ids, _, _ = click_batch(step, worker)
    rows = bag.unique().numel() + ids[ids != 0].unique().numel()
    dense = sum(p.numel() for p in ClickNet().mlp.parameters())
    return int(2 * (workers - 1) / workers * 4 * dense) + (workers - 1) * rows * (4 * DIM + 8)


def reference_adagrad(steps: int, workers: int) -> dict:
    """Single process, dense gradients, torch's Adagrad, on the workers' batches joined (the same math:
    a row with a zero gradient does not move under either form)."""
    model = ClickNet()
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    for step in range(steps):
        bag, ids, x, y = (torch.cat(t) for t in zip(*(click_batch(step, w) for w in range(workers))))
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(bag, ids, x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 4])
def test_sparse_allreduce_sgd_matches_single_process(launch, workers):
    states = launch(train_clicks, strategy="allreduce", workers=workers, args=("sgd", STEPS, True),
                    step_timeout=60, timeout=280)
    reference = reference_clicks("sgd", STEPS, workers)
    start = ClickNet().state_dict()
    for state in states:
        assert max_diff(state, reference) <= 1e-5
    for key in TABLES:
        assert (states[0][key] - start[key]).abs().max() > 1e-4  # the tables trained


@pytest.mark.timeout(300)
def test_sparse_allreduce_adagrad_matches_single_process_with_sparse_gradients(launch):
    results = launch(train_sparse_adagrad, strategy="allreduce", workers=2, args=(STEPS,),
                     step_timeout=60, timeout=280)
    reference = reference_adagrad(STEPS, 2)
    for worker, (state, sparse, sent) in enumerate(results):
        assert max_diff(state, reference) <= 1e-5
        assert sparse == [True, True]  # DDP handed the optimizer sparse gradients: only touched rows
        assert sent == [expected_bytes(step, worker, 2) for step in range(STEPS)]  # rows counted, not tables


@pytest.mark.timeout(300)
def test_ctr_sparse_grad_flag_runs_under_allreduce(tmp_path):
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", "--run-dir", str(tmp_path),
                   os.path.join(ROOT, "examples", "ctr.py"), "--sparse-grad", "--fields", "2", "--rows", "2000",
                   "--steps", "20", "--test-size", "2000", timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"AUC [\d.]+ \(planted model: [\d.]+\)", done.stdout), done.stdout
