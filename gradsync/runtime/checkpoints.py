"""Job checkpoints and resume: every server's shard and every worker's state at one step, and a manifest.

A checkpoint is taken at a step boundary: after `Trainer.step` of step N,
when N % checkpoint_every == 0. Every worker writes its own state; worker 0,
once the store says every worker has, asks every server to write its shard
(`ps.shard_file`: parameters, buffers, optimizer state, table rows, version)
and writes the manifest, last. In a sync job no step N+1 can be applied
meanwhile, as it needs worker 0's push; in an async or ssp job the other
workers wait until the shards are written, so every shard holds the same
pushes (each worker's first N) and the checkpoint is one consistent cut:

    DIR/step-00000010/shard-<s>.ckpt   each server's shard
    DIR/step-00000010/worker-<w>.ckpt  step, torch and Python RNG states, and (allreduce, hybrid, sharded)
                                       the model's and optimizer's local state; sharded: the worker's rows
                                       of every table and their row optimizer state, and its part of every
                                       dynamic table (as a server writes it)
    DIR/step-00000010/MANIFEST.json    step, strategy, mode, servers, workers, the model's tensors, and the
                                       files above with their SHA-256

Every file is written atomically with its SHA-256.

Dynamic tables on the servers (ps, hybrid) or on the workers (sharded, allreduce's replicas) with
--checkpoint-full-every N: of the checkpoints a job writes, the first and every N-th after it are full; each one between
is a delta (`DynamicTable.checkpoint`): its shards (sharded: its worker files) hold the dynamic tables' rows changed or
evicted since that full checkpoint (everything else whole), and its manifest names the full one's folder as its `base`,
which must be complete for the delta to be. Lookups change tables on the servers, so every worker waits until the
servers have written their shards, in sync mode too.

A checkpoint folder belongs to one run: a fresh job (no --resume) makes a run id, every manifest records it,
and a resume continues it. Rank 0 decides for the job what it continues or starts (`open_run`) and publishes
it in the store, so every refusal is one failure on the rank that decided it: a fresh job refuses a
--checkpoint-dir holding step folders (another run's) unless --start-over, which removes them first;
`--resume DIR` refuses a folder holding more than one run's checkpoints, and starts from the newest step folder
whose manifest exists, names the step its folder's name says, lists every file the checkpoint needs (each
server's shard, the state of each worker that wrote one), and whose files all verify and are the ones it names
(an older one when the newest is torn, altered, renamed, edited, unfinished or half rewritten by a later job;
the reason for each folder skipped), with any number of servers and workers (the servers re-split the shards:
`ps.reshard`; under sharded the workers re-home the rows by the row partition, `Strategy.load_rows`), and
refuses one written by a job of another strategy; worker 0 refuses one of another model or optimizer (`check`).
Temporary files that a writer which died left in step folders are removed on opening.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.config import ConfigError, JobConfig
from gradsync.core.atomic_file import temporaries, write_atomically
from gradsync.core.job_names import StoreKeys, worker_name
from gradsync.core.optimizer_spec import group_options
from gradsync.core.waiting import wait_until
from gradsync.membership.member_keys import staying
from gradsync.ps import shard_file
from gradsync.runtime import rng_states

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
    the servers write `shard-<s>.ckpt`, `ps.shard_file`)."""
    return [f"shard-{s}.ckpt" for s in range(servers)] + [worker_file(w) for w in workers]


def describe(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint's job must match to resume it (`check`): the model, {state_dict key: [shape, dtype]};
    the optimizer, its class and per group its parameters' sizes and its option keys."""
    cls = type(optimizer)
    return {
        "model": {k: [list(t.shape), str(t.dtype)] for k, t in module.state_dict().items()},
        "optimizer": {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "groups": [
                {"sizes": [p.numel() for p in g["params"]], "keys": sorted(group_options(g))}
                for g in optimizer.param_groups
            ],
        },
    }


def base_of(found: Found) -> str | None:
    """The folder of the full checkpoint that `found`, a delta, goes onto; None for a full one."""
    base = found.manifest.get("base")
    return base and os.path.join(os.path.dirname(os.path.normpath(found.path)), base)


def full_base(config: JobConfig, step: int, start: int) -> int | None:
    """The step of the full checkpoint onto which the checkpoint of `step` is a delta, in a job that started at
    step `start`; None: it is full (the job's first, and every `checkpoint_full_every`-th after it)."""
    every, full_every = config.checkpoint_every, config.checkpoint_full_every
    first = (start // every + 1) * every
    base = first + (step - first) // (every * full_every) * every * full_every
    return None if base == step else base


def open_run(config: JobConfig, store: dist.Store) -> tuple[str, Found | None]:
    """The run this job checkpoints ('' without --checkpoint-dir) and the checkpoint it resumes from (None
    without --resume): decided by rank 0's first process (`decide`), published in the store, read by the other
    ranks and by replacements.

    Raises:
        FileNotFoundError, ConfigError: on rank 0, the refusals of `decide`.
        RuntimeError: on another rank, rank 0 decided nothing within startup_timeout.
    """
    if not (config.checkpoint_dir or config.resume):
        return "", None
    if config.rank == 0 and not config.replacement:  # a replacement of rank 0 reads what its first process decided
        run, found = decide(config)
        store.set(StoreKeys.RUN, json.dumps({"run": run, "path": found and found.path}))
        return run, found
    try:
        store.wait([StoreKeys.RUN], datetime.timedelta(seconds=config.startup_timeout))
    except dist.DistError:
        raise RuntimeError(
            f"rank 0 did not decide within startup_timeout ({config.startup_timeout:.0f} s) which "
            "checkpoint this job resumes from or which run it starts (its failure says why)"
        ) from None
    decided = json.loads(store.get(StoreKeys.RUN))
    return decided["run"], decided["path"] and Found(*_manifest(decided["path"]))


def decide(config: JobConfig) -> tuple[str, Found | None]:
    """Rank 0's decision: remove dead writers' temporary files from the step folders; then, with --resume, the
    newest complete checkpoint of the one run --resume holds (`latest_complete`), checked against the job's
    strategy and --checkpoint-dir; else a new run id, in a --checkpoint-dir holding no step folder (or emptied
    with --start-over). Says on stderr what it removed, skipped and resumes.

    Raises:
        FileNotFoundError: --resume holds no complete checkpoint (the reason per folder).
        ConfigError: --resume holds several runs' checkpoints, or one of another strategy; --checkpoint-dir
            holds another run's checkpoints.
    """
    for directory in dict.fromkeys(d for d in (config.resume, config.checkpoint_dir) if d):
        _remove_temporaries(directory)
    if not config.resume:
        run = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        _claim(config.checkpoint_dir, run, config.start_over)
        return run, None
    found = latest_complete(config.resume)
    m, run = found.manifest, found.manifest["run"]
    for reason in found.skipped:
        _say(f"resume skips {reason}")
    if m["strategy"] != config.strategy:
        raise ConfigError(
            f"{found.path} was written by a job with strategy={m['strategy']!r}, and this job has strategy="
            f"{config.strategy!r}: resume with --strategy {m['strategy']}, or start without --resume"
        )
    if config.checkpoint_dir and os.path.abspath(config.checkpoint_dir) != os.path.abspath(config.resume):
        _claim(config.checkpoint_dir, run, start_over=False)
    reshaped = (m["servers"], m["workers"]) != (config.servers, config.num_workers)
    _say(
        f"resuming run {run} from step {found.step} ({found.path})"
        + (f", written by {m['servers']} servers and {m['workers']} workers" if reshaped else "")
    )
    return run, found


def _claim(directory: str, run: str, start_over: bool) -> None:
    """Make `directory` the checkpoint folder of `run`: refuse it when it holds step folders of another run
    (or of none known: unfinished), or with `start_over` remove them first."""
    runs: dict[str | None, list[str]] = {}  # run (None: unknown) -> its step folders
    for _, path in _step_folders(directory):
        try:
            theirs = _manifest(path)[2].get("run")
        except (OSError, ValueError, KeyError):
            theirs = None
        if theirs != run:
            runs.setdefault(theirs, []).append(os.path.basename(path))
    if not runs:
        return
    held = "; ".join(
        f"{', '.join(sorted(names))} ({'run ' + r if r else 'no run: unfinished or older'})"
        for r, names in runs.items()
    )
    if start_over:
        for names in runs.values():
            for name in names:
                shutil.rmtree(os.path.join(directory, name))
        _say(f"--start-over removed the step folders of another run from {directory}: {held}")
        return
    raise ConfigError(
        f"checkpoint_dir {directory!r} holds another run's checkpoints ({held}), and this job writes run {run}'s: "
        f"pass --resume {directory} to continue that run, --start-over to remove its step folders first, or "
        "another --checkpoint-dir"
    )


def _remove_temporaries(directory: str) -> None:
    """Remove the temporary files that a writer which died left in `directory`'s step folders (no writer of
    this job has started), saying which."""
    left = [p for _, folder in _step_folders(directory) for p in temporaries(folder)]
    if left:
        size = sum(os.path.getsize(p) for p in left)
        for path in left:
            os.unlink(path)
        _say(
            f"removed {len(left)} temporary files ({size / 2**20:.1f} MiB) that a checkpoint writer which died "
            f"left: {', '.join(os.path.relpath(p, directory) for p in left)}"
        )


def _say(line: str) -> None:
    print(f"gradsync: {line}", file=sys.stderr, flush=True)


def _step_folders(directory: str) -> list[tuple[int, str]]:
    """(step its name says, path) of `directory`'s step folders, newest first ([] when it does not exist)."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        (
            (int(m.group(1)), os.path.join(directory, name))
            for name in os.listdir(directory)
            if (m := _STEP.fullmatch(name)) and os.path.isdir(os.path.join(directory, name))
        ),
        reverse=True,
    )


def _manifest(path: str) -> tuple[int, str, dict]:
    """(step, path, manifest) of the step folder `path`, whose manifest names a run and the step of the
    folder's name.

    Raises:
        OSError, ValueError, KeyError: no readable manifest, or one that names no run or another step.
    """
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if "run" not in manifest:
        raise ValueError(
            f"its {MANIFEST} names no run (written by an older gradsync): start a new run with --start-over"
        )
    folder = _STEP.fullmatch(os.path.basename(os.path.normpath(path)))
    assert folder is not None  # a step folder: `_step_folders` lists those by name
    named = int(folder.group(1))
    if manifest["step"] != named:
        raise ValueError(
            f"its {MANIFEST} holds step {manifest['step']}, and its name says step {named}: a folder "
            "renamed or copied, refused (the step of its state is not the one its name orders it by, "
            "and the job would later write that step's files into it)"
        )
    return manifest["step"], path, manifest


def latest_complete(directory: str) -> Found:
    """The newest step folder of `directory` whose manifest exists, names a run and its folder's step, and
    lists every file the checkpoint needs, and whose files all verify (and are the ones it names).

    Raises:
        FileNotFoundError: no such folder, naming why each was refused.
        ConfigError: the manifests name more than one run.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"resume directory {directory!r} does not exist: pass the --checkpoint-dir of the job to resume"
        )
    manifests: dict[str, tuple[int, str, dict] | Exception] = {}
    skipped = []
    for _, path in _step_folders(directory):
        try:
            manifests[path] = _manifest(path)
        except (OSError, ValueError, KeyError) as e:
            manifests[path] = e
    runs: dict[str, list[str]] = {}
    for path, read in manifests.items():
        if not isinstance(read, Exception):
            runs.setdefault(read[2]["run"], []).append(os.path.basename(path))
    if len(runs) > 1:
        raise ConfigError(
            f"{directory!r} holds the checkpoints of {len(runs)} runs ("
            + "; ".join(f"run {r}: {', '.join(sorted(n))}" for r, n in runs.items())
            + "), and a resume continues one: move the other runs' step folders out"
        )
    for path, read in manifests.items():
        try:
            if isinstance(read, Exception):
                raise read
            step, _, manifest = read
            written = manifest.get("written", range(manifest["workers"]))  # elastic: the workers still there
            if omitted := [n for n in needed_files(manifest["servers"], written) if n not in manifest["files"]]:
                raise ValueError(
                    f"its {MANIFEST} does not list {', '.join(omitted)}, which a checkpoint of "
                    f"{manifest['servers']} servers and {len(written)} workers needs"
                )
            for file, digest in manifest["files"].items():
                shard_file.verify(os.path.join(path, file), digest)
            if "base" in manifest:
                _check_base(path, manifest)
        except (OSError, ValueError, KeyError) as e:
            skipped.append(f"{path}: {e}")
            continue
        return Found(step, path, manifest, tuple(skipped))
    raise FileNotFoundError(
        f"no complete checkpoint in {directory!r} (a step-N folder with {MANIFEST} and intact "
        "files, every one listed)" + "".join(f"\n  {reason}" for reason in skipped) + "\nstart without --resume"
    )


def _check_base(path: str, manifest: dict) -> None:
    """Refuse a delta checkpoint (in `path`) whose full checkpoint is not there whole, of the same run.

    Raises:
        OSError, ValueError, KeyError: naming what is wrong with the base.
    """
    base = os.path.join(os.path.dirname(os.path.normpath(path)), manifest["base"])
    try:
        _, _, full = _manifest(base)
        if full["run"] != manifest["run"] or "base" in full or full["servers"] != manifest["servers"]:
            raise ValueError("it is not a full checkpoint of the same run and servers")
        for file, digest in full["files"].items():
            shard_file.verify(os.path.join(base, file), digest)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"it is a delta onto the full checkpoint {manifest['base']}, which is not usable: {e}"
        ) from None


def check(found: Found, described: dict) -> None:
    """Refuse to resume `found` into the job's model and optimizer (`describe`) when they differ from the
    checkpoint's: raises ValueError naming the first tensor, or the optimizer classes, or the group that
    differs, and the fix."""
    fix = (
        "resume with the model and optimizer that wrote it, or start a new run (--start-over, or another "
        "--checkpoint-dir)"
    )
    theirs, ours = found.manifest["model"], described["model"]
    for key in [*theirs, *(k for k in ours if k not in theirs)]:
        if theirs.get(key) != ours.get(key):
            raise ValueError(
                f"{found.path} holds a different model: {key!r} is {theirs.get(key, 'absent')} there "
                f"and {ours.get(key, 'absent')} in this job's model ([shape, dtype]): {fix}"
            )
    theirs, ours = found.manifest["optimizer"], described["optimizer"]
    if theirs["class"] != ours["class"]:
        short = [c.rsplit(".", 1)[-1] for c in (theirs["class"], ours["class"])]
        a, b = short if short[0] != short[1] else (theirs["class"], ours["class"])
        raise ValueError(
            f"{found.path} was written with the optimizer {a}, and this job builds {b}: its state "
            f"(and options) are {a}'s: {fix}"
        )
    if len(theirs["groups"]) != len(ours["groups"]):
        raise ValueError(
            f"{found.path} holds {len(theirs['groups'])} parameter groups of {ours['class']}, and "
            f"this job's optimizer has {len(ours['groups'])}: {fix}"
        )
    for i, (saved, built) in enumerate(zip(theirs["groups"], ours["groups"])):
        for what, kind in (("sizes", "parameters of sizes"), ("keys", "options")):
            if saved[what] != built[what]:
                raise ValueError(
                    f"{found.path}'s parameter group {i} holds {kind} {saved[what]}, and this job's "
                    f"group {i} {built[what]}: {fix}"
                )


def save(store: dist.Store, config: JobConfig, run: str, step: int, strategy, described: dict, start: int = 0) -> None:
    """Write this worker's part of the checkpoint of `step` of `run` (its model and optimizer `described`); the
    coordinator (worker 0, or in an elastic job the
    lowest of the job's first workers still in it) has the servers write their shards and writes the manifest.
    Every worker of the job must call it after the same step (workers that joined a running job take no
    part; in an elastic job, neither do workers that have left it). In async and ssp jobs the workers wait
    until the servers have written their shards, so that every shard holds the same pushes: each worker's
    first `step`; so do the workers of a job whose servers hold dynamic tables. `start`: the step the job
    started at (`full_base`)."""
    me = config.worker_rank
    if me >= config.num_workers:
        return
    path = step_dir(config.checkpoint_dir, step)
    base = full_base(config, step, start) if strategy.writes_deltas else None
    state = dict(step=step, **rng_states.taken(), **strategy.local_state(delta=base is not None))
    shard_file.write(os.path.join(path, worker_file(me)), state)
    store.set(StoreKeys.CHECKPOINT.format(step, me), "1")
    # the others' pushes, or their lookups of dynamic tables, would go on meanwhile
    held = config.servers > 0 and (config.mode != "sync" or strategy.servers_hold_dynamic)
    while (coordinator := _coordinator(store, config)) != me:
        if not held or _wait(
            store,
            config,
            [StoreKeys.CHECKPOINT.format(step, "shards")],
            [coordinator],
            f"did not have the servers write their shards of the checkpoint of step {step} in {path}",
        ):
            return
        # the coordinator left the job before the shards were written: the next one takes over
    written = _wait(
        store,
        config,
        [StoreKeys.CHECKPOINT.format(step, w) for w in range(config.num_workers)],
        list(range(config.num_workers)),
        f"did not write its state of the checkpoint of step {step} in {path}",
        strategy.between_steps,  # a worker that died writing its part: its replacement writes it, once healed
    )
    # the full checkpoint's folder (`full_base`: a step > 0, or None)
    folder = None if base is None else os.path.basename(step_dir(config.checkpoint_dir, base))
    shards = strategy.checkpoint_servers(path, None if folder is None else os.path.join(config.checkpoint_dir, folder))
    paths = [p for p, _ in shards.values()] + [os.path.join(path, worker_file(w)) for w in written]
    files = {os.path.basename(p): shard_file.stored_digest(p) for p in paths}
    manifest = dict(
        run=run,
        step=step,
        strategy=config.strategy,
        mode=config.mode,
        servers=config.servers,
        workers=config.num_workers,
        written=written,
        **described,
        files=files,
        **({"base": folder} if folder else {}),
    )
    write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    if held:
        store.set(StoreKeys.CHECKPOINT.format(step, "shards"), "1")


def _coordinator(store: dist.Store, config: JobConfig) -> int:
    """The worker that has the servers write their shards and writes the manifest: worker 0, or in an elastic
    job the lowest of the job's first workers still in it."""
    if not config.elastic:
        return 0
    return min((w for w in staying(store) if w < config.num_workers), default=0)


def _wait(
    store: dist.Store,
    config: JobConfig,
    keys: list[str],
    workers: list[int],
    what: str,
    meanwhile: Callable[[], None] = lambda: None,
) -> list[int]:
    """Wait up to step_timeout until each key is set or its worker has left an elastic job (died, or finished
    its steps first), calling `meanwhile()` at each look; returns the workers whose key is set.

    Raises:
        TimeoutError: naming the workers still missing, and `what` they did not do.
    """

    def missing() -> list[int]:
        meanwhile()
        here = set(staying(store)) if config.elastic else set(workers)
        return [w for w, k in zip(workers, keys) if w in here and not store.check([k])]

    wait_until(
        lambda: not missing(),
        time.monotonic() + config.step_timeout,
        lambda: (
            f"{', '.join(worker_name(w) for w in missing())} {what} within step_timeout {config.step_timeout:.0f} s"
        ),
    )
    return [w for w, k in zip(workers, keys) if store.check([k])]


def restore(config: JobConfig, strategy, found: Found) -> int:
    """Load this worker's state of `found` (step, RNG states, the strategy's local state); returns the step.
    A worker beyond the checkpoint's workers, or whose file it lacks, takes the file of the lowest worker that
    wrote one (its model and optimizer under allreduce, hybrid and sharded, which every worker holds alike) and
    keeps its own RNG states. Under sharded each worker then takes its rows from that file and, when another
    number of workers wrote the checkpoint, from the other workers' files; under allreduce its dynamic tables'
    replicas from that file (`Strategy.load_rows`); a delta's onto the full checkpoint its manifest names."""
    me = config.worker_rank
    mine = me < found.manifest["workers"] and worker_file(me) in found.manifest["files"]
    written = found.manifest.get("written", list(range(found.manifest["workers"])))
    source = me if mine else min(written)  # worker 0, unless it had left an elastic job
    state = shard_file.load(os.path.join(found.path, worker_file(source)))
    if mine:
        rng_states.put_back(state)
    strategy.load_local_state(state)
    others = (shard_file.load(os.path.join(found.path, worker_file(w))) for w in written if w != source)
    base = base_of(found)
    full = base and functools.cache(lambda w=source: shard_file.load(os.path.join(base, worker_file(w))))
    strategy.load_rows(itertools.chain([state], others), found.path, full)
    return state["step"]
