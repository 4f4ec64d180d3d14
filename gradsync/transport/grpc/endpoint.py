"""Every server's gRPC endpoint, for the world outside the job (and the job's own workers under `grpc`).

`start_endpoint` serves a `ParameterServer` over gRPC (`gradsync.transport.grpc.servicer`)
and publishes the address (run directory and rendezvous store), whatever the
job's transport: `gradsync status|pull` and `gradsync.client.Client` reach a
running job through it.

Settings come from the environment the launcher (or the user, under torchrun)
sets: GRADSYNC_RUN_DIR (default ./runs/<job id>), GRADSYNC_GRPC_HOST (default
127.0.0.1: nothing listens beyond loopback unless asked), GRADSYNC_GRPC_PORT
(default 0, a free port; server i uses port + i), GRADSYNC_TOKEN (default: one
token per job, made by the first server and shared through the store), and
GRADSYNC_TLS_CERT / GRADSYNC_TLS_KEY for TLS. The token is the one for clients
outside the job (written to the run directory); the job's workers hold a second,
the member token, made by the first server and known only through the store, which
alone opens the job calls (`gradsync.transport.grpc.servicer`).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from gradsync.core import settings
from gradsync.core.job_names import StoreKeys
from gradsync.ps.server import ParameterServer
from gradsync.transport.grpc.endpoint_files import job_id, new_token, write_endpoints
from gradsync.transport.grpc.server import GrpcEndpoint, serve_grpc


def run_dir() -> str:
    """This job's run directory (created if missing)."""
    path = settings.RUN_DIR.read() or os.path.join("runs", os.environ.get("TORCHELASTIC_RUN_ID", "local"))
    os.makedirs(path, exist_ok=True)
    return path


def job_token(store: dist.Store) -> str:
    """The job's bearer token: GRADSYNC_TOKEN, else the first server's, shared through the store."""
    given = settings.TOKEN.read()
    if given:
        return given
    return store.compare_set(StoreKeys.TOKEN, "", new_token()).decode()


MEMBER_TOKEN_KEY = "gradsync/grpc_member_token"  # the store key of the member token


def member_token(store: dist.Store) -> str:
    """The job members' bearer token: the first server's, shared through the store only."""
    return store.compare_set(MEMBER_TOKEN_KEY, "", new_token()).decode()


def worker_token(store: dist.Store) -> str:
    """The token a worker's job calls carry: the member token, or, where the store has none (an endpoint
    served with one credential), the job's token."""
    return store.get(MEMBER_TOKEN_KEY).decode() if store.check([MEMBER_TOKEN_KEY]) else job_token(store)


def start_endpoint(server: ParameterServer, store: dist.Store, step_timeout: float) -> GrpcEndpoint:
    """Serve `server` over gRPC and write its address and the token to the run directory."""
    directory = run_dir()
    port = settings.GRPC_PORT.read()
    token, job = job_token(store), job_id(store)
    endpoint = serve_grpc(
        server,
        host=settings.GRPC_HOST.read(),
        port=port + server.shard_id if port else 0,
        token=token,
        member_token=member_token(store),
        tls_cert=settings.TLS_CERT.read(),
        tls_key=settings.TLS_KEY.read(),
        checkpoint_dir=os.path.join(directory, "checkpoints"),
        step_timeout=step_timeout,
        job=job,
    )
    write_endpoints(directory, server.shard_id, endpoint.address, token, job)
    store.set(StoreKeys.GRPC_ADDRESS.format(server.shard_id), endpoint.address)
    return endpoint
