"""Uneven data: every worker trains on its own number of batches per epoch inside `trainer.join()`, and the
single-process references: each step on the batches of the workers that still had one."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

import gradsync
from jobs import batch, make_bn_net, make_mlp, run_loop
from sparse_models import LR, ClickNet, click_batch


def _bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y)


NETS = {  # model, data (step, worker) -> (*inputs, target), loss, SGD settings
    "mlp": (make_mlp, batch, F.cross_entropy, dict(lr=0.1, momentum=0.9)),
    "bn": (make_bn_net, batch, F.cross_entropy, dict(lr=0.1, momentum=0.9)),
    "clicks": (ClickNet, click_batch, _bce, dict(lr=LR)),  # tables served row by row (ps, hybrid)
}


def _step(epoch: int, i: int) -> int:
    """The data index of batch i of epoch `epoch`."""
    return 100 * epoch + i


def train_uneven(net: str, counts: list[tuple[int, ...]], with_stats: bool = False):
    """One `trainer.join()` block per epoch, `counts[epoch][worker]` batches in it; returns the final state (and
    server 0's counters with `with_stats`)."""
    make, data, loss_fn, kwargs = NETS[net]
    me = gradsync.worker_rank()
    trainer = gradsync.Trainer(make(), torch.optim.SGD, **kwargs)
    for epoch, per_worker in enumerate(counts):
        with trainer.join():
            run_loop(trainer, per_worker[me], data=lambda i, worker: data(_step(epoch, i), worker), loss_fn=loss_fn)
    state = trainer.state_dict()
    return (state, trainer.server_stats()[0]) if with_stats else state


def _active_steps(counts: list[tuple[int, ...]]):
    """(data index, workers that have a batch) for every step of every epoch."""
    for epoch, per_worker in enumerate(counts):
        for i in range(max(per_worker)):
            yield _step(epoch, i), [w for w, n in enumerate(per_worker) if n > i]


def reference_uneven(net: str, counts: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Single-process training; each step on the batches of the workers active in it, joined."""
    make, data, loss_fn, kwargs = NETS[net]
    model = make()
    opt = torch.optim.SGD(model.parameters(), **kwargs)
    for step, active in _active_steps(counts):
        *inputs, y = (torch.cat(t) for t in zip(*(data(step, w) for w in active)))
        opt.zero_grad()
        loss_fn(model(*inputs), y).backward()
        opt.step()
    return model.state_dict()


def reference_uneven_bn(counts: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """One process simulating the active workers of each step (BatchNorm sees each worker's batch alone): the
    mean of their gradients, the mean of their floating buffers, the integer ones from the first."""
    make, data, loss_fn, kwargs = NETS["bn"]
    model = make()
    opt = torch.optim.SGD(model.parameters(), **kwargs)
    for step, active in _active_steps(counts):
        grads, buffers = [], []
        for w in active:
            replica = copy.deepcopy(model)
            x, y = data(step, w)
            loss_fn(replica(x), y).backward()
            grads.append([p.grad for p in replica.parameters()])
            buffers.append([b.detach().clone() for b in replica.buffers()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).sum(0) / len(active)
        opt.step()
        with torch.no_grad():
            for b, *bs in zip(model.buffers(), *buffers):
                b.copy_(torch.stack(bs).sum(0) / len(active) if b.is_floating_point() else bs[0])
    return model.state_dict()


def join_without_every_worker(steps: int) -> None:
    """Worker 0 trains inside trainer.join(); worker 1 trains as many steps without it, and leaves."""
    make, data, loss_fn, kwargs = NETS["mlp"]
    trainer = gradsync.Trainer(make(), torch.optim.SGD, **kwargs)
    with trainer.join() if gradsync.worker_rank() == 0 else contextlib.nullcontext():
        run_loop(trainer, steps, data=data, loss_fn=loss_fn)


def open_join() -> None:
    """Build the Trainer and open a join block (refused with --checkpoint-every)."""
    make, _, _, kwargs = NETS["mlp"]
    with gradsync.Trainer(make(), torch.optim.SGD, **kwargs).join():
        pass
