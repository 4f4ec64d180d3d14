"""A dead worker's lookups of dynamic tables answered again to its replacement (`ps.lookup_replay`), in one
process: the replacement's lookups of the step in flight count once, in the order they came; beyond what its
dead process asked they are looked up as any; other ids are refused, naming the worker."""
import pytest
import torch

from gradsync.core.errors import Refusal
from gradsync.ps.lookup_replay import LookupReplay
from gradsync.ps.messages import Lookups


def _call(worker: int, step: int, *ids: int) -> Lookups:
    return Lookups((("t", torch.tensor(ids), torch.ones(len(ids), dtype=torch.int64)),), step, None, worker)


def test_a_replacement_is_answered_as_its_dead_process_call_by_call_then_as_anyone():
    replay, counted = LookupReplay(), []

    def ask(call):
        return replay.answer(call, lambda: counted.append(call) or len(counted))

    first, second = ask(_call(1, 3, 5, 7)), ask(_call(1, 3, 9))  # the dead process's two calls of step 3
    assert ask(_call(0, 3, 5)) == 3  # another worker's: its own
    replay.restarted(1)
    assert ask(_call(1, 3, 5, 7)) == first and ask(_call(1, 3, 9)) == second  # counted once
    assert ask(_call(1, 3, 11)) == 4 and len(counted) == 4  # beyond what the dead process asked: as any
    assert ask(_call(1, 4, 5, 7)) == 5  # the next step: as any


def test_a_replacement_asking_other_ids_is_refused_naming_it():
    replay = LookupReplay()
    replay.answer(_call(1, 3, 5, 7), lambda: "rows")
    replay.restarted(1)
    with pytest.raises(Refusal, match=r"worker 1's replacement looked up other ids of dynamic tables in step 3"):
        replay.answer(_call(1, 3, 5, 8), lambda: "other rows")


def test_only_the_last_two_steps_are_kept():
    replay, counted = LookupReplay(), []
    for step in range(4):
        replay.answer(_call(1, step, step), lambda: counted.append(step))
    replay.restarted(1)
    replay.answer(_call(1, 1, 1), lambda: counted.append("again"))  # step 1 is gone: looked up anew
    assert counted[-1] == "again"
    replay.restarted(1)
    replay.answer(_call(1, 3, 3), lambda: counted.append("not again"))
    assert counted[-1] == "again"  # step 3 is kept
    assert replay.answer(Lookups((), 0), lambda: "no worker") == "no worker"
