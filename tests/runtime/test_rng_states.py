"""A worker's RNG states as a replacement takes them: packed into bytes each step, unpacked and put back, the draws
that follow are the draws the dead process would have made."""
import random

import torch

from gradsync.runtime import rng_states


def test_packed_states_put_back_give_the_same_draws():
    torch.manual_seed(3)
    random.seed(4)
    torch.rand(5), random.random()  # states somewhere in their sequences
    data = rng_states.packed(7)
    expected = torch.rand(3), random.random(), random.gauss(0, 1), random.gauss(0, 1)  # gauss keeps a spare
    torch.manual_seed(0)
    random.seed(0)
    step, states = rng_states.unpacked(data)
    rng_states.put_back(states)
    assert step == 7
    drawn = torch.rand(3), random.random(), random.gauss(0, 1), random.gauss(0, 1)
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]
    assert isinstance(data, bytes) and len(data) < 16_000
