"""Worker-to-server calls over torch RPC (TensorPipe): the default transport of the ps strategy.

Pulls made with a context id are recorded by distributed autograd, so the
gradients travel back in `dist_autograd.backward` and `commit` only tells each
server to apply them; `push` sends gradients the worker encoded itself.
"""
from __future__ import annotations

import time

import torch
import torch.distributed.rpc as rpc

from gradsync.config import JobConfig, server_name
from gradsync.ps import server as ps_server


def wait_all(futures: dict[int, torch.futures.Future], what: str, timeout: float) -> dict[int, object]:
    """Wait for one future per server; the error names the operation, server and elapsed time."""
    start = time.monotonic()
    results = {}
    for server, fut in futures.items():
        try:
            result = fut.wait()
        except Exception as e:
            error = e
        else:
            # torch RPC hands an exception set on an async_execution future back as a value
            if not isinstance(result, BaseException):
                results[server] = result
                continue
            error = result
        elapsed = time.monotonic() - start
        raise RuntimeError(
            f"{what} on {server_name(server)} failed after {elapsed:.1f} s (timeout {timeout:.0f} s): {error}"
        ) from error
    return results


class RpcTransport:
    """One asynchronous torch RPC per server for each call."""

    def __init__(self, config: JobConfig, servers: list[int]):
        self.config = config
        self.worker = config.worker_rank
        self.servers = servers
        self.timeout = config.step_timeout
        self.records_gradients = config.compression == "none"

    def _call(self, fn, args_of, what: str, timeout: float | None = None) -> dict[int, object]:
        timeout = timeout or self.timeout
        futures = {s: rpc.rpc_async(server_name(s), fn, args=args_of(s), timeout=timeout) for s in self.servers}
        return wait_all(futures, what, timeout)

    def register(self, spec, setups: dict[int, dict | None]) -> None:
        self._call(ps_server.rpc_register, lambda s: (self.worker, spec, setups[s]), "registering the model",
                   self.config.startup_timeout)

    def pull(self, context_id: int | None) -> dict[int, tuple[int, list[torch.Tensor], dict]]:
        recorded = context_id if self.records_gradients else None
        return self._call(ps_server.rpc_pull, lambda s: (self.worker, recorded), "pull")

    def commit(self, context_id: int, versions: dict[int, int], buffers: dict[int, dict]) -> None:
        self._call(ps_server.rpc_commit, lambda s: (self.worker, context_id, versions[s], buffers[s]), "commit")

    def push(self, versions: dict[int, int], payloads: dict[int, list], buffers: dict[int, dict]) -> None:
        self._call(ps_server.rpc_push, lambda s: (self.worker, versions[s], payloads[s], buffers[s]), "push")

    def state_dict(self) -> dict[str, torch.Tensor]:
        values = {}
        for part in self._call(ps_server.rpc_state_dict, lambda s: (), "state_dict").values():
            values.update(part)
        return values
