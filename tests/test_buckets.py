"""Bucket plans: every parameter placed once, caps respected, servers balanced, views exact."""
import torch
from torch import nn

from gradsync.ps.buckets import ModelSpec, TensorSpec, assign_buffers, plan_buckets


def spec(*shapes, dtype=torch.float32):
    return tuple(TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(shapes))


def test_every_parameter_is_placed_once_in_reverse_order_within_the_cap():
    params = spec((100,), (50, 4), (10,), (300,), (7, 7))
    buckets = plan_buckets(params, num_servers=2, cap_bytes=1600)
    names = [e.name for b in buckets for e in b.entries]
    assert names == ["p4", "p3", "p2", "p1", "p0"]
    assert all(b.nbytes <= 1600 or len(b.entries) == 1 for b in buckets)
    for b in buckets:
        assert [e.offset for e in b.entries] == [sum(x.numel for x in b.entries[:i]) for i in range(len(b.entries))]


def test_servers_get_balanced_loads():
    params = spec(*[(1000,)] * 8)
    buckets = plan_buckets(params, num_servers=2, cap_bytes=10**9)
    loads = [sum(b.nbytes for b in buckets if b.server == s) for s in (0, 1)]
    assert loads == [16000, 16000]


def test_dtypes_never_share_a_bucket():
    params = spec((10,)) + (TensorSpec("h", (10,), torch.float16),) + spec((10,))
    buckets = plan_buckets(params, num_servers=1, cap_bytes=10**9)
    assert all(len({b.dtype}) == 1 for b in buckets) and len(buckets) == 3


def test_views_and_flatten_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = dict(model.named_parameters())
    (bucket,) = plan_buckets(ModelSpec.of(params, {}).params, 1, 10**9)
    flat = bucket.flatten(params)
    for name, view in bucket.views(flat).items():
        assert view.equal(params[name].detach())


def test_model_spec_difference_names_the_first_mismatch():
    a = ModelSpec.of({"w": torch.zeros(2, 3)}, {"b": torch.zeros(3)})
    assert a.difference(ModelSpec.of({"w": torch.zeros(2, 3)}, {"b": torch.zeros(3)})) is None
    assert "param 'w' is (3, 2) torch.float32, expected (2, 3)" in a.difference(
        ModelSpec.of({"w": torch.zeros(3, 2)}, {"b": torch.zeros(3)})
    )
    assert "missing ['w'], unexpected ['v']" in a.difference(ModelSpec.of({"v": torch.zeros(2, 3)}, {"b": torch.zeros(3)}))
    assert assign_buffers(spec((1,), (1,), (1,)), 2) == {"p0": 0, "p1": 1, "p2": 0}
