"""The sharded strategy matches single-process training on the joint batch (an EmbeddingBag with offsets and
an Embedding under row optimizers, dense layers under AdamW), on uneven batches (a worker with no id of some
owner, one with no bag id at all); the trainer's and the user's module's state_dict hold the whole tables; an
id out of a table is refused by every worker with one error and nothing applied."""
import pytest
import torch

import gradsync
from helpers import max_diff
from sharded_models import ROWS_EMB, BagNet, bag_batch, reference_bags, train_bags

pytestmark = pytest.mark.job  # every test here starts processes

STEPS, BAD_AT = 6, 3


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,optimizer,max_norm,tolerance", [(2, "sgd", None, 1e-5), (4, "adagrad", 0.5, 1e-5)])
def test_sharded_tables_match_single_process(workers, optimizer, max_norm, tolerance):
    results = gradsync.launch(train_bags, strategy="sharded", workers=workers,
                              args=(optimizer, STEPS, max_norm, BAD_AT), step_timeout=60, timeout=140)
    reference = reference_bags(optimizer, STEPS, workers, max_norm)
    start = BagNet().state_dict()
    for r in results:
        assert list(r["state"]) == list(reference) == list(r["module"])  # keyed as model.state_dict()
        assert max_diff(r["state"], reference) <= tolerance
        assert max_diff(r["module"], reference) <= tolerance  # the user's module gathers the whole tables
        assert r["refused"] == (f"table 'emb.weight' has rows 0..{ROWS_EMB - 1}, but a batch looked up id "
                                f"{ROWS_EMB + 3} on worker 1: fix the input ids (nothing was looked up or applied)")
        assert r["unchanged"]
        assert r["sizes"]["sharded_tables"] == 2
    trained = BagNet()
    trained.load_state_dict(reference)
    with torch.no_grad():
        expected = trained(*bag_batch(STEPS, 0)[:4])
    assert (results[0]["evaluated"] - expected).abs().max() <= 10 * tolerance  # evaluation on worker 0 alone
    for key in ("bag.weight", "emb.weight", "mlp.0.weight"):
        assert (results[0]["state"][key] - start[key]).abs().max() > 1e-3  # it trained
    if max_norm is not None:  # the clipping bit: without it the reference lands elsewhere
        assert max_diff(reference_bags(optimizer, STEPS, workers, None), reference) > 1e-3
