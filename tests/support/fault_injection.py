"""Fault injection for the multi-process tests, after torchft's failure injector: worker W fails at step K."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import NamedTuple

import torch

import gradsync
from gradsync.launcher import procfs
from jobs import batch, make_mlp, run_loop


class Fault(NamedTuple):
    """Worker `worker` fails as it reaches step `step`: 'raise' an exception, 'kill' itself (SIGKILL), 'stop'
    itself (SIGSTOP: alive but silent until the launcher kills it), 'leave' (stop training early, as a
    worker with fewer batches does), or 'exit' (sys.exit(0): a script that ends there, without
    gradsync.shutdown()); 'mark' only notes the time (a sign that the job runs). `stamps`: a directory where
    it notes time.time() in `fault` first."""

    worker: int
    step: int
    how: str
    stamps: str | None = None

    def strike(self, worker: int, step: int) -> bool:
        """Call at the top of each step; True when this worker must stop training now ('leave')."""
        if (worker, step) != (self.worker, self.step):
            return False
        if self.stamps is not None:
            stamp(self.stamps, "fault")
        if self.how == "raise":
            raise RuntimeError(f"worker {worker} broke on purpose at step {step}")
        if self.how == "exit":
            sys.exit(0)
        if self.how in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)
        return self.how == "leave"


def stamp(directory: str, name: str, value: float | None = None) -> None:
    """Write `value` (default: time.time()) to directory/name."""
    with open(os.path.join(directory, name), "w") as f:
        f.write(repr(time.time() if value is None else value))


def read_stamp(directory: str, name: str) -> float:
    with open(os.path.join(directory, name)) as f:
        return float(f.read())


def train_with_fault(fault: Fault, steps: int) -> int:
    """Train the MLP for up to `steps` steps on every worker with `fault` injected; returns the steps taken."""
    return _train(gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1), fault, steps)


def train_in_join(fault: Fault, steps: int, outside: int | None = None) -> int:
    """`train_with_fault` inside `trainer.join()` on every worker but `outside` (None: on every one)."""
    trainer = gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1)
    with trainer.join() if gradsync.worker_rank() != outside else contextlib.nullcontext():
        return _train(trainer, fault, steps)


def _train(trainer: gradsync.Trainer, fault: Fault, steps: int) -> int:
    """This worker's loop: up to `steps` steps on its MLP batches, stopping where `fault` strikes."""
    me = gradsync.worker_rank()
    return run_loop(trainer, steps, stop=lambda step: fault.strike(me, step))


def train_then_leave(fault: Fault, steps: int) -> None:
    """`train_with_fault`, then `gradsync.shutdown()`; notes in fault.stamps/shutdown-<worker> how long it took."""
    train_with_fault(fault, steps)
    me, start = gradsync.worker_rank(), time.monotonic()
    gradsync.shutdown()
    stamp(fault.stamps, f"shutdown-{me}", time.monotonic() - start)


OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)), "adam": (torch.optim.Adam, dict(lr=0.01))}


def kill_job() -> None:
    """SIGKILL every rank of this `gradsync.launch` job (the children of its fork server), this one last."""
    for pid in procfs.children(os.getppid()):
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def train_resumable(steps: int, optimizer: str, kill_at: int | None = None) -> tuple[int, dict]:
    """The README's resumable loop on noisy batches (noise from the global RNG, so a resume must restore it);
    worker 0 kills the whole job as it reaches step `kill_at`. Returns (start step, final state)."""
    optimizer_cls, kwargs = OPTIMIZERS[optimizer]
    trainer = gradsync.Trainer(make_mlp(), optimizer_cls, **kwargs)

    def noisy(step: int, worker: int):
        if worker == 0 and step == kill_at:
            kill_job()
        x, y = batch(step, worker)
        return x + 0.1 * torch.randn_like(x), y

    run_loop(trainer, steps, data=noisy)
    return trainer.start_step, trainer.state_dict()


def build_wider() -> None:
    """Build a Trainer for a wider MLP than `make_mlp` (a model a checkpoint of `make_mlp` must refuse)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    gradsync.Trainer(model, torch.optim.SGD, lr=0.1)


def train_without_one_trainer(lazy: int, steps: int) -> int:
    """`train_with_fault` on every worker but `lazy`, which never builds its Trainer (it sleeps until killed)."""
    if gradsync.worker_rank() == lazy:
        time.sleep(3600)
    return train_with_fault(Fault(-1, -1, "none"), steps)


def sample_without_arguments() -> list[int]:
    """The indices of `DistributedSampler(dataset)` with no place given, as a DDP script writes it."""
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(list(range(10))))


def die_mid_push(withheld: int) -> None:
    """A worker killed halfway through a push, the same way every time (torch RPC ps jobs): from now on, this
    worker's push reaches every server but `withheld` whole, and `withheld` only in part, its head and first
    piece (the others never leave: answered here at once, so the push goes on); SIGKILL once server 0 has
    answered its part (applied it)."""
    import torch.distributed.rpc as rpc

    from gradsync.core.job_names import server_name
    from gradsync.core.futures import resolved
    from gradsync.transport import rpc as rpc_transport

    send, pieces = rpc.rpc_async, []

    def rpc_async(to, fn, *args, **kwargs):
        if fn is rpc_transport.rpc_push_piece and to == server_name(withheld):
            pieces.append(fn)
            if len(pieces) > 1:
                return resolved(None)
        fut = send(to, fn, *args, **kwargs)
        if fn is rpc_transport.rpc_push and to == server_name(0):
            fut.add_done_callback(lambda _: os.kill(os.getpid(), signal.SIGKILL))
        return fut

    rpc.rpc_async = rpc_async


def break_push(worker: int) -> None:
    """In a server, before gradsync.init(): its push handler raises a KeyError for `worker`'s pushes (a server's
    own failure, not the push's), and answers the others as before."""
    from gradsync.ps.server import ParameterServer

    push = ParameterServer.push

    def broken(self, pusher: int, *args, **kwargs):
        if pusher == worker:
            raise KeyError(f"the push handler broke on purpose for worker {worker}")
        return push(self, pusher, *args, **kwargs)

    ParameterServer.push = broken
