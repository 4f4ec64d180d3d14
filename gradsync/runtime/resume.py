"""Job checkpoints and resume: every server's shard and every worker's state at one step, and a manifest.

A checkpoint is taken at a step boundary: after `Trainer.step` of step N,
when N % checkpoint_every == 0. Every worker writes its own state; worker 0,
once the store says every worker has, asks every server to write its shard
(`ps.checkpoint`: parameters, buffers, optimizer state, table rows, version)
and writes the manifest, last. In a sync job no step N+1 can be applied
meanwhile, as it needs worker 0's push; in an async or ssp job the other
workers wait until the shards are written, so every shard holds the same
pushes (each worker's first N) and the checkpoint is one consistent cut:

    DIR/step-00000010/shard-<s>.ckpt   each server's shard
    DIR/step-00000010/worker-<w>.ckpt  step, torch and Python RNG states, and (allreduce, hybrid) the model's
                                       and optimizer's local state
    DIR/step-00000010/MANIFEST.json    step, strategy, mode, servers, workers, the model's tensors, and the
                                       files above with their SHA-256

Every file is written atomically with its SHA-256. `--resume DIR` starts from
the newest step folder whose manifest exists, lists every file the checkpoint
needs (each server's shard, the state of each worker that wrote one), and whose
files all verify and are the ones it names (an older one when the newest is torn,
altered, edited, unfinished or half rewritten by a later job), with any number of
servers and workers (the servers re-split the shards: `ps.reshard`), and refuses
one written by a job of another strategy or model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import sys
import time

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig, StoreKeys, worker_name
from gradsync.core.atomic_file import write_atomically
from gradsync.membership.liveness import staying
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


def needed_files(servers: int, workers: list[int]) -> list[str]:
    """The files a checkpoint of `servers` servers, written by `workers`, holds (its manifest must list each;
    the servers write `shard-<s>.ckpt`, `ps.checkpoint`)."""
    return [f"shard-{s}.ckpt" for s in range(servers)] + [worker_file(w) for w in workers]


def describe_model(module: torch.nn.Module) -> dict[str, list]:
    """{state_dict key: [shape, dtype]}: what a checkpoint's model must match."""
    return {k: [list(t.shape), str(t.dtype)] for k, t in module.state_dict().items()}


def find(config: JobConfig) -> Found | None:
    """The newest complete checkpoint of `config.resume` (None without --resume), checked against the job: any
    number of servers and workers may resume it (`ps.reshard`), a job of another strategy may not.

    Raises:
        FileNotFoundError: the directory holds no complete checkpoint.
        ConfigError: the checkpoint was written by a job of another strategy.
    """
    if not config.resume:
        return None
    found = latest_complete(config.resume)
    m = found.manifest
    if config.rank == 0:
        for reason in found.skipped:
            print(f"gradsync: resume skips {reason}", file=sys.stderr, flush=True)
        reshaped = (m["servers"], m["workers"]) != (config.servers, config.num_workers)
        print(f"gradsync: resuming from step {found.step} ({found.path})"
              + (f", written by {m['servers']} servers and {m['workers']} workers" if reshaped else ""),
              file=sys.stderr, flush=True)
    if m["strategy"] != config.strategy:
        raise ConfigError(
            f"{found.path} was written by a job with strategy={m['strategy']!r}, and this job has strategy="
            f"{config.strategy!r}: resume with --strategy {m['strategy']}, or start without --resume"
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
            written = manifest.get("written", range(manifest["workers"]))  # elastic: the workers still there
            if omitted := [n for n in needed_files(manifest["servers"], written) if n not in manifest["files"]]:
                raise ValueError(f"its {MANIFEST} does not list {', '.join(omitted)}, which a checkpoint of "
                                 f"{manifest['servers']} servers and {len(written)} workers needs")
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
    """Write this worker's part of the checkpoint of `step`; the coordinator (worker 0, or in an elastic job the
    lowest of the job's first workers still in it) has the servers write their shards and writes the manifest.
    Every worker of the job must call it after the same step (workers that joined a running job take no
    part; in an elastic job, neither do workers that have left it). In async and ssp jobs the workers wait
    until the servers have written their shards, so that every shard holds the same pushes: each worker's
    first `step`."""
    me = config.worker_rank
    if me >= config.num_workers:
        return
    path = step_dir(config.checkpoint_dir, step)
    state = dict(step=step, torch_rng=torch.get_rng_state(), python_rng=random.getstate(),
                 cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                 **strategy.local_state())
    checkpoint.write(os.path.join(path, worker_file(me)), state)
    store.set(StoreKeys.CHECKPOINT.format(step, me), "1")
    held = config.mode != "sync" and config.servers > 0  # the others' pushes would go on meanwhile
    while (coordinator := _coordinator(store, config)) != me:
        if not held or _wait(store, config, [StoreKeys.CHECKPOINT.format(step, "shards")], [coordinator],
                             f"did not have the servers write their shards of the checkpoint of step {step} in "
                             f"{path}"):
            return
        # the coordinator left the job before the shards were written: the next one takes over
    written = _wait(store, config, [StoreKeys.CHECKPOINT.format(step, w) for w in range(config.num_workers)],
                    list(range(config.num_workers)),
                    f"did not write its state of the checkpoint of step {step} in {path}")
    shards = strategy.checkpoint_servers(path)
    paths = [p for p, _ in shards.values()] + [os.path.join(path, worker_file(w)) for w in written]
    files = {os.path.basename(p): checkpoint.stored_digest(p) for p in paths}
    manifest = dict(step=step, strategy=config.strategy, mode=config.mode, servers=config.servers,
                    workers=config.num_workers, written=written, model=model, files=files)
    write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    if held:
        store.set(StoreKeys.CHECKPOINT.format(step, "shards"), "1")


def _coordinator(store: dist.Store, config: JobConfig) -> int:
    """The worker that has the servers write their shards and writes the manifest: worker 0, or in an elastic
    job the lowest of the job's first workers still in it."""
    if not config.elastic:
        return 0
    return min((w for w in staying(store) if w < config.num_workers), default=0)


def _wait(store: dist.Store, config: JobConfig, keys: list[str], workers: list[int], what: str) -> list[int]:
    """Wait up to step_timeout until each key is set or its worker has left an elastic job (died, or finished
    its steps first); returns the workers whose key is set.

    Raises:
        RuntimeError: naming the workers still missing, and `what` they did not do.
    """
    deadline = time.monotonic() + config.step_timeout
    while True:
        here = set(staying(store)) if config.elastic else set(workers)
        done = [w for w, k in zip(workers, keys) if store.check([k])]
        missing = [w for w in workers if w not in done and w in here]
        if not missing:
            return done
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(worker_name(w) for w in missing)} {what} within step_timeout "
                               f"{config.step_timeout:.0f} s")
        time.sleep(0.02)


def restore(config: JobConfig, strategy, found: Found) -> int:
    """Load this worker's state of `found` (step, RNG states, the strategy's local state); returns the step.
    A worker beyond the checkpoint's workers, or whose file it lacks, takes the file of the lowest worker that
    wrote one (its model and optimizer under allreduce and hybrid, which every worker holds alike) and keeps
    its own RNG states."""
    me = config.worker_rank
    mine = me < found.manifest["workers"] and worker_file(me) in found.manifest["files"]
    first = min(found.manifest.get("written", [0]))  # worker 0, unless it had left an elastic job
    state = checkpoint.load(os.path.join(found.path, worker_file(me if mine else first)))
    if mine:
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
    strategy.load_local_state(state)
    return state["step"]
