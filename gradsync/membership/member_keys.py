"""Who is in the job, as the rendezvous store holds it: the membership keys every rank creates at start
(`create_keys`), what their values say (`parse_left`, `parse_gone`, `parse_workers`, `workers_in_order`), a gone
worker recorded (`record_gone`), the workers staying, and how a message names ranks (`ranks_named`).

The keys (`StoreKeys`): every rank's heartbeat counter (ALIVE) and, of a worker, the count of beats at which its
main thread had moved (MOVED), both read by `heartbeat.Watch`; LEFT, the `worker:steps,` entries of the workers
that left with `gradsync.shutdown`; GONE, the `worker:how` lines of workers that died in an elastic job (async or
ssp ps: by the launcher, or by a server for a joined worker gone silent), which count as left; TRAINERS, the
`worker,` list of the workers that began to build their Trainer; EXITED, the `worker,` list of the workers that
exited without `gradsync.shutdown`, in that order; WORKERS, the count of worker indices handed out, so that
workers that join are watched too. The launcher reads the same keys.
"""

from __future__ import annotations

import torch.distributed as dist

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys


def create_keys(store: dist.Store, world_size: int, workers: int) -> None:
    """Create every rank's counter, the lists of leavers and the count of workers (`workers`, unless set
    already), so that reading them never waits."""
    for rank in range(world_size):
        store.add(StoreKeys.ALIVE.format(rank), 0)
        store.add(StoreKeys.MOVED.format(rank), 0)
    # Store.append: missing from torch's stubs
    store.append(StoreKeys.LEFT, "")  # type: ignore[attr-defined]
    store.append(StoreKeys.GONE, "")  # type: ignore[attr-defined]
    store.append(StoreKeys.TRAINERS, "")  # type: ignore[attr-defined]
    store.append(StoreKeys.EXITED, "")  # type: ignore[attr-defined]
    store.compare_set(StoreKeys.WORKERS, "", str(workers))


def parse_left(raw: bytes) -> dict[int, int]:
    """{worker: steps it had taken} from the `worker:steps,` entries of the LEFT key."""
    return {int(w): int(s) for w, s in (item.split(":") for item in raw.decode().split(",") if item)}


def parse_workers(raw: bytes) -> set[int]:
    """The workers of a `worker,` list (the TRAINERS key)."""
    return set(workers_in_order(raw))


def workers_in_order(raw: bytes) -> list[int]:
    """The workers of a `worker,` list in the order they were appended (the EXITED key: the order they exited)."""
    return [int(w) for w in raw.decode().split(",") if w]


BACK = "+back"
"""What a GONE line says of a worker whose replacement joined the job again (`record_back`)."""


def _gone_lines(raw: bytes) -> list[tuple[int, str]]:
    """(worker, how it went, or BACK) of each `worker:how` line of the GONE key, in order."""
    return [(int(worker), how) for worker, _, how in (line.partition(":") for line in raw.decode().splitlines())]


def parse_gone(raw: bytes) -> dict[int, str]:
    """{worker: how it went} of the workers gone now, from the lines of the GONE key: a worker's first death since
    it was last back (`record_back`)."""
    gone: dict[int, str] = {}
    for worker, how in _gone_lines(raw):
        if how == BACK:
            gone.pop(worker, None)
        else:
            gone.setdefault(worker, how)
    return gone


def deaths(raw: bytes) -> dict[int, int]:
    """{worker: how many of its processes died} from the GONE key's lines (a worker's replacements die too)."""
    counts: dict[int, int] = {}
    for worker, how in _gone_lines(raw):
        if how != BACK:
            counts[worker] = counts.get(worker, 0) + 1
    return counts


def record_gone(store: dist.Store, worker: int, how: str) -> None:
    """Record that `worker` left an elastic job without gradsync.shutdown() (`how`: 'killed by SIGKILL'...)."""
    # Store.append: missing from torch's stubs
    store.append(StoreKeys.GONE, f"{worker}:{how}\n")  # type: ignore[attr-defined]


def record_back(store: dist.Store, worker: int) -> None:
    """Record that `worker`, gone, is in the job again: its replacement joined it (worker_loss drop)."""
    store.append(StoreKeys.GONE, f"{worker}:{BACK}\n")  # type: ignore[attr-defined]


def staying(store: dist.Store) -> list[int]:
    """The workers in the job now: every index handed out, less those that left or are gone."""
    workers, left, gone = store.multi_get([StoreKeys.WORKERS, StoreKeys.LEFT, StoreKeys.GONE])
    return sorted(set(range(int(workers))) - set(parse_left(left)) - set(parse_gone(gone)))


def ranks_named(config: JobConfig, ranks: list[int]) -> str:
    """'rank 2 (worker1), rank 3 (worker2)'."""
    return ", ".join(f"rank {rank} ({config.role(rank)})" for rank in ranks)
