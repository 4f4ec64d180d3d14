"""Jobs of the elastic tests (module level, so the ranks can unpickle them): a model whose every push moves it
by a known amount, a worker that brings a new worker into its running job with `gradsync run --join`, and
one killed halfway through a push."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

import gradsync
from helpers import CLI

LR, GRAD, SIZE = 0.5, 1.0, 4
JOINER = os.path.join(os.path.dirname(__file__), "elastic_joiner.py")


class Constant(nn.Module):
    """loss = sum(w * x) with x = GRAD: every step's gradient is GRAD, whatever w is, so under async SGD the
    weights after n applied pushes are -LR * GRAD * n (exactly, in float32; ssp: each push scaled by 1/W)
    and the loss at a step is sum(w) = -SIZE * LR * GRAD * (pushes applied before it). `size`: w's elements."""

    def __init__(self, size: int = SIZE):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def constant_step(trainer: gradsync.Trainer) -> float:
    """One step of `Constant`; returns its loss (what the worker pulled, summed)."""
    with dist_autograd.context() as cid:
        loss = trainer.model(torch.full((trainer.model.module.w.numel(),), GRAD))
        dist_autograd.backward(cid, [loss])
        trainer.step(cid)
    return loss.item()


def die_before_the_trainer(worker: int) -> None:
    """Worker `worker` is killed before it builds its Trainer; the others build theirs (and wait for it)."""
    if gradsync.worker_rank() == worker:
        os.kill(os.getpid(), signal.SIGKILL)
    gradsync.Trainer(Constant(), torch.optim.SGD, lr=LR)


def kill_the_server_at(step: int, steps: int) -> None:
    """Train `Constant`; worker 0 kills the server (it asks ps0 for its pid over RPC) at `step`."""
    trainer = gradsync.Trainer(Constant(), torch.optim.SGD, lr=LR)
    for i in range(steps):
        if i == step and gradsync.worker_rank() == 0:
            os.kill(rpc.rpc_sync("ps0", os.getpid), signal.SIGKILL)
        constant_step(trainer)


def train_while_a_worker_joins(steps: int, joiner_steps: int, how: str = "run-dir") -> dict:
    """Worker 1 takes `steps` steps and leaves; then worker 0 starts one new worker (`joiner_steps` steps),
    `how`: 'run-dir' (`gradsync run --join RUN_DIR`), 'address' (`--join HOST:PORT`, the store's) or 'init'
    (plain python with GRADSYNC_JOIN=RUN_DIR: `gradsync.init` joins), and steps (slowly) until it ends.
    Returns, from worker 0, its outcome and the servers' counters and weights once no other worker pushes."""
    trainer = gradsync.Trainer(Constant(), torch.optim.SGD, lr=LR)
    if gradsync.worker_rank() == 1:
        for _ in range(steps):
            constant_step(trainer)
        return {}
    while trainer.server_stats()[0]["pushes_by_worker"].get(1, 0) < steps:
        constant_step(trainer)
    run_dir, env = os.environ["GRADSYNC_RUN_DIR"], dict(os.environ)
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if how == "init":  # a process of the user's own, not one of the job's ranks: none of their variables
        env = {k: v for k, v in env.items() if not k.startswith("GRADSYNC_") and
               k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        command, env["GRADSYNC_JOIN"] = [sys.executable, JOINER, str(joiner_steps)], run_dir
    else:
        command = [*CLI, "run", "--join", run_dir if how == "run-dir" else address, JOINER, str(joiner_steps)]
    joiner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    while joiner.poll() is None and time.monotonic() < deadline:
        constant_step(trainer)
        time.sleep(0.02)  # leave the 2 cores to the joiner's start-up
    out = joiner.communicate(timeout=10)[0]
    return dict(code=joiner.returncode, out=out, stats=trainer.server_stats()[0], state=trainer.state_dict())


def train_constant_and_stats(steps: int, size: int) -> tuple[dict[str, torch.Tensor], dict[int, dict]]:
    """`steps` steps of `Constant(size)` inside `trainer.join()`; returns, once every worker has joined (its
    pushes all applied), the state and every server's counters."""
    trainer = gradsync.Trainer(Constant(size), torch.optim.SGD, lr=LR)
    with trainer.join():
        for _ in range(steps):
            constant_step(trainer)
    return trainer.state_dict(), trainer.server_stats()


def train_until_killed_mid_push(kill_at: int, size: int, withheld: int) -> dict | None:
    """`Constant(size)` over two servers or more: worker 1 is killed during its push of step `kill_at`
    (`fault_injection.die_mid_push`: every server but `withheld` gets it whole, `withheld` its head and first piece);
    worker 0 steps until server 0 has applied that push, and returns the servers' counters and the state."""
    from fault_injection import die_mid_push

    trainer = gradsync.Trainer(Constant(size), torch.optim.SGD, lr=LR)
    if gradsync.worker_rank() == 1:
        for _ in range(kill_at):
            constant_step(trainer)
        die_mid_push(withheld)
        constant_step(trainer)
        raise AssertionError("worker 1 outlived its push of step kill_at")
    while trainer.server_stats()[0]["pushes_by_worker"].get(1, 0) <= kill_at:  # bounded by the job's timeout
        constant_step(trainer)
    return dict(stats=trainer.server_stats(), state=trainer.state_dict())
