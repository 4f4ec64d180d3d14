"""The allreduce strategy's DDP hooks (`gradsync.worker.ddp.ddp_hooks.make_ddp_hook`) in a real
2-process gloo group on 127.0.0.1, against a plain mean all-reduce.

Each rank trains nothing: for a few steps it runs the same small model on its
own batch, once through DDP with the hook and once without DDP, all-reduces
the plain gradients (sum / world size) and records both. The test then
checks every compression's gradients against that mean within the
compression's own bound.
"""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.launcher.local_job import host_store
from gradsync.worker.ddp.ddp_hooks import make_ddp_hook

WORLD = 2
STEPS = 4
COMPRESSIONS = ("none", "fp16", "bf16", "int8")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)  # the parent hosts it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        results = {}
        for compression in COMPRESSIONS:
            plain = _model()
            ddp = DDP(_model(), bucket_cap_mb=0.01)  # ~2.5k floats per bucket: several buckets
            state, hook = make_ddp_hook(compression, block_size=64)
            ddp.register_comm_hook(state, hook)
            steps = []
            for step in range(STEPS):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
                for m in (plain, ddp):
                    m.zero_grad()
                    nn.functional.cross_entropy(m(x), y).backward()
                local = torch.cat([p.grad.flatten() for p in plain.parameters()])
                mean = local.clone()
                dist.all_reduce(mean)
                mean /= WORLD
                amax = local.abs().max()
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
                got = torch.cat([p.grad.flatten() for p in ddp.parameters()])
                steps.append({"got": got, "mean": mean, "amax": amax})
            results[compression] = {"steps": steps, "buckets": len(state.residuals)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_ranks(out_dir: str, timeout: float) -> None:
    """Start WORLD ranks; re-raise the first rank failure; kill every rank on failure or timeout. The ranks
    meet in a store this process hosts on loopback, on a port the kernel picked (no free-port guess another
    process can take)."""
    store = host_store(0)
    ctx = mp.start_processes(_rank_main, args=(store.port, out_dir), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP hook ranks did not finish within {timeout:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_hook")
    _run_ranks(str(out), timeout=100)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_ddp_hook_gives_the_mean_over_ranks(ranks, compression):
    for rank in ranks:
        rec = rank[compression]
        assert len(rec["steps"]) == STEPS
        for s in rec["steps"]:
            got, mean = s["got"], s["mean"]
            if compression == "none":
                torch.testing.assert_close(got, mean, rtol=1e-6, atol=1e-8)
            elif compression in ("fp16", "bf16"):
                # Two roundings of at most eps / 2 relative: each rank's cast of g / W (|g| <= amax, so
                # together <= eps / 2 * amax) and the 16-bit sum (<= eps / 2 * |mean| <= eps / 2 * amax);
                # plus fp16's subnormal spacing (6e-8) near zero.
                eps = torch.finfo(torch.float16 if compression == "fp16" else torch.bfloat16).eps
                err = (got - mean).abs().max().item()
                assert err <= eps * s["amax"].item() + 1e-7, (err, eps * s["amax"].item())
            else:
                # got - mean = mean_r(e_r,prev - e_r,new), each |e| <= s / 2 with s = amax(v) / 127 and
                # |v| <= |g| + |e_prev| <= amax * (1 + 1 / 254): |got - mean| <= amax * 1.004 / 127.
                bound = s["amax"].item() * 1.004 / 127
                err = (got - mean).abs().max().item()
                assert 0 < err <= bound, (err, bound)
    if compression == "int8":
        assert ranks[0]["int8"]["buckets"] > 1  # several buckets, one residual each
    # Every rank ends with the same gradients, as DDP promises.
    for a, b in zip(ranks[0][compression]["steps"], ranks[1][compression]["steps"]):
        assert torch.equal(a["got"], b["got"])


@pytest.mark.parametrize("call,match", [
    (lambda: make_ddp_hook("int4"), "compression: unknown value 'int4'"),
    (lambda: make_ddp_hook("int8", block_size=3), "block_size: got 3"),
])
def test_bad_hook_settings_get_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
