"""Clipping computed in parts (as servers that each hold a part of the gradient compute it) against
torch.nn.utils.clip_grad_norm_ on the whole."""
import math

import pytest
import torch

from gradsync.core.clipping import Clipping


def grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g) * 10, torch.randn(2, 2, generator=g)]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_the_norm_in_parts_and_its_coefficient_are_torchs(norm_type):
    mine, theirs = grads(), [torch.nn.Parameter(torch.zeros_like(g)) for g in grads()]
    for p, g in zip(theirs, grads()):
        p.grad = g.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type))
    clipping = Clipping(1.5, norm_type)
    total = clipping.total([clipping.partial(mine[:1]), clipping.partial(mine[1:])])  # two servers' parts
    assert total == pytest.approx(expected, rel=1e-6)
    coefficient = clipping.coefficient(total)
    assert coefficient < 1.0
    for g, p in zip(mine, theirs):
        torch.testing.assert_close(g * coefficient, p.grad, rtol=1e-6, atol=0)


def test_a_small_gradient_is_left_alone_and_clip_local_returns_the_norm_before():
    clipping = Clipping(1e6)
    tensors = grads()
    before = [t.clone() for t in tensors]
    norm = clipping.clip_local(tensors)
    assert norm == pytest.approx(math.sqrt(sum(float(t.pow(2).sum()) for t in before)), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_a_nonfinite_norm_scales_nothing_or_raises_as_torch_does_with_error_if_nonfinite():
    assert Clipping(1.0).coefficient(math.nan) == 1.0
    with pytest.raises(RuntimeError, match="The total norm of order 2.0 .* is non-finite"):
        Clipping(1.0, error_if_nonfinite=True).coefficient(math.inf)


@pytest.mark.parametrize("kwargs,match", [(dict(max_norm=0), r"max_grad_norm=0: expected a number > 0"),
                                          (dict(max_norm=-1.0), r"max_grad_norm=-1.0"),
                                          (dict(max_norm=1.0, norm_type=0), r"grad_norm_type=0: expected")])
def test_bad_values_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Clipping(**kwargs)
