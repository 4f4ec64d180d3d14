"""Train a digit classifier (8x8 handwritten digits, shipped in examples/data) with gradsync.

Run it with either strategy and any number of workers; the loop is the same:
    gradsync run --strategy ps --workers 2 --servers 1 examples/digits.py
    gradsync run --strategy allreduce --workers 3 examples/digits.py
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from progress import Progress

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits(test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): pixels scaled to [0, 1], a fixed shuffle."""
    with gzip.open(DATA, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64] / 16.0)
    y = torch.from_numpy(table[:, 64]).long()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def train(epochs: int = 10, batch_size: int = 64, lr: float = 0.05) -> dict:
    """The training loop every worker runs; returns this worker's summary. `batch_size`: a step's joint batch,
    split among the workers, so that the training is much the same at any number of them."""
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    x_train, y_train, x_test, y_test = load_digits()
    # every worker gets the same number of samples, so the same number of steps (a sync step waits for every
    # worker); the remainder is left out, as DistributedSampler(drop_last=True) does
    share = len(y_train) // workers
    mine = torch.arange(me, share * workers, workers)  # this worker's share of the training set
    batch_size //= workers  # this worker's part of each step's batch
    steps_per_epoch = share // batch_size
    model = make_model()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    bar = Progress(epochs * steps_per_epoch, f"worker {me}", enabled=me == 0)
    start, losses = time.perf_counter(), []
    order = lambda epoch: mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch * 100 + me))]  # noqa: E731
    # from trainer.start_step: 0, or the step a resumed job (--resume) or a dead worker's replacement starts at
    for at in range(trainer.start_step, epochs * steps_per_epoch):
        epoch, step = divmod(at, steps_per_epoch)
        if step == 0 or at == trainer.start_step:
            shuffled = order(epoch)
        idx = shuffled[step * batch_size : (step + 1) * batch_size]
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(x_train[idx]), y_train[idx])
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        losses.append(loss.item())
        gradsync.log(loss=loss.item(), samples=len(idx))  # for gradsync compare; nothing otherwise
        bar.update(f"loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    trainer.model.eval()
    with torch.no_grad():
        accuracy = (trainer.model(x_test).argmax(1) == y_test).float().mean().item()
    gradsync.log(acc=accuracy)
    return {
        "final_loss": sum(losses[-steps_per_epoch:]) / len(losses[-steps_per_epoch:]),
        "test_accuracy": accuracy,
        "samples_per_s": workers * len(losses) * batch_size / elapsed,
        **trainer.metrics.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    gradsync.init()
    summary = train(args.epochs)
    if gradsync.worker_rank() == 0:
        print(f"test accuracy {summary['test_accuracy']:.3f}, final loss {summary['final_loss']:.3f}")
    gradsync.shutdown()


if __name__ == "__main__":
    main()
