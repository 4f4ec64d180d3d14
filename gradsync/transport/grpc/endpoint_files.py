"""Where a run's gRPC endpoints are: one `grpc-<shard>.json` file per server in the run directory.

Each server writes its own file, so servers never race on a shared one:
`{"shard": 0, "address": "127.0.0.1:50051", "token": "...", "job": "..."}`, where job is the id of the job the
server belongs to (`job_id`), which its Health call answers: a client checks that it reached that job.
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
from gradsync.core.job_names import StoreKeys

_NAME = re.compile(r"grpc-(\d+)\.json$")


def new_token() -> str:
    """A fresh random bearer token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def job_id(store) -> str:
    """The id of the job whose rendezvous store is `store`: the first caller's (its launcher, or its first server)
    makes it, every later one reads it."""
    return store.compare_set(StoreKeys.JOB_ID, "", secrets.token_hex(8)).decode()


def write_endpoints(run_dir: str, shard_id: int, address: str, token: str, job: str = "") -> str:
    """Record one server's endpoint, of job `job` (`job_id`), in `run_dir/grpc-<shard_id>.json`; returns the
    file's path."""
    path = os.path.join(run_dir, f"grpc-{shard_id}.json")
    entry = {"shard": shard_id, "address": address, "token": token, "job": job}
    write_atomically(path, json.dumps(entry).encode())  # mode 0600: it holds the token
    return path


def read_endpoints(run_dir: str) -> tuple[dict[int, str], str, str]:
    """Every server's address in a run directory.

    Returns:
        (address by shard id, the run's token, the id of its job: "" in files that name none).
    Raises:
        FileNotFoundError: no grpc-<shard>.json in `run_dir` (the servers have not started their endpoints).
        ValueError: a malformed file, or files that disagree on the token or the job.
    """
    paths = sorted(p for p in glob.glob(os.path.join(run_dir, "grpc-*.json")) if _NAME.search(p))
    if not paths:
        raise FileNotFoundError(
            f"no grpc-<shard>.json in {run_dir!r}: is it the run directory of a job whose servers serve gRPC?"
        )
    addresses: dict[int, str] = {}
    tokens: set[str] = set()
    jobs: set[str] = set()
    for path in paths:
        try:
            with open(path) as f:
                entry = json.load(f)
            shard, address, token = int(entry["shard"]), str(entry["address"]), str(entry["token"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a gradsync endpoint file ({e}): delete it or restart that server") from e
        named = _NAME.search(path)
        assert named is not None  # the files are listed by that name
        if shard != int(named.group(1)):
            raise ValueError(f"{path} says it is shard {shard}: the file name and its 'shard' field must agree")
        addresses[shard] = address
        tokens.add(token)
        jobs.add(str(entry.get("job", "")))
    if len(tokens) != 1 or len(jobs) != 1:
        raise ValueError(
            f"the endpoint files in {run_dir!r} disagree on the token or the job: they are from different runs"
        )
    return addresses, tokens.pop(), jobs.pop()
