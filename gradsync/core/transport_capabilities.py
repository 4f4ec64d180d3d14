"""What each transport can do, keyed by the value of the `transport` setting: the one table of capabilities.

The table sits in core, below `config` and `membership`, because the job's checks (`config.Training`) and
the joining of workers (`membership.newcomers`) read it, and those layers may not import `gradsync.transport`
(tests/package/test_layout.py). The transport classes (`gradsync.transport.registry`) declare these same objects as
their `capabilities`, so a capability is written once, here, and each refusal's text is made here from it.
"""

from __future__ import annotations

import dataclasses

from gradsync.core.strategies import names


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """One transport's declared capabilities."""

    name: str  # the `transport` setting's value
    strategies: tuple[str, ...]  # the strategies it serves (`core/strategies.py`'s names)
    compression: bool  # gradients compressed on the wire (--compression other than none)
    row_tables: bool  # embedding tables served row by row (Trainer(tables='rows'), the hybrid strategy)
    joining: bool  # workers joining a running async job
    streams: bool  # a ps step's pieces leave during the backward (`worker.pipeline.streaming`)
    pipelines_on_one_host: bool  # a sync step is a pipeline of pieces (`pipeline` auto) on loopback too
    replaces_workers: bool  # a dead worker's replacement rejoins the running job (worker_loss wait)

    def job_refusal(self, strategy: str, compression: str) -> str | None:
        """Why this transport cannot run a job of `strategy` with `compression`; None when it can."""
        if strategy in self.strategies and (self.compression or compression == "none"):
            return None
        serves = f"the {'/'.join(self.strategies)} strategy" + ("" if self.compression else " without compression")
        use = f"--strategy {'/'.join(self.strategies)}" + ("" if self.compression else " --compression none")
        other = serving(lambda c: strategy in c.strategies and (c.compression or compression == "none"))
        return (
            f"the {self.name} transport serves {serves}, got strategy={strategy!r}, compression={compression!r}: "
            f"use {use}, or --transport {other}"
        )

    def replacement_refusal(self, transport: str) -> str | None:
        """Why this transport cannot take a dead worker's replacement into the running job; None when it can."""
        if self.replaces_workers:
            return None
        return (
            "replacing a dead worker (--max-restarts with --worker-loss wait, or drop) needs a transport that takes "
            "the replacement into the running job, "
            f"and the {transport} transport does not yet: use --transport {serving(lambda c: c.replaces_workers)}"
        )

    def rows_refusal(self) -> str:
        """Why this transport refuses Trainer(tables='rows')."""
        return (
            f"the {self.name} transport does not serve embedding tables row by row yet: use --transport "
            f"{serving(lambda c: c.row_tables)}, or keep the tables dense with Trainer(..., tables='auto' or "
            "'dense')"
        )


CAPABILITIES = {
    c.name: c
    for c in (
        Capabilities(
            "rpc",
            strategies=names(),
            compression=True,
            row_tables=True,
            joining=True,
            streams=True,
            pipelines_on_one_host=True,
            replaces_workers=True,
        ),
        # the gRPC job calls carry a worker's calls to the servers only: the strategies whose workers need nothing else
        Capabilities(
            "grpc",
            strategies=names(lambda t: t.servers and not t.process_group),
            compression=False,
            row_tables=False,
            joining=False,
            streams=False,
            pipelines_on_one_host=False,
            replaces_workers=False,
        ),
    )
}
"""Every transport by name; the first is the `transport` setting's default and serves every strategy (those
without servers run over it too: their workers start the RPC agent every rank starts)."""


def capabilities(name: str) -> Capabilities:
    """The capabilities of transport `name` (a value the `transport` setting accepts)."""
    try:
        return CAPABILITIES[name]
    except KeyError:
        raise ValueError(f"no transport named {name!r}: expected one of {', '.join(CAPABILITIES)}") from None


def serving(can) -> str:
    """The name of the first transport whose capabilities satisfy `can` (the fix a refusal names)."""
    return next(c.name for c in CAPABILITIES.values() if can(c))
