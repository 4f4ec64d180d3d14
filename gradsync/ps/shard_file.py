"""Atomic, verified checkpoints of one shard: parameters, buffers, optimizer state, embedding table rows
with their row optimizer state, dynamic tables (whole, or a delta since the last full checkpoint), and version.

A shard's state names everything, so that any other layout can take it back
(`ps.reshard`): its entries (parameter, shape, element range), the values and
optimizer state by entry key, and each table's rows with the server and number
of servers that held them.

A checkpoint file is a magic line, the SHA-256 of the payload, and the payload
(`torch.save` of a dict of tensors and plain values). `save` writes a
temporary file in the target directory, fsyncs it, renames it over
`shard-<id>.ckpt` and fsyncs the directory, so a reader sees the old file or
the new one, never a torn one. `load` refuses a file whose digest does not match.
`write` and `load` serve any such file (a worker's state in a job checkpoint, `gradsync.runtime.checkpoints`).
"""

from __future__ import annotations

import hashlib
import io
import os

import torch

from gradsync.core.atomic_file import write_atomically
from gradsync.ps.shard import ShardState

MAGIC = b"GRADSYNC-CHECKPOINT-1\n"
_DIGEST = 32


def capture(shard: ShardState, full: bool = True) -> dict:
    """CPU copies of the shard's state at one version (takes `shard.lock`): entries as (name, shape, start,
    numel), the optimizer's state by entry key with its groups' options (`ShardState.optimizer_state`);
    dynamic tables whole, or with `full` False only what changed since their last full checkpoint
    (`DynamicTable.checkpoint`)."""
    with shard.lock:
        return captured(shard, full)


def captured(shard: ShardState, full: bool = True) -> dict:
    """`capture`'s state, the caller holding `shard.lock`."""
    return {
        "shard_id": shard.shard_id,
        "version": shard.version,
        "entries": [(e.name, list(e.shape), e.start, e.numel) for b in shard.buckets for e in b.entries],
        "params": {n: p.detach().to("cpu", copy=True) for n, p in shard.params.items()},
        "buffers": {n: b.to("cpu", copy=True) for n, b in shard.buffers.items()},
        "frozen": {n: t.clone() for n, t in shard.frozen.items()},
        "optimizer": shard.optimizer_state(),
        "tables": {n: t.checkpoint(full) for n, t in shard.tables.items()},
    }


def save(shard: ShardState, directory: str, full: bool = True) -> tuple[str, int]:
    """Write the shard's current state (`capture`) to `directory/shard-<id>.ckpt` atomically.

    Returns:
        The file's path and the version it holds.
    """
    state = capture(shard, full)
    return write(os.path.join(directory, f"shard-{shard.shard_id}.ckpt"), state), state["version"]


def write(path: str, state: dict) -> str:
    """Write `state` (tensors and plain values) to `path` atomically, with its SHA-256; returns `path`."""
    payload = io.BytesIO()
    torch.save(state, payload)
    data = payload.getvalue()
    return write_atomically(path, MAGIC + hashlib.sha256(data).digest() + data)


def verify(path: str, expected: str | None = None) -> bytes:
    """The payload of the checkpoint file `path`, after checking its header and digest (and that the digest
    is `expected`, hex, when given).

    Raises:
        ValueError: the file is not a gradsync checkpoint, its digest does not match (torn or altered), or it
            is not the `expected` one.
    """
    with open(path, "rb") as f:
        blob = f.read()
    digest, data = _digest(blob, path), blob[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(data).digest() != digest:
        raise ValueError(f"{path} is corrupt: its SHA-256 does not match the stored digest; use an older checkpoint")
    if expected is not None and digest.hex() != expected:
        raise ValueError(
            f"{path} has SHA-256 {digest.hex()}, not {expected}: it was rewritten after the "
            "manifest was written; use an older checkpoint"
        )
    return data


def stored_digest(path: str) -> str:
    """The SHA-256 (hex) in the header of the checkpoint file `path` (`verify` checks it against the payload)."""
    with open(path, "rb") as f:
        return _digest(f.read(len(MAGIC) + _DIGEST), path).hex()


def _digest(head: bytes, path: str) -> bytes:
    """The SHA-256 in the header `head` (a file's first bytes, at least the magic line and the digest)."""
    if not head.startswith(MAGIC) or len(head) < len(MAGIC) + _DIGEST:
        raise ValueError(
            f"{path} is not a gradsync checkpoint (bad magic header): pass a file that "
            "gradsync wrote (shard-<id>.ckpt, worker-<id>.ckpt)"
        )
    return head[len(MAGIC) : len(MAGIC) + _DIGEST]


def load(path: str) -> dict:
    """Read and verify a checkpoint (`verify`); a shard's has keys shard_id, version, entries, params, buffers,
    frozen, optimizer, tables (`capture`)."""
    return torch.load(io.BytesIO(verify(path)), weights_only=True)
