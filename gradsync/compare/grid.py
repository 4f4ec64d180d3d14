"""The configurations `gradsync compare` runs: strategy x mode x servers x compression."""

from __future__ import annotations

import dataclasses

from gradsync.core.strategies import STRATEGIES, Dense


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's settings (workers are the same for every run)."""

    strategy: str
    mode: str = "sync"
    servers: int = 0
    compression: str = "none"

    @property
    def name(self) -> str:
        """A short label: 'allreduce', 'ps sync S=2', 'hybrid S=1 int8', 'sharded', ..."""
        parts = [self.strategy]
        if _runs_every_mode(self.strategy):
            parts.append(self.mode)
        if self.servers:
            parts.append(f"S={self.servers}")
        if self.compression != "none":
            parts.append(self.compression)
        return " ".join(parts)

    @property
    def slug(self) -> str:
        """The name as a directory name."""
        return self.name.replace(" ", "_").replace("=", "")

    def settings(self) -> dict:
        """Keyword arguments of `gradsync.launcher.scripts.run_script` for this run."""
        return dict(strategy=self.strategy, mode=self.mode, servers=self.servers, compression=self.compression)


def _runs_every_mode(strategy: str) -> bool:
    """Whether the grid runs `strategy` in every mode asked for: its dense layers are on the servers (ps); the
    others' are DDP's, synchronous (hybrid's servers hold only the embedding tables)."""
    return strategy in STRATEGIES and STRATEGIES[strategy].dense is Dense.SERVERS


def grid(strategies: list[str], servers: list[int], modes: list[str], compressions: list[str]) -> list[Config]:
    """Every combination that means something: allreduce and sharded have no servers and one mode; ps takes
    every mode and server count; hybrid's servers hold only the embedding tables (sync dense layers)."""
    if any(s < 1 for s in servers):
        raise ValueError(f"--servers {servers}: each count must be >= 1 (allreduce runs without servers anyway)")
    configs = []
    for strategy in strategies:
        for compression in compressions:
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r} in --strategies: use allreduce, ps, hybrid or sharded")
            if not STRATEGIES[strategy].servers:
                configs.append(Config(strategy, compression=compression))
            elif _runs_every_mode(strategy):
                configs += [Config(strategy, mode, s, compression) for mode in modes for s in servers]
            else:
                configs += [Config(strategy, "sync", s, compression) for s in servers]
    return configs
