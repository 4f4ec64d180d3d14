"""Compressed pushes: PS training with fp16/bf16/int8 gradients stays close to exact training."""
import pytest
import torch

import gradsync
from gradsync.cuda_ops import compress_int8
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Push
from gradsync.core.errors import GradientError
from gradsync.ps.gradient_codecs import make_wire
from jobs import reference_mlp, train_mlp_with_metrics
from shards import ALL, grads_of, make_shard
from helpers import max_diff

STEPS = 20
# per-element error after 20 SGD-momentum steps of the test MLP: fp16 keeps 11 bits, bf16 8, int8 7 per block
TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2, "int8": 1e-2}


@pytest.mark.job
@pytest.mark.timeout(240)
def test_compressed_ps_training_tracks_exact_training_and_sends_fewer_bytes(launch):
    reference = reference_mlp(STEPS, 2)
    exact_state, exact = launch(train_mlp_with_metrics, strategy="ps", workers=2, servers=2,
                                args=(STEPS,), timeout=120)[0]
    assert max_diff(exact_state, reference) <= 1e-5
    param_bytes = sum(t.nbytes for t in reference.values())
    assert exact["bytes_sent"] == param_bytes
    for compression, tolerance in TOLERANCE.items():
        state, metrics = launch(train_mlp_with_metrics, strategy="ps", workers=2, servers=2,
                                args=(STEPS,), compression=compression, timeout=120)[0]
        assert 0 < max_diff(state, reference) <= tolerance, compression
        expected = param_bytes // 2 if compression != "int8" else param_bytes // 4  # + one fp32 scale per block
        assert expected <= metrics["bytes_sent"] < expected + param_bytes // 8, (compression, metrics)


def test_int8_push_of_the_wrong_shape_is_refused_and_changes_nothing():
    shard, _ = make_shard()
    wire = make_wire("int8")
    before = [f.clone() for f in shard.flats]
    good = [wire.encode(g, i) for i, g in enumerate(grads_of(0, shard))]
    bad_scales = [good[0]._replace(scales=good[0].scales[:-1])] + good[1:]
    bad_block = [compress_int8(grads_of(0, shard)[0], None, 64)] + good[1:]
    rule = SyncRule(shard, 2, "raise")
    with pytest.raises(GradientError, match="int8 scales of bucket 0"):
        rule.commit(0, 0, Push(bad_scales, ALL), wire).wait()
    with pytest.raises(GradientError, match="not int8 with block size 256"):
        rule.commit(0, 0, Push(bad_block, ALL), wire).wait()
    with pytest.raises(GradientError, match="is not|expected"):
        rule.commit(0, 0, Push(grads_of(0, shard), ALL), wire).wait()  # plain tensors where int8 is expected
    assert all(a.equal(b) for a, b in zip(before, shard.flats)) and shard.stats.pushes_rejected == 3


def test_int8_mean_is_the_mean_of_the_decoded_pushes_and_nan_is_named():
    shard, _ = make_shard()
    wire = make_wire("int8")
    pushes = [[wire.encode(g, 100 * w + i) for i, g in enumerate(grads_of(w, shard))] for w in range(2)]
    rule = SyncRule(shard, 2, "raise")
    reference, _ = make_shard()
    expected = [(wire.decode(a, torch.float32) + wire.decode(b, torch.float32)) / 2 for a, b in zip(*pushes)]
    futures = [rule.commit(w, 0, Push(pushes[w], ALL), wire) for w in range(2)]
    assert [f.wait().version for f in futures] == [1, 1]
    reference.apply(expected, [set()] * len(expected), {})
    for a, b in zip(shard.flats, reference.flats):
        assert torch.allclose(a, b, rtol=0, atol=1e-3)
    nan = grads_of(0, shard)
    nan[0][5] = float("nan")
    bad = rule.commit(0, 1, Push([wire.encode(g, 999 + i) for i, g in enumerate(nan)], ALL), wire)
    good = rule.commit(1, 1, Push([wire.encode(g, 99 + i) for i, g in enumerate(grads_of(1, shard))], ALL), wire)
    for fut in (bad, good):  # the mean is checked once all W arrived: every worker learns who sent NaN
        with pytest.raises(GradientError, match=r"parameter '\w+' from worker 0"):
            fut.wait()
