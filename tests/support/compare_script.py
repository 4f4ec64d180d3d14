"""A tiny training script for `gradsync compare` tests: 10 SGD steps of the jobs.py MLP, logged.

`--quiet`: log nothing (no gradsync.log calls); `--fail-under STRATEGY`: the workers raise under that strategy."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
from jobs import make_mlp, run_loop  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--fail-under", default=None)
    args = parser.parse_args()
    gradsync.init()
    if os.environ.get("GRADSYNC_STRATEGY") == args.fail_under:
        raise RuntimeError(f"compare_script.py fails under {args.fail_under} on purpose")
    run_loop(gradsync.Trainer(make_mlp(), torch.optim.SGD, lr=0.1), 10, log=not args.quiet)
    if not args.quiet:
        gradsync.log(acc=0.5 + gradsync.worker_rank())
    gradsync.shutdown()
