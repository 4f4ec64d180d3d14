"""Worker side of the parameter-server strategy: pull, functional forward, push (a pipeline of pieces in sync).

`PSStrategy.model` wraps the user's module. Its forward runs the module with
`torch.func.functional_call` on the servers' current values: each trainable
parameter is a leaf tensor of its own (a view of the pulled bucket, or the
pieces of a parameter split across servers joined), so backward writes each
parameter's gradient once and knows which parameters got none. `step` reads
the gradients from the dist_autograd context, packs them into the bucket plan
(with the entries that got no gradient listed), encodes them (`ps.gradient_codecs`) and
pushes them: in sync mode without clipping or a GradScaler as pieces (unless
the job's plan, `worker.pipeline.piece_size.step_plan`, sends steps whole: gRPC on one
machine, or a model too small for a pipeline to pay behind its link), one
call per bucket in the forward's order, each answered with that bucket's
values once its server has applied it (`transport.rpc.Pipeline`); else one
call per server. Over torch RPC most pieces leave during the backward, from a
`GradientStream` on the context's leaves (sync, async and ssp; async and ssp
servers keep them until the push names them). The bucket plan's size comes
from `worker.pipeline.piece_size` when `bucket_cap_mb` is unset. The replies make the
snapshot after the step, which the next forward uses without another pull. Frozen parameters
(`requires_grad=False`) never travel after registration. A worker that ran
out of data (`join`) tells the servers through the store (`gradsync.membership.uneven_data`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.func import functional_call

from gradsync.core.buckets import (
    Bucket,
    ModelSpec,
    applied_early,
    assign_tensors,
    by_server,
    forward_order,
    join_pieces,
    may_split,
    plan_buckets,
)
from gradsync.core.clipping import Clipping
from gradsync.core.errors import no_gradients_error, step_twice_error
from gradsync.core.finite import first_nonfinite
from gradsync.core.optimizer_spec import OptimizerSpec, SentOptions, group_options
from gradsync.core.torch_internals import current_context_id
from gradsync.core.waiting import wait_until
from gradsync.membership.uneven_data import Joiner
from gradsync.metrics.step_metrics import StepMetrics
from gradsync.metrics.timeline import HEAD
from gradsync.metrics.traffic import head_bytes
from gradsync.ps.gradient_codecs import make_wire
from gradsync.ps.messages import Agreement, Partial, Piece, PipelineHead, Push, Readmitted, Rejoined, Setup, Snapshot
from gradsync.tables.placement import table_specs
from gradsync.transport.registry import transport
from gradsync.worker.module.amp import inverse_scale, record_found_inf
from gradsync.worker.module.model_state import named_tensors, ordered, to_state_dict
from gradsync.worker.module.plain_module import Attachments
from gradsync.worker.module.served_optimizer import ServedState, serve_state
from gradsync.worker.module.user_optimizer import StepGuard
from gradsync.worker.pipeline.piece_size import pipelined, step_plan
from gradsync.worker.pipeline.streaming import GradientStream, dense, next_seq
from gradsync.worker.rows.choice import choose_tables
from gradsync.worker.rows.served import ServedRows
from gradsync.worker.strategies.on_servers import OnServers
from gradsync.worker.strategies.strategy import Strategy

if TYPE_CHECKING:  # imports point one way: the start-up code (cluster) builds the strategies
    from gradsync.runtime.cluster import Cluster


def whole_params(
    server_buckets: dict[int, list[Bucket]], flats: dict[int, list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Each parameter from its bucket pieces: a view when it is whole in one bucket, else its pieces joined
    in a new tensor."""
    entries = [
        (e, flat) for s, buckets in server_buckets.items() for b, flat in zip(buckets, flats[s]) for e in b.entries
    ]
    return join_pieces({e.key: e.view(flat) for e, flat in entries}, [e for e, _ in entries if not e.whole])


class _Pulled:
    """What one forward runs on: the tensors by name, the trainable leaves by name, each server's version."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        leaves: dict[str, torch.Tensor],
        versions: dict[int, int],
        buffer_names: dict[int, list[str]],
    ):
        self.tensors = tensors
        self.leaves = leaves
        self.versions = versions
        self.buffer_names = buffer_names


@dataclasses.dataclass(frozen=True)
class _Outgoing:
    """What one step sends each server: its buckets' encoded payloads and the entries each lacks, its buffers,
    its rows of each table, and the optimizer options changed since the last step."""

    payloads: dict[int, list]
    absent: dict[int, list]
    buffers: dict[int, dict[str, torch.Tensor]]
    rows: dict
    changes: dict

    def push(self, server: int, agree: Agreement | None, seq: int = 0) -> Push:
        """All of it for `server` in one push (numbered `seq`; `agree`: held for the workers' word)."""
        return Push(
            self.payloads[server],
            self.absent[server],
            self.buffers[server],
            self.rows.get(server, {}),
            self.changes,
            agree,
            seq=seq,
        )


class PSModel(nn.Module):
    """The user's module, run on parameters pulled from the servers."""

    def __init__(self, module: nn.Module, strategy: PSStrategy):
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list keeps nn.Module from registering it

    def forward(self, *args, **kwargs):
        pulled = self._strategy[0].pulled(current_context_id())
        return functional_call(self.module, pulled.tensors, args, kwargs)


class PSStrategy(OnServers, Strategy):
    """Pull / push against the parameter servers. Every worker must construct it (a barrier)."""

    model: PSModel

    def __init__(
        self,
        cluster: Cluster,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tables: str = "auto",
        table_optimizer=None,
        clipping: Clipping = Clipping(),
    ):
        config = cluster.config
        self.config = config
        self.worker = config.worker_rank
        self.metrics = StepMetrics()
        self.clipping = clipping
        self.keys = list(module.state_dict().keys())
        spec = OptimizerSpec.of(optimizer, module)
        spec.check_buildable()
        chosen = transport(config.transport)
        if tables == "rows" and not chosen.capabilities.row_tables:
            raise ValueError(chosen.capabilities.rows_refusal())
        row_tables, row_options = choose_tables(
            module, tables if chosen.capabilities.row_tables else "dense", spec, table_optimizer, say=self.worker == 0
        )
        params, buffers = named_tensors(module)
        params = {n: p for n, p in params.items() if n not in row_tables}  # their weights leave the module
        self.spec = ModelSpec.of(params, buffers, table_specs(row_tables))
        sizes = [t.nbytes for t in self.spec.params]
        pipeline = pipelined(config, chosen.capabilities)
        measure = lambda: chosen.worker.bandwidth(config, cluster.store) if pipeline else None  # noqa: E731
        piece, self._pipelined = step_plan(config, cluster.store, sizes, measure, pipeline)  # else whole steps
        cap = int(piece * 2**20)
        self.buckets = plan_buckets(self.spec.params, config.servers, cap, split=may_split(spec.cls))
        self.servers = list(range(config.servers))
        self.server_buckets = by_server(self.buckets, config.servers)
        self._order = [(b.server, self.server_buckets[b.server].index(b)) for b in forward_order(self.buckets)]
        self.owner = assign_tensors(self.spec.buffers + self.spec.frozen, config.servers)
        self.wire = make_wire(config.compression)
        early = applied_early(spec.cls, config.nonfinite, config.worker_loss == "drop")
        self.transport = chosen.worker(config, cluster.store, self.server_buckets, self.metrics.timeline, early)
        self.attached = Attachments()  # what the module's own copies, saves and loads see (`plain_module`)
        self.rows = ServedRows(
            module,
            row_tables,
            row_options,
            config=config,
            capabilities=chosen.capabilities,
            table_optimizer=table_optimizer,
            optimizer=optimizer,
            transport=self.transport,
            metrics=self.metrics,
            attached=self.attached,
            send=self.worker == 0,
        )
        if config.replicated and self.rows.holds_dynamic:
            raise ValueError(
                "replicas=1 with a DynamicEmbedding: servers do not yet keep a replica of a dynamic table (its "
                "admission and eviction); pass --replicas 0, or use a fixed nn.Embedding table"
            )
        self.params, self.buffers = named_tensors(module)  # the user's module's: pointed at the servers' values
        # a step's pieces may leave during the backward (worker.pipeline.streaming): decided per context from the last
        self._streams = chosen.capabilities.streams and self._pipelined and not clipping.on and not self.wire.stateful
        self._stream_next = False
        self._stream: tuple[int, GradientStream] | None = None
        self._quiet = False  # inside trainer.no_sync()
        self.joiner = Joiner(cluster.store, cluster.config, cluster.heartbeat, self.servers)
        self.replaced = config.replacement > 0  # this process replaces a worker that died (worker_loss wait)
        self._rejoining = False  # a replacement, before its first step
        self._late: dict[int, Rejoined] = {}  # a replacement's servers that closed its first step before it came
        self._rejoined_options: list[dict] = []  # a replacement: the groups' options its first step began with
        self._late_values: set[int] = set()  # those whose values come after a held first step's finish
        self.rejoined_at: int | None = None  # a replacement: the steps the servers closed before it rejoined
        if self.replaced:
            self.frozen, first = self._readmit() if config.readmits_workers else self._rejoin()
        else:
            self.frozen, first = self._register(params, buffers, spec), None
        self.model = PSModel(module, self)
        loaded = optimizer.state_dict() if any(optimizer.state.values()) else None  # loaded before the Trainer
        assert spec.names is not None  # `OptimizerSpec.of` names each group's parameters
        served = ServedState(
            optimizer,
            spec.names,
            {s: [e for b in bs for e in b.entries] for s, bs in self.server_buckets.items()},
            self.transport.optimizer_state,
            self.transport.load_optimizer_state,
        )
        serve_state(optimizer, served)
        self.optimizer = optimizer  # the user's own, answering with the servers' state
        self.steps = StepGuard(optimizer, lambda closure=None: None)  # the servers applied the step
        self._sent = SentOptions.of(optimizer.param_groups)
        if self.replaced and self._rejoined_options:
            self._sent = SentOptions(self._rejoined_options)
        self._last: tuple[int, _Pulled] | None = None
        self._stepped: int | None = None
        self.grad_norm: float | None = None
        # what the next forward runs on, the module points at
        self._next: _Pulled | None = self._build(first or self.transport.pull())
        self.rows.begin_serving()
        self.attached.on_load(module.modules(), (self.rows,), self._commit_load, self._repull)
        cluster.leaving.append(self.attached.detach)
        if self.worker == 0 and loaded is not None and not self.replaced:  # the servers hold it already
            optimizer.load_state_dict(loaded)

    def _register(self, params, buffers, spec: OptimizerSpec) -> dict[str, torch.Tensor]:
        setups: dict[int, Setup | None] = {s: None for s in self.servers}
        if self.worker == 0:
            frozen = {t.name: params[t.name] for t in self.spec.frozen}
            for s in self.servers:
                mine = lambda tensors: {n: t for n, t in tensors.items() if self.owner[n] == s}  # noqa: E731, B023 (used in this iteration)
                setups[s] = Setup.of(
                    self.server_buckets[s],
                    params,
                    mine(buffers),
                    mine(frozen),
                    spec,
                    self.rows.setups[s],
                    self.config.servers,
                )
        return self.transport.register(self.spec, setups)

    def _rejoin(self) -> tuple[dict[str, torch.Tensor], dict[int, Snapshot]]:
        """A replacement rejoins the servers (`ParameterServer.rejoin`): the frozen parameters, and what its first
        forward runs on, each server's values as the step in flight began (a server that closed that step before
        the replacement came answers with the values it had before, and takes no part of it again: `_late`).
        Under async and ssp, it goes on from the current values, after the fewest pushes of it a server applied: a
        server that applied one more takes no part of its first step."""
        answers = self.transport.rejoin(self.spec)
        first = min(a.closed for a in answers.values())
        sync = self.config.mode == "sync"  # async, ssp: each server's pushes of it, from the current values
        if any(a.closed > first + 1 or (sync and a.closed > first and a.before is None) for a in answers.values()):
            raise RuntimeError(
                f"worker {self.worker}'s replacement found the servers at different steps "
                f"({ {s: a.closed for s, a in answers.items()} } closed), more than the one step a worker's death "
                "can leave between them"
            )
        self._late = {s: a for s, a in answers.items() if a.closed > first}
        # the options the servers held as the step began: what its push changes (`SentOptions`)
        self._rejoined_options = next((a.options for a in answers.values() if a.closed == first and a.options), [])
        self._rejoining = True
        self.rows.take_before(frozenset(self._late) if sync else None)
        current = self.transport.pull()
        before = self._late if sync else {}
        values = {s: cast(Snapshot, a.before) if s in before else a.begun or current[s] for s, a in answers.items()}
        self.rejoined_at = first
        return {n: t for a in answers.values() for n, t in a.frozen.items()}, values

    def _readmit(self) -> tuple[dict[str, torch.Tensor], dict[int, Snapshot]]:
        """A replacement of a sync job that went on without its dead process (worker_loss drop) joins it at a step
        boundary (`ParameterServer.readmit`): the step after the furthest server's step in flight (again from a
        later one when a server has closed it by then), taken once every server has begun it, within
        restart_timeout. Returns the frozen parameters and each server's values as that step begins (no server
        applies any of it before the replacement's part is in: `applied_early` under drop)."""
        asked = [0]

        def begun() -> dict[int, Readmitted]:  # {} until every server has begun the step asked
            answers = self.transport.readmit(self.spec, self.config.replacement, asked[0])
            if all(a.taken and a.closed == asked[0] for a in answers.values()):
                return answers
            if any(not a.taken and a.closed > asked[0] for a in answers.values()):
                asked[0] = max(a.closed for a in answers.values()) + 1
            return {}

        answers = wait_until(
            begun,
            time.monotonic() + self.config.restart_timeout,
            lambda: f"worker {self.worker}'s replacement joining the job at step {asked[0]} (restart_timeout)",
        )
        self._rejoined_options = next((a.options for a in answers.values() if a.options), [])
        self.rejoined_at = asked[0]
        return {n: t for a in answers.values() for n, t in a.frozen.items()}, self.transport.pull()

    def _commit_load(self) -> None:
        """After the module's `load_state_dict` succeeded: its values go to the servers (each its buckets, buffers,
        frozen parameters and table rows; the load numbered, so that each server takes it once however many
        workers send it), its dynamic tables too, and the next forward runs on what the servers then hold."""
        self.params, self.buffers = named_tensors(self.model.module)  # new objects after load_state_dict(assign=)
        values = {n: t.detach() for n, t in {**self.params, **self.buffers}.items()}
        self.frozen = {n: values[n] for n in self.frozen}
        self.rows.commit_load(
            lambda s: (
                [b.flatten(values) for b in self.server_buckets[s]],
                {n: values[n] for n, owner in self.owner.items() if owner == s},
            )
        )
        self._last, self._next = None, self._build(self.transport.pull())

    def _repull(self) -> None:
        """After a `load_state_dict` that raised: the module shows the servers' values again (torch had loaded
        some keys into it)."""
        self._last, self._next = None, self._build(self.transport.pull())

    def pulled(self, context_id: int | None) -> _Pulled:
        """The tensors a forward runs on: once per context (a second forward in it reuses them), from the
        last step's replies when there are any, else from a pull."""
        if context_id is not None and self._last is not None and self._last[0] == context_id:
            return self._last[1]
        start = time.perf_counter()
        pulled, received = self._next, 0
        if pulled is None:
            snapshots = self.transport.pull()
            received = sum(s.nbytes for s in snapshots.values())
            pulled = self._build(snapshots)
        if context_id is None:  # an evaluation forward: keep them for the next step
            self._next = pulled
            return pulled
        self._next = None
        self._last = (context_id, pulled)
        self.metrics.timeline.begin()
        self._listen(context_id, pulled)
        self.metrics.pulled(time.perf_counter() - start, received)
        return pulled

    def _listen(self, context_id: int, pulled: _Pulled) -> None:
        """Hook this context's backward (`worker.pipeline.streaming`): its pieces leave as they are ready when the last
        step showed it safe, else it is only watched."""
        if self._stream is not None:
            self._stream[1].close()
        self._stream = None
        if self._streams:
            pipeline = self.transport.pipeline(pulled.versions) if self._stream_next else None
            self._stream = (
                context_id,
                GradientStream(
                    pulled.leaves,
                    self.server_buckets,
                    lambda: dist_autograd.get_gradients(context_id),
                    self._encode,
                    pipeline,
                    lambda: self._quiet,
                ),
            )

    def _encode(self, flat: torch.Tensor | None, bucket: Bucket):
        return None if flat is None else self.wire.encode(flat, bucket.index)

    def _build(self, snapshots: dict[int, Snapshot]) -> _Pulled:
        """What a forward runs on, from the servers' snapshots; the user's module is pointed at the same values."""
        flats = {s: snap.flats for s, snap in snapshots.items()}
        leaves = {n: t.requires_grad_(True) for n, t in whole_params(self.server_buckets, flats).items()}
        tensors = dict(leaves)
        tensors.update(self.frozen)
        buffer_names = {}
        for s, snap in snapshots.items():
            tensors.update(snap.buffers)
            buffer_names[s] = list(snap.buffers)
        self._point(tensors)
        return _Pulled(tensors, leaves, {s: snap.version for s, snap in snapshots.items()}, buffer_names)

    def _point(self, values: dict[str, torch.Tensor]) -> None:
        """Point the user's module's parameters and buffers at `values` (by name): no copy."""
        for n, t in values.items():
            mine = self.params.get(n, self.buffers.get(n))
            if mine is not None:
                mine.data = t.detach()

    def step(self, context_id: int, scaler=None) -> None:
        """Push this context's gradients to every server and wait until they are applied (or, with clipping
        or a GradScaler in sync mode, agree on the step's norm first)."""
        pulled = self._pulled_for(context_id)
        start = time.perf_counter()
        stream, streamed = self._take_stream(context_id)
        unscale = inverse_scale(scaler)
        grads, rows = self._gradients(context_id, pulled, scaler, unscale)
        self._last, self._stepped = None, context_id
        agree = self._agreement(scaler)
        if agree is None and self._dropped_here(grads, rows, scaler):
            self.metrics.committed(start, 0, 0)
            return
        if agree is not None or unscale != 1.0:  # held or unscaled: what left during the backward is void
            streamed = {}
        out = _Outgoing(
            *self._pack(grads, streamed),
            rows=rows,
            changes=self._sent.take(self.optimizer.param_groups),
            buffers={s: {n: pulled.tensors[n].detach() for n in pulled.buffer_names[s]} for s in self.servers},
        )
        sizes = self._sizes(out)
        seq = next_seq if self._streams else lambda: 0  # numbered where pieces may have left ahead
        fresh: dict[int, Snapshot] | dict[int, Snapshot | Partial]
        if self._rejoining:  # a replacement's first step: whole, to the servers that have not closed it
            fresh = self._push_rejoined(pulled, out, agree)
        elif agree is None and self._pipelined and (self.config.mode == "sync" or self._streams):
            fresh = self._send_pipelined(pulled, stream, streamed, out, seq, sizes)
        else:  # one call per server
            fresh = self.transport.push(pulled.versions, {s: out.push(s, agree, seq()) for s in self.servers})
        self._commit(fresh, agree, scaler, stream, streamed, sum(sizes.values()), start)

    def _push_rejoined(self, pulled: _Pulled, out: _Outgoing, agree: Agreement | None) -> dict:
        """A replacement's first step: one whole push to each server that has not closed it (whole, never pieces:
        the others' pieces of the step left in the order their backward made them, and a pipeline's window
        waiting on its oldest piece in another order would wait on them while they wait on it); the others
        (`_late`) closed it with the dead process's part (the same bits) and answer with their values now, or,
        when it was held, with their part of its norm, its finish going to the others alone (`_finish`)."""
        late, self._late, self._rejoining = self._late, {}, False
        self.rows.take_before(None)
        pushes = {s: out.push(s, agree) for s in self.servers if s not in late}
        fresh = self.transport.push({s: pulled.versions[s] for s in pushes}, pushes) if pushes else {}
        if agree is not None:
            self._late_values = set(late)
            return {**fresh, **{s: cast(Partial, a.partial) for s, a in late.items()}}
        current = self.transport.pull()
        return {s: fresh[s] if s in fresh else current[s] for s in self.servers}

    def _take_stream(self, context_id: int) -> tuple[GradientStream | None, dict]:
        """This context's stream, closed, and the pieces that left during its backward ({(server, bucket):
        piece}); (None, {}) when none listened to it."""
        if self._stream is None or self._stream[0] != context_id:
            return None, {}
        stream, self._stream = self._stream[1], None
        return stream, stream.close()

    def _gradients(
        self, context_id: int, pulled: _Pulled, scaler, unscale: float
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """The context's dense gradients by parameter name, times `unscale` (1 / `scaler`'s scale), and its tables'
        row gradients by server, unscaled by `scaler` (a GradScaler)."""
        by_leaf = dist_autograd.get_gradients(context_id)
        grads = {n: dense(by_leaf[leaf]) for n, leaf in pulled.leaves.items() if leaf in by_leaf}
        rows = self.rows.gradients(context_id, by_leaf, scaler).pushes
        if unscale != 1.0:
            grads = {n: g * unscale for n, g in grads.items()}
        if not grads and not any(rows.values()):
            raise no_gradients_error(context_id)
        return grads, rows

    def _agreement(self, scaler) -> Agreement | None:
        """In sync mode with clipping or a GradScaler, what the servers agree on before they apply the step
        (`_finish`); else None."""
        if self.config.mode == "sync" and (self.clipping.on or scaler is not None):
            return Agreement(self.clipping.norm_type, skip_nonfinite=scaler is not None)
        return None

    def _dropped_here(self, grads: dict[str, torch.Tensor], rows: dict, scaler) -> bool:
        """Async and ssp: clip this push by its own norm; True when it holds an inf/NaN under a GradScaler, so
        the servers never see it (the next forward pulls)."""
        if not (self.clipping.on or scaler is not None):
            return False
        tensors = list(grads.values()) + [r.grads for per in rows.values() for r in per.values()]
        found_inf = first_nonfinite(tensors) is not None if scaler is not None else False
        if self.clipping.on and not found_inf:
            self.grad_norm = self.clipping.clip_local(tensors)
        if found_inf:
            record_found_inf(scaler, True)
        return found_inf

    def _pack(self, grads: dict[str, torch.Tensor], streamed: dict) -> tuple[dict[int, list], dict[int, list]]:
        """Each server's buckets as encoded payloads, and the entries each lacks (no gradient); a bucket that
        left during the backward (`streamed`) as it left."""
        payloads: dict[int, list] = {}
        absent: dict[int, list] = {}
        for s in self.servers:
            payloads[s], absent[s] = [], []
            for b, bucket in enumerate(self.server_buckets[s]):
                if (s, b) in streamed:
                    payload, missing = streamed[(s, b)].payload, streamed[(s, b)].absent
                else:
                    flat, missing = bucket.pack(
                        [e.piece(grads[e.name]) if e.name in grads else None for e in bucket.entries]
                    )
                    payload = self._encode(flat, bucket)
                payloads[s].append(payload)
                absent[s].append(missing)
        return payloads, absent

    def _sizes(self, out: _Outgoing) -> dict[tuple[int, int | None], int]:
        """Bytes on the wire of each (server, bucket) payload, and of each server's head (`HEAD`)."""
        sizes: dict[tuple[int, int | None], int] = {
            (s, b): self.wire.nbytes(p) for s, per in out.payloads.items() for b, p in enumerate(per) if p is not None
        }
        sizes.update({(s, HEAD): head_bytes(out.buffers[s], out.rows.get(s, {})) for s in self.servers})
        return sizes

    def _send_pipelined(
        self,
        pulled: _Pulled,
        stream: GradientStream | None,
        streamed: dict,
        out: _Outgoing,
        seq,
        sizes: dict[tuple[int, int | None], int],
    ) -> dict[int, Snapshot]:
        """The pieces that did not leave during the backward, in the forward's order, then each server's head
        (naming the pieces that count when they may have left ahead); each piece back once applied."""
        pieces = [
            Piece(s, b, out.payloads[s][b], out.absent[s][b], seq()) for s, b in self._order if (s, b) not in streamed
        ]
        named = {(p.server, p.bucket): p.seq for p in [*streamed.values(), *pieces]}
        heads = {
            s: PipelineHead(
                buffers=out.buffers[s],
                rows=out.rows.get(s, {}),
                options=out.changes,
                pieces=tuple(named[(s, b)] for b in range(len(self.server_buckets[s]))) if self._streams else None,
            )
            for s in self.servers
        }
        self.metrics.timeline.expect(sizes)
        if stream is not None and stream.pipeline is not None:
            return stream.pipeline.finish(heads, pieces)
        return self.transport.push_pieces(pulled.versions, heads, pieces)

    def _commit(
        self,
        fresh: dict,
        agree: Agreement | None,
        scaler,
        stream: GradientStream | None,
        streamed: dict,
        sent: int,
        start: float,
    ) -> None:
        """The step's end: the agreed step applied (`_finish`), the replies as the next forward's values, whether
        the next backward streams, the step's bytes, and the user's optimizer stepped (its schedule's count)."""
        if agree is not None:
            fresh = self._finish(fresh, scaler)
        elif scaler is not None:
            record_found_inf(scaler, False)
        self.rows.end_step(fresh)
        self._next = self._build(fresh)
        self._stream_next = stream is not None and scaler is None and not stream.resend
        if stream is not None:  # pieces that left and were superseded: bytes on the link all the same
            sent += sum(
                self.wire.nbytes(p.payload)
                for k, p in stream.sent.items()
                if k not in streamed and p.payload is not None
            )
        self.metrics.committed(start, sent, sum(s.nbytes for s in fresh.values()))
        with self.steps.open():
            self.optimizer.step()

    def _finish(self, partials: dict[int, Partial], scaler) -> dict[int, Snapshot]:
        """The servers' parts of the held step's norm -> the total (the same float on every worker), then
        every server applies it clipped, or skips it when it holds an inf/NaN under a GradScaler."""
        total = self.clipping.total([partials[s].value for s in self.servers])
        finite = math.isfinite(total)
        coefficient = self.clipping.coefficient(total) if self.clipping.on else 1.0
        if self.clipping.on:
            self.grad_norm = total
        late, self._late_values = self._late_values, set()  # a replacement's first step: closed there already
        fresh = self.transport.finish(
            {s: p.version for s, p in partials.items() if s not in late}, coefficient if finite else None
        )
        if late:
            fresh.update({s: snap for s, snap in self.transport.pull().items() if s in late})
        if scaler is not None:
            record_found_inf(scaler, not finite)
        return fresh

    def model_sizes(self, trainable: int) -> dict[str, int]:
        """The tables' sizes (`RowLayout.model_sizes`) and the largest piece's elements (the cost model's)."""
        return {**self.rows.model_sizes(trainable), "largest_piece": max((b.numel for b in self.buckets), default=0)}

    @contextlib.contextmanager
    def no_sync(self):
        """`Trainer.no_sync`: the gradients travel once per step anyway; backward passes inside it send nothing
        ahead of the step (`worker.pipeline.streaming`)."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    @contextlib.contextmanager
    def join(self):
        """`Trainer.join`: on leaving the block, tell the servers and wait for every worker to join; the next
        forward pulls (the replies this worker holds are from before the others' last steps), and the dynamic
        tables' lookups go on at the step the servers are at (their last step's evictions sent before this worker
        says it joined: a worker that joined earlier looks up next without them). Refused in a dead worker's
        replacement, which cannot know how far into the block its dead process's data had gone."""
        if self.replaced:
            raise RuntimeError(
                f"worker {self.worker}'s replacement (worker_loss={self.config.worker_loss!r}) entered trainer.join(): "
                "a replacement "
                "cannot tell how many of the block's batches its dead process had trained on, nor whether it had "
                "joined; give every worker the same number of batches (drop_last=True, or DistributedSampler) "
                "instead of trainer.join(), or pass --worker-loss fail with --checkpoint-dir/--checkpoint-every"
            )
        yield
        self.rows.settle()
        self.joiner.announce()
        self.joiner.wait()
        self.rows.resume(None)
        self._last = None
        self._next = self._build(self.transport.pull())

    def _pulled_for(self, context_id: int) -> _Pulled:
        if self._last is not None and self._last[0] == context_id:
            return self._last[1]
        if context_id == self._stepped:
            raise step_twice_error(context_id)
        raise RuntimeError(
            f"step({context_id}) found no forward pass in that context: call trainer.model(...) inside "
            "the same dist_autograd.context() before trainer.step(context_id)"
        )

    def local_state(self, delta: bool = False) -> dict:
        """What a checkpoint keeps of this worker beyond its step and RNG: its optimizer groups' options (the
        servers hold the model and the optimizer's state)."""
        return {"groups": [group_options(g) for g in self.optimizer.param_groups]}

    def load_local_state(self, state: dict) -> None:
        """The servers restored their shards at registration; the optimizer's groups take the checkpoint's
        options (a schedule's lr), which the next push sends every server (tables whose rows follow a group)."""
        for group, options in zip(self.optimizer.param_groups, state["groups"]):
            group.update(options)
        self.rows.resume(state["step"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        states = self.transport.state()
        values = whole_params(self.server_buckets, {s: st[1] for s, st in states.items()})
        for _, _, named in states.values():
            values.update(named)
        self._point({n: t.clone() for n, t in values.items()})  # the module's own: the state returned is the caller's
        tables = self.rows.state(states)
        with self.rows.own_state():
            return ordered(to_state_dict(self.model.module, values), tables, self.keys)
