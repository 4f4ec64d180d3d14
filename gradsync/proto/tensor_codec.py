"""torch.Tensor <-> `gradsync.Tensor` chunk messages, with strict validation on decode.

A tensor travels as one or more consecutive chunks carrying its address, dtype,
shape and total byte size; each chunk says at which byte offset its data
starts. The address (a `Key`) is a name (`Tensor.name`: a parameter or buffer)
or, in the job calls, a bucket index (`Tensor.bucket`). `decode` accepts exactly
the chunk sequences `encode` produces: anything else (unknown dtype, a shape
that does not match the byte count, a missing, duplicate, out-of-order or
oversized chunk, a tensor sent twice, more tensors or bytes than the call takes)
raises a ValueError naming the tensor and the field.

Two representations of the same wire format:
- `encode` / `encode_all` make `gradsync.Tensor` protobuf objects (for tools and tests);
- `encode_messages` makes the serialized bytes of the messages that carry the chunks
  (`PullResponse` / `PushRequest` / `JobPushRequest`), byte for byte what protobuf would
  serialize (but for `Tensor.bucket`, which comes before `data`: protobuf accepts fields in
  any order), with one copy of the tensor's data instead of three; `parse_message` reads such bytes back
  into a `Chunk` whose `data` is a view of the received bytes (no copy), and
  returns None for any layout it does not recognise, so that the caller parses it with
  protobuf instead. `decode` takes `Chunk`s and `Tensor` messages alike and copies
  each chunk's data exactly once, into the tensor it returns.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError

from gradsync.core import memory
from gradsync.proto import gradsync_pb2 as pb

if sys.byteorder != "little":
    raise ImportError("gradsync's wire format is little-endian raw bytes; big-endian hosts are not supported")

CHUNK_BYTES = 1 << 20
"""Largest `data` field a sender puts in one chunk, and the most a receiver accepts."""

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Key = str | int
_K = TypeVar("_K", bound=Key)
"""A tensor's address: its name (`Tensor.name`), or the index of a bucket (`Tensor.bucket`)."""

_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_OFFSET_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["offset"].number


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype; raises ValueError for one gradsync does not send."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent: supported dtypes are {', '.join(DTYPES)}")
    return name


def describe(key: Key) -> str:
    """How errors name the tensor at `key`."""
    return f"bucket {key}" if isinstance(key, int) else f"tensor {key!r}"


class Chunk:
    """One chunk, as `decode` reads it: the fields of a `Tensor` message (`bucket` None when not set),
    `data` any bytes-like object."""

    __slots__ = ("name", "dtype", "shape", "total_bytes", "offset", "data", "bucket")

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        total_bytes: int,
        offset: int,
        data,
        bucket: int | None = None,
    ):
        self.name, self.dtype, self.shape = name, dtype, shape
        self.total_bytes, self.offset, self.data, self.bucket = total_bytes, offset, data, bucket

    @classmethod
    def of(cls, message: pb.Tensor) -> Chunk:
        # each read of a bytes field makes a copy: read it once
        return cls(
            message.name,
            message.dtype,
            tuple(message.shape),
            message.total_bytes,
            message.offset,
            message.data,
            message.bucket if message.HasField("bucket") else None,
        )

    @property
    def key(self) -> Key:
        """The chunk's address; raises ValueError unless exactly one of name and bucket is set."""
        if self.bucket is None:
            if not self.name:
                raise ValueError("Tensor.name is empty: every chunk must name its tensor (or set Tensor.bucket)")
            return self.name
        if self.name:
            raise ValueError(f"a chunk of bucket {self.bucket} also sets Tensor.name {self.name!r}: set one of the two")
        return self.bucket


def _address(key: Key) -> dict:
    """The `Tensor` fields that carry `key`."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return {"bucket": key}
    if isinstance(key, str) and key:
        return {"name": key}
    raise ValueError(f"a tensor is sent under a non-empty name or a bucket index >= 0, got {key!r}")


def _raw(tensor: torch.Tensor) -> tuple[str, list[int], int, memoryview | None]:
    """(dtype name, shape, byte size, the bytes of a contiguous CPU copy or view) of a tensor to send."""
    dtype = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # no copy for a contiguous CPU tensor
    total = flat.numel() * flat.element_size()
    # numpy's stubs give an ndarray the buffer protocol (`__buffer__`) from Python 3.12 on only
    raw = memoryview(flat.view(torch.uint8).numpy()) if total else None  # type: ignore[arg-type]
    return dtype, list(tensor.shape), total, raw


def _spans(total: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    offset = 0
    while True:  # at least one chunk, even for an empty tensor
        end = min(total, offset + chunk_bytes)
        yield offset, end
        offset = end
        if offset >= total:
            return


def encode(key: Key, tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Tensor]:
    """The chunks of one tensor (at least one, even when it is empty).

    Args:
        key: the tensor's name (non-empty) or bucket index (>= 0).
        tensor: any device; it is copied to CPU and made contiguous.
        chunk_bytes: the largest `data` per chunk.
    """
    address = _address(key)
    dtype, shape, total, raw = _raw(tensor)
    for offset, end in _spans(total, chunk_bytes):
        data = raw[offset:end].tobytes() if raw is not None else b""
        yield pb.Tensor(**address, dtype=dtype, shape=shape, total_bytes=total, offset=offset, data=data)


def encode_all(tensors: Mapping[_K, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Tensor]:
    """The chunks of several tensors, one tensor after the other."""
    for key, tensor in tensors.items():
        yield from encode(key, tensor, chunk_bytes)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _chunk_field(message_cls) -> int:
    return message_cls.DESCRIPTOR.fields_by_name["chunk"].number


def encode_messages(tensors: Mapping[_K, torch.Tensor], message_cls, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized messages that carry the chunks of several tensors, one tensor after the other.

    Each item parses as `message_cls(chunk=c)` for the chunks `c` of `encode_all(tensors, chunk_bytes)`
    (byte for byte protobuf's serialization for a named tensor; a bucket's `Tensor.bucket` comes before
    `data`), made with one copy of the tensor data (protobuf makes three: slice, field, serialize).
    Hand them to gRPC with `serialize`, which passes bytes through.

    Args:
        message_cls: `PullResponse`, `PushRequest` or `JobPushRequest` (a message with a `Tensor chunk` field).
    """
    outer_tag = _varint(_chunk_field(message_cls) << 3 | 2)
    for key, tensor in tensors.items():
        address = _address(key)
        dtype, shape, total, raw = _raw(tensor)
        head = pb.Tensor(**address, dtype=dtype, shape=shape, total_bytes=total).SerializeToString()
        for offset, end in _spans(total, chunk_bytes):
            size = end - offset
            body = head
            if offset:  # proto3 leaves out fields at their default: 0, b""
                body += bytes([_OFFSET_FIELD << 3]) + _varint(offset)
            if size:
                body += bytes([_DATA_FIELD << 3 | 2]) + _varint(size)
            data = raw[offset:end] if size and raw is not None else b""  # raw: None for an empty tensor only
            yield b"".join((outer_tag, _varint(len(body) + size), body, data))


class _Unrecognised(Exception):
    pass


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Unrecognised
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip_field(buf: bytes, pos: int, end: int) -> tuple[int, int, int, int]:
    """(field number, wire type, where its value starts, where it ends) of the field at `pos`."""
    key, pos = _read_varint(buf, pos, end)
    number, wire_type = key >> 3, key & 7
    start = pos
    if wire_type == 0:
        _, pos = _read_varint(buf, pos, end)
    elif wire_type == 2:
        size, start = _read_varint(buf, pos, end)
        pos = start + size
    elif wire_type == 1:
        pos += 8
    elif wire_type == 5:
        pos += 4
    else:  # groups: never in our messages
        raise _Unrecognised
    if number == 0 or pos > end:
        raise _Unrecognised
    return number, wire_type, start, pos


def parse_message(buf: bytes, message_cls) -> Chunk | None:
    """The chunk in the serialized bytes of a `message_cls` that holds only its `chunk`, with `data` last.

    That is the layout `encode_messages` (and protobuf) produces for a chunk. The returned chunk's `data` is a
    read-only view of `buf`, not a copy. Returns None for any other layout (a header, fields in another order,
    anything malformed): parse those with protobuf, which reads them in full and refuses what is malformed.

    Raises:
        DecodeError: the fields before `data` are not a valid `Tensor` (protobuf's own check).
    """
    end = len(buf)
    try:
        number, wire_type, start, stop = _skip_field(buf, 0, end)
        if (number, wire_type, stop) != (_chunk_field(message_cls), 2, end):
            return None
        pos, last = start, None
        while pos < end:
            last = (pos, *_skip_field(buf, pos, end))
            pos = last[-1]
    except _Unrecognised:
        return None
    if last is None or last[1:3] != (_DATA_FIELD, 2):
        return None
    head = pb.Tensor.FromString(buf[start : last[0]])  # protobuf keeps the last `data`, as this does
    return Chunk(
        head.name,
        head.dtype,
        tuple(head.shape),
        head.total_bytes,
        head.offset,
        memoryview(buf)[last[3] : end],
        head.bucket if head.HasField("bucket") else None,
    )


def message_parser(message_cls):
    """A gRPC deserializer: the `Chunk` of a chunk message (no copy of its data), else a `message_cls`."""

    def parse(buf: bytes):
        try:
            chunk = parse_message(buf, message_cls)
        except DecodeError:
            chunk = None  # let protobuf parse it all and say what is wrong
        return chunk if chunk is not None else message_cls.FromString(buf)

    return parse


def serialize(message) -> bytes:
    """A gRPC serializer: bytes (from `encode_messages`) as they are, a protobuf message serialized."""
    return message if type(message) is bytes else message.SerializeToString()


class _Partial:
    """A tensor whose chunks are still arriving, copied into place as they come."""

    def __init__(self, key: Key, chunk: Chunk, budget: int | None, max_bytes: int | None):
        where = describe(key)
        if chunk.dtype not in DTYPES:
            raise ValueError(f"{where}: unknown Tensor.dtype {chunk.dtype!r}; expected one of {', '.join(DTYPES)}")
        if any(d < 0 for d in chunk.shape):
            raise ValueError(f"{where}: Tensor.shape {list(chunk.shape)} has a negative dimension")
        self.key, self.dtype_name, self.shape = key, chunk.dtype, chunk.shape
        self.dtype = DTYPES[chunk.dtype]
        self.total = chunk.total_bytes
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.total != expected:
            raise ValueError(
                f"{where}: Tensor.total_bytes is {self.total} but shape {list(self.shape)} of {chunk.dtype} "
                f"needs {expected} bytes"
            )
        if budget is not None and self.total > budget:
            raise ValueError(
                f"{where}: Tensor.total_bytes {self.total} exceeds the {budget} bytes left of the {max_bytes} "
                "this call accepts (is it the right tensor for this server?)"
            )
        self.out = memory.empty(self.shape, self.dtype)  # huge pages when large: see gradsync.core.memory
        # the tensor's own bytes, writable: each chunk is copied straight into place
        # numpy's stubs give an ndarray the buffer protocol (`__buffer__`) from Python 3.12 on only
        self.bytes = memoryview(self.out.reshape(-1).view(torch.uint8).numpy()) if self.total else None  # type: ignore[arg-type]
        self.received = 0

    def add(self, chunk: Chunk) -> None:
        where = describe(self.key)
        if (chunk.dtype, chunk.shape, chunk.total_bytes) != (self.dtype_name, self.shape, self.total):
            raise ValueError(f"{where}: a chunk changed Tensor.dtype, Tensor.shape or Tensor.total_bytes mid-tensor")
        if chunk.offset != self.received:
            raise ValueError(
                f"{where}: chunk at Tensor.offset {chunk.offset}, expected {self.received} "
                "(a chunk is missing, repeated or out of order)"
            )
        data = chunk.data
        size = len(data)
        if size > CHUNK_BYTES:
            raise ValueError(f"{where}: chunk of {size} bytes exceeds the {CHUNK_BYTES}-byte limit on Tensor.data")
        if self.received + size > self.total:
            raise ValueError(
                f"{where}: chunk at Tensor.offset {chunk.offset} with {size} bytes runs past "
                f"Tensor.total_bytes {self.total}"
            )
        if size == 0 and self.total != 0:
            raise ValueError(f"{where}: empty Tensor.data in a chunk of a non-empty tensor")
        if size:
            assert self.bytes is not None  # a non-empty tensor's
            self.bytes[self.received : self.received + size] = data
        self.received += size

    @property
    def complete(self) -> bool:
        return self.received == self.total


def decode(
    chunks: Iterable[pb.Tensor | Chunk], max_bytes: int | None = None, max_tensors: int | None = None
) -> dict[Key, torch.Tensor]:
    """Reassemble tensors from their chunks, in the order they arrive (`decode_each`, gathered).

    Returns:
        Tensors by key: name or bucket index (CPU, writable, not sharing memory with the messages).
    """
    return dict(decode_each(chunks, max_bytes, max_tensors))


def decode_each(
    chunks: Iterable[pb.Tensor | Chunk], max_bytes: int | None = None, max_tensors: int | None = None
) -> Iterator[tuple[Key, torch.Tensor]]:
    """Each tensor as soon as its last chunk arrived: (key, tensor), in the order they arrive.

    Args:
        chunks: `Tensor` messages as `encode_all` produces them, or `Chunk`s as `parse_message` returns them.
        max_bytes: the most tensor bytes to accept in all (checked before allocating); None: no limit.
        max_tensors: the most tensors to accept (checked when a new one starts); None: no limit.
    Yields:
        (name or bucket index, tensor): CPU, writable, not sharing memory with the messages.
    Raises:
        ValueError: naming the tensor and the field, for any sequence `encode_all` would not produce.
    """
    seen: set[Key] = set()
    current: _Partial | None = None
    budget = max_bytes
    for chunk in chunks:
        if isinstance(chunk, pb.Tensor):
            chunk = Chunk.of(chunk)
        elif not isinstance(chunk, Chunk):
            raise ValueError(f"expected a Tensor message, got {type(chunk).__name__}")
        key = chunk.key
        if current is not None and key != current.key:
            raise ValueError(
                f"{describe(current.key)} is truncated: {current.received} of {current.total} bytes arrived "
                f"before a chunk of {describe(key)}"
            )
        if current is None:
            if key in seen:
                raise ValueError(f"{describe(key)} was sent twice (duplicate Tensor.name or Tensor.bucket)")
            if max_tensors is not None and len(seen) >= max_tensors:
                raise ValueError(
                    f"{describe(key)} is one tensor too many: this call accepts at most {max_tensors} "
                    "(is it the right server?)"
                )
            current = _Partial(key, chunk, budget, max_bytes)
            seen.add(key)
            if budget is not None:
                budget -= current.total
        current.add(chunk)
        if current.complete:
            done, current = current, None
            yield done.key, done.out
    if current is not None:
        raise ValueError(f"{describe(current.key)} is truncated: {current.received} of {current.total} bytes arrived")
