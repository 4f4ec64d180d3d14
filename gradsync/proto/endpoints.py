"""Where a run's gRPC endpoints are: one `grpc-<shard>.json` file per server in the run directory.

Each server writes its own file, so servers never race on a shared one:
`{"shard": 0, "address": "127.0.0.1:50051", "token": "..."}`.
Files are written atomically (temporary file, fsync, rename) with owner-only
permissions (0600), because they hold the bearer token.
"""
from __future__ import annotations

import glob
import json
import os
import re
import secrets

from gradsync.core.atomic_file import write_atomically

_NAME = re.compile(r"grpc-(\d+)\.json$")


def new_token() -> str:
    """A fresh random bearer token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def write_endpoints(run_dir: str, shard_id: int, address: str, token: str) -> str:
    """Record one server's endpoint in `run_dir/grpc-<shard_id>.json`; returns the file's path."""
    path = os.path.join(run_dir, f"grpc-{shard_id}.json")
    entry = {"shard": shard_id, "address": address, "token": token}
    write_atomically(path, json.dumps(entry).encode())  # mode 0600: it holds the token
    return path


def read_endpoints(run_dir: str) -> tuple[dict[int, str], str]:
    """Every server's address in a run directory.

    Returns:
        (address by shard id, the run's token).
    Raises:
        FileNotFoundError: no grpc-<shard>.json in `run_dir` (the servers have not started their endpoints).
        ValueError: a malformed file, or files that disagree on the token.
    """
    paths = sorted(p for p in glob.glob(os.path.join(run_dir, "grpc-*.json")) if _NAME.search(p))
    if not paths:
        raise FileNotFoundError(
            f"no grpc-<shard>.json in {run_dir!r}: is it the run directory of a job whose servers serve gRPC?"
        )
    addresses: dict[int, str] = {}
    tokens: set[str] = set()
    for path in paths:
        try:
            with open(path) as f:
                entry = json.load(f)
            shard, address, token = int(entry["shard"]), str(entry["address"]), str(entry["token"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a gradsync endpoint file ({e}): delete it or restart that server") from e
        if shard != int(_NAME.search(path).group(1)):
            raise ValueError(f"{path} says it is shard {shard}: the file name and its 'shard' field must agree")
        addresses[shard] = address
        tokens.add(token)
    if len(tokens) != 1:
        raise ValueError(f"the endpoint files in {run_dir!r} disagree on the token: they are from different runs")
    return addresses, tokens.pop()
