"""Start a server process's gRPC endpoint and publish where it is.

Settings come from the environment the launcher (or the user, under torchrun)
sets: GRADSYNC_RUN_DIR (default ./runs/<job id>), GRADSYNC_GRPC_HOST (default
127.0.0.1: nothing listens beyond loopback unless asked), GRADSYNC_GRPC_PORT
(default 0, a free port; server i uses port + i), GRADSYNC_TOKEN (default: one
token per job, made by the first server and shared through the store), and
GRADSYNC_TLS_CERT / GRADSYNC_TLS_KEY for TLS.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from gradsync.proto.endpoints import write_endpoints
from gradsync.proto.service import GrpcEndpoint, new_token, serve_grpc
from gradsync.ps.server import ParameterServer

_TOKEN_KEY = "gradsync/grpc_token"
ADDRESS_KEY = "gradsync/grpc/address/{}"
"""Store key where server i publishes its gRPC address (workers of the grpc transport read it)."""


def run_dir() -> str:
    """This job's run directory (created if missing)."""
    path = os.environ.get("GRADSYNC_RUN_DIR") or os.path.join("runs", os.environ.get("TORCHELASTIC_RUN_ID", "local"))
    os.makedirs(path, exist_ok=True)
    return path


def job_token(store: dist.Store) -> str:
    """The job's bearer token: GRADSYNC_TOKEN, else the first server's, shared through the store."""
    given = os.environ.get("GRADSYNC_TOKEN")
    if given:
        return given
    return store.compare_set(_TOKEN_KEY, "", new_token()).decode()


def start_endpoint(server: ParameterServer, store: dist.Store, step_timeout: float) -> GrpcEndpoint:
    """Serve `server` over gRPC and write its address and the token to the run directory."""
    directory = run_dir()
    port = int(os.environ.get("GRADSYNC_GRPC_PORT", "0"))
    token = job_token(store)
    endpoint = serve_grpc(
        server,
        host=os.environ.get("GRADSYNC_GRPC_HOST", "127.0.0.1"),
        port=port + server.shard_id if port else 0,
        token=token,
        tls_cert=os.environ.get("GRADSYNC_TLS_CERT"),
        tls_key=os.environ.get("GRADSYNC_TLS_KEY"),
        checkpoint_dir=os.path.join(directory, "checkpoints"),
        step_timeout=step_timeout,
    )
    write_endpoints(directory, server.shard_id, endpoint.address, token)
    store.set(ADDRESS_KEY.format(server.shard_id), endpoint.address)
    print(f"gradsync: ps{server.shard_id} serves gRPC at {endpoint.address} (run dir {directory})", flush=True)
    return endpoint
