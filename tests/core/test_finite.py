"""core.finite: the cheap NaN/Inf detector names the first bad tensor and ignores overflowing sums."""
import pytest
import torch

from gradsync.core.finite import first_nonfinite


def with_value(value: float, n: int = 5) -> torch.Tensor:
    t = torch.randn(n)
    t[n // 2] = value
    return t


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_nonfinite_tensor_is_named(bad):
    assert first_nonfinite([torch.randn(4), with_value(bad), with_value(bad)]) == 1


def test_inf_and_minus_inf_in_one_tensor_are_found():
    t = torch.zeros(4)
    t[0], t[3] = float("inf"), float("-inf")
    assert first_nonfinite([t]) == 0


def test_finite_tensors_whose_sum_overflows_are_a_false_alarm():
    huge = torch.full((4,), 3e38)
    assert not torch.isfinite(huge.sum())
    assert first_nonfinite([huge, torch.full((8,), 6e4, dtype=torch.float16)]) is None
    assert first_nonfinite([huge, with_value(float("nan"))]) == 1


def test_empty_and_finite_inputs():
    assert first_nonfinite([]) is None
    assert first_nonfinite([torch.zeros(0), torch.randn(3, 3), torch.arange(4)]) is None
