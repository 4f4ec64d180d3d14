"""Every setting gradsync reads from the environment, declared once: its variable, type, default, help,
concern, and the option and keyword that set it.

`gradsync.config`'s `JobConfig` has the settings of the job concerns as its fields (written out there,
checked against this table by tests/core/test_settings.py), and builds its defaults, checks, `to_env` and
`settings_from_env` from them; `gradsync.cli` builds `gradsync run`'s options from them; the other modules
read their variables with `Setting.read`, never `os.environ` (`tests/core/test_settings.py` checks it). The
settings tables of docs/architecture.md are `markdown()` (`make docs` rewrites them).
Internal settings are set by a launcher (gradsync's, or torchrun) for the processes it starts; the user
sets the others.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Generic, TypeVar, cast

from gradsync.core.strategies import STRATEGIES, described, listed, names
from gradsync.core.transport_capabilities import CAPABILITIES

JOB_CONCERNS = ("placement", "training", "timeouts", "checkpointing", "faults")
"""The concerns of `JobConfig`, one dataclass each; the other concerns are read where they are used."""


class ConfigError(ValueError):
    """A job setting is invalid; the message names the bad value and the fix."""


_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Setting(Generic[_T]):
    """One setting. `name`: its JobConfig field and `init`/`launch` keyword (job concerns), else how the
    code calls it; `flag`: the option of `gradsync run` (or `compare`) that sets it; `shared`: the job's
    value holds on every rank, and a worker that joins takes it; `default_text`: the default in words, where
    it is not the `default` value."""

    name: str
    env: str
    type: type
    default: _T
    concern: str
    help: str
    flag: str | None = None
    choices: tuple = ()
    label: str = ""
    shared: bool = False
    internal: bool = False
    default_text: str = ""

    def parse(self, raw: str | None) -> _T:
        """The value of the variable's text `raw` (None: unset, the default; '' is unset for a number)."""
        if raw is None or (raw == "" and self.type is not str):
            return self.default
        if self.type is bool:
            return cast(_T, raw == "1")
        try:
            return self.type(raw)
        except ValueError:
            kind = "an integer" if self.type is int else "a number"
            raise ConfigError(f"{self.env}={raw!r} is not {kind}") from None

    def text(self, value) -> str:
        """The variable's text for `value` (what `parse` reads back)."""
        return ("1" if value else "0") if self.type is bool else str(value)

    def check(self, value) -> None:
        """Refuse a value outside `choices`, naming it, the choices and where to set it."""
        if self.choices and value not in self.choices:
            raise ConfigError(
                f"unknown {self.label or self.name} {value!r}: expected one of "
                f"{', '.join(map(repr, self.choices))} (set it with {self.where})"
            )

    def read(self, environ=None) -> _T:
        """This setting in `environ` (default: this process's environment), checked."""
        value = self.parse((os.environ if environ is None else environ).get(self.env))
        self.check(value)
        return value

    def given(self, environ=None) -> bool:
        """Whether `environ` (default: this process's environment) sets the variable (to a non-empty text)."""
        return bool((os.environ if environ is None else environ).get(self.env))

    @property
    def option(self) -> str:
        """Its option of `gradsync run` (or `compare`), for a setting that has one."""
        if self.flag is None:
            raise ValueError(f"{self.env} is set by no option of gradsync run")
        return self.flag

    @property
    def where(self) -> str:
        """How a user sets it: '--flag or ENV', or 'ENV'."""
        return f"{self.flag} or {self.env}" if self.flag else self.env

    @property
    def shown_default(self) -> str:
        return self.default_text or ("unset" if self.default in ("", None) else str(self.default))


_S = Setting
# Placement: where this process sits in the job (torchrun's variables; gradsync run sets them the same way).
RANK = _S("rank", "RANK", int, 0, "placement", "global rank of this process, 0 .. world_size-1", internal=True)
WORLD_SIZE = _S(
    "world_size", "WORLD_SIZE", int, 1, "placement", "servers + workers", internal=True, default_text="servers + 1"
)
MASTER_ADDR = _S(
    "master_addr", "MASTER_ADDR", str, "127.0.0.1", "placement", "host of the rendezvous store", internal=True
)
MASTER_PORT = _S("master_port", "MASTER_PORT", int, 29500, "placement", "port of the rendezvous store", internal=True)
STORE_IS_HOSTED = _S(
    "store_is_hosted",
    "GRADSYNC_STORE_HOSTED",
    bool,
    False,
    "placement",
    "'1': a launcher hosts the store (as torchrun's TORCHELASTIC_USE_AGENT_STORE=True does), so rank 0 connects to it",
    internal=True,
)
SERVERS = _S(
    "servers",
    "GRADSYNC_SERVERS",
    int,
    1,
    "placement",
    "parameter servers, the first ranks",
    flag="--servers",
    shared=True,
    default_text=f"1 for {listed(names(lambda t: t.servers))}, 0 for {listed(names(lambda t: not t.servers))}",
)
SERVER_DEVICE = _S(
    "server_device",
    "GRADSYNC_SERVER_DEVICE",
    str,
    "cpu",
    "placement",
    "where servers keep their shard and aggregate: cpu, cuda (a server's GPU is its LOCAL_RANK "
    "modulo the GPUs it sees: a machine's servers spread over its GPUs), cuda:N",
    flag="--server-device",
)
# Training: what a step computes and how gradients travel.
STRATEGY = _S(
    "strategy",
    "GRADSYNC_STRATEGY",
    str,
    next(iter(STRATEGIES)),
    "training",
    described(),
    flag="--strategy",
    choices=tuple(STRATEGIES),
    shared=True,
)
MODE = _S(
    "mode",
    "GRADSYNC_MODE",
    str,
    "sync",
    "training",
    f"sync, async or ssp ({listed(names(lambda t: len(t.modes) > 1))}): sync averages all workers' gradients "
    "each step, async applies each as it arrives, ssp too but no worker runs more than --staleness steps ahead",
    flag="--mode",
    choices=("sync", "async", "ssp"),
    shared=True,
)
STALENESS = _S(
    "staleness",
    "GRADSYNC_STALENESS",
    int,
    0,
    "training",
    "with --mode ssp: steps a worker may run ahead of the slowest",
    flag="--staleness",
    shared=True,
)
NONFINITE = _S(
    "nonfinite",
    "GRADSYNC_NONFINITE",
    str,
    "raise",
    "training",
    "raise or skip, for NaN/Inf gradients: raise names the parameter and worker, skip drops the step",
    flag="--nonfinite",
    choices=("raise", "skip"),
    label="nonfinite policy",
    shared=True,
)
COMPRESSION = _S(
    "compression",
    "GRADSYNC_COMPRESSION",
    str,
    "none",
    "training",
    "none, fp16, bf16 or int8 gradients on the wire",
    flag="--compression",
    choices=("none", "fp16", "bf16", "int8"),
    shared=True,
)
TRANSPORT = _S(
    "transport",
    "GRADSYNC_TRANSPORT",
    str,
    next(iter(CAPABILITIES)),
    "training",
    "rpc or grpc: how ps workers reach the servers (torch RPC, or gRPC without TensorPipe)",
    flag="--transport",
    choices=tuple(CAPABILITIES),
    shared=True,
)
BUCKET_CAP_MB: Setting[float | None] = _S(
    "bucket_cap_mb",
    "GRADSYNC_BUCKET_CAP_MB",
    float,
    None,
    "training",
    "ps: largest parameter bucket in MB (one bucket is one flat tensor on the wire), and with an "
    "elementwise optimizer the size of the pieces a larger parameter is cut into (a step's pieces "
    "are applied and sent back one by one); unset: chosen at start-up from the bandwidth worker 0 "
    "measures to the servers (small pieces behind a slow link, large ones on a fast one: "
    "gradsync.worker.pipeline.piece_size)",
    flag="--bucket-cap-mb",
    shared=True,
    default_text="auto",
)
PIPELINE = _S(
    "pipeline",
    "GRADSYNC_PIPELINE",
    str,
    "auto",
    "training",
    "ps sync: a step as a pipeline of pieces, each applied and sent back once every worker's part of it "
    "is in (on), or whole (off); auto: on where it pays: off over grpc when the job's store is on this "
    "machine's loopback (no link to overlap: gRPC's pipeline threads then cost more than they save), and "
    "behind a link for a model whose whole step costs less than the pipeline's pieces (with "
    "bucket_cap_mb unset; gradsync.worker.pipeline.piece_size)",
    flag="--pipeline",
    choices=("auto", "on", "off"),
    shared=True,
)
# Timeouts: each rank's own; a worker that joins may choose its own.
STARTUP_TIMEOUT = _S(
    "startup_timeout",
    "GRADSYNC_STARTUP_TIMEOUT",
    float,
    120.0,
    "timeouts",
    "seconds for every rank to join and register the model",
    flag="--startup-timeout",
)
STEP_TIMEOUT = _S(
    "step_timeout",
    "GRADSYNC_STEP_TIMEOUT",
    float,
    60.0,
    "timeouts",
    "seconds an RPC or collective of a step may take; a rank silent that long is named and the job stopped",
    flag="--step-timeout",
)
STALL_REPORT = _S(
    "stall_report",
    "GRADSYNC_STALL_REPORT",
    float,
    300.0,
    "timeouts",
    "seconds a worker's main thread may stay at the same place (no step, no line run: waiting on a "
    "lock, a DataLoader, a peer) before the launcher shows every rank's Python stack, once (the job "
    "goes on; inf: never); a job the launcher stops (--timeout, a signal) shows them too",
    flag="--stall-report",
)
SHUTDOWN_TIMEOUT = _S(
    "shutdown_timeout",
    "GRADSYNC_SHUTDOWN_TIMEOUT",
    float,
    30.0,
    "timeouts",
    "seconds shutdown waits for the other workers to finish",
    flag="--shutdown-timeout",
)
# Checkpointing: every strategy, mode and transport; a resume may change the number of servers and workers.
CHECKPOINT_DIR = _S(
    "checkpoint_dir",
    "GRADSYNC_CHECKPOINT_DIR",
    str,
    "",
    "checkpointing",
    "write a checkpoint every --checkpoint-every steps into this directory (a folder per step; "
    "every rank must reach it)",
    flag="--checkpoint-dir",
    shared=True,
)
CHECKPOINT_EVERY = _S(
    "checkpoint_every",
    "GRADSYNC_CHECKPOINT_EVERY",
    int,
    0,
    "checkpointing",
    "steps between checkpoints (every strategy and mode)",
    flag="--checkpoint-every",
    shared=True,
)
CHECKPOINT_FULL_EVERY = _S(
    "checkpoint_full_every",
    "GRADSYNC_CHECKPOINT_FULL_EVERY",
    int,
    1,
    "checkpointing",
    "every N-th checkpoint holds the whole of each dynamic table (gradsync.DynamicEmbedding, "
    "every strategy); the ones between only its rows changed or evicted since that full one "
    "(1: every checkpoint is full)",
    flag="--checkpoint-full-every",
    shared=True,
)
RESUME = _S(
    "resume",
    "GRADSYNC_RESUME",
    str,
    "",
    "checkpointing",
    "restart from the newest complete checkpoint in this directory (any --servers/--workers)",
    flag="--resume",
    shared=True,
)
START_OVER = _S(
    "start_over",
    "GRADSYNC_START_OVER",
    bool,
    False,
    "checkpointing",
    "start a new run in a --checkpoint-dir that holds another run's checkpoints: remove its step "
    "folders first (without it such a folder is refused)",
    flag="--start-over",
    shared=True,
)
# Faults: what a job does when one of its ranks dies.
WORKER_LOSS = _S(
    "worker_loss",
    "GRADSYNC_WORKER_LOSS",
    str,
    "fail",
    "faults",
    "what a sync ps or allreduce job does when a worker dies (killed, exits non-zero, or silent past "
    "--step-timeout): fail (the job fails, naming it), wait (the launcher starts a replacement with the same worker "
    "rank, within --max-restarts; the step in flight waits for it, and the job ends bit for bit as without the "
    "death), drop (ps only: "
    "the job goes on without it, each step the mean of the live workers' batches; with --max-restarts a "
    "replacement joins at a step boundary)",
    flag="--worker-loss",
    choices=("fail", "wait", "drop"),
    label="worker_loss policy",
    shared=True,
)
MAX_RESTARTS = _S(
    "max_restarts",
    "GRADSYNC_MAX_RESTARTS",
    int,
    0,
    "faults",
    "replacements the launcher may start per rank: a worker's (--worker-loss wait or drop), a server's "
    "(--replicas 1), or the whole job from its checkpoint after a server's death; 0: none",
    flag="--max-restarts",
    shared=True,
)
RESTART_TIMEOUT = _S(
    "restart_timeout",
    "GRADSYNC_RESTART_TIMEOUT",
    float,
    60.0,
    "faults",
    "seconds a replacement may take to rejoin the job (--worker-loss wait or drop); past it the job fails, naming "
    "the worker",
    flag="--restart-timeout",
    shared=True,
)
REPLICAS = _S(
    "replicas",
    "GRADSYNC_REPLICAS",
    int,
    0,
    "faults",
    "ps: 0, or 1 to keep each server's shards on a second server as well",
    flag="--replicas",
    shared=True,
)
REPLACEMENT = _S(
    "replacement",
    "GRADSYNC_REPLACEMENT",
    int,
    0,
    "placement",
    "n > 0 in the n-th replacement of a worker that died in the running job (--worker-loss wait)",
    internal=True,
)
RESTART_COUNT = _S(
    "restart_count",
    "TORCHELASTIC_RESTART_COUNT",
    int,
    0,
    "launcher",
    "which incarnation of its rank this process is: 0, or n in the n-th replacement (gradsync.restart_count())",
    internal=True,
)
# The process: read where it is used.
LOCAL_RANK = _S(
    "local_rank",
    "LOCAL_RANK",
    int,
    0,
    "process",
    "this process's index among its machine's processes (torchrun's; gradsync run sets it to the "
    "rank): a server's GPU with --server-device cuda",
    internal=True,
)
DEVICE = _S(
    "device",
    "GRADSYNC_DEVICE",
    str,
    "cuda",
    "process",
    "the workers' process group (allreduce, hybrid, sharded): cuda adds nccl for CUDA tensors beside gloo for "
    "CPU ones when CUDA is available; cpu uses gloo alone",
    choices=("cuda", "cpu"),
)
JOIN = _S(
    "join",
    "GRADSYNC_JOIN",
    str,
    "",
    "process",
    "a running async ps job's run directory or store HOST:PORT: gradsync.init() joins it as a new worker "
    "(also gradsync.init(join=...))",
    flag="--join",
)
RUN_DIR = _S(
    "run_dir",
    "GRADSYNC_RUN_DIR",
    str,
    "",
    "process",
    "the job's files, kept (endpoints, tokens, join.json, stats)",
    flag="--run-dir",
    default_text="a new temporary directory, removed at the end (torchrun: ./runs/<job id>, made "
    "when a gRPC endpoint needs one)",
)
RANK_START = _S(
    "rank_start",
    "GRADSYNC_RANK_START",
    str,
    "fork",
    "process",
    "how gradsync run starts its ranks: fork, from a fork server that imported torch once (a rank starts "
    "in a fraction of a second, without importing torch again); exec, each a new `python SCRIPT` "
    "process, as torchrun "
    "does (for a script that sets, before importing torch, variables torch reads only then)",
    choices=("fork", "exec"),
)
# gRPC endpoints of the servers (the world outside the job, and --transport grpc).
GRPC_HOST = _S(
    "grpc_host",
    "GRADSYNC_GRPC_HOST",
    str,
    "127.0.0.1",
    "grpc",
    "where the servers' gRPC endpoints listen (loopback only unless set)",
)
GRPC_PORT = _S(
    "grpc_port",
    "GRADSYNC_GRPC_PORT",
    int,
    0,
    "grpc",
    "port of server 0's endpoint, server i on port + i; 0: free ports",
)
TOKEN: Setting[str | None] = _S(
    "token",
    "GRADSYNC_TOKEN",
    str,
    None,
    "grpc",
    "bearer token of clients outside the job",
    default_text="one per job, written to the run directory",
)
TLS_CERT: Setting[str | None] = _S(
    "tls_cert",
    "GRADSYNC_TLS_CERT",
    str,
    None,
    "grpc",
    "PEM certificate the endpoints serve with (with GRADSYNC_TLS_KEY: TLS only), which the job's own "
    "workers, gradsync status and pull (--tls-cert) and gradsync.client.Client trust",
    flag="--tls-cert",
)
TLS_KEY: Setting[str | None] = _S(
    "tls_key", "GRADSYNC_TLS_KEY", str, None, "grpc", "PEM key of the endpoints (with GRADSYNC_TLS_CERT)"
)
# gradsync compare.
STRAGGLER = _S(
    "straggler",
    "GRADSYNC_STRAGGLER",
    str,
    "",
    "compare",
    "worker W's compute takes F times as long (W:F, an emulated straggler)",
    flag="--straggler",
)
TIMELINE = _S(
    "timeline",
    "GRADSYNC_TIMELINE",
    bool,
    False,
    "compare",
    "'1': record each step's timeline, when every piece or bucket left the worker, reached and was "
    "applied on its server and came back (a worker's trainer.metrics.timeline; compare draws "
    "timeline.png)",
    flag="--timeline",
)
LOG_DIR = _S(
    "log_dir",
    "GRADSYNC_LOG_DIR",
    str,
    "",
    "compare",
    "where gradsync.log writes each worker's JSON lines (compare sets it per run)",
    internal=True,
)
TENSORBOARD_DIR = _S(
    "tensorboard_dir",
    "GRADSYNC_TENSORBOARD_DIR",
    str,
    "",
    "compare",
    "where gradsync.log also writes TensorBoard scalars (compare --log-dir, per run)",
    internal=True,
)
# Set by gradsync's launcher for the ranks and joiners it starts.
LAUNCHER_PID: Setting[int | None] = _S(
    "launcher_pid",
    "GRADSYNC_LAUNCHER_PID",
    int,
    None,
    "launcher",
    "pid of the launcher the rank dies with",
    internal=True,
)
LAUNCHED = _S(
    "launched",
    "GRADSYNC_LAUNCHED",
    bool,
    False,
    "launcher",
    "'1' in a rank gradsync.launch started: a second gradsync.init() there joins the job",
    internal=True,
)
ERROR_FILE = _S(
    "error_file",
    "GRADSYNC_ERROR_FILE",
    str,
    "",
    "launcher",
    "where a rank writes its failure for the launcher (which shows it, so the rank does not)",
    internal=True,
)
STACK_FILE = _S(
    "stack_file",
    "GRADSYNC_STACK_FILE",
    str,
    "",
    "launcher",
    "where a rank writes its Python stack (every thread) when its launcher asks with SIGUSR1",
    internal=True,
)
EARLY_STDERR = _S(
    "early_stderr",
    "GRADSYNC_EARLY_STDERR",
    str,
    "",
    "launcher",
    "where a rank's stderr goes until it reaches gradsync.init() (the launcher shows what ranks that "
    "fail before it printed, once)",
    internal=True,
)
STDERR_FD: Setting[int | None] = _S(
    "stderr_fd",
    "GRADSYNC_STDERR_FD",
    int,
    None,
    "launcher",
    "the descriptor of the launcher's stderr, which a rank's stderr goes back to at gradsync.init()",
    internal=True,
)
JOIN_INDEX_FILE: Setting[str | None] = _S(
    "join_index_file",
    "GRADSYNC_JOIN_INDEX_FILE",
    str,
    None,
    "launcher",
    "where a joining worker writes the worker index it took (gradsync run --join)",
    internal=True,
)
LINK = _S(
    "link",
    "GRADSYNC_LINK",
    str,
    "",
    "launcher",
    "the rate of the rank's emulated link (gradsync run --link)",
    internal=True,
)
del _S

TABLE: tuple[Setting, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Setting))
"""Every setting, in the order above."""


def of(concern: str) -> tuple[Setting, ...]:
    return tuple(s for s in TABLE if s.concern == concern)


JOB_SETTINGS = tuple(s for s in TABLE if s.concern in JOB_CONCERNS and not s.internal)
"""What a user chooses for a job: `gradsync.init`/`launch` keywords, `gradsync run` options, and the
variables a launcher passes to every rank (`JobConfig.to_env`)."""
SHARED = tuple(s.name for s in TABLE if s.shared)
"""The settings whose job's value holds on every rank: a worker that joins takes them, and may not ask for others."""


def markdown() -> str:
    """The settings tables of docs/architecture.md: the user's, then the internal ones."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    user = ["| Variable | Keyword | Option | Default | Concern | What |", "|---|---|---|---|---|---|"]
    user += [
        f"| `{s.env}` | {f'`{s.name}=`' if s in JOB_SETTINGS else ''} | {f'`{s.flag}`' if s.flag else ''} | "
        f"{cell(s.shown_default)} | {s.concern} | {cell(s.help)} |"
        for s in TABLE
        if not s.internal
    ]
    internal = ["| Variable | Set by | Concern | What |", "|---|---|---|---|"]
    internal += [
        f"| `{s.env}` | {'torchrun, gradsync' if not s.env.startswith('GRADSYNC_') else 'gradsync'} | "
        f"{s.concern} | {cell(s.help)} |"
        for s in TABLE
        if s.internal
    ]
    said = "Set by a launcher (gradsync's, or torchrun) for the processes it starts; not settings:"
    return "\n".join(user + ["", said, ""] + internal) + "\n"


BEGIN, END = "<!-- settings: generated from gradsync/core/settings.py by `make docs` -->", "<!-- end of settings -->"


def rewrite(path: str) -> None:
    """Replace the generated tables in the Markdown file `path` with `markdown()`."""
    with open(path) as f:
        text = f.read()
    pattern = re.escape(BEGIN) + ".*?" + re.escape(END)
    if not re.search(pattern, text, flags=re.S):
        raise ValueError(f"{path} has no {BEGIN} ... {END} block to rewrite: add one where the tables go")
    with open(path, "w") as f:
        f.write(re.sub(pattern, lambda m: f"{BEGIN}\n{markdown()}{END}", text, flags=re.S))
