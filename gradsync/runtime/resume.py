"""Job checkpoints and exact resume: every server's shard and every worker's state at one step, and a manifest.

A checkpoint is taken at a step boundary of a sync job: after `Trainer.step` of
step N, when N % checkpoint_every == 0. Worker 0 first asks every server to
write its shard (`ps.checkpoint`: parameters, buffers, optimizer state, table
rows, version N; no step N+1 can be applied meanwhile, as it needs worker 0's
push), then every worker writes its own state, and worker 0, once the store
says every worker has, writes the manifest, last:

    DIR/step-00000010/shard-<s>.ckpt   each server's shard
    DIR/step-00000010/worker-<w>.ckpt  step, torch and Python RNG states, and (allreduce) model and optimizer
    DIR/step-00000010/MANIFEST.json    step, strategy, servers, workers, the model's tensors, and the files
                                       above with their SHA-256

Every file is written atomically with its SHA-256. `--resume DIR` starts from
the newest step folder whose manifest exists, lists every file the checkpoint
needs (each server's shard, each worker's state), and whose files all verify and
are the ones it names (an older one when the newest is torn, altered, edited,
unfinished or half rewritten by a later job), and refuses one written by a job
of another strategy, layout, world size or model.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import re
import sys

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, StoreKeys, worker_name
from gradsync.core.atomic_file import write_atomically
from gradsync.ps import checkpoint

MANIFEST = "MANIFEST.json"
_STEP = re.compile(r"step-(\d+)")


@dataclasses.dataclass(frozen=True)
class Found:
    """The checkpoint a job resumes from: its step, its folder, its manifest, and why newer folders were skipped."""

    step: int
    path: str
    manifest: dict
    skipped: tuple[str, ...] = ()


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def worker_file(worker: int) -> str:
    return f"worker-{worker}.ckpt"


def needed_files(servers: int, workers: int) -> list[str]:
    """The files a checkpoint of a job with `servers` and `workers` holds (its manifest must list each; the
    servers write `shard-<s>.ckpt`, `ps.checkpoint`)."""
    return [f"shard-{s}.ckpt" for s in range(servers)] + [worker_file(w) for w in range(workers)]


def describe_model(module: torch.nn.Module) -> dict[str, list]:
    """{state_dict key: [shape, dtype]}: what a checkpoint's model must match."""
    return {k: [list(t.shape), str(t.dtype)] for k, t in module.state_dict().items()}


def find(config: JobConfig) -> Found | None:
    """The newest complete checkpoint of `config.resume` (None without --resume), checked against the job.

    Raises:
        FileNotFoundError: the directory holds no complete checkpoint.
        ConfigError: the checkpoint was written by a job of another strategy, servers or workers.
    """
    if not config.resume:
        return None
    found = latest_complete(config.resume)
    if config.rank == 0:
        for reason in found.skipped:
            print(f"gradsync: resume skips {reason}", file=sys.stderr, flush=True)
        print(f"gradsync: resuming from step {found.step} ({found.path})", file=sys.stderr, flush=True)
    m = found.manifest
    theirs, ours = (m["strategy"], m["servers"], m["workers"]), (config.strategy, config.servers, config.num_workers)
    if theirs != ours:
        raise ConfigError(
            f"{found.path} was written by a job with strategy={theirs[0]!r}, servers={theirs[1]}, workers="
            f"{theirs[2]}, and this job has strategy={ours[0]!r}, servers={ours[1]}, workers={ours[2]}: resume "
            "with the same --strategy, --servers and --workers, or start without --resume"
        )
    return found


def latest_complete(directory: str) -> Found:
    """The newest step folder of `directory` whose manifest exists and lists every file the checkpoint needs,
    and whose files all verify (and are the ones it names)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"resume directory {directory!r} does not exist: pass the --checkpoint-dir of "
                                "the job to resume")
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(directory) if (m := _STEP.fullmatch(name))),
                   reverse=True)
    skipped = []
    for step, name in steps:
        path = os.path.join(directory, name)
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
            omitted = [n for n in needed_files(manifest["servers"], manifest["workers"]) if n not in manifest["files"]]
            if omitted:
                raise ValueError(f"its {MANIFEST} does not list {', '.join(omitted)}, which a checkpoint of "
                                 f"{manifest['servers']} servers and {manifest['workers']} workers needs")
            for file, digest in manifest["files"].items():
                checkpoint.verify(os.path.join(path, file), digest)
        except (OSError, ValueError, KeyError) as e:
            skipped.append(f"{path}: {e}")
            continue
        return Found(step, path, manifest, tuple(skipped))
    raise FileNotFoundError(f"no complete checkpoint in {directory!r} (a step-N folder with {MANIFEST} and "
                            "intact files, every one listed): start without --resume")


def check_model(found: Found, module: torch.nn.Module) -> None:
    """Raises ValueError naming the first tensor where `module` differs from the checkpoint's model."""
    theirs, ours = found.manifest["model"], describe_model(module)
    for key in [*theirs, *(k for k in ours if k not in theirs)]:
        if theirs.get(key) != ours.get(key):
            raise ValueError(
                f"{found.path} holds a different model: {key!r} is {theirs.get(key, 'absent')} there and "
                f"{ours.get(key, 'absent')} in this job's model ([shape, dtype]): resume with the model that wrote "
                "it, or start without --resume"
            )


def save(store: dist.Store, config: JobConfig, step: int, strategy, model: dict[str, list]) -> None:
    """Write this worker's part of the checkpoint of `step` (worker 0: the servers' shards and the manifest
    too). Every worker must call it after the same step."""
    path = step_dir(config.checkpoint_dir, step)
    me = config.worker_rank
    shards = strategy.transport.checkpoint(path) if me == 0 and config.servers else {}
    state = dict(step=step, torch_rng=torch.get_rng_state(), python_rng=random.getstate(),
                 cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                 **strategy.local_state())
    checkpoint.write(os.path.join(path, worker_file(me)), state)
    store.set(StoreKeys.CHECKPOINT.format(step, me), "1")
    if me != 0:
        return
    keys = [StoreKeys.CHECKPOINT.format(step, w) for w in range(config.num_workers)]
    try:
        store.wait(keys, datetime.timedelta(seconds=config.step_timeout))
    except dist.DistStoreError as e:
        missing = [worker_name(w) for w, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(f"checkpoint of step {step} in {path}: {', '.join(missing)} did not write its state "
                           f"within step_timeout {config.step_timeout:.0f} s") from e
    paths = [p for p, _ in shards.values()]
    paths += [os.path.join(path, worker_file(w)) for w in range(config.num_workers)]
    files = {os.path.basename(p): checkpoint.stored_digest(p) for p in paths}
    manifest = dict(step=step, strategy=config.strategy, servers=config.servers, workers=config.num_workers,
                    model=model, files=files)
    write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())


def restore(config: JobConfig, strategy, found: Found) -> int:
    """Load this worker's state of `found` (step, RNG states, the strategy's local state); returns the step."""
    state = checkpoint.load(os.path.join(found.path, worker_file(config.worker_rank)))
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    strategy.load_local_state(state)
    return state["step"]
