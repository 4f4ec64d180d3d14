"""Resumable training loops for the checkpoint tests of every mode and of resharding, and what a checkpoint
folder holds, read back as whole tensors by name (the tests' own reading, independent of `ps.reshard`)."""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync
from fault_injection import Fault, kill_job
from gradsync.core.buckets import Entry, join_pieces
from gradsync.core.optimizer_spec import join_state
from gradsync.tables.placement import join_rows
from gradsync.ps import shard_file
from helpers import wait_until
from jobs import batch, make_mlp, run_loop
from sparse_models import ClickNet, click_batch


def _started(trainer: gradsync.Trainer, out: str | None) -> None:
    """On a resumed job: worker 0 saves the state the job starts from to out/start.pt before any worker
    steps (the others wait for the file), so a test can compare it with the checkpoint's."""
    if out is None or trainer.start_step == 0:
        return
    path = os.path.join(out, "start.pt")
    if gradsync.worker_rank() == 0:
        start = {"model": trainer.state_dict(), "optimizer": trainer.optimizer.state_dict()}
        torch.save(start, path + ".tmp")
        os.rename(path + ".tmp", path)
    wait_until(lambda: os.path.exists(path), f"worker 0 did not save {path}", timeout=60)


def train_clicks(steps: int, kill_at: int | None = None, out: str | None = None) -> tuple[int, dict]:
    """ClickNet with Adam on the dense layers (its lr decayed by hand each step) and lazy-momentum rows (served
    by row over torch RPC, dense over gRPC), from `trainer.start_step`; worker 0 kills the job as it reaches
    `kill_at`. Returns (start step, final state)."""
    me = gradsync.worker_rank()
    model = ClickNet()
    trainer = gradsync.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                               table_optimizer=gradsync.RowSGD(lr=0.1, momentum=0.9))
    _started(trainer, out)
    for step in range(trainer.start_step, steps):
        if me == 0 and step == kill_at:
            kill_job()
        bag, ids, dense, y = click_batch(step, me)
        trainer.optimizer.param_groups[0]["lr"] = 0.01 * 0.9**step  # a resumed job starts with step 9's
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(trainer.model(bag, ids, dense), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
    return trainer.start_step, trainer.state_dict()


def train_mlp(steps: int, out: str | None = None) -> tuple[int, dict]:
    """The MLP with Adam from `trainer.start_step` on worker w's batches of each step (w < num_workers()).
    Returns (start step, final state)."""
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01))
    _started(trainer, out)
    run_loop(trainer, steps)
    return trainer.start_step, trainer.state_dict()


def train_mlp_with_fault(steps: int, fault: Fault) -> tuple[int, dict]:
    """`train_mlp` in which `fault` kills a worker or makes it leave early (an async job goes on without it)."""
    me = gradsync.worker_rank()
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01))
    run_loop(trainer, steps, stop=lambda step: fault.strike(me, step))
    return trainer.start_step, trainer.state_dict()


def reference_mlp(start: dict, first: int, steps: int, workers: int) -> dict[str, torch.Tensor]:
    """Single-process training from `start` (model and optimizer state dicts) for steps first..steps-1 on the
    concatenation of the workers' batches."""
    model = make_mlp()
    model.load_state_dict(start["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(start["optimizer"])
    for step in range(first, steps):
        xs, ys = zip(*(batch(step, w) for w in range(workers)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model.state_dict()


def saved(folder: str) -> dict:
    """What the checkpoint folder holds, whole: {"model": tensors by name (the servers' parameters,
    buffers and tables, and the worker's model under allreduce and hybrid), "optimizer": the servers'
    optimizer state by parameter name, "worker": worker 0's file, "versions": each shard's version}."""
    with open(os.path.join(folder, "MANIFEST.json")) as f:
        manifest = json.load(f)
    worker = shard_file.load(os.path.join(folder, "worker-0.ckpt"))
    model, optimizer, entries, tables, pieces, versions = dict(worker.get("model", {})), {}, [], {}, {}, {}
    for path in sorted(glob.glob(os.path.join(folder, "shard-*.ckpt"))):
        shard = shard_file.load(path)
        mine = [Entry(n, tuple(shape), 0, numel, start) for n, shape, start, numel in shard["entries"]]
        entries += mine
        versions[shard["shard_id"]] = shard["version"]
        pieces.update(shard["params"])
        model.update(shard["buffers"])
        model.update(shard["frozen"])
        optimizer.update(shard["optimizer"]["state"])
        for name, rows in shard["tables"].items():
            tables.setdefault(name, {})[rows["server"]] = rows
    model.update(join_pieces(pieces, [e for e in entries if not e.whole]))
    for name, parts in tables.items():
        model[name] = join_rows({s: p["values"] for s, p in parts.items()},
                                (sum(p["values"].shape[0] for p in parts.values()), parts[0]["values"].shape[1]),
                                manifest["servers"])
    return {"model": model, "optimizer": join_state(optimizer, entries), "worker": worker, "versions": versions}


def by_name(optimizer_state: dict, names: list[str]) -> dict[str, dict]:
    """A single-process optimizer state dict's per-parameter state keyed by parameter name (one group)."""
    return {names[i]: s for i, s in optimizer_state["state"].items()}
