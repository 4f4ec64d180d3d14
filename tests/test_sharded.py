"""The sharded strategy matches single-process training on the joint batch (an EmbeddingBag with offsets and
an Embedding under row optimizers, dense layers under AdamW), on uneven batches (a worker with no id of some
owner, one with no bag id at all); the trainer's and the user's module's state_dict hold the whole tables; an
id out of a table is refused by every worker with one error and nothing applied. Each all-to-all is a lane of
the step timeline carrying the bytes the batches imply, and its time is the step's exchange, not its pull."""
import pytest
import torch

import gradsync
from gradsync.tables.row_partition import owners
from helpers import check_timeline_order, max_diff
from sharded_models import DIM, ROWS_EMB, BagNet, bag_batch, reference_bags, train_bags

pytestmark = pytest.mark.job  # every test here starts processes

STEPS, BAD_AT = 6, 3
INT64, FP32 = 8, 4


def _exchanges(step: int, me: int, workers: int) -> list[tuple[str, int, int]]:
    """Worker `me`'s all-to-alls of `step` (lane, bytes to the other workers, bytes from them), from the
    batches: per table the counts, then the ids of its batch that other workers own and their rows back; at
    the step one exchange of flags, then per table the gradients of those rows (no ids: the forward's route)."""
    batches = [bag_batch(step, w) for w in range(workers)]
    meta = 4 * INT64 * (workers - 1)
    forward, backward = [], [("a2a grad flags", meta, meta)]
    for name, at in (("bag.weight", 0), ("emb.weight", 2)):
        unique = [b[at].unique() for b in batches]
        out = int((owners(unique[me], workers) != me).sum())
        into = sum(int((owners(unique[w], workers) == me).sum()) for w in range(workers) if w != me)
        forward += [(f"a2a {name} counts", meta, meta), (f"a2a {name} ids", INT64 * out, INT64 * into),
                    (f"a2a {name} rows", DIM * FP32 * into, DIM * FP32 * out)]
        backward.append((f"a2a {name} grads", DIM * FP32 * out, DIM * FP32 * into))
    return forward + backward


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,optimizer,max_norm,tolerance", [(2, "sgd", None, 1e-5), (4, "adagrad", 0.5, 1e-5)])
def test_sharded_tables_match_single_process(workers, optimizer, max_norm, tolerance):
    results = gradsync.launch(train_bags, strategy="sharded", workers=workers,
                              args=(optimizer, STEPS, max_norm, BAD_AT), step_timeout=60, timeout=140)
    reference = reference_bags(optimizer, STEPS, workers, max_norm)
    start = BagNet().state_dict()
    for me, r in enumerate(results):
        for record, timed in zip(r["records"], r["timeline"]):
            if timed["step"] - 1 == BAD_AT:  # the refused lookup's exchanges count in that step too
                continue
            pieces = timed["pieces"]
            lanes = [(p["lane"], p["bytes_sent"], p["bytes_received"]) for p in pieces if p["exchange"]]
            assert lanes == _exchanges(timed["step"] - 1, me, workers)
            assert sum(p["bytes_sent"] for p in pieces) == record["bytes_sent"]  # with DDP's bucket lanes
            assert sum(p["bytes_received"] for p in pieces) == record["bytes_received"]
            assert record["pull_s"] == 0 < record["exchange_s"]  # its own column: neither pull nor compute
            check_timeline_order(pieces)
        assert list(r["state"]) == list(reference) == list(r["module"])  # keyed as model.state_dict()
        assert max_diff(r["state"], reference) <= tolerance
        assert max_diff(r["module"], reference) <= tolerance  # the user's module gathers the whole tables
        assert r["refused"] == (f"table 'emb.weight' has rows 0..{ROWS_EMB - 1}, but a batch looked up id "
                                f"{ROWS_EMB + 3} on worker 1: fix the input ids (nothing was looked up or applied)")
        assert r["unchanged"]
        assert r["sizes"]["sharded_tables"] == 2
    for key in ("bag.weight", "emb.weight", "mlp.0.weight"):
        assert (results[0]["state"][key] - start[key]).abs().max() > 1e-3  # it trained
    if max_norm is not None:  # the clipping bit: without it the reference lands elsewhere
        assert max_diff(reference_bags(optimizer, STEPS, workers, None), reference) > 1e-3
