"""Waiting for something outside this thread (a store key, a file, a process's exit) by polling it, bounded.

`wait_until` is the one poll loop: every wait that cannot block on an event (the store's keys change under
other processes, a process's exit or a file's growth is seen only by looking) polls through it. A caller that
gives up quietly when its grace period ends suppresses the TimeoutError; one whose timeout has its own error
(naming the setting that bounds it and the fix) raises that from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05
"""Seconds between two looks of a wait: short beside any timeout a user sets (seconds) and beside a step's
time, long enough that a rank's waits cost no measurable CPU."""

THREAD_STOP_S = 5.0
"""How long stopping one of gradsync's own helper threads may take: each wakes at once when told to stop,
so this only bounds a thread stuck in a call; the caller goes on without it (they are daemon threads)."""


def wait_until(
    condition: Callable[[], T], deadline: float | None, what: str | Callable[[], str], poll: float = POLL_S
) -> T:
    """Call `condition()` every `poll` seconds until it returns a true value, and return that value.

    `deadline` is a `time.monotonic()` time, or None to wait until `condition` returns or raises (a wait whose
    bound is a liveness check inside `condition`). `condition` may raise to end the wait early (another rank
    failed). `what` says what was awaited: a text, or a function that makes it when the deadline passes (to
    name what is still missing then).

    Raises:
        TimeoutError: `deadline` passed first: "`what` (waited S s)".
    """
    start = time.monotonic()
    while not (result := condition()):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"{what() if callable(what) else what} (waited {now - start:.1f} s)")
        time.sleep(poll if deadline is None else min(poll, deadline - now))
    return result
