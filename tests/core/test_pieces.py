"""The piece plan: large parameters cut into pieces no larger than the cap, every element in exactly one
piece, and the order a worker sends them in (the forward's, interleaved across servers)."""
import math

import pytest
import torch

from gradsync.core.buckets import TensorSpec, forward_order, plan_buckets

from helpers import placed_once


def mlp(*sizes):
    """Weights and biases of an MLP, in registration order."""
    out = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        out += [TensorSpec(f"{i}.weight", (b, a), torch.float32), TensorSpec(f"{i}.bias", (b,), torch.float32)]
    return tuple(out)


@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("cap", [4096, 100_000, 1 << 20])
def test_every_element_in_exactly_one_piece_and_no_piece_over_the_cap(servers, cap):
    params = mlp(3000, 128, 128, 30)
    buckets = plan_buckets(params, servers, cap, split=True)
    assert placed_once(buckets, params)
    assert all(b.nbytes <= cap for b in buckets)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert sum(any(e.name == "0.weight" for e in b.entries) for b in buckets) >= math.ceil(3000 * 128 * 4 / cap)


def test_pieces_smaller_than_a_parameter_keep_their_server_and_element_order():
    params = mlp(1000, 64, 10)
    buckets = plan_buckets(params, 1, 10_000, split=True)
    pieces = [b.entries[0] for b in buckets if b.entries[0].name == "0.weight"]
    assert [p.start for p in pieces] == sorted(p.start for p in pieces)
    assert all(p.offset == 0 and not p.whole for p in pieces)


def test_whole_parameters_when_the_optimizer_may_not_see_pieces():
    params = mlp(3000, 128, 30)
    buckets = plan_buckets(params, 2, 4096, split=False)
    assert all(e.whole for b in buckets for e in b.entries)


def test_the_forward_order_sends_the_first_layer_first():
    params = mlp(2000, 64, 64, 10)
    buckets = plan_buckets(params, 1, 50_000, split=True)
    order = forward_order(buckets)
    assert sorted(b.index for b in order) == [b.index for b in buckets]
    position = {p.name: i for i, p in enumerate(params)}
    needed = [min(position[e.name] for e in b.entries) for b in order]  # when the forward first needs each
    assert needed == sorted(needed) and needed[0] == 0


def test_the_forward_order_interleaves_the_servers():
    params = mlp(4000, 64, 10)
    buckets = plan_buckets(params, 2, 64_000, split=True)
    order = forward_order(buckets)
    sent = {0: 0, 1: 0}
    total = {s: sum(b.nbytes for b in buckets if b.server == s) for s in sent}
    for b in order:  # neither server's share runs ahead of the other's by more than one piece
        sent[b.server] += b.nbytes
        assert abs(sent[0] / total[0] - sent[1] / total[1]) <= max(b.nbytes for b in buckets) / min(total.values())
