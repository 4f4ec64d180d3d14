"""Loops in which a worker dies once, at a chosen point of a chosen step, for the tests of worker_loss wait: its
first process dies there, its replacement trains on from `trainer.start_step`, and every worker returns where it
started, which process it was and the job's final state."""
from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from typing import NamedTuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
import gradsync
from gradsync.runtime import checkpoints
from gradsync.transport import rpc
from gradsync.worker.ddp.kept_averaging import KeptAveraging
from dynamic_jobs import DIM, LR, TABLE_OPTIMIZERS, Net, dynamic_batch
from jobs import batch, make_mlp
from sparse_models import ClickNet, click_batch

POINTS = ("forward", "backward", "pieces", "pushed", "one server", "finish", "checkpoint", "stop", "allreduce", "stepped")


class Death(NamedTuple):
    """Worker `worker`'s first process dies (SIGKILL) in step `step`: in its 'forward', in its 'backward', between
    the 'pieces' of its push (the first sent, the others not), once it has 'pushed' the step (before the reply),
    once its whole push reached server 0 alone ('one server': whole steps), once its word on a held step reached
    server 0 alone ('finish': clipping), or writing its part of the 'checkpoint' after the step; or it 'stop's
    (SIGSTOP) in its forward, silent until the launcher kills it. Under allreduce: in the step's 'allreduce', its
    first bucket averaged and the second not yet sent, or once its step is done ('stepped': before the next)."""

    worker: int
    step: int
    point: str


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(death: Death, layer: torch.nn.Module, step: list[int]) -> None:
    """Make this process die at `death`'s point when it reaches its step (`step[0]`: the step now); `layer`: the
    model's layer whose forward or backward it dies in."""
    now = lambda: step[0] == death.step  # noqa: E731
    if death.point in ("forward", "stop"):
        sig = signal.SIGKILL if death.point == "forward" else signal.SIGSTOP
        layer.register_forward_pre_hook(lambda *a: os.kill(os.getpid(), sig) if now() else None)
    elif death.point == "backward":
        layer.register_full_backward_hook(lambda *a: _die() if now() else None)
    elif death.point == "pieces":
        send, sent = rpc.Pipeline.send, []

        def send_one(pipeline, piece):
            if now() and sent:
                _die()
            send(pipeline, piece)
            sent.append(piece) if now() else None

        rpc.Pipeline.send = send_one
    elif death.point == "pushed":
        wait_all = rpc.wait_all

        def pushed_then_die(futures, what, timeout, *again):
            if now() and what in ("push", "pushing a piece (bucket)"):
                time.sleep(0.5)  # the messages are on the servers
                _die()
            return wait_all(futures, what, timeout, *again)

        rpc.wait_all = pushed_then_die
    elif death.point in ("one server", "finish"):
        call, fn = rpc.rpc.rpc_async, rpc.rpc_push if death.point == "one server" else rpc.rpc_finish

        def reach_one(to, called, *args, **kwargs):
            if now() and called is fn and to == "ps1":
                time.sleep(0.5)  # its message to ps0 is there
                _die()
            return call(to, called, *args, **kwargs)

        rpc.rpc.rpc_async = reach_one
    elif death.point == "allreduce":
        average, calls = KeptAveraging._average, []

        def average_then_die(averaging, *args):
            if now() and calls:  # its first bucket averaged, the second not begun: the others wait in it
                time.sleep(0.2)
                _die()
            calls.append(step[0]) if now() else None
            average(averaging, *args)

        KeptAveraging._average = average_then_die
    elif death.point == "stepped":
        trainer_step = gradsync.Trainer.step

        def step_then_die(trainer, *args):
            trainer_step(trainer, *args)
            if now():
                _die()

        gradsync.Trainer.step = step_then_die
    elif death.point == "checkpoint":
        write = checkpoints.shard_file.write

        def write_then_die(path, state):
            write(path, state)
            if step[0] == death.step and os.path.basename(path).startswith("worker-"):
                _die()

        checkpoints.shard_file.write = write_then_die


def _arm_mine(deaths: tuple[Death, ...], layer: torch.nn.Module, step: list[int]) -> None:
    """Arm this process's death: the n-th process of a worker dies as the n-th of `deaths` naming it says."""
    mine = [d for d in deaths if d.worker == gradsync.worker_rank()]
    if gradsync.restart_count() < len(mine):
        _arm(mine[gradsync.restart_count()], layer, step)


def starts_at(death: Death, held: bool) -> int:
    """The step the replacement of the process `death` ends continues from: the step it died in, or the next when
    every server had closed that step (its push applied, unless `held` for the workers' word: clipping, a
    GradScaler; or its checkpoint's step)."""
    return death.step + (death.point == "checkpoint" or (death.point == "pushed" and not held))


def train(deaths: tuple[Death, ...], steps: int, clip: float | None = None, micro: int = 1,
          hidden: int = 16, scaled: bool = False) -> tuple[int, int, dict, dict]:
    """The MLP with dropout (drawing on the RNG) and AdamW (with `clip`: clipping at that norm) for `steps` steps on
    worker w's batches of each step, each in `micro` micro-batches (`trainer.no_sync()` but the last), `hidden` wide,
    with `scaled` the loss scaled by a GradScaler whose scale grows every 2 steps. The n-th
    process of a worker dies as `deaths[i]` says, `i` the n-th of `deaths` naming that worker. Returns (start step,
    restart count, final state (with the GradScaler's), each server's count of each worker's replacements)."""
    me = gradsync.worker_rank()
    model = make_mlp(hidden=hidden)
    model.insert(1, torch.nn.Dropout(0.1))  # the RNG a replacement must continue
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), max_grad_norm=clip)
    step = [trainer.start_step]
    _arm_mine(deaths, model[2], step)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scaled else None
    scale = (lambda loss: scaler.scale(loss)) if scaler is not None else (lambda loss: loss)  # noqa: E731
    for step[0] in range(trainer.start_step, steps):
        x, y = batch(step[0], me)
        with dist_autograd.context() as cid:
            for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                with trainer.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    dist_autograd.backward(cid, [scale(F.cross_entropy(trainer.model(xs), ys) / micro)])
            trainer.step(cid, scaler)
    replaced = {s: st["workers_replaced"] for s, st in trainer.server_stats().items()}
    state = trainer.state_dict()
    if scaler is not None:  # its scale and growth count as every worker's: where the clean run's are
        state.update({f"scaler.{k}": torch.tensor(float(v)) for k, v in scaler.state_dict().items()})
    return trainer.start_step, gradsync.restart_count(), state, replaced


def train_async(deaths: tuple[Death, ...], steps: int) -> tuple[int, int, dict]:
    """`train`'s MLP, AdamW and deaths in an async or ssp job. Returns (start step, restart count, each server's
    pushes of this worker and largest lead of a worker over the slowest)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    model.insert(1, torch.nn.Dropout(0.1))
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = [trainer.start_step]
    _arm_mine(deaths, model[2], step)
    for step[0] in range(trainer.start_step, steps):
        x, y = batch(step[0], me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
    stats = trainer.server_stats()
    return trainer.start_step, gradsync.restart_count(), {
        s: (st["pushes_by_worker"].get(me, st["pushes_by_worker"].get(str(me))), st["max_lead"])
        for s, st in stats.items()}


class _Net(torch.nn.Module):
    """A model as real loops have them: a frozen stem, BatchNorm (running statistics: buffers the servers
    average), a layer used only on even steps, and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.norm = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)
        self.body, self.even, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.stem.requires_grad_(False)

    def forward(self, x, step: int):
        h = torch.relu(self.body(torch.relu(self.norm(self.stem(x)))))
        return self.head(h + self.even(h) if step % 2 == 0 else h)


def _real_loop_optimizer(model: _Net) -> torch.optim.AdamW:
    """AdamW over two parameter groups of `model`, with their own lr and weight decay."""
    return torch.optim.AdamW([
        {"params": [*model.body.parameters(), *model.even.parameters()], "lr": 0.02, "weight_decay": 0.1},
        {"params": [*model.norm.parameters(), *model.head.parameters()], "lr": 0.01, "weight_decay": 0.0}])


def _schedule(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Each group's lr halves every 2 steps, set from the step (as a resumed script sets its schedule)."""
    for group, lr in zip(optimizer.param_groups, (0.02, 0.01)):
        group["lr"] = lr * 0.5 ** (step // 2)


def train_real_loop(deaths: tuple[Death, ...], steps: int, pace: float = 0.0, **trainer_keywords) -> tuple[int, dict, dict]:
    """`_Net` with `_real_loop_optimizer` on `_schedule`, each step at least `pace` seconds; deaths as `train`'s.
    Returns (start step, final state, the steps server 0 went on without a worker: {step: workers}; {} without
    servers)."""
    me = gradsync.worker_rank()
    model = _Net()
    trainer = gradsync.Trainer(model, _real_loop_optimizer(model), **trainer_keywords)
    step = [trainer.start_step]
    _arm_mine(deaths, model.body, step)
    for step[0] in range(trainer.start_step, steps):
        _schedule(trainer.optimizer, step[0])
        x, y = batch(step[0], me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x, step[0]), y)])
            trainer.step(cid)
        time.sleep(pace)
    stats = trainer.server_stats()
    return trainer.start_step, trainer.state_dict(), stats[0]["steps_without"] if stats else {}


def reference_real_loop(steps: int, workers: int, without: dict[int, list[int]]) -> dict:
    """`train_real_loop` in one process, each step's workers applied then (all `workers`, less those `without`
    names) simulated: each computes its gradient and BatchNorm statistics on its own batch from the same values,
    and the step applies the mean of their gradients and of their floating buffers (the integer ones as the
    first worker's), as the servers do."""
    model = _Net()
    optimizer = _real_loop_optimizer(model)
    for step in range(steps):
        applied = [w for w in range(workers) if w not in without.get(step, [])]
        copies = [copy.deepcopy(model) for _ in applied]
        for w, each in zip(applied, copies):
            x, y = batch(step, w)
            F.cross_entropy(each(x, step), y).backward()
        for p, *theirs in zip(model.parameters(), *(c.parameters() for c in copies)):
            grads = [q.grad for q in theirs if q.grad is not None]
            p.grad = torch.stack(grads).sum(0) / len(applied) if grads else None
        for (name, b), *theirs in zip(model.named_buffers(), *(c.buffers() for c in copies)):
            b.copy_(torch.stack(theirs).mean(0) if b.is_floating_point() else theirs[0])
        _schedule(optimizer, step)
        optimizer.step()
    return model.state_dict()


def train_joining(death: Death, steps: int) -> int:
    """The MLP for `steps` steps inside one `trainer.join()` block; `death` kills its worker. Returns the steps
    taken."""
    me = gradsync.worker_rank()
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = [trainer.start_step]
    if death.worker == me and gradsync.restart_count() == 0:
        _arm(death, model[2], step)
    with trainer.join():
        for step[0] in range(trainer.start_step, steps):
            x, y = batch(step[0], me)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
                trainer.step(cid)
    return steps


def train_joining_dropping(death: Death, batches: tuple[int, ...]) -> tuple[dict, dict]:
    """The MLP with AdamW inside one `trainer.join()` block, worker w on its batches of steps 0..batches[w] - 1,
    then one step more on its batch of step max(batches), every worker active again; `death` kills its worker
    (worker_loss drop). Returns (final state, server 0's steps without a worker)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = [0]
    if death.worker == me:
        _arm(death, model[2], step)
    with trainer.join():
        for step[0] in range(batches[me]):
            x, y = batch(step[0], me)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
                trainer.step(cid)
    x, y = batch(max(batches), me)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
        trainer.step(cid)
    return trainer.state_dict(), trainer.server_stats()[0]["steps_without"]


def train_dropping(death: Death, steps: int, pace: float = 0.0, late: float = 0.0) -> tuple[dict, dict, int]:
    """The plain MLP with AdamW for `steps` steps on worker w's batches of each step, each step at least `pace`
    seconds; `death` kills its worker (worker_loss drop: the job goes on without it), whose replacement waits
    `late` seconds before it builds its Trainer. Returns (final state, the steps each server went on without a
    worker: {server: {step: workers}}, the step this process started at)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    time.sleep(late if gradsync.restart_count() else 0.0)
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = [trainer.start_step]
    if death.worker == me:
        _arm(death, model[2], step)
    for step[0] in range(trainer.start_step, steps):
        x, y = batch(step[0], me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
        time.sleep(pace)
    without = {s: st["steps_without"] for s, st in trainer.server_stats().items()}
    return trainer.state_dict(), without, trainer.start_step


def reference(steps: int, workers: int, without: dict[int, list[int]]) -> dict:
    """Single-process training of `train_dropping`'s model on each step's batches of the workers applied then (all
    `workers`, less those `without` names for that step; a step none applied is no step)."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        applied = [w for w in range(workers) if w not in without.get(step, [])]
        if not applied:
            continue
        x, y = (torch.cat(t) for t in zip(*(batch(step, w) for w in applied)))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def train_clicks(deaths: tuple[Death, ...], steps: int, sparse: bool = False) -> tuple[int, dict]:
    """ClickNet (two tables served by rows, lazy momentum rows; under allreduce, `sparse`: with sparse=True) with
    SGD momentum on its MLP, each worker's click batch of each step; deaths as `train`'s. Returns (start step,
    final state)."""
    me = gradsync.worker_rank()
    model = ClickNet(sparse=sparse)
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               table_optimizer=gradsync.RowSGD(lr=0.1, momentum=0.9))
    step = [trainer.start_step]
    _arm_mine(deaths, model.mlp, step)
    for step[0] in range(trainer.start_step, steps):
        bag, ids, dense, y = click_batch(step[0], me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.binary_cross_entropy_with_logits(trainer.model(bag, ids, dense), y)])
            trainer.step(cid)
    return trainer.start_step, trainer.state_dict()


def train_dynamic_tables(deaths: tuple[Death, ...], steps: int) -> tuple[int, dict]:
    """dynamic_jobs.Net (three dynamic tables: admission after sightings and by probability, LRU and LFU
    eviction, a TTL) with AdamW and RowAdagrad rows, each worker's batch of each step; deaths as `train`'s.
    Returns (start step, final state, the tables' ids, rows, counts and eviction state included)."""
    me = gradsync.worker_rank()
    model = Net(gradsync.DynamicEmbedding(DIM, capacity=1000))
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR),
                               table_optimizer=TABLE_OPTIMIZERS["adagrad"])
    step = [trainer.start_step]
    _arm_mine(deaths, model.head, step)
    for step[0] in range(trainer.start_step, steps):
        users, items, tags, clicks = dynamic_batch(step[0], me)
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(users, items, tags), clicks)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.start_step, trainer.state_dict()


def train_killing_a_server(kill_at: int, steps: int) -> tuple[int, int, dict]:
    """The plain MLP with AdamW from `trainer.start_step`; in the job's first run, worker 0 SIGKILLs server 0 (its
    pid from `trainer.server_stats()`) as it reaches `kill_at`. Returns (start step, restart count, final state)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for step in range(trainer.start_step, steps):
        if me == 0 and step == kill_at and gradsync.restart_count() == 0:
            os.kill(trainer.server_stats()[0]["pid"], signal.SIGKILL)
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
    return trainer.start_step, gradsync.restart_count(), trainer.state_dict()
