"""Jobs of the elastic tests (module level, so the ranks can unpickle them): a model whose every push moves it
by a known amount, and a worker that brings a new worker into its running job with `gradsync run --join`."""
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

LR, GRAD, SIZE = 0.5, 1.0, 4
JOINER = os.path.join(os.path.dirname(__file__), "elastic_joiner.py")


class Constant(nn.Module):
    """loss = sum(w * x) with x = GRAD: every step's gradient is GRAD, whatever w is, so under async SGD the
    weights after n applied pushes are -LR * GRAD * n (exactly, in float32) and the loss at a step is
    sum(w) = -SIZE * LR * GRAD * (pushes applied before it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def constant_step(trainer: gradsync.Trainer) -> float:
    """One step of `Constant`; returns its loss (what the worker pulled, summed)."""
    with dist_autograd.context() as cid:
        loss = trainer.model(torch.full((SIZE,), GRAD))
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
        command = [sys.executable, "-m", "gradsync.cli", "run", "--join", run_dir if how == "run-dir" else address,
                   JOINER, str(joiner_steps)]
    joiner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    while joiner.poll() is None and time.monotonic() < deadline:
        constant_step(trainer)
        time.sleep(0.02)  # leave the 2 cores to the joiner's start-up
    out = joiner.communicate(timeout=10)[0]
    return dict(code=joiner.returncode, out=out, stats=trainer.server_stats()[0], state=trainer.state_dict())
