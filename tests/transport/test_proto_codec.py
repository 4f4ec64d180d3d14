"""Tensor <-> chunk messages: bit-exact round trips and strict rejection of malformed chunk sequences."""
from __future__ import annotations

import filecmp
import itertools
import os

import pytest
import torch
from google.protobuf.message import DecodeError

from gradsync.proto import generate, tensor_codec
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto.tensor_codec import (
    CHUNK_BYTES, Chunk, decode, encode, encode_all, encode_messages, message_parser, parse_message,
)

GENERATED = ("gradsync_pb2.py", "gradsync_pb2.pyi", "gradsync_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path):
    generate.generate(str(tmp_path))
    here = os.path.dirname(tensor_codec.__file__)
    for name in GENERATED:
        fresh = tmp_path / "gradsync" / "proto" / name
        assert filecmp.cmp(fresh, os.path.join(here, name), shallow=False), (
            f"gradsync/proto/{name} is out of date with gradsync.proto: run `make proto`"
        )


@pytest.mark.parametrize("dtype", list(tensor_codec.DTYPES.values()))
def test_round_trip_every_dtype_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3, 5, 7 * dtype.itemsize), dtype=torch.uint8, generator=g)
    t = raw.view(dtype) if dtype != torch.bool else raw % 2 == 1  # every bit pattern, NaNs included
    back = decode(encode("x", t))["x"]
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_round_trip_chunked_scalar_empty_and_noncontiguous():
    big = torch.arange(10_000, dtype=torch.float32)
    chunks = list(encode("big", big, chunk_bytes=4096))
    assert len(chunks) == 10 and [c.offset for c in chunks] == [4096 * i for i in range(10)]
    assert all(c.total_bytes == 40_000 for c in chunks)
    tensors = {
        "big": big, "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
    }
    back = decode(encode_all(tensors, chunk_bytes=4096))
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t)


def test_decoded_tensor_owns_its_memory():
    chunks = list(encode("x", torch.ones(4)))
    t = decode(chunks)["x"]
    t.add_(1)
    assert torch.equal(decode(chunks)["x"], torch.ones(4))


def _chunks(n=3, chunk=16):
    return list(encode("w", torch.arange(4.0 * n), chunk_bytes=chunk))


def _edit(chunk: pb.Tensor, **fields) -> pb.Tensor:
    c = pb.Tensor()
    c.CopyFrom(chunk)
    for k, v in fields.items():
        if k == "shape":
            del c.shape[:]
            c.shape.extend(v)
        else:
            setattr(c, k, v)
    return c


BAD = {
    "unknown dtype": (lambda c: [_edit(c[0], dtype="float8")] + c[1:], "Tensor.dtype"),
    "shape/bytes mismatch": (lambda c: [_edit(x, shape=[5]) for x in c], "Tensor.total_bytes"),
    "negative dimension": (lambda c: [_edit(x, shape=[-12]) for x in c], "Tensor.shape"),
    "missing chunk": (lambda c: [c[0], c[2]], "Tensor.offset"),
    "duplicate chunk": (lambda c: [c[0], c[0], c[1], c[2]], "Tensor.offset"),
    "out of order": (lambda c: [c[1], c[0], c[2]], "Tensor.offset"),
    "truncated at the end": (lambda c: c[:2], "truncated"),
    "chunk past the end": (lambda c: c[:2] + [_edit(c[2], data=c[2].data + b"\0" * 4)], "Tensor.total_bytes"),
    "oversized chunk": (
        lambda c: [_edit(c[0], shape=[CHUNK_BYTES], total_bytes=4 * CHUNK_BYTES, data=b"\0" * (CHUNK_BYTES + 4))],
        "Tensor.data",
    ),
    "header changes mid-tensor": (lambda c: [c[0], _edit(c[1], dtype="int32"), c[2]], "mid-tensor"),
    "empty name": (lambda c: [_edit(x, name="") for x in c], "Tensor.name"),
    "empty data": (lambda c: [c[0], _edit(c[1], data=b"")] + c[1:], "empty Tensor.data"),
    "tensor sent twice": (lambda c: c + c, "duplicate Tensor.name"),
    "bucket sent twice": (lambda c: [_edit(x, name="", bucket=2) for x in c + c], "bucket 2 was sent twice"),
    "name and bucket": (lambda c: [_edit(x, bucket=0) for x in c], "set one of the two"),
    "interleaved tensors": (lambda c: [c[0]] + list(encode("v", torch.ones(1))) + c[1:], "truncated"),
}


@pytest.mark.parametrize("wire", [False, True], ids=["messages", "wire bytes"])
@pytest.mark.parametrize("case", list(BAD))
def test_decode_rejects_malformed_sequences(case, wire):
    mutate, field = BAD[case]
    chunks = mutate(_chunks())
    if wire:  # the same chunks as a server receives them: serialized, then parsed without copying data
        parse = message_parser(pb.PushRequest)
        named = not any(c.HasField("bucket") for c in chunks)  # protobuf puts `bucket` after `data`
        chunks = [parse(pb.PushRequest(chunk=c).SerializeToString()) for c in chunks]
        assert any(isinstance(c, Chunk) for c in chunks) or not named
        chunks = [c if isinstance(c, Chunk) else c.chunk for c in chunks]
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        decode(chunks)


def _wire_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=g)
    return {
        "odd fp32": torch.randn(1001, generator=g),  # 4004 bytes: chunks end mid-element
        "bf16": raw[:4098].view(torch.bfloat16).reshape(3, 683),  # every bit pattern, NaNs included
        "int8": raw.view(torch.int8),
        "bool": raw[:77] % 2 == 1,
        "empty": torch.empty(0, 5, dtype=torch.float16),
        "scalar": torch.tensor(-2.5, dtype=torch.float64),
        "int64": torch.arange(-5, 300, dtype=torch.int64),
    }


@pytest.mark.parametrize("chunk_bytes", [1, 333, 4096, CHUNK_BYTES])
@pytest.mark.parametrize("message_cls", [pb.PullResponse, pb.PushRequest])
def test_wire_bytes_are_protobufs_own_and_round_trip_bit_for_bit(message_cls, chunk_bytes):
    tensors = _wire_cases()
    wire = list(encode_messages(tensors, message_cls, chunk_bytes))
    assert wire == [message_cls(chunk=c).SerializeToString() for c in encode_all(tensors, chunk_bytes)]
    parsed = [message_parser(message_cls)(b) for b in wire]
    # every chunk with data comes back as a view of the received bytes; the empty tensor's chunk has no
    # `data` field, so protobuf parses it
    assert [type(p) for p in parsed].count(message_cls) == 1
    assert all(isinstance(p, (Chunk, message_cls)) for p in parsed)
    back = decode(p if isinstance(p, Chunk) else p.chunk for p in parsed)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_buckets_travel_by_index_beside_named_buffers():
    """Job calls: a bucket's chunks carry `Tensor.bucket` (before `data`, so they parse as views of the
    received bytes); protobuf's own serialization (`bucket` after `data`) decodes to the same tensors."""
    tensors = {0: torch.arange(300.0), 2: torch.ones(0), "bn.running_mean": torch.full((3,), 0.5)}
    wire = list(encode_messages(tensors, pb.JobPushRequest, chunk_bytes=256))
    parsed = [message_parser(pb.JobPushRequest)(b) for b in wire]
    assert [p.bucket for p in parsed if isinstance(p, Chunk)] == [0, 0, 0, 0, 0, None]
    ours = decode(p if isinstance(p, Chunk) else p.chunk for p in parsed)
    theirs = decode(pb.JobPushRequest.FromString(pb.JobPushRequest(chunk=c).SerializeToString()).chunk
                    for c in encode_all(tensors, 256))
    for back in (ours, theirs):
        assert list(back) == list(tensors)
        assert all(torch.equal(back[k], t) and back[k].dtype == t.dtype for k, t in tensors.items())
    with pytest.raises(ValueError, match="bucket index >= 0, got -1"):
        list(encode_messages({-1: torch.ones(1)}, pb.JobPushRequest))


def test_tensor_count_is_refused_at_the_first_tensor_past_the_limit():
    consumed = []

    def endless():  # a stream of empty tensors that never ends
        for i in itertools.count():
            consumed.append(i)
            yield pb.Tensor(name=f"t{i}", dtype="float32", shape=[0])

    with pytest.raises(ValueError, match="tensor 't5' is one tensor too many: this call accepts at most 5"):
        decode(endless(), max_tensors=5)
    assert len(consumed) == 6


def test_wire_decoded_tensor_is_writable_and_owns_its_memory():
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MB: large enough for huge pages
    wire = list(encode_messages({"x": big, "y": torch.ones(4)}, pb.PushRequest))
    parse = message_parser(pb.PushRequest)
    first = decode(parse(b) for b in wire)
    for t in first.values():
        t.add_(1)
    again = decode(parse(b) for b in wire)
    assert torch.equal(again["x"], big) and torch.equal(again["y"], torch.ones(4))
    assert torch.equal(first["x"], big + 1)


def test_parse_message_leaves_other_layouts_to_protobuf():
    chunk = next(encode("w", torch.arange(6.0)))
    canonical = pb.PushRequest(chunk=chunk).SerializeToString()
    assert isinstance(parse_message(canonical, pb.PushRequest), Chunk)
    header = pb.PushRequest(header=pb.PushHeader(worker=1, version=2)).SerializeToString()
    head_only = pb.Tensor(name="w", dtype="float32", shape=[6], total_bytes=24).SerializeToString()
    data_first = b"\x32\x18" + chunk.data + head_only  # Tensor.data, then the other fields: valid protobuf
    reordered = b"\x12" + bytes([len(data_first)]) + data_first
    for layout in (header, reordered, canonical + header, b"", b"\x12\x80", b"\x13"):
        assert parse_message(layout, pb.PushRequest) is None
    parse = message_parser(pb.PushRequest)
    assert parse(header).header.worker == 1
    assert torch.equal(decode([parse(reordered).chunk])["w"], torch.arange(6.0))
    # the fields before `data` are checked by protobuf: an invalid UTF-8 name is refused, not passed on
    bad_name = b"\x0a\x02\xff\xfe" + canonical[2 + len(b"\x0a\x01w"):]
    bad = b"\x12" + bytes([len(bad_name)]) + bad_name
    with pytest.raises(DecodeError):
        parse(bad)


def test_decode_budget_is_checked_before_allocating():
    huge = pb.Tensor(name="w", dtype="float32", shape=[1 << 40], total_bytes=4 << 40, offset=0, data=b"\0")
    with pytest.raises(ValueError, match="exceeds the 1024 bytes left of the 1024"):
        decode([huge], max_bytes=1024)
    with pytest.raises(ValueError, match="exceeds the 8 bytes left of the 20"):
        decode(encode_all({"a": torch.ones(3), "b": torch.ones(3)}), max_bytes=20)


def test_encode_refuses_unsupported_dtype_and_empty_name():
    with pytest.raises(ValueError, match="complex64"):
        list(encode("z", torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(ValueError, match="non-empty name"):
        list(encode("", torch.zeros(2)))
