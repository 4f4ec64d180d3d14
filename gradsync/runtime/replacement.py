"""Replacing a dead worker of a ps job (worker_loss wait; drop with max_restarts): what each worker leaves for a
replacement, and what a replacement takes.

Each worker of such a job records, as each `trainer.step` begins, the step and its RNG states in the rendezvous
store (`record`), under one of two keys by the step's parity, so that the record of the step before the one in
flight is always there, whenever the worker dies. The launcher starts a dead worker's replacement with
GRADSYNC_REPLACEMENT=n and TORCHELASTIC_RESTART_COUNT=n (as torchrun would set it); the replacement joins the
running job's RPC group under a name of its own (`JobConfig.rpc_identity`) and rejoins the servers
(`ParameterServer.rejoin`), which forget what the dead process had sent of the step in flight and say how many
steps each has closed. It starts at the step in flight (`trainer.start_step`) from the servers' values as of that
step (a server that has closed it already answers with the values it had before), and the RNG states recorded as
the step before it began (`take`: `trainer.step` draws none, so they are the states as the step in flight began).
Once its Trainer is built, it says so (`say_rejoined`), which the launcher reports. Under worker_loss drop, the
job goes on without the dead worker, and its replacement joins it at a step boundary (`PSStrategy._readmit`), with
the RNG states its script gives it; a GradScaler's state is taken from the others as under wait.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from gradsync.core import settings
from gradsync.core.job_names import StoreKeys
from gradsync.core.waiting import wait_until
from gradsync.runtime import checkpoints, rng_states


def rejoin(cluster, strategy, described: dict) -> int:
    """The step a replacement's Trainer starts at (`strategy.rejoined_at` steps after the job's first), with (wait)
    its RNG states as of that step and, when the job resumed, the checkpoint's optimizer options; when that step is a
    checkpoint's, this worker's part of it written (the dead process may have died writing it)."""
    config, store = cluster.config, cluster.store
    first = cluster.resumed.step if cluster.resumed is not None else 0
    start = first + strategy.rejoined_at
    if cluster.resumed is not None:
        checkpoints.restore(config, strategy, cluster.resumed)
    if start > first and config.replaces_workers:  # drop: a replacement joins later, with its own RNG states
        take(store, config.worker_rank, start)
        every = config.checkpoint_every
        if every and start % every == 0:
            checkpoints.save(store, config, cluster.run, start, strategy, described, first)
    say_rejoined(store, config.worker_rank, config.replacement, start)
    return start


def restart_count() -> int:
    """0 in a worker's first process; n in its n-th replacement (TORCHELASTIC_RESTART_COUNT, as torchrun sets it)."""
    return settings.RESTART_COUNT.read()


def record(store: dist.Store, worker: int, step: int) -> None:
    """Leave `worker`'s RNG states as step `step` begins (its trainer.step) for a replacement."""
    record = rng_states.packed(step)
    store.set(StoreKeys.STEP_BEGUN.format(worker, step % 2), record)  # type: ignore[arg-type]  # bytes: torch's stub says str


def record_scaler(store: dist.Store, worker: int, step: int, scaler) -> None:
    """Leave the state `worker`'s GradScaler has after step `step` (its scale and growth count), which every
    worker's has alike (each step's found-inf is the job's), for a replacement (`scaler_after`)."""
    state = {k: scaler.state_dict()[k] for k in ("scale", "_growth_tracker")}
    store.set(StoreKeys.SCALER.format(worker, step % 2), f"{step}:{json.dumps(state)}")


def scaler_after(store: dist.Store, config, step: int) -> dict:
    """The GradScaler state after step `step`, as any worker left it (the dead one, or a live one once it has
    taken that step), within step_timeout.

    Raises:
        TimeoutError: no worker left it in time.
    """
    keys = [StoreKeys.SCALER.format(w, step % 2) for w in range(config.num_workers)]
    found: list[dict] = []

    def left() -> bool:
        for key in keys:
            if store.check([key]):
                recorded, _, state = store.get(key).decode().partition(":")
                if int(recorded) == step:
                    found.append(json.loads(state))
                    return True
        return False

    wait_until(left, time.monotonic() + config.call_timeout, f"a worker's GradScaler state after step {step}")
    return found[0]


def take(store: dist.Store, worker: int, step: int) -> None:
    """Put back the RNG states `worker` recorded as step `step - 1` began: its states as step `step` began.

    Raises:
        RuntimeError: the record is of another step (the dead worker recorded no such step).
    """
    key = StoreKeys.STEP_BEGUN.format(worker, (step - 1) % 2)
    recorded, states = rng_states.unpacked(store.get(key))
    if recorded != step - 1:
        raise RuntimeError(
            f"worker {worker}'s replacement starts at step {step}, and the dead worker's last record is of step "
            f"{recorded}, not {step - 1}: its RNG states as of step {step} are lost"
        )
    rng_states.put_back(states)


class ContinuedScaler:
    """A replacement's GradScaler in its first step, `step`: the loss was scaled by its own scale (`get_scale`), and
    the scaler then takes the state every worker's had after step `step - 1` (`scaler_after`), so that the step's
    update (`worker.module.amp.record_found_inf`) leaves it where theirs are. Its found-inf check of that one step is
    made at its own scale."""

    def __init__(self, scaler, after: dict):
        self.scaler, self.used = scaler, scaler.get_scale()
        scaler.load_state_dict({**scaler.state_dict(), **after})

    def get_scale(self) -> float:
        return self.used

    def __getattr__(self, name: str):
        return getattr(self.scaler, name)


def say_rejoined(store: dist.Store, worker: int, replacement: int, step: int) -> None:
    """Tell the launcher that `worker`'s `replacement`-th replacement has built its Trainer, at `step`."""
    store.set(StoreKeys.REJOINED.format(worker), f"{replacement}:{step}")


def rejoined(store: dist.Store, worker: int, replacement: int) -> int | None:
    """The step `worker`'s `replacement`-th replacement continues from, once it has rejoined; else None."""
    key = StoreKeys.REJOINED.format(worker)
    if not store.check([key]):
        return None
    number, _, step = store.get(key).decode().partition(":")
    return int(step) if int(number) == replacement else None
