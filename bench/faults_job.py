"""The training script bench/faults.py runs under `gradsync run` (a 1.06M-parameter MLP, AdamW, each worker's seeded
batch of each step, emulated compute); worker 1's first process SIGKILLs itself at `--kill-at` ('forward': as the
step begins; 'backward': inside its backward), or with `--kill-server`, worker 0 SIGKILLs server 1 there. Each worker appends a JSON line per step it committed to
`--log`-<worker>.jsonl (its wall time, the step's seconds in trainer.step, its process's restart count); worker 0
writes the final parameters' sha256 to `--log`-final.json.

    gradsync run --strategy ps --workers 2 bench/faults_job.py --log PREFIX [--steps 150] [--compute-s 0.15]
        [--kill-at 60 --kill-in forward|backward [--kill-server]]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F

import gradsync


def model() -> torch.nn.Module:
    """512 -> 1024 -> 512 -> 10: 1,055,242 parameters (the workload of bench/faults_torchft.py too)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--compute-s", type=float, default=0.15)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in", choices=("forward", "backward"), default="forward")
    parser.add_argument("--kill-server", action="store_true", help="worker 0 kills server 1 instead")
    args = parser.parse_args()
    gradsync.init()
    me = gradsync.worker_rank()
    net = model()
    trainer = gradsync.Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    dies = me == (0 if args.kill_server else 1) and gradsync.restart_count() == 0
    victim = trainer.server_stats()[1]["pid"] if args.kill_server and dies else os.getpid()
    step = trainer.start_step
    if dies and args.kill_in == "backward":
        net[2].register_full_backward_hook(lambda *a: os.kill(victim, signal.SIGKILL) if step == args.kill_at else None)
    with open(f"{args.log}-{me}.jsonl", "a") as log:
        for step in range(trainer.start_step, args.steps):
            if dies and step == args.kill_at and args.kill_in == "forward":
                os.kill(victim, signal.SIGKILL)
            time.sleep(args.compute_s)
            x, y = batch(step, me)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
                start = time.perf_counter()
                trainer.step(cid)
            log.write(json.dumps({"step": step, "t": time.time(), "step_s": time.perf_counter() - start,
                                  "restart": gradsync.restart_count()}) + "\n")
            log.flush()
    if me == 0:
        state = trainer.state_dict()
        digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
        with open(f"{args.log}-final.json", "w") as f:
            json.dump({"sha256": digest, "start_step": trainer.start_step}, f)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
