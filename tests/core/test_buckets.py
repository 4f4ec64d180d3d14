"""Bucket plans: every element placed once, caps respected, servers balanced, views exact."""
import pytest
import torch
from torch import nn

from gradsync.core.buckets import Bucket, Entry, ModelSpec, TensorSpec, assign_tensors, may_split, plan_buckets
from helpers import placed_once


def spec(*shapes, dtype=torch.float32):
    return tuple(TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(shapes))


@pytest.mark.parametrize("split", [False, True])
def test_every_element_is_placed_once_in_reverse_order_within_the_cap(split):
    params = spec((100,), (50, 4), (10,), (300,), (7, 7))
    buckets = plan_buckets(params, num_servers=2, cap_bytes=1600, split=split)
    assert placed_once(buckets, params)
    names = list(dict.fromkeys(e.name for b in buckets for e in b.entries))
    assert names == ["p4", "p3", "p2", "p1", "p0"]
    assert all(b.nbytes <= 1600 or len(b.entries) == 1 for b in buckets)
    for b in buckets:
        assert [e.offset for e in b.entries] == [sum(x.numel for x in b.entries[:i]) for i in range(len(b.entries))]


def test_whole_plan_balances_equal_parameters():
    params = spec(*[(1000,)] * 8)
    buckets = plan_buckets(params, num_servers=2, cap_bytes=10**9)
    loads = [sum(b.nbytes for b in buckets if b.server == s) for s in (0, 1)]
    assert loads == [16000, 16000]


@pytest.mark.parametrize("servers", [2, 3, 5])
def test_split_plan_balances_one_huge_layer_to_within_one_element(servers):
    params = spec((12288 * 512,), (512,), (512 * 512,), (30 * 512,), (30,))  # the reference MLP's shapes
    buckets = plan_buckets(params, servers, cap_bytes=25 * 2**20, split=True)
    loads = [sum(b.nbytes for b in buckets if b.server == s) for s in range(servers)]
    assert max(loads) - min(loads) <= 4 * servers
    assert placed_once(buckets, params)
    unsplit = plan_buckets(params, servers, cap_bytes=25 * 2**20)  # whole parameters: one server holds p0
    assert max(sum(b.nbytes for b in unsplit if b.server == s) for s in range(servers)) >= 12288 * 512 * 4


def test_split_entries_view_and_flatten_round_trip():
    params = {"a": torch.arange(24.0).view(4, 6), "b": torch.arange(5.0)}
    specs = ModelSpec.of({n: t.requires_grad_() for n, t in params.items()}, {}).params
    buckets = plan_buckets(specs, 3, 10**9, split=True)
    rebuilt = {n: torch.zeros(t.numel()) for n, t in params.items()}
    for b in buckets:
        flat = b.flatten(params)
        for e in b.entries:
            assert e.view(flat).shape == e.view_shape
            rebuilt[e.name][e.start : e.start + e.numel] = e.view(flat).reshape(-1)
            assert e.key == e.name if e.whole else e.key == f"{e.name}[{e.start}:{e.start + e.numel}]"
    assert all(rebuilt[n].equal(t.detach().reshape(-1)) for n, t in params.items())
    assert any(not e.whole for b in buckets for e in b.entries)


def test_dtypes_never_share_a_bucket():
    params = spec((10,)) + (TensorSpec("h", (10,), torch.float16),) + spec((10,))
    for split in (False, True):
        buckets = plan_buckets(params, num_servers=1, cap_bytes=10**9, split=split)
        assert len(buckets) == 3


def test_views_and_flatten_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = dict(model.named_parameters())
    (bucket,) = plan_buckets(ModelSpec.of(params, {}).params, 1, 10**9)
    flat = bucket.flatten(params)
    for name, view in bucket.views(flat).items():
        assert view.equal(params[name].detach())


def test_frozen_parameters_are_apart_from_trainable_ones():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    spec_ = ModelSpec.of(dict(model.named_parameters()), {})
    assert [t.name for t in spec_.params] == ["1.weight", "1.bias"]
    assert [t.name for t in spec_.frozen] == ["0.weight", "0.bias"]
    model[0].weight.requires_grad_(True)
    other = ModelSpec.of(dict(model.named_parameters()), {})
    assert "trainable params differ by name: missing [], unexpected ['0.weight']" in spec_.difference(other)


def test_only_elementwise_optimizers_may_split():
    assert may_split(torch.optim.SGD) and may_split(torch.optim.Adam) and may_split(torch.optim.Adagrad)
    assert not may_split(torch.optim.Adafactor) and not may_split(type("MySGD", (torch.optim.SGD,), {}))


def test_model_spec_difference_names_the_first_mismatch():
    a = ModelSpec.of({"w": torch.zeros(2, 3, requires_grad=True)}, {"b": torch.zeros(3)})
    same = ModelSpec.of({"w": torch.zeros(2, 3, requires_grad=True)}, {"b": torch.zeros(3)})
    assert a.difference(same) is None
    assert "param 'w' is (3, 2) torch.float32, expected (2, 3)" in a.difference(
        ModelSpec.of({"w": torch.zeros(3, 2, requires_grad=True)}, {"b": torch.zeros(3)})
    )
    assert "missing ['w'], unexpected ['v']" in a.difference(
        ModelSpec.of({"v": torch.zeros(2, 3, requires_grad=True)}, {"b": torch.zeros(3)})
    )


def test_buffers_and_frozen_tensors_go_to_the_least_loaded_server():
    assert assign_tensors(spec((1,), (1,), (1,)), 2) == {"p0": 0, "p1": 1, "p2": 0}
    assert assign_tensors(spec((100,), (60,), (50,)), 2) == {"p0": 0, "p1": 1, "p2": 1}


def test_a_packed_piece_of_a_larger_gradient_owns_its_storage():
    """torch RPC sends a view's storage up to the view's end: the second half of a split gradient must not
    carry the first half with it."""
    entry = Entry("w", (4, 5), 0, 10, start=10)
    bucket = Bucket(0, 1, torch.float32, (entry,))
    grad = torch.arange(20.0).view(4, 5)
    flat, absent = bucket.pack([entry.piece(grad)])
    assert absent == () and torch.equal(flat, torch.arange(10.0, 20.0))
    assert flat.untyped_storage().nbytes() == flat.nbytes
