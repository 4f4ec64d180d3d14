"""Loops in which a server dies once, at a chosen point of a chosen step, for the tests of replicas 1: the death
is armed in that server's process as the job's arguments are unpickled there (`ServerDeath.__reduce__`), before
`gradsync.init`, and the workers train on and return the job's final state."""
from __future__ import annotations

import datetime
import os
import signal
from typing import NamedTuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from gradsync.core.job_names import StoreKeys
from gradsync.ps.server import ParameterServer
from gradsync.runtime import cluster
from gradsync.ps.shard import ShardState
from jobs import batch, make_mlp
from replaced import _Net
from sparse_models import ClickNet, click_batch

POINTS = ("pushed", "closed", "held", "checkpoint", "stop")


class ServerDeath(NamedTuple):
    """Server `server`'s process dies (SIGKILL) in step `step` (counted from 0, the steps its shard closed): as
    worker 1's push of it arrives ('pushed': the step not applied), once the step is applied and its replica holds
    it, before any worker is answered ('closed'), or as the first word on the held step arrives ('held': clipping,
    its partials answered, nothing applied), or once it has written its shard's file of the checkpoint after the
    step, before it answers ('checkpoint'); or it stops ('stop': SIGSTOP as worker 1's push arrives), silent until
    the launcher kills it. With `after` ('pushed' and 'stop'), not before the replacement of that server
    keeps its replicas.
    """

    server: int
    step: int
    point: str
    after: int | None = None

    def __reduce__(self):
        return _armed, tuple(self)


def _die(sig=signal.SIGKILL, after: int | None = None) -> None:
    if after is not None:  # the job's first replacement of that server keeps its replicas
        store = cluster.running().store
        store.wait([StoreKeys.REPLICAS_KEPT.format(after)], datetime.timedelta(seconds=60))
    os.kill(os.getpid(), sig)


def _armed(server: int, step: int, point: str, after: int | None = None) -> ServerDeath:
    """The death, armed when this process is that server (its first process)."""
    if int(os.environ.get("RANK", "-1")) == server and not int(os.environ.get("GRADSYNC_REPLACEMENT", "0")):
        _arm(server, step, point, after)
    return ServerDeath(server, step, point, after)


def _arm(server: int, step: int, point: str, after: int | None) -> None:
    now = lambda shard: shard.shard_id == server and shard.closed == step  # noqa: E731
    if point in ("pushed", "stop"):
        push, sig = ParameterServer.push, signal.SIGKILL if point == "pushed" else signal.SIGSTOP

        def dying_push(self, worker, *args, **kwargs):
            if self.shard is not None and now(self.shard) and worker == min(1, self.num_workers - 1):
                _die(sig, after)
            return push(self, worker, *args, **kwargs)

        ParameterServer.push = dying_push
    elif point == "closed":
        for name in ("end_step", "skipped_step"):
            def closing(self, *args, _close=getattr(ShardState, name), **kwargs):
                dies = now(self)
                _close(self, *args, **kwargs)
                if dies:
                    _die()

            setattr(ShardState, name, closing)
    elif point == "held":
        finish = ParameterServer.finish

        def dying_finish(self, *args, **kwargs):
            if now(self.shard):
                _die()
            return finish(self, *args, **kwargs)

        ParameterServer.finish = dying_finish
    elif point == "checkpoint":
        checkpoint = ParameterServer.checkpoint

        def dying_checkpoint(self, *args, **kwargs):
            written = checkpoint(self, *args, **kwargs)
            if self.shard_id == server and self.shard.closed == step + 1:
                _die()
            return written

        ParameterServer.checkpoint = dying_checkpoint


def train(deaths: tuple[ServerDeath, ...], steps: int, clip: float | None = None) -> tuple[dict, dict]:
    """The MLP with dropout (drawing on the RNG) and AdamW (with `clip`: clipping at that norm) for `steps` steps on
    worker w's batches of each step; `deaths` kill servers. Returns (final state, each server's stats)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    model.insert(1, torch.nn.Dropout(0.1))
    trainer = gradsync.Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), max_grad_norm=clip)
    for step in range(trainer.start_step, steps):
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
    return trainer.state_dict(), trainer.server_stats()


def train_clicks(deaths: tuple[ServerDeath, ...], steps: int) -> tuple[dict, dict]:
    """ClickNet (two tables served by rows, lazy momentum rows) with SGD momentum on its MLP, a GradScaler whose
    scale grows every 2 steps, each worker's click batch of each step; `deaths` as `train`'s."""
    me = gradsync.worker_rank()
    model = ClickNet()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               table_optimizer=gradsync.RowSGD(lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(trainer.start_step, steps):
        bag, ids, dense, y = click_batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(bag, ids, dense), y)
            dist_autograd.backward(cid, [scaler.scale(loss)])
            trainer.step(cid, scaler)
    return trainer.state_dict(), trainer.server_stats()


def train_real_loop(deaths: tuple[ServerDeath, ...], steps: int) -> tuple[dict, dict]:
    """`replaced._Net` (a frozen stem, BatchNorm, a layer used only on even steps) with AdamW over two parameter
    groups of their own lr and weight decay, the lr halved every 2 steps from the loop, each worker's batch of each
    step; `deaths` as `train`'s."""
    me = gradsync.worker_rank()
    model = _Net()
    groups = [{"params": [*model.body.parameters(), *model.even.parameters()], "lr": 0.02, "weight_decay": 0.1},
              {"params": [*model.norm.parameters(), *model.head.parameters()], "lr": 0.01, "weight_decay": 0.0}]
    trainer = gradsync.Trainer(model, torch.optim.AdamW(groups))
    for step in range(trainer.start_step, steps):
        for group, lr in zip(trainer.optimizer.param_groups, (0.02, 0.01)):
            group["lr"] = lr * 0.5 ** (step // 2)
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x, step), y)])
            trainer.step(cid)
    return trainer.state_dict(), trainer.server_stats()


def train_with_worker_deaths(deaths: tuple[ServerDeath, ...], worker_deaths: tuple, steps: int) -> dict:
    """`replaced.train` (worker deaths, clipping at 0.5) in a job whose servers die as `deaths` say: its final
    state."""
    from replaced import train as train_replaced

    return train_replaced(worker_deaths, steps, 0.5)[2]
