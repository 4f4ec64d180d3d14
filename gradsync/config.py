"""Typed job configuration: where this process sits, how the job trains, its timeouts and checkpoints.

Each concern is a kw-only dataclass (`Placement`, `Training`, `Timeouts`, `Checkpointing`) whose fields are
the settings of that concern in the settings table (`gradsync.core.settings`, where each says what it means),
in its order, with its types and defaults (`tests/core/test_settings.py` checks that they agree); `JobConfig` is
the four together, with flat attributes. A setting comes from an argument of `gradsync.init`/`launch`, from
the environment a launcher sets (`GRADSYNC_*`, torchrun's `RANK`/`WORLD_SIZE`/...), or its default;
`JobConfig.from_env` merges them and `__post_init__` rejects bad values with a message that names the value
and the fix.
"""

from __future__ import annotations

import dataclasses
import os

from gradsync.core import settings
from gradsync.core.job_names import server_name, worker_name
from gradsync.core.settings import ConfigError
from gradsync.core.strategies import STRATEGIES, traits
from gradsync.core.transport_capabilities import capabilities


def _positive(config, concern: str) -> None:
    for s in settings.of(concern):
        if s.type is float and getattr(config, s.name) is not None and getattr(config, s.name) <= 0:
            raise ConfigError(f"{s.name} must be > 0, got {getattr(config, s.name)}")


@dataclasses.dataclass(kw_only=True)
class Placement:
    """Where this process sits in the job: the first `servers` ranks are the parameter servers."""

    rank: int = settings.RANK.default
    world_size: int = settings.WORLD_SIZE.default
    master_addr: str = settings.MASTER_ADDR.default
    master_port: int = settings.MASTER_PORT.default
    store_is_hosted: bool = settings.STORE_IS_HOSTED.default
    servers: int = settings.SERVERS.default
    server_device: str = settings.SERVER_DEVICE.default
    replacement: int = settings.REPLACEMENT.default

    def __post_init__(self) -> None:
        self._check_placement()

    def _check_placement(self) -> None:
        if not (self.server_device == "cpu" or self.server_device == "cuda" or self.server_device.startswith("cuda:")):
            raise ConfigError(
                f"server_device {self.server_device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N' "
                f"({settings.SERVER_DEVICE.where})"
            )
        if self.servers < 0:
            raise ConfigError(f"servers must be >= 0, got {self.servers}")
        if self.world_size - self.servers < 1:
            raise ConfigError(
                f"world size {self.world_size} leaves no workers after {self.servers} servers: "
                "start more processes or fewer servers"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1} (check RANK and WORLD_SIZE)")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"master port {self.master_port} is not a TCP port (0..65535)")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.servers

    @property
    def is_server(self) -> bool:
        return self.rank < self.servers

    @property
    def worker_rank(self) -> int:
        """0 .. num_workers-1 on a worker; raises on a server."""
        if self.is_server:
            raise RuntimeError(f"rank {self.rank} is a parameter server, not a worker")
        return self.rank - self.servers

    @property
    def name(self) -> str:
        """RPC name of this process: 'ps<i>' or 'worker<i>'."""
        return self.role(self.rank)

    def role(self, rank: int) -> str:
        """RPC name of global rank `rank`: 'ps<i>' for the first `servers` ranks, else 'worker<i>'."""
        return server_name(rank) if rank < self.servers else worker_name(rank - self.servers)


@dataclasses.dataclass(kw_only=True)
class Training:
    """What a step computes and how gradients travel."""

    strategy: str = settings.STRATEGY.default
    mode: str = settings.MODE.default
    staleness: int = settings.STALENESS.default
    nonfinite: str = settings.NONFINITE.default
    compression: str = settings.COMPRESSION.default
    transport: str = settings.TRANSPORT.default
    bucket_cap_mb: float | None = settings.BUCKET_CAP_MB.default
    pipeline: str = settings.PIPELINE.default

    def __post_init__(self) -> None:
        self._check_training()

    def _check_training(self) -> None:
        for s in settings.of("training"):
            s.check(getattr(self, s.name))
        refusal = capabilities(self.transport).job_refusal(self.strategy, self.compression)
        if refusal:
            raise ConfigError(refusal)
        if self.staleness < 0 or (self.staleness and self.mode != "ssp"):
            raise ConfigError(
                f"staleness={self.staleness}: it bounds --mode ssp and must be >= 0; pass --mode ssp "
                "--staleness K, or leave --staleness out"
            )
        if self.mode not in traits(self.strategy).modes:  # allreduce and sharded: sync only
            raise ConfigError(
                f"the {self.strategy} strategy is synchronous (every step averages every worker's "
                f"gradients), got --mode {self.mode}: pass --mode sync, or use --strategy ps (or "
                "hybrid) for async and ssp"
            )
        _positive(self, "training")


@dataclasses.dataclass(kw_only=True)
class Timeouts:
    """How long each wait of this rank may take, in seconds."""

    startup_timeout: float = settings.STARTUP_TIMEOUT.default
    step_timeout: float = settings.STEP_TIMEOUT.default
    stall_report: float = settings.STALL_REPORT.default
    shutdown_timeout: float = settings.SHUTDOWN_TIMEOUT.default

    def __post_init__(self) -> None:
        self._check_timeouts()

    def _check_timeouts(self) -> None:
        _positive(self, "timeouts")


@dataclasses.dataclass(kw_only=True)
class Checkpointing:
    """Checkpoints of the job, and the one it resumes from."""

    checkpoint_dir: str = settings.CHECKPOINT_DIR.default
    checkpoint_every: int = settings.CHECKPOINT_EVERY.default
    checkpoint_full_every: int = settings.CHECKPOINT_FULL_EVERY.default
    resume: str = settings.RESUME.default
    start_over: bool = settings.START_OVER.default

    def __post_init__(self) -> None:
        self._check_checkpointing()

    def _check_checkpointing(self) -> None:
        if self.checkpoint_every < 0 or bool(self.checkpoint_every) != bool(self.checkpoint_dir):
            raise ConfigError(
                f"checkpoint_every={self.checkpoint_every}, checkpoint_dir={self.checkpoint_dir!r}: pass both "
                "--checkpoint-dir DIR and --checkpoint-every N (N >= 1), or neither"
            )
        if self.checkpoint_full_every < 1:
            raise ConfigError(
                f"checkpoint_full_every={self.checkpoint_full_every}: pass --checkpoint-full-every N "
                "with N >= 1 (1: every checkpoint is full)"
            )
        if self.start_over and (self.resume or not self.checkpoint_dir):
            raise ConfigError(
                f"start_over with resume={self.resume!r}, checkpoint_dir={self.checkpoint_dir!r}: --start-over "
                "begins a new run in --checkpoint-dir, removing the old run's checkpoints, and --resume continues "
                "one: pass --checkpoint-dir DIR with one of them"
            )


@dataclasses.dataclass(kw_only=True)
class Faults:
    """What the job does when one of its ranks dies (docs/guide.md, "When a rank dies")."""

    worker_loss: str = settings.WORKER_LOSS.default
    max_restarts: int = settings.MAX_RESTARTS.default
    restart_timeout: float = settings.RESTART_TIMEOUT.default
    replicas: int = settings.REPLICAS.default

    def __post_init__(self) -> None:
        self._check_faults()

    def _check_faults(self) -> None:
        for s in settings.of("faults"):
            s.check(getattr(self, s.name))
        _positive(self, "faults")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts}: pass --max-restarts N with N >= 0 (0: none)")
        if self.replicas not in (0, 1):
            raise ConfigError(
                f"replicas={self.replicas}: pass --replicas 1 (each server's shard kept on the next server too) "
                "or --replicas 0 (none)"
            )

    @property
    def replaces_workers(self) -> bool:
        """Whether a worker that dies is replaced and its step waits for the replacement (`worker_loss` wait)."""
        return self.worker_loss == "wait"

    @property
    def readmits_workers(self) -> bool:
        """Whether a worker that dies is replaced by one that joins the job at a step boundary, which goes on
        without it until then (`worker_loss` drop with max_restarts)."""
        return self.worker_loss == "drop" and self.max_restarts > 0

    @property
    def restarts_workers(self) -> bool:
        """Whether the launcher starts a replacement for a worker that dies (`replaces_workers` or
        `readmits_workers`)."""
        return self.replaces_workers or self.readmits_workers


@dataclasses.dataclass(kw_only=True)
class JobConfig(Faults, Checkpointing, Timeouts, Training, Placement):  # fields in the order placement, training, ...
    """Where this process sits in the job and how the job trains: the five concerns, checked together."""

    def __post_init__(self) -> None:
        self._check_training()
        strategy = traits(self.strategy)
        if strategy.servers and self.servers < 1:
            raise ConfigError(
                f"the {self.strategy} strategy needs at least one server, got servers={self.servers}: "
                "pass --servers 1 (or more), or use --strategy allreduce"
            )
        if not strategy.servers and self.servers != 0:
            raise ConfigError(
                f"the {self.strategy} strategy uses no servers, got servers={self.servers}: pass --servers 0"
            )
        self._check_checkpointing()
        self._check_placement()
        self._check_timeouts()
        self._check_faults()
        refusal = strategy.worker_loss_refusal(self.worker_loss, self.mode)
        if self.readmits_workers and self.mode != "sync":
            refusal = refusal or (
                f"worker_loss='drop' with max_restarts={self.max_restarts} and mode={self.mode!r}: a dropped "
                "worker's replacement joins a sync job at a step boundary; under async and ssp pass --worker-loss "
                "wait, whose replacement takes the dead worker's rank and goes on at once"
            )
        if self.restarts_workers:
            refusal = refusal or capabilities(self.transport).replacement_refusal(self.transport)
        if refusal:
            raise ConfigError(refusal)
        if self.replicas and (refusal := self._replicas_refusal()):
            raise ConfigError(refusal)

    def _replicas_refusal(self) -> str | None:
        """Why this job cannot keep each shard on a second server (`ps.replica`); None when it can."""
        where = [f"{t.name} {'/'.join(t.replicated)}" for t in STRATEGIES.values() if t.replicated]
        if self.mode not in traits(self.strategy).replicated or self.transport != "rpc" or self.servers < 2:
            return (
                f"replicas=1 with strategy={self.strategy!r}, mode={self.mode!r}, transport={self.transport!r}, "
                f"servers={self.servers}: a replica of each shard is kept in {', '.join(where)} jobs over torch RPC "
                "with two servers or more so far; pass --transport rpc --servers 2 (or more), or --replicas 0"
            )
        if self.pipeline == "on":
            return (
                "replicas=1 with pipeline='on': a replicated shard takes each step whole, so that a step is "
                "answered only once both copies hold it; pass --pipeline auto (or off), or --replicas 0"
            )
        if self.worker_loss == "drop":
            return (
                "replicas=1 with worker_loss='drop': servers that keep each other's shards do not yet go on "
                "without a dead worker; pass --worker-loss wait (a replacement takes its place) or fail, or "
                "--replicas 0"
            )
        return None

    @property
    def replicated(self) -> bool:
        """Whether each server's shard is kept on the next server too, which serves it once that server dies
        (`replicas` 1: `ps.replica`)."""
        return self.replicas == 1

    @property
    def rpc_identity(self) -> tuple[str, int]:
        """(name, rank) of this process in the job's RPC group: its role and rank, or, in the n-th replacement of
        a worker or a server, a name and a rank of its own (`worker1_r2`, `ps1_r1`), which no earlier process of
        the group held (workers' replacements first, then servers')."""
        if not self.replacement:
            return self.name, self.rank
        if self.is_server:
            base = self.world_size + self.max_restarts * self.num_workers
            return f"{self.name}_r{self.replacement}", base + (self.replacement - 1) * self.servers + self.rank
        return f"{self.name}_r{self.replacement}", self.world_size + (self.replacement - 1) * self.num_workers + (
            self.rank - self.servers
        )

    @property
    def elastic(self) -> bool:
        """An async or ssp ps job, or one with worker_loss drop: a worker that dies or leaves does not stop it,
        and (async, over torch RPC) a new worker may join it while it runs (docs/guide.md, "Elastic async
        workers", "When a rank dies")."""
        return not traits(self.strategy).process_group and (self.mode != "sync" or self.worker_loss == "drop")

    @property
    def dynamic_group(self) -> bool:
        """Whether the job's RPC group takes members while it runs: an elastic job, or one whose dead workers
        are replaced (`transport.rpc_group`)."""
        return self.elastic or self.replaces_workers or self.replicated

    @property
    def call_timeout(self) -> float:
        """Seconds a worker's call of a step may wait: step_timeout, and restart_timeout more in a job whose
        step waits for a dead worker's replacement (wait; drop: from the step it joins at), or step_timeout more
        in one whose servers keep replicas (a step waits for its replica, or for the launcher's word that the
        replica's server died)."""
        return (
            self.step_timeout
            + (self.restart_timeout if self.restarts_workers else 0.0)
            + (self.step_timeout if self.replicated else 0.0)
        )

    @classmethod
    def from_env(cls, environ=None, **overrides) -> JobConfig:
        """Build the config from a launcher's environment; non-None `overrides` win."""
        env = os.environ if environ is None else environ
        values = settings_from_env(env, overrides.get("strategy"))
        values.update({s.name: s.parse(env.get(s.env)) for s in settings.of("placement") if s.internal})
        values["store_is_hosted"] |= env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if not settings.WORLD_SIZE.given(env):
            del values["world_size"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        values.setdefault("world_size", values["servers"] + 1)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The GRADSYNC_* variables that reproduce this job's settings in a child process."""
        return {
            s.env: s.text(getattr(self, s.name)) for s in settings.JOB_SETTINGS if getattr(self, s.name) is not None
        }


def settings_from_env(env, strategy: str | None = None) -> dict:
    """The job's settings from its GRADSYNC_* variables (what `to_env` writes), defaults for the unset ones;
    not torchrun's placement (RANK, WORLD_SIZE, MASTER_*). `strategy`, when given, wins over GRADSYNC_STRATEGY."""
    values = {s.name: s.parse(env.get(s.env)) for s in settings.JOB_SETTINGS}
    values["strategy"] = strategy or values["strategy"]
    if not settings.SERVERS.given(env):
        values["servers"] = default_servers(values["strategy"])
    return values


def job_keywords(given: dict, call: str) -> dict:
    """`given`, the settings keywords of `call` (gradsync.init, gradsync.launch...), refusing one that is no
    job setting."""
    names = [s.name for s in settings.JOB_SETTINGS]
    unknown = [k for k in given if k not in names]
    if unknown:
        raise TypeError(
            f"{call}() got an unknown setting {unknown[0]!r}: the settings are {', '.join(names)} "
            "(docs/architecture.md, Settings)"
        )
    return given


def default_servers(strategy: str) -> int:
    """Parameter servers a job gets when none are asked for: 1 for a strategy with servers (ps, hybrid), 0 for one
    without (allreduce, sharded); 1 for a name that is no strategy, which the job's checks then refuse."""
    return 0 if strategy in STRATEGIES and not STRATEGIES[strategy].servers else 1
