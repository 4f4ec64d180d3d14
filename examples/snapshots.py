"""A training script in the shape of pytorch/examples' DDP trainers, ported to gradsync as docs/porting.md says.

What real scripts do and gradsync must survive as they are: options from argparse, a DataLoader with worker
processes (any start method) over a DistributedSampler, mixed precision (bfloat16 autocast on CPU), and a
snapshot file in the working directory, saved every epoch with the optimizer object the script built, and
resumed from when the script finds one at start. Run it twice and the second run continues the first:
    gradsync run --strategy ps --workers 2 examples/snapshots.py --epochs 2
    gradsync run --strategy ps --workers 2 examples/snapshots.py --epochs 4
"""
import argparse
import json
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradsync
from digits import load_digits

CONTEXTS = ("none", "default", "fork", "spawn", "forkserver")
"""--loaders: 'none' loads in the training process (num_workers=0); the others start loader workers with that
multiprocessing start method ('default': the DataLoader's own choice)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--samples", type=int, default=512, help="the first N training samples")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--loaders", default="default",
                        help=f"comma-separated, one per epoch in turn, of {', '.join(CONTEXTS)}")
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast in the forward")
    parser.add_argument("--snapshot", default="snapshot.pt", help="saved every epoch; resumed from when found")
    parser.add_argument("--losses", help="worker 0 writes each epoch's mean loss here (JSON)")
    args = parser.parse_args()
    unknown = [c for c in args.loaders.split(",") if c not in CONTEXTS]
    if unknown:
        parser.error(f"--loaders: unknown {unknown}, expected any of {', '.join(CONTEXTS)}")
    return args


def loader(dataset: TensorDataset, sampler: DistributedSampler, args, context: str) -> DataLoader:
    if context == "none":
        return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.loader_workers,
                      multiprocessing_context=None if context == "default" else context,
                      persistent_workers=context == "fork", pin_memory=context == "spawn")


def main() -> None:
    args = parse_args()
    gradsync.init()
    x, y, _, _ = load_digits()
    dataset = TensorDataset(x[:args.samples], y[:args.samples])
    sampler = DistributedSampler(dataset, num_replicas=gradsync.num_workers(), rank=gradsync.worker_rank(),
                                 shuffle=True, seed=0, drop_last=True)
    contexts = args.loaders.split(",")
    loaders = {c: loader(dataset, sampler, args, c) for c in set(contexts)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first_epoch = snapshot["epochs_run"]
        if gradsync.worker_rank() == 0:
            print(f"resuming from {args.snapshot} at epoch {first_epoch}", flush=True)
    trainer = gradsync.Trainer(model, optimizer)
    losses = []
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        total = batches = 0
        for xb, yb in loaders[contexts[epoch % len(contexts)]]:
            with dist_autograd.context() as cid:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                    loss = F.cross_entropy(trainer.model(xb), yb)
                dist_autograd.backward(cid, [loss])
                trainer.step(cid)
            gradsync.log(loss=loss.item(), samples=len(yb))
            total, batches = total + loss.item(), batches + 1
        losses.append(total / batches)
        if gradsync.worker_rank() == 0:
            torch.save({"model": trainer.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epoch + 1},
                       args.snapshot)
            print(f"epoch {epoch} loss {losses[-1]:.4f}", flush=True)
    if gradsync.worker_rank() == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump({"first_epoch": first_epoch, "losses": losses}, f)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
