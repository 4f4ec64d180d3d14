"""The messages between a worker and a parameter server: a worker's setup, a push (or a pipeline's head), a
piece, what a consistency rule resolves to, the snapshot a server answers with, and the calls on dynamic tables
(`TableCall`).

Each is a small frozen dataclass. torch RPC pickles them as they are; the
gRPC transport converts them to its protobuf messages and back at its
boundary (`gradsync.transport.grpc.job_calls`, `gradsync.transport.grpc.servicer`, and
`gradsync.transport.grpc.plain_data` for the setup), so the server's logic sees these
types whichever transport a job runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gradsync.core.buckets import Bucket, TensorSpec
from gradsync.core.optimizer_spec import OptimizerSpec

if TYPE_CHECKING:
    from gradsync.tables.row_optim import RowOptimizer


class Snapshot(NamedTuple):
    """A shard at one version: CPU bucket tensors and buffers that are never modified after publication."""

    version: int
    flats: list[torch.Tensor]
    buffers: dict[str, torch.Tensor]
    ended: tuple[int, dict] | None = None
    """A sync push's reply: `Committed.ended`."""

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.flats) + sum(b.nbytes for b in self.buffers.values())


class Rejoined(NamedTuple):
    """A server's answer to a dead worker's replacement (`ParameterServer.rejoin`)."""

    frozen: dict[str, torch.Tensor]
    """This shard's frozen parameters, as a registration answers."""
    closed: int
    """The sync steps this server has closed since it started, for this worker: a step applied on the others'
    word that still waits for the dead worker's counts as open (its replacement pushes and finishes it)."""
    begun: Snapshot | None
    """Where step `closed` began, when the shard has moved past it (that open step); None: the current values."""
    before: Snapshot | None
    """Where step `closed - 1` began: the replacement's values where this server is a step ahead of another."""
    partial: Partial | None
    """That step's part of its norm, when it was held (clipping, a GradScaler): the replacement's total needs it."""
    options: list[dict]
    """The optimizer groups' options step `closed` began with (a schedule's lr), which the replacement's first
    push changes as every worker's does; [] for a shard without dense parameters."""
    taken: int | None = None
    """With replicas: the closed steps of this shard that took this worker's push (`StepJournal.taken`), which
    the replacement counts as answered (`RpcTransport.done`)."""


class Readmitted(NamedTuple):
    """A server's answer to a dead worker's replacement asking to join a sync job at a step (worker_loss drop:
    `ParameterServer.readmit`)."""

    frozen: dict[str, torch.Tensor]
    """This shard's frozen parameters, as a registration answers, once it has begun that step ({} before)."""
    taken: bool
    """Whether it takes the replacement's part of that step and of every later one."""
    closed: int
    """The steps this server has closed; -1 while it has not yet heard of the death (ask again)."""
    options: list[dict]
    """The optimizer groups' options of the step in flight, which the replacement's first push changes as every
    worker's does; [] for a shard without dense parameters."""


@dataclasses.dataclass(frozen=True)
class TableSetup:
    """What worker 0 sends a server of one embedding table served row by row."""

    spec: TensorSpec
    """The whole table's name, shape and dtype."""
    values: torch.Tensor | None
    """This server's rows of worker 0's values (row r on server r % S); None: the server initialises them."""
    padding_idx: int | None
    """The table's padding row (never trained), as `nn.Embedding.padding_idx`."""
    optimizer: RowOptimizer
    """The row optimizer (`gradsync.RowSGD`, `gradsync.RowAdagrad`)."""
    group: int | None
    """The optimizer group whose schedule sets the row optimizer's lr; None: its own lr throughout."""


@dataclasses.dataclass(frozen=True)
class DynamicSetup:
    """What worker 0 sends every server of one dynamic embedding table (`gradsync.DynamicEmbedding`): the
    table's settings, its `init` included (pickled: a module-level function or a dataclass such as the default
    `HashedUniform`), and its row optimizer."""

    settings: dict
    """The `DynamicTable` keywords: dim, capacity, init, admit_after, admit_probability, evict, ttl_steps,
    dtype, seed, name."""
    optimizer: RowOptimizer
    """The row optimizer (`gradsync.RowSGD`, `gradsync.RowAdagrad`)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What worker 0 sends one server at registration; the server builds its shard from it."""

    buckets: list[Bucket]
    """The server's buckets of the plan, in its bucket order."""
    params: dict[str, torch.Tensor]
    """The values of the parameters those buckets hold pieces of, by name (CPU)."""
    buffers: dict[str, torch.Tensor]
    """The buffers this server keeps, by name (CPU)."""
    frozen: dict[str, torch.Tensor]
    """The frozen parameters (requires_grad=False) this server keeps, by name (CPU)."""
    optimizer: OptimizerSpec
    """The user's optimizer as data: the server builds its class with its groups over the shard."""
    tables: dict[str, TableSetup | DynamicSetup]
    """The embedding tables served row by row, by name (a dynamic table by its module's name)."""
    num_servers: int
    """The job's servers (a table's rows are spread over all of them)."""

    @classmethod
    def of(
        cls,
        buckets: list[Bucket],
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        optimizer: OptimizerSpec,
        tables: dict[str, TableSetup | DynamicSetup] | None = None,
        num_servers: int = 1,
    ) -> Setup:
        """One server's setup: of `params` only those its `buckets` hold, every tensor as a CPU tensor."""
        names = {e.name for b in buckets for e in b.entries}
        cpu = lambda tensors: {n: t.detach().cpu() for n, t in tensors.items()}  # noqa: E731
        return cls(
            list(buckets),
            cpu({n: t for n, t in params.items() if n in names}),
            cpu(buffers),
            cpu(frozen),
            optimizer,
            dict(tables or {}),
            num_servers,
        )


@dataclasses.dataclass(frozen=True)
class RowGrads:
    """One worker's gradients of the rows of one served table that its step looked up, for one server."""

    version: int
    """The server's version the rows were pulled at (the oldest, when a step looked them up more than once)."""
    ids: torch.Tensor
    """The unique local row ids on that server (int64)."""
    grads: torch.Tensor
    """Their summed gradients, one row of the table's dim per id."""

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.grads.nbytes

    def times(self, factor: float) -> RowGrads:
        """The same rows with their gradients times `factor` (a GradScaler's inverse scale)."""
        return RowGrads(self.version, self.ids, self.grads * factor)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """A sync push asks its server to hold the averaged gradient and answer with its part of the norm
    (`Partial`), for the workers to agree on the step's total norm (clipping) or finiteness (a GradScaler)
    before any server applies (`SyncRule.finish`)."""

    norm_type: float
    """The p of the norm (as `clip_grad_norm_`'s norm_type; inf: the largest |g|)."""
    skip_nonfinite: bool
    """A NaN/Inf skips the step (a GradScaler) instead of being the job's error."""


@dataclasses.dataclass(frozen=True)
class Push:
    """One worker's step for one server (the worker and the version it pulled travel beside it)."""

    payloads: list | None
    """One gradient per bucket of the server, in the wire format (None: no entry of that bucket got one);
    None only in a `PipelineHead`."""
    absent: list | None
    """Per bucket, the indices of the entries without a gradient (their elements in the payload are zeros);
    None with `payloads`."""
    buffers: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The worker's updated buffers this server keeps, by name."""
    rows: dict[str, RowGrads] = dataclasses.field(default_factory=dict)
    """Row gradients by served table."""
    options: dict[int, dict] = dataclasses.field(default_factory=dict)
    """The optimizer group options a schedule changed, {group index: {option: value}}, applied before the step."""
    agree: Agreement | None = None
    """Hold the averaged step until the workers agree on its norm (sync only); None: apply it."""
    pieces: tuple[int, ...] | None = None
    """In a `PipelineHead`: per bucket, the `Piece.seq` of the piece that carries this step's gradient (a
    bucket may have been sent more than once: the one named counts); None: whichever piece comes."""
    seq: int = 0
    """The worker's send number (`Piece.seq`'s counter): pieces it numbered below supersede
    nothing and are void (they left during a backward whose step then travelled whole); 0: unnumbered."""

    def __post_init__(self):
        if (self.payloads is None) != isinstance(self, PipelineHead):
            raise TypeError(
                "a step whose buckets follow as pieces is a PipelineHead(buffers=..., ...), which "
                "carries no gradients; a Push carries them all"
            )


@dataclasses.dataclass(frozen=True)
class PipelineHead(Push):
    """A sync step's head whose buckets follow as `Piece`s (the pipeline): the buffers, rows and options of a
    `Push`, no gradients (async and ssp: the server stages the pieces its `pieces` name until it comes)."""

    payloads: None = None
    absent: None = None


@dataclasses.dataclass(frozen=True)
class Piece:
    """One worker's gradient of one bucket in a sync step whose push carried none (the pipeline), sent as soon
    as the backward produced it (`worker.pipeline.streaming`) or with the step."""

    server: int
    """The server that owns the bucket."""
    bucket: int
    """The bucket's index among that server's buckets."""
    payload: Any
    """Its gradient in the wire format; None: no entry of the bucket got one."""
    absent: tuple[int, ...]
    """The indices of the bucket's entries without a gradient."""
    seq: int = 0
    """The worker's send number, increasing over the job: a piece supersedes the same bucket's earlier ones
    from that worker until its step's push names the one that counts (`Push.pieces`); 0: unnumbered."""


@dataclasses.dataclass(frozen=True)
class Partial:
    """A server's part of a held step's norm: sum of |g|^p of its averaged gradient (max |g| for p = inf)."""

    version: int
    """The version of the held step (`finish` names it)."""
    value: float
    """This server's sum of |g|^p (max |g| for p = inf)."""


@dataclasses.dataclass(frozen=True)
class Committed:
    """What every consistency rule's commit, and `SyncRule.finish`, resolves to."""

    version: int
    """The shard's version after the push (a push dropped under nonfinite='skip': the version it left)."""
    snapshot: Snapshot | None = None
    """ssp: the snapshot the worker goes on from, taken when the rule released it; None: the shard's own."""
    partial: Partial | None = None
    """A held sync step: this server's part of its norm (the workers then `finish` it)."""
    ended: tuple[int, dict] | None = None
    """Sync, the step applied or skipped: (step, the server's dynamic tables' `end` answer to it, by table), so
    that no worker calls `end` (`ps.dynamic_shard.step_end`); None without dynamic tables."""


@dataclasses.dataclass(frozen=True)
class Evict:
    """The end of step `step` decided over the whole table (`tables.global_eviction`): by table, (the row ids to
    evict, the waiting ids to forget) of this holder. Taken once per step."""

    step: int
    plan: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Lookups:
    """Step `step`'s lookups of dynamic tables: (table, distinct ids, their counts) each; rows as at the step's
    start, admitted ids created with `init`. `evictions`: the last step's `Evict`, applied first (it travels with
    the next step's first lookups). Answered with (version, [(rows, admitted) of each lookup])."""

    lookups: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]
    step: int
    evictions: Evict | None = None
    worker: int | None = None
    """The worker looking up (with worker_loss wait, a replacement's lookups are answered as its dead process's
    were: `ps.lookup_replay`); None: no worker's (a test, a tool)."""


@dataclasses.dataclass(frozen=True)
class ReadRows:
    """The rows of `ids` of table `table` (zeros where not resident), counting nothing: an evaluation forward."""

    table: str
    ids: torch.Tensor


@dataclasses.dataclass(frozen=True)
class EndStep:
    """End step `step` here (`ttl_steps`; one holder: the capacity bounds too): by table, (resident rows, waiting
    ids, the first candidate rows to evict with their keys, the first waiting ids with theirs)."""

    step: int


@dataclasses.dataclass(frozen=True)
class FirstToGo:
    """Of step `step`'s end, by table, the (rows, waiting ids) that go first here: their ids with their keys."""

    step: int
    counts: dict[str, tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class LoadTables:
    """A worker's `load_state_dict` of whole dynamic tables (by table, its module's state-dict form): each holder
    keeps its ids of them, once per `number`."""

    number: int
    states: dict[str, dict]


@dataclasses.dataclass(frozen=True)
class TablesState:
    """By table, the holder's `DynamicTable.state()`."""


@dataclasses.dataclass(frozen=True)
class TablesCounts:
    """By table, (resident rows, [admitted, filtered, evicted])."""


@dataclasses.dataclass(frozen=True)
class TablesStep:
    """By table, the step its next lookups belong to."""


TableCall = Lookups | ReadRows | EndStep | FirstToGo | Evict | LoadTables | TablesState | TablesCounts | TablesStep
"""A call on a holder's parts of dynamic tables (a server's, or a worker's under sharded)."""
