"""Bytes on the wire: the one place for the formulas that the strategies' step metrics and the cost model
(`gradsync.compare.costmodel`) both use."""

from __future__ import annotations

import pickle

import torch

from gradsync.core.torch_internals import sparse_parts
from gradsync.cuda_ops import DEFAULT_BLOCK_SIZE

ITEMSIZE = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}
"""Bytes per gradient value on the wire, by compression."""
FP32 = 4


def wire_bytes(elements: int, compression: str) -> int:
    """Bytes of `elements` gradient values on the wire: int8 adds one fp32 scale per block."""
    if compression == "int8":
        return elements + FP32 * -(-elements // DEFAULT_BLOCK_SIZE)
    return elements * ITEMSIZE[compression]


def allreduce_bytes(elements: int, workers: int, compression: str) -> tuple[float, int]:
    """(bytes through each link in one direction, sequential messages) of one allreduce of `elements`: a ring
    (reduce-scatter then all-gather) moves 2 (W-1)/W of the payload in 2 (W-1) messages; int8 is an
    all-gather (as gradsync does it) to W-1 peers."""
    if compression == "int8":
        return (workers - 1) * wire_bytes(elements, compression), workers - 1
    return 2 * (workers - 1) / workers * wire_bytes(elements, compression), 2 * (workers - 1)


def sparse_bytes(grad: torch.Tensor) -> int:
    """Bytes of a sparse gradient's rows and indices (what DDP's sparse allreduce all-gathers)."""
    values, indices = sparse_parts(grad)
    return values.nbytes + indices.nbytes


def head_bytes(buffers: dict[str, torch.Tensor], rows: dict) -> int:
    """Bytes of a ps push's part that is not a bucket: its buffers, and its rows of each table ({name:
    `ps.messages.RowGrads`})."""
    return sum(b.nbytes for b in buffers.values()) + sum(r.nbytes for r in rows.values())


def object_gather_bytes(objects: list) -> int:
    """Bytes each rank sends, and receives, in `torch.distributed.all_gather_object` of `objects` (one per rank):
    each object's size (8 bytes), then every object pickled and padded to the largest, from each other rank."""
    largest = max(len(pickle.dumps(o)) for o in objects)
    return (len(objects) - 1) * (8 + largest)
