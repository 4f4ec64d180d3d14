"""Functions the multi-process tests run on each worker (module level, so spawn can pickle them)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 6


def make_mlp(seed: int = 0, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, OUT))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: worker w's batch at `step` (the reference concatenates all workers')."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def run_loop(trainer: gradsync.Trainer, steps: int, log: bool = False, pause_s: float = 0.0, data=batch,
             loss_fn=F.cross_entropy, stop=None) -> int:
    """The user loop of the README, from `trainer.start_step` to `steps`, on this worker's batches
    (`data(step, worker)` -> (*inputs, target), scored by `loss_fn`); `log`: each step's loss through gradsync.log;
    `pause_s`: seconds of sleep before each step, a slow worker; `stop(step)`: true ends the loop before that
    step. Returns the step it ended before."""
    me = gradsync.worker_rank()
    for step in range(trainer.start_step, steps):
        if stop is not None and stop(step):
            return step
        time.sleep(pause_s)
        *inputs, y = data(step, me)
        with dist_autograd.context() as cid:
            loss = loss_fn(trainer.model(*inputs), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        if log:
            gradsync.log(loss=loss.item(), samples=len(y))
    return steps


def train_mlp(steps: int, lr: float = 0.1, momentum: float = 0.9, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """Train the MLP (`hidden` wide) with SGD on every worker; returns the final state dict."""
    trainer = gradsync.Trainer(make_mlp(hidden=hidden), torch.optim.SGD, lr=lr, momentum=momentum)
    run_loop(trainer, steps)
    return trainer.state_dict()


def reference_mlp(steps: int, workers: int, lr: float = 0.1, momentum: float = 0.9, skip: int | None = None,
                  hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of the workers' batches (`skip`: a step left out) of the
    MLP `hidden` wide."""
    model = make_mlp(hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        if step == skip:
            continue
        xs, ys = zip(*(batch(step, w) for w in range(workers)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model.state_dict()


def train_mlp_stats(steps: int, steps_worker1: int | None = None) -> dict:
    """Train (worker 1 may stop early) and return server 0's counters as seen at the end."""
    me = gradsync.worker_rank()
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.05)
    run_loop(trainer, steps_worker1 if (me == 1 and steps_worker1 is not None) else steps)
    return trainer.server_stats()[0]


def build_mismatched() -> None:
    """Worker 1 builds a wider model than the others."""
    torch.manual_seed(0)
    width = HIDDEN + (1 if gradsync.worker_rank() == 1 else 0)
    gradsync.Trainer(nn.Sequential(nn.Linear(IN, width), nn.Linear(width, OUT)), torch.optim.SGD, lr=0.1)


def train_with_nan(steps: int, nan_step: int) -> dict[str, torch.Tensor]:
    """Worker 1's loss is NaN at `nan_step`."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1, momentum=0.9)
    me = gradsync.worker_rank()
    for step in range(steps):
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(x), y)
            if me == 1 and step == nan_step:
                loss = loss * float("nan")
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.state_dict()


def reference_skipping(steps: int, workers: int, skip: int) -> dict[str, torch.Tensor]:
    """`reference_mlp` with step `skip` left out entirely."""
    return reference_mlp(steps, workers, skip=skip)


def make_bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # No bias before the BatchNorm (as is usual): its gradient would be rounding noise, which Adam scales up to
    # steps of about lr in a direction set by the last bits, so any difference of float kernels (a server on a
    # GPU) would move it far from the reference.
    return nn.Sequential(nn.Linear(IN, HIDDEN, bias=False), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def train_bn(steps: int) -> dict[str, torch.Tensor]:
    """A BatchNorm model trained with Adam (the server-side optimizer keeps Adam's state)."""
    trainer = gradsync.Trainer(make_bn_net(), torch.optim.Adam, lr=0.01)
    run_loop(trainer, steps)
    return trainer.state_dict()


def reference_bn(steps: int, workers: int) -> dict[str, torch.Tensor]:
    """Single process, W simulated workers: mean of their gradients, mean of their updated buffers."""
    import copy

    model = make_bn_net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        grads, buffers = [], []
        for w in range(workers):
            replica = copy.deepcopy(model)
            x, y = batch(step, w)
            F.cross_entropy(replica(x), y).backward()
            grads.append([p.grad for p in replica.parameters()])
            buffers.append([b.detach().clone() for b in replica.buffers()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).sum(0) / workers
        opt.step()
        with torch.no_grad():
            for b, *bs in zip(model.buffers(), *buffers):
                b.copy_(torch.stack(bs).sum(0) / workers if b.is_floating_point() else bs[0])
    return model.state_dict()


def train_then_read_over_grpc(steps: int) -> dict:
    """Train, then read the job from outside the RPC world: the gRPC client and the CLI."""
    import os
    import stat

    from gradsync.transport.grpc.client import Client
    from helpers import run_cli

    state = train_mlp(steps)
    run_dir = os.environ["GRADSYNC_RUN_DIR"]
    with Client(run_dir) as client:
        pulled, versions = client.pull_versioned()
        stats, pieces = client.stats(), client.pieces()
    out = os.path.join(run_dir, "weights.pt")
    status = run_cli("status", run_dir, timeout=60)
    pulled_cli = run_cli("pull", run_dir, out, timeout=60)
    return dict(
        state=state,
        pulled=pulled,
        versions=versions,
        stats=stats,
        pieces=pieces,
        modes=[stat.S_IMODE(os.stat(os.path.join(run_dir, f)).st_mode) for f in sorted(os.listdir(run_dir))
               if f.startswith("grpc-")],
        status=status.stdout + status.stderr,
        cli_weights=torch.load(out) if pulled_cli.returncode == 0 else pulled_cli.stderr,
    )


def train_mlp_with_metrics(steps: int) -> tuple[dict[str, torch.Tensor], dict]:
    """`train_mlp`, also returning worker's step metrics (bytes on the wire)."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1, momentum=0.9)
    run_loop(trainer, steps)
    return trainer.state_dict(), trainer.metrics.summary()


def train_with_outside_worker(steps: int, steps_worker1: int) -> dict:
    """Async gRPC job: worker 1 leaves early; midway, a process outside the job joins as worker 9,
    pulls and pushes one gradient over gRPC, and leaves. Returns what worker 0 saw at the end."""
    import os
    import subprocess
    import sys

    import torch.distributed.rpc as rpc

    from gradsync.transport.grpc.client import Client

    me = gradsync.worker_rank()
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.05)
    outsider = None
    run_loop(trainer, steps if me == 0 else steps_worker1)
    if me == 0:
        code = (
            "import sys, torch, torch.nn.functional as F; sys.path.insert(0, %r)\n"
            "from gradsync.transport.grpc.client import Client; import jobs\n"
            "c = Client(%r)\n"
            "state, versions = c.pull_versioned()\n"
            "model = jobs.make_mlp(); model.load_state_dict(state)\n"
            "x, y = jobs.batch(99, 9); F.cross_entropy(model(x), y).backward()\n"
            "print(c.push({n: p.grad for n, p in model.named_parameters()}, versions, worker=9))\n"
        ) % (os.path.dirname(__file__), os.environ["GRADSYNC_RUN_DIR"])
        outsider = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        run_loop(trainer, 2)
    with Client(os.environ["GRADSYNC_RUN_DIR"]) as client:
        stats = client.stats()
    return dict(stats=stats, rpc_agent=rpc.api._is_current_rpc_agent_set(),
                outsider=None if outsider is None else (outsider.returncode, outsider.stdout + outsider.stderr))


def init_then_train(steps: int, init_kwargs: dict) -> dict[str, torch.Tensor]:
    """The README's script shape: the function calls gradsync.init() (and shutdown) itself."""
    gradsync.init(**init_kwargs)
    state = train_mlp(steps)
    gradsync.shutdown()
    return state


def train_mlp_server_stats(steps: int) -> dict[int, dict]:
    """Train with SGD; returns every server's counters, read before any other call (no state_dict)."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1)
    run_loop(trainer, steps)
    return trainer.server_stats()


def train_mlp_and_stats(steps: int, lr: float = 0.1, momentum: float = 0.0, slow_s: float = 0.0,
                        hidden: int = HIDDEN) -> tuple[dict[str, torch.Tensor], dict]:
    """Train the MLP (`hidden` wide) with SGD; returns the final state and every server's counters (`slow_s`:
    every worker but worker 0 sleeps that long before each step)."""
    trainer = gradsync.Trainer(make_mlp(hidden=hidden), torch.optim.SGD, lr=lr, momentum=momentum)
    run_loop(trainer, steps, pause_s=slow_s if gradsync.worker_rank() != 0 else 0.0)
    return trainer.state_dict(), trainer.server_stats()


def forever(pids: str) -> None:
    """A worker's body that never ends: after 2 steps (every rank is up) worker 0 notes every rank's pid
    (the fork server's children)."""
    from fault_injection import batch, make_mlp
    from gradsync.launcher import procfs

    me, step = gradsync.worker_rank(), 0
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1)
    while True:
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
        step += 1
        if step == 2 and me == 0:
            with open(os.path.join(pids, "ranks.tmp"), "w") as f:
                f.write(" ".join(map(str, procfs.children(os.getppid()))))
            os.rename(os.path.join(pids, "ranks.tmp"), os.path.join(pids, "ranks"))


def train_with_timeline(steps: int, bn: bool = False, timeline: bool = True
                        ) -> tuple[dict[str, torch.Tensor], list[dict], list[dict]]:
    """`train_mlp` (or, with `bn`, `train_bn`) with the step timeline on (GRADSYNC_TIMELINE, set here, in
    the rank, before its Trainer reads it): the final state, each
    step's record and each step's timeline."""
    import dataclasses

    from gradsync.core import settings

    if timeline:  # this rank's own environment: it ends with the job
        os.environ[settings.TIMELINE.env] = "1"
    else:
        os.environ.pop(settings.TIMELINE.env, None)
    if bn:
        trainer = gradsync.Trainer(make_bn_net(), torch.optim.Adam, lr=0.01)
    else:
        trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1, momentum=0.9)
    run_loop(trainer, steps)
    records = [dataclasses.asdict(r) for r in trainer.metrics.records]
    return trainer.state_dict(), records, list(trainer.metrics.timeline.steps)


def environment_value(name: str) -> str | None:
    """This rank's value of the environment variable `name`."""
    return os.environ.get(name)


def threads_and_draws() -> tuple[int, float, int]:
    """This rank's intra-op thread count and a first draw of torch's and numpy's global generators."""
    import numpy

    return torch.get_num_threads(), torch.rand(1).item(), int(numpy.random.randint(2**31))
