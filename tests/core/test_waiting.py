"""core.waiting.wait_until, the one poll loop: what it returns, what its timeout says, what ends it early."""
import time

import pytest

from gradsync.core.waiting import wait_until


def test_returns_the_conditions_first_true_value_after_as_many_looks_as_it_took():
    looks = []

    def third_time():
        looks.append(1)
        return "done" if len(looks) == 3 else None

    assert wait_until(third_time, None, "the third look", poll=0) == "done"
    assert len(looks) == 3


def test_a_passed_deadline_raises_timeout_naming_what_as_it_is_then_and_the_seconds():
    missing = ["worker1"]
    with pytest.raises(TimeoutError, match=r"^worker1 did not arrive \(waited \d+\.\d s\)$"):
        wait_until(lambda: False, time.monotonic(), lambda: f"{', '.join(missing)} did not arrive", poll=0)
    with pytest.raises(TimeoutError, match=r"^the shards \(waited"):
        wait_until(lambda: 0, time.monotonic() - 1, "the shards")


def test_a_condition_true_at_once_returns_even_past_the_deadline():
    assert wait_until(lambda: [3], time.monotonic() - 1, "never said") == [3]


def test_an_error_the_condition_raises_ends_the_wait():
    def failed():
        raise RuntimeError("another rank failed")

    with pytest.raises(RuntimeError, match="another rank failed"):
        wait_until(failed, None, "unused")
