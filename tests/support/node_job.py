"""A tiny deterministic gradsync job that runs as written under `gradsync run` and under `torchrun` (one node or
many): `python node_job.py OUT_DIR STEPS`. Each worker trains `jobs.train_mlp(STEPS)` and writes its final
state dict to OUT_DIR/worker-<worker rank>.pt, and beside it (OUT_DIR/worker-<worker rank>.json) its global rank,
its host's network devices, the rendezvous store's address and its own address towards it (the source address the
route to the store picks: a UDP socket's connect sends nothing); servers serve inside gradsync.init()."""
import json
import os
import socket
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
import jobs  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])
gradsync.init()
state = jobs.train_mlp(steps)
me = gradsync.worker_rank()
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((os.environ["MASTER_ADDR"], 9))
    address = probe.getsockname()[0]
torch.save(state, os.path.join(out, f"worker-{me}.pt"))
with open(os.path.join(out, f"worker-{me}.json"), "w") as f:
    json.dump({"rank": int(os.environ["RANK"]), "devices": sorted(n for _, n in socket.if_nameindex()),
               "master_addr": os.environ["MASTER_ADDR"], "address": address, "workers": gradsync.num_workers()}, f)
gradsync.shutdown()
