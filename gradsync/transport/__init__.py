"""How ps workers reach the parameter servers: one module per transport, each with both sides.

`rpc` (torch RPC over TensorPipe, the default) and `grpc` (no TensorPipe at
all) both implement `Transport` on the worker and translate messages into
calls on a `gradsync.ps.server.ParameterServer` on the server. Members of one
job exchange flat buckets of the shared bucket plan; names are for clients
outside the job (`gradsync.client.Client`).
"""
from __future__ import annotations

from typing import Protocol

import torch

from gradsync.core.buckets import ModelSpec
from gradsync.ps.messages import Partial, Push, Setup
from gradsync.ps.shard import Snapshot


class Transport(Protocol):
    """A worker's calls to every server; each waits (bounded by the job's timeouts) for all servers."""

    def register(self, spec: ModelSpec, setups: dict[int, Setup | None]) -> dict[str, torch.Tensor]:
        """Register this worker's model on every server (worker 0 brings each server's setup); returns the
        frozen parameters' values (worker 0's)."""

    def pull(self) -> dict[int, Snapshot]:
        """Every server's current snapshot."""

    def pull_rows(self, table: str, ids: dict[int, torch.Tensor]) -> dict[int, tuple[int, torch.Tensor]]:
        """Rows of an embedding table: per server, its unique local row ids; returns per server (version,
        rows)."""

    def push(self, versions: dict[int, int], pushes: dict[int, Push]) -> dict[int, Snapshot | Partial]:
        """One step: per server, the version it was pulled at and its `Push`; returns every server's snapshot
        after the step (with `Push.agree`, its `Partial` of the held step's norm, and `finish` applies it)."""

    def finish(self, versions: dict[int, int], coefficient: float | None) -> dict[int, Snapshot]:
        """Apply every server's held step with its gradients times `coefficient` (None: skip it); returns
        every server's snapshot after it."""

    def optimizer_state(self) -> dict[int, dict]:
        """Every server's optimizer state by entry key and its groups' options."""

    def load_optimizer_state(self, parts: dict[int, tuple[dict, list]]) -> None:
        """Give every server its (state by entry key, group options)."""

    def state(self) -> dict[int, tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]]:
        """Every server's (version, bucket tensors, buffers and frozen parameters by name)."""

    def stats(self) -> dict[int, dict]:
        """Every server's counters."""

    def close(self) -> None:
        """Release what the transport holds (connections); the job's shutdown stops the servers."""
