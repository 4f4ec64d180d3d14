"""TorchRec as bench/sparse.py's outside baseline: the same tables, ids and MLP through TorchRec's own API.

The tables are one `EmbeddingBagCollection` (one bag of one id per field and sample, sum pooling: the same
lookup as `nn.Embedding`), fed a `KeyedJaggedTensor`; `DistributedModelParallel` over gloo on the CPU shards
them with a table-wise plan (`torchrec-tw`: table f on worker f mod W) or a row-wise plan (`torchrec-rw`: each
table cut into W blocks of consecutive rows), trains them with TorchRec's fused row-wise optimizer
(`apply_optimizer_in_backward`: RowWiseAdagrad, FBGEMM's EXACT_ROWWISE_ADAGRAD, eps 1e-10 as
gradsync.RowAdagrad's; or SGD, EXACT_SGD), and keeps the MLP in DDP under torch's optimizer. TorchRec divides the
gradients coming back through its all-to-alls by W (`comm_ops.set_gradient_division`, on by default), so a
row's owner applies the mean of the W workers' row gradients, as gradsync does: both train as single-process training on
the joint batch does, which `check` verifies row by row on each worker's shards.

The plans are written with `construct_module_sharding_plan`: TorchRec's planner (`EmbeddingShardingPlanner`)
refuses a row-wise constraint on the CPU ("No available sharding type and compute kernel combination":
`EmbeddingBagCollectionSharder.sharding_types` offers row-wise for CUDA only), while the row-wise sharding
itself runs on the CPU.

Optional: imported only when bench/sparse.py runs a torchrec configuration, and only where torchrec imports
(`INSTALL`; never a dependency of gradsync). The W ranks are spawned processes of the bench (gloo over a
FileStore), not a gradsync job.
"""
from __future__ import annotations

import datetime
import os
import queue
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from gradsync.launcher.procfs import memory
from measure import cpu_per_step, cpu_snapshot, job_pids
from sparse_workload import BATCHES, DIM, LR, CTRModel, optimizers, reference, worker_batches

PLANS = {"torchrec-tw": "table_wise", "torchrec-rw": "row_wise"}
INSTALL = "pip install --no-deps -r bench/requirements-torchrec.txt"
EPS = 1e-10  # gradsync.RowAdagrad's
POLL_S = 1.0


def missing() -> str | None:
    """Why the torchrec configurations cannot run here (None: torchrec imports)."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # an import error, or fbgemm's operators failing to load against this torch
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; {INSTALL})"
    return None


class TorchRecCTR(nn.Module):
    """examples/ctr.py's CTRModel with its tables as one EmbeddingBagCollection (`tables`) and the same MLP."""

    def __init__(self, fields: int, table_rows: int, device: torch.device):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        self.tables = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"table{f}", embedding_dim=DIM, num_embeddings=table_rows,
                               feature_names=[f"field{f}"], pooling=PoolingType.SUM) for f in range(fields)],
            device=device)
        self.mlp = CTRModel(fields, 1, DIM, tables_on="meta").mlp

    def forward(self, features) -> torch.Tensor:
        by_field = self.tables(features).to_dict()  # a sharded collection's values() are in its shards' order
        pooled = torch.cat([by_field[f"field{f}"] for f in range(len(by_field))], 1)
        return self.mlp(pooled).squeeze(1)


def features(ids: torch.Tensor):
    """A batch's ids (B, fields) as a KeyedJaggedTensor: one id per field and sample."""
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"field{f}" for f in range(ids.shape[1])], values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32))


def sharded_model(config: str, fields: int, table_rows: int, workers: int, optimizer: str, device: str):
    """DistributedModelParallel over TorchRecCTR with `config`'s plan and TorchRec's fused row optimizer; the
    dense optimizer over the rest. Every rank must call it."""
    import torchrec.optim as trec_optim
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = TorchRecCTR(fields, table_rows, torch.device(device))
    if optimizer == "sgd":
        apply_optimizer_in_backward(trec_optim.SGD, model.tables.parameters(), {"lr": LR})
    else:
        apply_optimizer_in_backward(trec_optim.RowWiseAdagrad, model.tables.parameters(), {"lr": LR, "eps": EPS})
    sharder = EmbeddingBagCollectionSharder()
    per_table = {f"table{f}": table_wise(rank=f % workers) if PLANS[config] == "table_wise" else row_wise()
                 for f in range(fields)}
    plan = ShardingPlan({"tables": construct_module_sharding_plan(
        model.tables, per_param_sharding=per_table, local_size=workers, world_size=workers, device_type="cpu",
        sharder=sharder)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_cls, _ = optimizers(optimizer)
    dense = dense_cls([p for name, p in dmp.named_parameters() if "embedding_bags" not in name], lr=LR)
    return dmp, dense


def _table_key(key: str) -> str | None:
    """CTRModel's state_dict key of a TorchRec table weight ('tables.embedding_bags.table3.weight' ->
    'tables.3.weight'); None for the dense keys."""
    if "embedding_bags." not in key:
        return None
    return f"tables.{key.split('embedding_bags.table')[1].split('.')[0]}.weight"


def _local_parts(dmp) -> list[tuple[str, torch.Tensor, tuple[slice, slice] | None]]:
    """(CTRModel key, this rank's tensor, its slice of the whole table or None for a dense tensor) of every
    tensor in the sharded model's state."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    parts = []
    for key, value in dmp.state_dict().items():
        table = _table_key(key)
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                parts.append((table, shard.tensor, (slice(r, r + nr), slice(c, c + nc))))
        else:
            parts.append((key.removeprefix("module."), value, None))
    return parts


def _worker(rank: int, workers: int, store: str, job: dict, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=workers,
                            timeout=datetime.timedelta(seconds=job["step_timeout"]))
    try:
        results.put((rank, (_check if job["check"] else _measure)(rank, workers, job)))
    finally:
        dist.destroy_process_group()


def _steps(dmp, dense, batches: list, steps: int, on_step=None) -> list[float]:
    times = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        ids, clicks = batches[i % BATCHES]
        started = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(dmp(features(ids)), clicks)
        dense.zero_grad()
        loss.backward()
        dense.step()
        times.append(time.perf_counter() - started)
    return times


def _check(rank: int, workers: int, job: dict) -> float:
    """Max |difference| of this rank's shards and dense values from single-process training after
    job["steps"] steps, started from CTRModel's values."""
    fields, rows = job["fields"], job["rows"]
    start = CTRModel(fields, rows // fields, DIM).state_dict()
    dmp, dense = sharded_model(job["config"], fields, rows // fields, workers, job["optimizer"], "cpu")
    with torch.no_grad():
        for key, tensor, where in _local_parts(dmp):
            tensor.copy_(start[key][where] if where else start[key])
    _steps(dmp, dense, worker_batches(fields, rows // fields, job["ids"], rank, workers), job["steps"])
    expected = reference(fields, rows, job["ids"], workers, job["steps"], job["optimizer"], row_wise=True)
    return max(float((tensor - (expected[key][where] if where else expected[key])).abs().max())
               for key, tensor, where in _local_parts(dmp))


def _measure(rank: int, workers: int, job: dict) -> dict:
    import torchrec.distributed  # noqa: F401  (its libraries loaded before the baseline: they are not the model)

    fields, rows = job["fields"], job["rows"]
    before_model = memory("self", "VmRSS")
    batches = worker_batches(fields, rows // fields, job["ids"], rank, workers)
    dmp, dense = sharded_model(job["config"], fields, rows // fields, workers, job["optimizer"], "meta")
    window = {}

    def open_window(i: int) -> None:
        if i == job["warmup"] and rank == 0:
            window["before"] = cpu_snapshot()

    times = _steps(dmp, dense, batches, job["warmup"] + job["steps"], open_window)
    result = {"pid": os.getpid(), "step_s": statistics.median(times[job["warmup"]:]),
              "model_rss": memory("self") - before_model}
    if rank == 0:
        result.update(cpu_per_step(window["before"], cpu_snapshot(), job["steps"]))
        result["rss"] = {pid: peak for pid in job_pids() if (peak := memory(pid)) is not None}
    return result


def launch(job: dict, workers: int, timeout: float) -> list:
    """Run `job` on W spawned ranks; their results in rank order. Raises TimeoutError (every rank killed) when
    they have not all answered within `timeout` seconds, and a rank's own exception when one fails."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.start_processes(_worker, args=(workers, os.path.join(tmp, "store"), job, results),
                                   nprocs=workers, join=False, start_method="spawn")
        deadline, answers = time.monotonic() + timeout, {}
        try:
            while len(answers) < workers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job['config']} at W = {workers}: {workers - len(answers)} rank(s) gave no "
                                       f"result within {timeout:.0f} s; raise --torchrec-timeout or run fewer rows")
                try:
                    rank, result = results.get(timeout=POLL_S)
                    answers[rank] = result
                except queue.Empty:
                    ranks.join(timeout=0)  # raises a failed rank's exception
            while not ranks.join(timeout=POLL_S):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job['config']} at W = {workers}: the ranks did not exit within "
                                       f"{timeout:.0f} s")
        finally:
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
    return [answers[r] for r in range(workers)]


def check(config: str, optimizer: str, ids: str, timeout: float) -> float:
    """Max |difference| from single-process training over every rank's shards: 5 steps, W = 2, 10^4 rows."""
    job = dict(config=config, optimizer=optimizer, ids=ids, fields=4, rows=10**4, steps=5, check=True,
               step_timeout=timeout)
    return max(launch(job, 2, timeout))


def run(config: str, rows: int, fields: int, workers: int, steps: int, warmup: int, optimizer: str, ids: str,
        timeout: float) -> list[dict]:
    """Each rank's measurement of `config` (see bench/sparse.py's worker)."""
    job = dict(config=config, optimizer=optimizer, ids=ids, fields=fields, rows=rows, steps=steps, warmup=warmup,
               check=False, step_timeout=timeout)
    return launch(job, workers, timeout)
