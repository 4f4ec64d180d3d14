"""What each strategy is, keyed by the value of the `strategy` setting: the one table of strategies' traits.

The table sits in core, below `config`, the settings table and `compare`, because all of them read it (the
`strategy` setting's choices, default and help; JobConfig's checks of servers and modes; the grid and cost model
of `gradsync compare`), and `core/transport_capabilities.py` names the strategies each transport serves from it.
The worker side of a strategy (a `gradsync.worker.strategies.strategy.Strategy`) is named here by its dotted path and
imported on first use (`StrategyTraits.load`), so the Trainer imports only the job's strategy's module and this
module imports nothing of gradsync. Code outside this module asks `traits(name)` (or walks `STRATEGIES`) and
reads a trait, never compares a strategy's name (`tests/core/test_strategies.py` scans the package for it).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Callable


class Dense(enum.Enum):
    """Where a strategy trains the model's dense parameters (everything but the tables it places)."""

    SERVERS = "on the parameter servers: pulled and pushed by every worker"
    DDP = "in every worker, averaged by DDP's allreduce"


class Tables(enum.Enum):
    """Where a strategy trains the embedding tables `Trainer(tables=...)` places (and `DynamicEmbedding`s)."""

    SERVED = "served by rows from the parameter servers, a worker pulling the rows its batch looks up"
    SHARDED = "split by row across the workers, looked up with all-to-all exchanges"
    REPLICATED = "dense: a replica in every worker (DDP, or a dynamic table's replicas kept alike)"


class Saved(enum.Enum):
    """A part of what a job checkpoint holds (beyond every worker's step and RNG state)."""

    SERVER_SHARDS = "every server's shard: its parameters or rows and their optimizer state"
    WORKER_OPTIONS = "every worker's optimizer options (a schedule's lr)"
    WORKER_DENSE = "every worker's model and optimizer state"
    WORKER_ROWS = "every worker's rows of the tables it holds, with their row optimizer state"


@dataclasses.dataclass(frozen=True)
class StrategyTraits:
    """One strategy's declared traits."""

    name: str  # the `strategy` setting's value
    summary: str  # the setting's help for it, in a few words
    servers: bool  # True: a job needs at least one parameter server; False: it has none (servers must be 0)
    process_group: bool  # the workers form a torch.distributed process group (DDP, all-to-all exchanges)
    modes: tuple[str, ...]  # the `mode` setting's values a job of it accepts
    dense: Dense  # where the dense parameters train
    tables: Tables  # where the embedding tables train (those Trainer(tables=...) places, DynamicEmbedding)
    needs_tables: bool  # it refuses a model without an embedding table to place (`core.errors.NoTablesToServe`)
    join: bool  # trainer.join() (workers with uneven data) is supported
    replaced: tuple[str, ...]  # the modes in which a dead worker's replacement takes its place (worker_loss wait)
    dropped: tuple[str, ...]  # the modes in which a job goes on without a dead worker (worker_loss drop)
    replicated: tuple[str, ...]  # the modes in which each server's shard is kept on the next server too (replicas 1)
    checkpoint: tuple[Saved, ...]  # what its job checkpoints hold; () would be no checkpoints
    loader: str  # the dotted path of its worker-side Strategy class, imported on first use
    keywords: tuple[str, ...]  # the Trainer's arguments its class's constructor takes (as keywords)

    @property
    def checkpoints(self) -> bool:
        """Whether its jobs write checkpoints (`--checkpoint-dir`, `--checkpoint-every`)."""
        return bool(self.checkpoint)

    def worker_loss_refusal(self, policy: str, mode: str) -> str | None:
        """Why a job of this strategy in `mode` cannot take a worker's death with `policy` ('wait': a replacement
        takes its place; 'drop': the job goes on without it); None when it can ('fail' always can)."""
        trait = {"wait": "replaced", "drop": "dropped"}.get(policy)
        if trait is None or mode in getattr(self, trait):
            return None
        where = [f"{t.name} {'/'.join(getattr(t, trait))}" for t in STRATEGIES.values() if getattr(t, trait)]
        return (
            f"worker_loss={policy!r} is available for {', '.join(where)} jobs so far, got strategy={self.name!r}, "
            f"mode={mode!r}: pass --worker-loss fail and --checkpoint-dir/--checkpoint-every to resume after a death"
        )

    def load(self) -> type:
        """Its worker-side `Strategy` class, its module imported now (once: Python keeps it)."""
        module, _, name = self.loader.rpartition(".")
        return getattr(importlib.import_module(module), name)


STRATEGIES: dict[str, StrategyTraits] = {
    t.name: t
    for t in (
        StrategyTraits(
            "ps",
            "parameter server",
            servers=True,
            process_group=False,
            modes=("sync", "async", "ssp"),
            dense=Dense.SERVERS,
            tables=Tables.SERVED,
            needs_tables=False,
            join=True,
            replaced=("sync", "async", "ssp"),
            dropped=("sync", "async", "ssp"),
            replicated=("sync", "async"),
            checkpoint=(Saved.SERVER_SHARDS, Saved.WORKER_OPTIONS),
            loader="gradsync.worker.strategies.ps_strategy.PSStrategy",
            keywords=("tables", "table_optimizer", "clipping"),
        ),
        StrategyTraits(
            "allreduce",
            "DDP",
            servers=False,
            process_group=True,
            modes=("sync",),
            dense=Dense.DDP,
            tables=Tables.REPLICATED,
            needs_tables=False,
            join=True,
            replaced=("sync",),
            dropped=(),
            replicated=(),
            checkpoint=(Saved.WORKER_DENSE, Saved.WORKER_ROWS),
            loader="gradsync.worker.strategies.allreduce_strategy.AllreduceStrategy",
            keywords=("find_unused_parameters", "clipping", "table_optimizer"),
        ),
        StrategyTraits(
            "hybrid",
            "embedding tables on the servers, the rest DDP",
            servers=True,
            process_group=True,
            modes=("sync", "async", "ssp"),
            dense=Dense.DDP,
            tables=Tables.SERVED,
            needs_tables=True,
            join=True,
            replaced=(),
            dropped=(),
            replicated=(),
            checkpoint=(Saved.SERVER_SHARDS, Saved.WORKER_DENSE),
            loader="gradsync.worker.strategies.hybrid_strategy.HybridStrategy",
            keywords=("tables", "table_optimizer", "find_unused_parameters", "clipping"),
        ),
        StrategyTraits(
            "sharded",
            "no servers: embedding tables split across the workers by row, over all-to-all; the rest DDP",
            servers=False,
            process_group=True,
            modes=("sync",),
            dense=Dense.DDP,
            tables=Tables.SHARDED,
            needs_tables=True,
            join=False,
            replaced=(),
            dropped=(),
            replicated=(),
            checkpoint=(Saved.WORKER_DENSE, Saved.WORKER_ROWS),
            loader="gradsync.worker.strategies.sharded_strategy.ShardedStrategy",
            keywords=("tables", "table_optimizer", "find_unused_parameters", "clipping"),
        ),
    )
}
"""Every strategy by name; the first is the `strategy` setting's default."""


def traits(name: str) -> StrategyTraits:
    """The traits of strategy `name` (a value the `strategy` setting accepts)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"no strategy named {name!r}: expected one of {', '.join(STRATEGIES)}") from None


def names(can: Callable[[StrategyTraits], bool] = lambda t: True) -> tuple[str, ...]:
    """The names of the strategies whose traits satisfy `can`, in the table's order."""
    return tuple(t.name for t in STRATEGIES.values() if can(t))


def listed(words: tuple[str, ...]) -> str:
    """`words` in a sentence: 'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def described() -> str:
    """The `strategy` setting's help: every strategy with its summary."""
    parts = [f"{t.name} ({t.summary})" for t in STRATEGIES.values()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])}, or {parts[-1]}"
