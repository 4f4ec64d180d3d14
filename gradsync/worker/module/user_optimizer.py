"""The optimizer object the user built, stepped only by `trainer.step`, and a `clip_grad_norm_` left beside it.

A ported script keeps its own `optimizer`: an LR scheduler built on it, a `optimizer.step()` or
`scaler.step(optimizer)` left from its DDP loop. `trainer.optimizer` is that same object under every strategy.
`StepGuard` takes over its `step()`: the strategy runs it inside `open()`, once the step's gradients are
averaged (allreduce) or the servers applied it (ps); a call from anywhere else would do nothing (the step's
gradients live in its dist_autograd context, not in `.grad`), or step a second time, so it is refused with the
fix. LR schedulers built on the optimizer, before the Trainer or after, still count each step.

`watch_clipping`: `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` left between the backward and the
step clips nothing either (under allreduce it measures the previous step's gradients, already applied): the
first call inside a dist_autograd context, outside gradsync's own step, is named once, by worker 0, with the fix
(`Trainer(..., max_grad_norm=)`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch

from gradsync.core.errors import optimizer_step_error
from gradsync.core.torch_internals import before_clip_grad_norm, current_context_id, take_over_step

_steps_open = 0
"""How many trainer steps are running now (gradsync's own clipping runs inside them)."""


class StepGuard:
    """`optimizer.step()` runs `run` inside `open()` and refuses outside it.

    Args:
        optimizer: the user's optimizer instance.
        run: what its step does inside a trainer's step (its own step, or nothing when the servers applied it);
            None: the step `optimizer` had.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, run: Callable | None = None):
        self._open = False
        replaced = take_over_step(optimizer, self._step)
        self._run = replaced if run is None else run

    @contextlib.contextmanager
    def open(self):
        """The block of a trainer's step, in which the optimizer steps."""
        global _steps_open
        before, self._open = self._open, True
        _steps_open += 1
        try:
            yield
        finally:
            self._open = before
            _steps_open -= 1

    def _step(self, closure=None):
        if not self._open:
            raise optimizer_step_error()
        return self._run(closure)


_LEFTOVER_CLIPPING = (
    "gradsync: clip_grad_norm_ was called inside a dist_autograd context: it clipped nothing, since "
    "the step's gradients live in the context, not in .grad. Pass max_grad_norm= to "
    "gradsync.Trainer (trainer.grad_norm is the norm before clipping) and remove the call"
)
_watching: list[bool] = []


def watch_clipping(say: bool) -> None:
    """Name the first `clip_grad_norm_` a script calls inside a dist_autograd context (see the module's
    docstring), on stderr when `say` (worker 0); once per process."""
    if _watching:
        return
    _watching.append(say)

    def seen(grads) -> None:
        if _watching == [True] and _steps_open == 0 and current_context_id() is not None:
            print(_LEFTOVER_CLIPPING, file=sys.stderr, flush=True)
            _watching[0] = False

    before_clip_grad_norm(seen)
