"""Dynamic tables on the hot path: memory, speed and quality of `gradsync.DynamicEmbedding`, with TorchRec's
managed-collision tables beside it. `--parts` picks which run; each writes its figures into one JSON (`--out`,
rewritten after every part; by default bench/results/dynamic_<parts>.json) with its PASS/FAIL against the
targets of the issue that asked for it.

The id stream of `memory` and `speed`: each worker's step looks up `--batch` ids, ranks drawn Zipf(`--zipf`)
over the positive integers (numpy's sampler, seeded by step and worker) hashed to 64-bit ids (`mix64`: any
int64). The job: `gradsync.launch`, ps (and hybrid) with S = `--servers`, W = `--workers`, one thread per
process; the model is one table of dim `--dim` and a linear head (BCE against the id's low bit); rows trained
by RowAdagrad, the head by Adagrad.

- `memory`: `--lookups` ids in all through a DynamicEmbedding of `--capacity` rows under ps. Worker 0 looks at
  the whole table (resident rows and rows admitted, summed over the servers) twice a step: after its forward,
  before its push, and after its step. The other worker may be up to a step ahead, so the bound a look checks
  is resident <= capacity + the ids admitted since worker 0's previous look in the middle of a step (that
  step's and this one's new ids), which holds at every look exactly when every step's eviction brings the
  table back to capacity; the largest excess over capacity and the new ids it stood against are recorded.
  Every `--sample-every` steps each server's VmRSS (/proc; the servers are the job's ranks that are not
  workers) and its resident rows. Target: every server's RSS (the largest sample) <= 1.5 x (capacity x bytes
  per row + its RSS in the empty job), bytes per row = the row + the row optimizer's state + the index (id,
  last step and lookup count: 24 bytes; the id index at most 4 buckets of 16 bytes; the recency log at most
  2 entries of 12 bytes). The empty job is the same job with a table of `--empty-capacity` rows for
  `--empty-steps` steps, run first (its RSS: the median over its second half). Flat: each server's largest / smallest RSS sample over the second half of the stream
  <= 1.05. Also each server's RSS over its own share (the most rows it held x bytes per row + its empty RSS),
  the stricter reading, and its VmHWM.
- `speed`: the same job, DynamicEmbedding against a fixed nn.Embedding of `--capacity` rows fed
  `id mod capacity`, under ps and hybrid (`--strategies`), `--repeats` times interleaved (the order reversed on
  every other repeat). The dynamic table first trains `fill` steps (computed here: until the stream has shown
  1.1 x capacity distinct ids, so it is full and evicting); both then take `--warmup` + `--steps` steps from
  that point of the stream. Worker 0's median step -> steps/s; dynamic / fixed is the ratio of the medians over
  repeats (target >= 0.7); the server ranks' CPU-seconds (/proc) over the timed steps per id looked up.
- `quality`: examples/ctr_stream.py's `--compare-tables` (its Stream, ClickModel and train), capacity half the
  distinct ids, `--stream-args` passed to its parser: AUC of LRU and LFU against unbounded (target within
  0.005) and against the hashed nn.Embedding of as many rows (target above), one process, the same run.
- `torchrec` (only where torchrec imports; else recorded as not installed): the same stream through TorchRec's
  ManagedCollisionEmbeddingBagCollection, one MCHManagedCollisionModule(zch_size = the same capacity,
  LRU_EvictionPolicy, eviction every step) per field, rows initialised as the dynamic table's (uniform in
  +-1/sqrt(dim)) and trained by the same RowAdagrad, the same steps: its AUC beside gradsync's dynamic LRU
  table (target: gradsync >= TorchRec - 0.002); and lookup-and-create throughput, one process, one thread, on
  `--tr-batches` batches of `--batch` ids of the Zipf stream into `--tr-rows` rows: DynamicTable.lookup +
  end_step (index, row creation, eviction) against the MCH module's forward (profile, eviction, remap), ids
  per second (target within 2x). Unsharded, TorchRec leaves an evicted slot's row as it was for the id that
  takes it (`mc_embedding_modules.evict` does nothing there): its AUC is what a one-process user gets.

    PYTHONPATH=$PWD .venv/bin/python bench/dynamic.py --parts memory speed quality
        [--lookups 100000000] [--capacity 1000000] [--batch 8192] [--repeats 3] [--out FILE]
    PYTHONPATH=$PWD VENV/bin/python bench/dynamic.py --parts quality torchrec  # VENV: bench/requirements-torchrec.txt
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

import numpy
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.launcher import procfs
from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.id_hash import mix64
from gradsync.tables.row_init import HashedUniform

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import ctr_stream  # noqa: E402
from measure import cpu_per_step, cpu_snapshot, job_pids, machine  # noqa: E402

PARTS = ("memory", "speed", "quality", "torchrec")
LR = 0.05
SLOT_BYTES = 24
"""Per resident row besides its values and optimizer state: its id, last step and lookup count (int64 each)."""
INDEX_BYTES = 4 * 16 + 2 * 12
"""The id index per id at most: 4 buckets of 16 bytes (id, value), `tables/id_index.py`; and 2 entries of
12 bytes in the recency log (slot, step), `tables/recency_log.py`."""
RSS_BOUND, FLAT_BOUND, SPEED_BOUND, AUC_WITHIN, TORCHREC_AUC_MARGIN, THROUGHPUT_BOUND = 1.5, 1.05, 0.7, 0.005, 0.002, 2
FILL_MARGIN = 1.1
"""The speed part's fill: steps until the stream has shown this many times capacity distinct ids."""


def zipf_ids(exponent: float, size: int, step: int, worker: int) -> torch.Tensor:
    """Worker `worker`'s ids at step `step`: Zipf ranks hashed to 64-bit ids (any int64)."""
    ranks = numpy.random.default_rng((step, worker)).zipf(exponent, size)
    return mix64(torch.from_numpy(ranks))


class Net(nn.Module):
    """One table of `dim` (a DynamicEmbedding of at most `capacity` rows, or an nn.Embedding of `capacity` rows fed
    `id mod capacity`) and a linear head."""

    def __init__(self, dynamic: bool, capacity: int, dim: int):
        super().__init__()
        torch.manual_seed(0)
        self.capacity = None if dynamic else capacity
        self.table = gradsync.DynamicEmbedding(dim, capacity=capacity) if dynamic else nn.Embedding(capacity, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.capacity is not None:
            ids = torch.remainder(ids, self.capacity)
        return self.head(self.table(ids)).squeeze(1)


def row_bytes(dim: int) -> dict[str, int]:
    """Bytes per resident row: its values, RowAdagrad's state, the index (SLOT_BYTES + INDEX_BYTES)."""
    return dict(row=4 * dim, optimizer=gradsync.RowAdagrad(lr=LR).state_bytes(1, dim, torch.float32),
                index=SLOT_BYTES + INDEX_BYTES)


class Job:
    """A worker's side of a bench job: its Trainer over `Net`, the step, and (worker 0) the servers' pids."""

    def __init__(self, folder: str, dynamic: bool, capacity: int, dim: int, batch: int, zipf: float):
        torch.set_num_threads(1)
        self.me, self.workers = gradsync.worker_rank(), gradsync.num_workers()
        self.folder, self.batch, self.zipf = folder, batch, zipf
        with open(os.path.join(folder, f"worker-{self.me}"), "w") as f:
            f.write(str(os.getpid()))
        self.model = Net(dynamic, capacity, dim)
        self.trainer = gradsync.Trainer(self.model, torch.optim.Adagrad, lr=LR,
                                        table_optimizer=gradsync.RowAdagrad(lr=LR))
        self._servers: list[int] | None = None

    def step(self, step: int, between=None) -> None:
        """Train on the stream's step `step`; `between()` runs after the forward, before the update."""
        ids = zipf_ids(self.zipf, self.batch, step, self.me)
        with dist_autograd.context() as cid:
            loss = F.binary_cross_entropy_with_logits(self.trainer.model(ids), (ids & 1).float())
            if between is not None:
                between()
            dist_autograd.backward(cid, [loss])
            self.trainer.step(cid)

    def servers(self) -> list[int]:
        """The server ranks' pids: the job's ranks less the workers (each wrote its pid before its first step,
        so after a sync step every worker's is there)."""
        if self._servers is None:
            workers = set()
            for w in range(self.workers):
                with open(os.path.join(self.folder, f"worker-{w}")) as f:
                    workers.add(int(f.read()))
            self._servers = sorted(set(job_pids()) - workers)
        return self._servers

    def server_rss(self) -> list[int]:
        return [procfs.memory(pid, "VmRSS") or 0 for pid in self.servers()]


def memory_worker(folder: str, capacity: int, dim: int, batch: int, zipf: float, steps: int,
                  sample_every: int) -> dict | None:
    """Train `steps` steps; worker 0 returns the rows bound's figures and the servers' RSS samples."""
    job = Job(folder, True, capacity, dim, batch, zipf)
    table = job.model.table
    if job.me != 0:
        for step in range(steps):
            job.step(step)
        return None
    out = dict(max_excess=0, new_at_max_excess=0, max_new=0, looks=0, violations=0, samples=[])
    last_mid = 0  # ids admitted at the previous look in the middle of a step

    def look(mid: bool) -> None:
        """One look at the whole table: resident rows against capacity + the ids admitted since the previous
        look in the middle of a step (see `memory` in the module docstring)."""
        nonlocal last_mid
        now = table.served()
        new = now["admitted"] - last_mid
        excess = now["resident_rows"] - capacity
        if excess > out["max_excess"]:
            out["max_excess"], out["new_at_max_excess"] = excess, new
        out["max_new"] = max(out["max_new"], new)
        out["looks"] += 1
        out["violations"] += excess > new
        if mid:
            last_mid = now["admitted"]

    for step in range(steps):
        job.step(step, between=lambda: look(mid=True))
        look(mid=False)
        if step % sample_every == 0 or step == steps - 1:
            per_server = job.trainer.server_stats()
            out["samples"].append(dict(step=step, lookups=(step + 1) * batch * job.workers, rss=job.server_rss(),
                                       resident=[stats_rows(per_server[s]) for s in sorted(per_server)]))
    out["peak_rss"] = [procfs.memory(pid) or 0 for pid in job.servers()]
    out["counters"] = table.counters
    return out


def stats_rows(stats: dict) -> int:
    """Rows of the dynamic table in one server's stats (`Trainer.server_stats`)."""
    return sum(t["rows"] for t in stats["tables"].values())


def run_memory(args) -> dict:
    """The empty job, then the stream; the figures and their PASS/FAIL."""
    per_row = row_bytes(args.dim)
    bytes_per_row = sum(per_row.values())
    runs = {}
    for name, capacity, steps in (("empty", args.empty_capacity, args.empty_steps),
                                  ("stream", args.capacity, max(1, args.lookups // (args.batch * args.workers)))):
        with tempfile.TemporaryDirectory(prefix="gradsync-dynamic-") as folder:
            started = time.perf_counter()
            runs[name] = gradsync.launch(memory_worker, strategy="ps", workers=args.workers, servers=args.servers,
                                         args=(folder, capacity, args.dim, args.batch, args.zipf, steps,
                                               args.sample_every), timeout=args.job_timeout)[0]
            runs[name]["steps"], runs[name]["job_s"] = steps, time.perf_counter() - started
        print(f"memory: {name} job, {steps} steps in {runs[name]['job_s']:.0f} s", flush=True)
    empty, stream = runs["empty"], runs["stream"]
    empty_rss = [statistics.median(s["rss"][i] for s in second_half(empty["samples"]))
                 for i in range(args.servers)]
    half = second_half(stream["samples"])
    servers = []
    for i in range(args.servers):
        peak = max(s["rss"][i] for s in stream["samples"])
        held = max(s["resident"][i] for s in stream["samples"])
        expected = args.capacity * bytes_per_row + empty_rss[i]
        flat = max(s["rss"][i] for s in half) / min(s["rss"][i] for s in half)
        servers.append(dict(empty_rss=empty_rss[i], max_rss=peak, peak_rss_vmhwm=stream["peak_rss"][i],
                            expected=expected, rss_vs_expected=peak / expected,
                            most_rows_held=held, rss_vs_share=peak / (held * bytes_per_row + empty_rss[i]),
                            second_half_max_over_min=flat,
                            rss=("PASS" if peak <= RSS_BOUND * expected else "FAIL"),
                            flat=("PASS" if flat <= FLAT_BOUND else "FAIL")))
    rows = dict(capacity=args.capacity, max_excess=stream["max_excess"],
                new_ids_at_max_excess=stream["new_at_max_excess"], most_new_ids_between_looks=stream["max_new"],
                looks=stream["looks"], looks_over_bound=stream["violations"],
                result="PASS" if stream["violations"] == 0 else "FAIL")
    return dict(lookups=stream["steps"] * args.batch * args.workers, steps=stream["steps"],
                distinct_admitted=stream["counters"]["admitted"], counters=stream["counters"],
                bytes_per_row=per_row, rows_bound=rows, servers=servers,
                rss_result="PASS" if all(s["rss"] == "PASS" for s in servers) else "FAIL",
                flat_result="PASS" if all(s["flat"] == "PASS" for s in servers) else "FAIL",
                samples=stream["samples"], empty_samples=empty["samples"],
                job_s={name: r["job_s"] for name, r in runs.items()})


def second_half(samples: list[dict]) -> list[dict]:
    """The samples taken over the second half of the stream (by lookups); the last one at least."""
    end = samples[-1]["lookups"]
    return [s for s in samples if s["lookups"] >= end / 2] or samples[-1:]


def speed_worker(folder: str, dynamic: bool, capacity: int, dim: int, batch: int, zipf: float, fill: int,
                 warmup: int, steps: int) -> dict | None:
    """The dynamic table trains `fill` steps first; then `warmup` + `steps` steps from step `fill` of the
    stream: worker 0's step times and the servers' CPU over the timed ones."""
    job = Job(folder, dynamic, capacity, dim, batch, zipf)
    if dynamic:
        for step in range(fill):
            job.step(step)
    times, before = [], {}
    for i in range(warmup + steps):
        if i == warmup and job.me == 0:
            before = servers_only(cpu_snapshot(), job.servers())
        start = time.perf_counter()
        job.step(fill + i)
        times.append(time.perf_counter() - start)
    if job.me != 0:
        return None
    cpu = cpu_per_step(before, servers_only(cpu_snapshot(), job.servers()), steps)
    return dict(step_s=statistics.median(times[warmup:]), step_times_s=times[warmup:],
                server_cpu_s_per_step=cpu["cpu_s_per_step"],
                server_cpu_s_per_id=cpu["cpu_s_per_step"] / (batch * job.workers),
                resident_rows=job.model.table.resident_rows if dynamic else capacity)


def servers_only(snapshot: dict, servers: list[int]) -> dict:
    return {pid: value for pid, value in snapshot.items() if pid in servers}


def fill_steps(args) -> int:
    """Steps until the stream (every worker's ids) has shown FILL_MARGIN x capacity distinct ids."""
    seen, step = numpy.zeros(0, dtype=numpy.int64), 0
    while seen.size < FILL_MARGIN * args.capacity:
        ranks = [numpy.random.default_rng((step, w)).zipf(args.zipf, args.batch) for w in range(args.workers)]
        seen = numpy.union1d(seen, numpy.concatenate(ranks))
        step += 1
    return step


def run_speed(args) -> dict:
    fill = fill_steps(args)
    configs = [(strategy, table) for strategy in args.strategies for table in ("dynamic", "fixed")]
    runs: dict[str, list[dict]] = {f"{s} {t}": [] for s, t in configs}
    for repeat in range(args.repeats):
        for strategy, table in configs if repeat % 2 == 0 else configs[::-1]:
            with tempfile.TemporaryDirectory(prefix="gradsync-dynamic-") as folder:
                r = gradsync.launch(speed_worker, strategy=strategy, workers=args.workers, servers=args.servers,
                                    args=(folder, table == "dynamic", args.capacity, args.dim, args.batch, args.zipf,
                                          fill, args.warmup, args.steps), timeout=args.job_timeout)[0]
            runs[f"{strategy} {table}"].append(r)
            print(f"speed: repeat {repeat} {strategy} {table}: {1 / r['step_s']:.1f} steps/s, server "
                  f"{1e6 * r['server_cpu_s_per_id']:.2f} CPU-us per id", flush=True)
    out = dict(fill_steps=fill, configs={}, ratios={})
    for name, reps in runs.items():
        out["configs"][name] = dict(
            steps_per_s=statistics.median(1 / r["step_s"] for r in reps),
            server_cpu_us_per_id=1e6 * statistics.median(r["server_cpu_s_per_id"] for r in reps),
            resident_rows=reps[-1]["resident_rows"], repeats=reps)
    for strategy in args.strategies:
        steps_per_s = {table: out["configs"][f"{strategy} {table}"]["steps_per_s"] for table in ("dynamic", "fixed")}
        ratio = steps_per_s["dynamic"] / steps_per_s["fixed"]
        out["ratios"][strategy] = dict(dynamic_over_fixed=ratio, result="PASS" if ratio >= SPEED_BOUND else "FAIL")
    return out


def stream_args(args) -> argparse.Namespace:
    return ctr_stream.parser().parse_args(shlex.split(args.stream_args))


def run_quality(args) -> dict:
    torch.set_num_threads(1)
    out = ctr_stream.compare_tables(stream_args(args))
    auc = {name: s["auc"] for name, s in out["tables"].items()}
    out["checks"] = {}
    for rule in ("lru", "lfu"):
        gap = auc["unbounded"] - auc[f"dynamic {rule}"]
        out["checks"][rule] = dict(
            auc=auc[f"dynamic {rule}"], below_unbounded=gap, above_hashed=auc[f"dynamic {rule}"] - auc["hashed"],
            within_unbounded="PASS" if gap <= AUC_WITHIN else "FAIL",
            above_hashed_result="PASS" if auc[f"dynamic {rule}"] > auc["hashed"] else "FAIL")
    return out


class TorchRecTable(nn.Module):
    """One field's TorchRec table: a ManagedCollisionEmbeddingBagCollection of `rows` rows (an MCH module with
    LRU eviction every step) fed one id per sample, rows uniform in +-1/sqrt(dim) as the dynamic table's;
    `step(row_optimizer)` trains the rows the step touched, as ctr_stream's LocalStep does a hashed table's."""

    def __init__(self, rows: int, dim: int, field: int):
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import ManagedCollisionCollection

        bound = dim ** -0.5
        self.name = f"f{field}"
        config = EmbeddingBagConfig(name=self.name, embedding_dim=dim, num_embeddings=rows,
                                    feature_names=[self.name], init_fn=lambda w: nn.init.uniform_(w, -bound, bound))
        self.collection = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[config], device=torch.device("cpu")),
            ManagedCollisionCollection({self.name: mch_module(rows)}, [config]))
        self.weight = self.collection._embedding_module.embedding_bags[self.name].weight
        self.state = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        features = KeyedJaggedTensor.from_lengths_sync(keys=[self.name], values=ids,
                                                       lengths=torch.ones_like(ids, dtype=torch.int32))
        return self.collection(features)[0][self.name]

    def step(self, optimizer) -> None:
        if self.state is None:
            self.state = optimizer.new_state(self.weight.shape[0], self.weight.shape[1], self.weight.dtype)
        grad = self.weight.grad
        if grad is not None:
            touched = grad.abs().sum(1).nonzero().squeeze(1)
            optimizer.step(self.weight.data, self.state, touched, grad[touched])
            self.weight.grad = None


def mch_module(rows: int):
    from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule

    return MCHManagedCollisionModule(zch_size=rows, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
                                     eviction_interval=1)


def throughput(args) -> dict:
    """Ids per second of lookup-and-create into `--tr-rows` rows, one thread: gradsync's DynamicTable (lookup,
    end_step) and TorchRec's MCH module (forward in training mode), on the same batches."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    batches = [zipf_ids(args.zipf, args.batch, step, 0) for step in range(args.tr_batches)]
    total = args.batch * args.tr_batches
    table = DynamicTable(args.dim, capacity=args.tr_rows, init=HashedUniform(args.dim))
    start = time.perf_counter()
    for step, ids in enumerate(batches):
        table.lookup(ids, step)
        table.end_step(step)
    gradsync_s = time.perf_counter() - start
    module = mch_module(args.tr_rows).train()
    lengths = torch.ones(args.batch, dtype=torch.int32)
    start = time.perf_counter()
    for ids in batches:
        module({"t": JaggedTensor(values=ids, lengths=lengths)})
    torchrec_s = time.perf_counter() - start
    ratio = (total / gradsync_s) / (total / torchrec_s)
    return dict(rows=args.tr_rows, batch=args.batch, batches=args.tr_batches, gradsync_ids_per_s=total / gradsync_s,
                torchrec_ids_per_s=total / torchrec_s, gradsync_over_torchrec=ratio,
                result="PASS" if 1 / THROUGHPUT_BOUND <= ratio else "FAIL")


def run_torchrec(args, quality: dict | None) -> dict:
    try:
        import torchrec
    except ImportError:
        return {"skipped": "not installed (bench/requirements-torchrec.txt)"}
    torch.set_num_threads(1)
    stream = stream_args(args)
    stream.workers_of_stream = 1
    capacity = quality["capacity"] if quality else stream.capacity or ctr_stream.distinct_ids(stream) // 2
    if quality:
        ours = quality["tables"]["dynamic lru"]
    else:
        stream.evict = "lru"
        ours = ctr_stream.train(stream, "dynamic", capacity, in_job=False)
    model = ctr_stream.ClickModel(stream.fields, stream.dim, "dynamic", capacity, "lru", None, 1)
    model.tables = nn.ModuleList(TorchRecTable(capacity, stream.dim, f) for f in range(stream.fields))
    theirs = ctr_stream.train(stream, "torchrec", capacity, in_job=False, model=model)
    print(f"torchrec: AUC {theirs['auc']:.4f} (gradsync dynamic lru {ours['auc']:.4f}), {capacity} rows", flush=True)
    speed = throughput(args)
    print(f"torchrec: lookup-and-create {speed['torchrec_ids_per_s'] / 1e6:.2f} M ids/s, gradsync "
          f"{speed['gradsync_ids_per_s'] / 1e6:.2f} M ids/s", flush=True)
    return dict(torchrec=torchrec.__version__, capacity=capacity, auc=theirs["auc"], gradsync_auc=ours["auc"],
                teacher_auc=theirs["teacher_auc"], gradsync_minus_torchrec=ours["auc"] - theirs["auc"],
                auc_result="PASS" if ours["auc"] >= theirs["auc"] - TORCHREC_AUC_MARGIN else "FAIL",
                throughput=speed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--lookups", type=int, default=10**8, help="memory: ids looked up in all")
    parser.add_argument("--capacity", type=int, default=10**6, help="memory and speed: the table's rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--batch", type=int, default=8192, help="ids per worker per step (torchrec: per batch)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--sample-every", type=int, default=50, help="memory: steps between RSS samples")
    parser.add_argument("--empty-capacity", type=int, default=1000, help="memory: the empty job's table")
    parser.add_argument("--empty-steps", type=int, default=300)
    parser.add_argument("--strategies", nargs="+", choices=["ps", "hybrid"], default=["ps", "hybrid"])
    parser.add_argument("--steps", type=int, default=100, help="speed: timed steps per job")
    parser.add_argument("--warmup", type=int, default=10, help="speed: untimed steps before the timed ones, >= 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-args", default="", help="quality and torchrec: arguments of examples/ctr_stream.py")
    parser.add_argument("--tr-rows", type=int, default=10**5, help="torchrec: rows of the throughput tables")
    parser.add_argument("--tr-batches", type=int, default=200)
    parser.add_argument("--job-timeout", type=float, default=3 * 3600)
    parser.add_argument("--out", help="default: bench/results/dynamic_<parts>.json, the parts joined by _")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: pass 1 or more (worker 0 finds the servers' pids after a first step)")
    args.out = args.out or os.path.join(HERE, "results", f"dynamic_{'_'.join(args.parts)}.json")
    result = dict(command="bench/dynamic.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(os.getloadavg()),
                  settings=vars(args))
    runners = dict(memory=run_memory, speed=run_speed, quality=run_quality,
                   torchrec=lambda a: run_torchrec(a, result.get("quality")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for part in args.parts:
        started = time.perf_counter()
        result[part] = runners[part](args)
        result[part]["wall_s"] = time.perf_counter() - started
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(summary(result))
    print(f"-> {args.out}")
    return 0


def summary(result: dict) -> str:
    """Each part's figures against their targets, one line each."""
    lines = []
    if "memory" in result:
        m = result["memory"]
        rows = m["rows_bound"]
        lines.append(f"memory: resident <= capacity + the new ids of the steps in flight at every look: "
                     f"{rows['result']} (max excess {rows['max_excess']}, against {rows['new_ids_at_max_excess']} "
                     f"new ids)")
        for i, s in enumerate(m["servers"]):
            lines.append(f"memory: server {i}: RSS {s['max_rss'] / 2**20:.0f} MB / expected "
                         f"{s['expected'] / 2**20:.0f} MB = {s['rss_vs_expected']:.2f}x (bound {RSS_BOUND}x): "
                         f"{s['rss']}; second half max/min {s['second_half_max_over_min']:.3f} "
                         f"(bound {FLAT_BOUND}): {s['flat']}")
    if "speed" in result:
        for strategy, r in result["speed"]["ratios"].items():
            cpu = result["speed"]["configs"][f"{strategy} dynamic"]["server_cpu_us_per_id"]
            lines.append(f"speed: {strategy} dynamic / fixed steps/s {r['dynamic_over_fixed']:.2f}x "
                         f"(target >= {SPEED_BOUND}): {r['result']}; server {cpu:.2f} CPU-us per id looked up")
    if "quality" in result:
        for rule, c in result["quality"]["checks"].items():
            lines.append(f"quality: {rule} AUC {c['auc']:.4f}, {c['below_unbounded']:+.4f} below unbounded "
                         f"(within {AUC_WITHIN}): {c['within_unbounded']}; {c['above_hashed']:+.4f} over hashed: "
                         f"{c['above_hashed_result']}")
    if "torchrec" in result:
        t = result["torchrec"]
        if "skipped" in t:
            lines.append(f"torchrec: {t['skipped']}")
        else:
            lines.append(f"torchrec: AUC {t['auc']:.4f}, gradsync {t['gradsync_auc']:.4f} "
                         f"(>= TorchRec - {TORCHREC_AUC_MARGIN}): {t['auc_result']}; lookup-and-create gradsync / "
                         f"TorchRec {t['throughput']['gradsync_over_torchrec']:.2f}x (within {THROUGHPUT_BOUND}x): "
                         f"{t['throughput']['result']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
