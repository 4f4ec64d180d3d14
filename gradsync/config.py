"""Typed job configuration: strategy, consistency mode, servers, timeouts and policies.

Every field can come from an argument of `gradsync.init`/`launch`, from the
environment a launcher sets (`GRADSYNC_*`, torchrun's `RANK`/`WORLD_SIZE`/...),
or from its default; `JobConfig.from_env` merges them and `__post_init__`
rejects bad values with a message that names the value and the fix.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, get_args

Strategy = Literal["ps", "allreduce", "hybrid"]
Mode = Literal["sync", "async", "ssp"]
NonFinitePolicy = Literal["raise", "skip"]
Compression = Literal["none", "fp16", "bf16", "int8"]
Transport = Literal["rpc", "grpc"]


class ConfigError(ValueError):
    """A job setting is invalid; the message names the bad value and the fix."""


def _choice(field: str, value: str, allowed_type, flag: str) -> None:
    allowed = get_args(allowed_type)
    if value not in allowed:
        raise ConfigError(
            f"unknown {field} {value!r}: expected one of {', '.join(repr(a) for a in allowed)} "
            f"(set it with {flag})"
        )


@dataclasses.dataclass
class JobConfig:
    """Where this process sits in the job and how the job trains."""

    strategy: Strategy = "ps"
    """'ps' (parameter server), 'allreduce' (DistributedDataParallel), or 'hybrid' (embedding tables on
    parameter servers, the rest with DistributedDataParallel)."""
    mode: Mode = "sync"
    """'sync': servers average all workers' gradients each step; 'async': apply each as it arrives;
    'ssp' (stale synchronous parallel): apply each as it arrives, scaled by 1/W, but no worker runs more
    than `staleness` steps ahead of the slowest (ps and hybrid only)."""
    staleness: int = 0
    """With mode 'ssp': how many steps a worker may run ahead of the slowest worker (0: lock step)."""
    servers: int = 1
    """Number of parameter-server processes; they are the first `servers` ranks. 0 for allreduce."""
    rank: int = 0
    """Global rank of this process, 0 .. world_size-1."""
    world_size: int = 1
    """servers + workers."""
    master_addr: str = "127.0.0.1"
    """Host of the rendezvous store."""
    master_port: int = 29500
    """Port of the rendezvous store."""
    store_is_hosted: bool = False
    """True when a launcher (gradsync run, torchrun's agent) already hosts the store, so rank 0 connects as a client."""
    nonfinite: NonFinitePolicy = "raise"
    """What a NaN/Inf gradient does: 'raise' names the parameter and worker; 'skip' drops that step."""
    compression: Compression = "none"
    """Wire format of gradients: 'none', 'fp16', 'bf16' or 'int8'."""
    transport: Transport = "rpc"
    """How ps workers reach the servers: 'rpc' (torch RPC, TensorPipe) or 'grpc' (no TensorPipe at all)."""
    server_device: str = "cpu"
    """Where each server keeps its shard and aggregates: 'cpu', 'cuda' or 'cuda:N' (pulls and pushes still
    cross the RPC boundary on the CPU, as distributed autograd requires)."""
    bucket_cap_mb: float = 25.0
    """Largest parameter bucket, in MB (one bucket is one flat tensor on the wire), and, under ps with an
    elementwise optimizer, the size of the pieces a larger parameter is cut into (a sync step's pieces are
    applied and sent back one by one). Behind a slow link 0.25 brings a step close to the link's floor, but
    each piece costs ~1.5 ms of CPU in torch RPC, 4x the CPU per step on loopback (BENCHMARKS.md)."""
    startup_timeout: float = 120.0
    """Seconds to wait for every rank to join and for the model to be registered."""
    step_timeout: float = 60.0
    """Seconds any single RPC or collective of a training step may take."""
    shutdown_timeout: float = 30.0
    """Seconds shutdown may wait for the other ranks before it gives up on a graceful exit."""
    checkpoint_dir: str = ""
    """Where the job writes a checkpoint every `checkpoint_every` steps (a folder per step; every rank must
    reach it: a shared filesystem across machines); '' writes none."""
    checkpoint_every: int = 0
    """Steps between checkpoints (with `checkpoint_dir`); 0: none."""
    resume: str = ""
    """A checkpoint directory to resume from: its newest complete checkpoint; '' starts afresh."""

    def __post_init__(self) -> None:
        _choice("strategy", self.strategy, Strategy, "--strategy or GRADSYNC_STRATEGY")
        _choice("mode", self.mode, Mode, "--mode or GRADSYNC_MODE")
        _choice("nonfinite policy", self.nonfinite, NonFinitePolicy, "nonfinite= or GRADSYNC_NONFINITE")
        _choice("compression", self.compression, Compression, "--compression or GRADSYNC_COMPRESSION")
        _choice("transport", self.transport, Transport, "--transport or GRADSYNC_TRANSPORT")
        if self.transport == "grpc" and (self.strategy != "ps" or self.compression != "none"):
            raise ConfigError(
                f"the grpc transport serves the ps strategy without compression, got strategy={self.strategy!r}, "
                f"compression={self.compression!r}: use --strategy ps --compression none, or --transport rpc"
            )
        if self.strategy in ("ps", "hybrid") and self.servers < 1:
            raise ConfigError(
                f"the {self.strategy} strategy needs at least one server, got servers={self.servers}: "
                "pass --servers 1 (or more), or use --strategy allreduce"
            )
        if self.strategy == "allreduce" and self.servers != 0:
            raise ConfigError(
                f"the allreduce strategy uses no servers, got servers={self.servers}: pass --servers 0"
            )
        if self.staleness < 0 or (self.staleness and self.mode != "ssp"):
            raise ConfigError(
                f"staleness={self.staleness}: it bounds --mode ssp and must be >= 0; pass --mode ssp "
                "--staleness K, or leave --staleness out"
            )
        if self.checkpoint_every < 0 or bool(self.checkpoint_every) != bool(self.checkpoint_dir):
            raise ConfigError(
                f"checkpoint_every={self.checkpoint_every}, checkpoint_dir={self.checkpoint_dir!r}: pass both "
                "--checkpoint-dir DIR and --checkpoint-every N (N >= 1), or neither"
            )
        if (self.checkpoint_every or self.resume) and (self.strategy == "hybrid" or self.mode != "sync"
                                                       or self.transport != "rpc"):
            raise ConfigError(
                f"checkpoint and resume are exact for sync jobs of the ps and allreduce strategies over rpc; got "
                f"strategy={self.strategy!r}, mode={self.mode!r}, transport={self.transport!r}: use --mode sync "
                "--transport rpc with --strategy ps or allreduce, or leave out --checkpoint-every and --resume"
            )
        if self.strategy == "allreduce" and self.mode != "sync":
            raise ConfigError("the allreduce strategy is synchronous: pass --mode sync, or use --strategy ps")
        if not (self.server_device == "cpu" or self.server_device == "cuda" or self.server_device.startswith("cuda:")):
            raise ConfigError(
                f"server_device {self.server_device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N' "
                "(--server-device or GRADSYNC_SERVER_DEVICE)"
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
        for name in _FLOAT_FIELDS:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.servers

    @property
    def elastic(self) -> bool:
        """An async or ssp ps job: a worker that dies or leaves does not stop it, and (async, over torch RPC)
        a new worker may join it while it runs (README, "Elastic async workers")."""
        return self.strategy == "ps" and self.mode != "sync"

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

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "JobConfig":
        """Build the config from a launcher's environment; non-None `overrides` win."""
        env = os.environ if environ is None else environ
        values = dict(
            settings_from_env(env, overrides.get("strategy")),
            rank=_int(env, "RANK", 0),
            world_size=_int(env, "WORLD_SIZE", None),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            store_is_hosted=env.get("GRADSYNC_STORE_HOSTED") == "1"
            or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["world_size"] is None:
            values["world_size"] = values["servers"] + 1
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The GRADSYNC_* variables that reproduce this job's settings in a child process."""
        return {
            "GRADSYNC_STRATEGY": self.strategy,
            "GRADSYNC_MODE": self.mode,
            "GRADSYNC_STALENESS": str(self.staleness),
            "GRADSYNC_SERVERS": str(self.servers),
            "GRADSYNC_NONFINITE": self.nonfinite,
            "GRADSYNC_COMPRESSION": self.compression,
            "GRADSYNC_SERVER_DEVICE": self.server_device,
            "GRADSYNC_TRANSPORT": self.transport,
            "GRADSYNC_CHECKPOINT_DIR": self.checkpoint_dir,
            "GRADSYNC_CHECKPOINT_EVERY": str(self.checkpoint_every),
            "GRADSYNC_RESUME": self.resume,
            **{f"GRADSYNC_{name.upper()}": str(getattr(self, name)) for name in _FLOAT_FIELDS},
        }


_FLOAT_FIELDS = ("bucket_cap_mb", "startup_timeout", "step_timeout", "shutdown_timeout")


def settings_from_env(env, strategy: str | None = None) -> dict:
    """The job's settings from its GRADSYNC_* variables (what `to_env` writes), defaults for the unset ones;
    no placement (RANK, WORLD_SIZE, MASTER_*). `strategy`, when given, wins over GRADSYNC_STRATEGY."""
    strategy = strategy or env.get("GRADSYNC_STRATEGY", "ps")
    values = dict(
        strategy=strategy,
        mode=env.get("GRADSYNC_MODE", "sync"),
        staleness=_int(env, "GRADSYNC_STALENESS", 0),
        servers=_int(env, "GRADSYNC_SERVERS", default_servers(strategy)),
        nonfinite=env.get("GRADSYNC_NONFINITE", "raise"),
        compression=env.get("GRADSYNC_COMPRESSION", "none"),
        server_device=env.get("GRADSYNC_SERVER_DEVICE", "cpu"),
        transport=env.get("GRADSYNC_TRANSPORT", "rpc"),
        checkpoint_dir=env.get("GRADSYNC_CHECKPOINT_DIR", ""),
        checkpoint_every=_int(env, "GRADSYNC_CHECKPOINT_EVERY", 0),
        resume=env.get("GRADSYNC_RESUME", ""),
    )
    for name in _FLOAT_FIELDS:
        raw = env.get(f"GRADSYNC_{name.upper()}")
        if raw:
            values[name] = _float(f"GRADSYNC_{name.upper()}", raw)
    return values


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _int(env, name: str, default):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


class StoreKeys:
    """Every key and prefix gradsync uses in the rendezvous store (`{}`: a shard, worker or global rank index)."""

    FAILED = "gradsync/failed"
    ALIVE = "gradsync/alive/{}"
    LEFT = "gradsync/left"
    GONE = "gradsync/gone"  # workers that left an elastic job without gradsync.shutdown(): `worker:how` lines
    TRAINERS = "gradsync/trainers"  # `worker,` entries: the workers that have begun to build their Trainer
    WORKERS = "gradsync/workers"  # worker indices handed out: the job's workers, then one more per joiner
    JOB = "gradsync/job"  # an elastic job's settings (GRADSYNC_* variables, JSON), for workers that join it
    RPC_SERVING = "gradsync/rpc_serving/{}"  # server s is in the dynamic RPC group of an elastic job
    RPC_MEMBERSHIP = "gradsync/rpc_membership"  # the rank that joins or leaves that group now
    PROCESS_GROUP = "gradsync/pg"
    RPC = "gradsync/rpc"
    TOKEN = "gradsync/grpc_token"
    GRPC_ADDRESS = "gradsync/grpc/address/{}"
    GRPC_SETUP = "gradsync/grpc/setup/{}"
    GRPC_SPEC = "gradsync/grpc/spec/{}/{}"
    GRPC_REGISTERED = "gradsync/grpc/registered/{}"
    CHECKPOINT = "gradsync/checkpoint/{}/{}"  # step, worker: that worker wrote its state of that step
    JOINS = "gradsync/joins"  # how many times a worker has joined (trainer.join()): numbers the events
    JOINED = "gradsync/joined/{}"  # event number: the worker that joined
    JOIN_DONE = "gradsync/join_done/{}/{}"  # round, shard: that server saw every worker join that round


def default_servers(strategy: str) -> int:
    """Parameter servers a job gets when none are asked for: 1 for ps and hybrid, 0 for allreduce."""
    return 0 if strategy == "allreduce" else 1


def server_name(index: int) -> str:
    return f"ps{index}"


def worker_name(index: int) -> str:
    return f"worker{index}"
