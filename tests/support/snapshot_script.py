"""A training script in the shape of pytorch/examples' trainers, for `gradsync compare` tests: at start it resumes
from snapshot.pt (the epoch) and model.pt (the whole module, `torch.save(model)`, loaded back into the running job
with `trainer.load_state_dict` on every worker) in its working directory when it finds them, and worker 0 saves
both there after every epoch. 3 epochs of 3 SGD steps of the jobs.py MLP, each step logged with its global step (from 0); each epoch
appends a line to the file that `--notes` names (a relative path: the working directory's).

`--epochs-under STRATEGY:N`: N epochs under that strategy (a run that logs fewer steps); `--fail-after K`: worker 1
raises once it has logged K steps."""
import argparse
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
from jobs import batch, make_mlp  # noqa: E402

EPOCHS, STEPS = 3, 3
SNAPSHOT, MODEL = "snapshot.pt", "model.pt"

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs-under", default="")
    parser.add_argument("--fail-after", type=int, default=0)
    parser.add_argument("--notes", default="notes.txt")
    args = parser.parse_args()
    gradsync.init()
    strategy = os.environ["GRADSYNC_STRATEGY"]
    under, _, fewer = args.epochs_under.partition(":")
    epochs = int(fewer) if under == strategy else EPOCHS
    me = gradsync.worker_rank()
    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.SGD, lr=0.1)
    first = torch.load(SNAPSHOT)["epoch"] + 1 if os.path.exists(SNAPSHOT) else 0
    if first:
        trainer.load_state_dict(torch.load(MODEL, weights_only=False).state_dict())
    for epoch in range(first, epochs):
        for i in range(STEPS):
            step = epoch * STEPS + i
            x, y = batch(step, me)
            with dist_autograd.context() as cid:
                loss = F.cross_entropy(trainer.model(x), y)
                dist_autograd.backward(cid, [loss])
                trainer.step(cid)
            gradsync.log(step=step, loss=loss.item(), samples=len(y))
            if me == 1 and step + 1 == args.fail_after:
                raise RuntimeError(f"snapshot_script.py fails after {args.fail_after} steps on purpose")
        if me == 0:
            torch.save({"epoch": epoch}, SNAPSHOT)
            torch.save(model, MODEL)
            with open(args.notes, "a") as f:
                f.write(f"{strategy} epoch {epoch}\n")
            print(f"snapshot_script.py: {strategy} saved epoch {epoch}", file=sys.stderr, flush=True)
    gradsync.shutdown()
