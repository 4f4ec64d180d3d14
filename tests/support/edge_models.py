"""Models people train that stress the gradient path, each with a single-process reference.

Every case is a small model, an optimizer and a rule for which rows of a batch
take the model's `branch` (all workers take the same path in a step unless the
case says otherwise). Worker functions are module level so spawn can pickle
them; the reference trains one process on the concatenation of the workers'
batches, where torch.optim skips a parameter whose `.grad` is None.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from helpers import max_diff
from jobs import BATCH, HIDDEN, IN, OUT, batch, run_loop

VOCAB, DIM = 12, 8


class BranchNet(nn.Module):
    """body -> head, plus `branch` added for the rows in `use`; `unused` (if any) is never called."""

    def __init__(self, frozen_first: bool = False, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT)
        self.unused = nn.Linear(HIDDEN, OUT) if unused else None
        if frozen_first:
            self.body[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        rows = use.nonzero().flatten()
        if len(rows):  # the branch is in the graph only when some row takes it
            out = out.index_add(0, rows, self.branch(h[rows]))
        return out


class TiedLM(nn.Module):
    """Token embedding -> tanh(Linear) -> output Linear whose weight is the embedding matrix."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(x))))


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    optimizer: type
    kwargs: dict
    uses_branch: Callable[[int, int], bool]  # (step, worker) -> whether that worker's rows take the branch
    find_unused: bool = False
    untouched: tuple[str, ...] = ()  # state_dict keys single-process training never changes
    tokens: bool = False  # inputs are token ids (TiedLM)


SGD_WD = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
ALWAYS = lambda step, worker: True  # noqa: E731

CASES = {
    "frozen": Case(lambda: BranchNet(frozen_first=True), torch.optim.SGD, SGD_WD, ALWAYS,
                   untouched=("body.0.weight", "body.0.bias")),
    "unused": Case(lambda: BranchNet(unused=True), torch.optim.SGD, SGD_WD, ALWAYS, find_unused=True,
                   untouched=("unused.weight", "unused.bias")),
    "even_steps": Case(BranchNet, torch.optim.SGD, SGD_WD, lambda step, worker: step % 2 == 0, find_unused=True),
    "one_worker": Case(BranchNet, torch.optim.SGD, SGD_WD, lambda step, worker: worker == 0, find_unused=True),
    "adam_unused": Case(lambda: BranchNet(unused=True), torch.optim.Adam, dict(lr=0.01, weight_decay=0.01), ALWAYS,
                        find_unused=True, untouched=("unused.weight", "unused.bias")),
    "tied": Case(TiedLM, torch.optim.SGD, SGD_WD, ALWAYS, tokens=True),
}


def inputs(case: str, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Worker `worker`'s batch at `step`: (x, use, y), `use` marking the rows that take the branch."""
    c = CASES[case]
    if c.tokens:
        g = torch.Generator().manual_seed(1000 * step + worker)
        x, y = torch.randint(0, VOCAB, (BATCH,), generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g)
    else:
        x, y = batch(step, worker)
    return x, torch.full((BATCH,), c.uses_branch(step, worker)), y


def initial(case: str) -> dict[str, torch.Tensor]:
    return CASES[case].build().state_dict()


def train_edge(case: str, steps: int) -> dict[str, torch.Tensor]:
    """The README loop on this worker's batches; returns the final state."""
    c = CASES[case]
    trainer = gradsync.Trainer(c.build(), c.optimizer, find_unused_parameters=c.find_unused, **c.kwargs)
    run_loop(trainer, steps, data=lambda step, worker: inputs(case, step, worker))
    return trainer.state_dict()


def reference_edge(case: str, steps: int, workers: int) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of the workers' batches."""
    c = CASES[case]
    model = c.build()
    opt = c.optimizer(model.parameters(), **c.kwargs)
    for step in range(steps):
        x, use, y = (torch.cat(t) for t in zip(*(inputs(case, step, w) for w in range(workers))))
        opt.zero_grad()
        F.cross_entropy(model(x, use), y).backward()
        opt.step()
    return model.state_dict()


def step_without_backward() -> None:
    """Forward, then step with no backward in the context."""
    trainer = gradsync.Trainer(BranchNet(), torch.optim.SGD, lr=0.1)
    x, use, y = inputs("frozen", 0, gradsync.worker_rank())
    with dist_autograd.context() as cid:
        F.cross_entropy(trainer.model(x, use), y)
        trainer.step(cid)


def step_twice() -> None:
    """A correct step, then a second step for the same context."""
    trainer = gradsync.Trainer(BranchNet(), torch.optim.SGD, lr=0.1)
    x, use, y = inputs("frozen", 0, gradsync.worker_rank())
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x, use), y)])
        trainer.step(cid)
        trainer.step(cid)


def check_parity(case: str, states: list, workers: int, steps: int) -> None:
    """The states of a job that trained `case` for `steps` steps equal single-process training's, and leave
    alone what it leaves alone."""
    reference, start = reference_edge(case, steps, workers), initial(case)
    for state in states:
        assert max_diff(state, reference) <= 1e-5
        for key in CASES[case].untouched:  # where single-process training leaves a tensor alone, so must we
            assert torch.equal(reference[key], start[key]), key
            assert torch.equal(state[key], start[key]), key
    assert max_diff(states[0], start) > 1e-3  # training moved the weights
