"""The workers' process group of an allreduce job whose dead workers are replaced (worker_loss wait), by generation.

The job's first processes form generation 0 as the strategy starts. Each death ends a generation: the survivors
and the dead worker's replacement form the next, of the same W workers with the same ranks. The launcher numbers
the generations: as it starts a replacement it counts one more in the store (`StoreKeys.GENERATION`,
`launcher.restarts`). A survivor whose collective failed waits for a number beyond its generation's; a replacement
takes the number as it starts. Each registers under that number and, once all W have, they form a gloo group over
the store under the number's prefix (`core.torch_internals.gloo_group`); a death meanwhile makes a later number,
which every one still waiting moves to. All of it is bounded by restart_timeout. A generation's group is dropped
once the next is formed, which closes its connections, so that a survivor still waiting in its collective on a
live peer that left it fails at once rather than at the step timeout.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.core.torch_internals import gloo_group
from gradsync.core.waiting import wait_until


def _count(store: dist.Store, key: str) -> int:
    """The counter `key` of the store (0 when nobody counted yet)."""
    return store.add(key, 0)


class Generations:
    """This worker's generation of the workers' group: `group`, formed with the others, and its `number`."""

    def __init__(self, store: dist.Store, config: JobConfig):
        """A first process forms generation 0 with the others; a replacement waits to form the launcher's latest."""
        self.store, self.config = store, config
        self.number = _count(store, StoreKeys.GENERATION) - 1 if config.replacement else -1
        self.group: dist.ProcessGroup | None = None
        if not config.replacement:
            self.form(time.monotonic() + config.startup_timeout)

    def numbered(self) -> bool:
        """Whether the launcher numbered a generation after this one (a worker died)."""
        return _count(self.store, StoreKeys.GENERATION) > self.number

    def form(self, deadline: float) -> None:
        """Form the generation after this one with the other workers, by `deadline` (time.monotonic()).

        Raises:
            TimeoutError: no generation was numbered, or not every worker came to it, in time.
        """
        store, config = self.store, self.config
        if self.number >= 0:  # the launcher numbers each generation after the first
            wait_until(
                self.numbered,
                deadline,
                f"{config.name}: a collective failed, and no worker of the job was replaced (restart_timeout "
                f"{config.restart_timeout:g} s)",
            )
        target = max(self.number + 1, _count(store, StoreKeys.GENERATION))
        while (latest := self._gather(target, deadline)) != target:
            target = latest  # a death while they gathered: its replacement comes to a later one
        prefix = dist.PrefixStore(f"{StoreKeys.PROCESS_GROUP}/{target}", store)
        timeout = datetime.timedelta(seconds=config.step_timeout)
        self.group = None  # the last generation's connections closed first
        self.group = gloo_group(prefix, config.worker_rank, config.num_workers, timeout)
        self.number = target

    def _gather(self, target: int, deadline: float) -> int:
        """Register at generation `target` and wait until every worker has (`target`) or the launcher gave a later
        number (that number)."""
        store, config = self.store, self.config
        store.add(StoreKeys.GENERATION_MEMBERS.format(target), 1)
        settled = wait_until(
            lambda: self._settled(target),
            deadline,
            lambda: (
                f"{config.name}: not every worker came to generation {target} of the job's process group "
                f"({_count(store, StoreKeys.GENERATION_MEMBERS.format(target))} of {config.num_workers}; "
                f"restart_timeout {config.restart_timeout:g} s)"
            ),
        )
        assert settled is not None  # wait_until returns a true value
        return settled[0]

    def _settled(self, target: int) -> list[int] | None:
        """[target] once every worker registered there; [a later number] the launcher gave meanwhile; else None."""
        latest = _count(self.store, StoreKeys.GENERATION)
        if latest > target:
            return [latest]
        members = _count(self.store, StoreKeys.GENERATION_MEMBERS.format(target))
        return [target] if members >= self.config.num_workers else None
