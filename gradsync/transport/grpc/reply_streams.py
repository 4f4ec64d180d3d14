"""Reading a reply stream of `PullResponse`s: the PullHeader that opens it, then the tensors' chunks (`chunk_of`
tells a chunk from the other items a pipelined JobPush's reply carries). Shared by the outside client's pulls
(`client`) and the job's own calls (`job_calls`). A failed call raises its grpc.RpcError from the iteration,
which the caller turns into the builtin error naming the call and the server (`client.Client.error`)."""

from __future__ import annotations

import torch

from gradsync.core.job_names import server_name
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec


def read_pulled(call, what: str, shard: int) -> tuple[int, dict[tensor_codec.Key, torch.Tensor]]:
    """The version in the PullHeader that opens a stream of `PullResponse`s (Pull, JobPull, JobPush), and
    the tensors that follow it. Raises grpc.RpcError when the call fails, RuntimeError on a malformed stream."""
    header, tensors = read_stream(call, what, shard)
    return header.version, tensors


def read_stream(call, what: str, shard: int) -> tuple[pb.PullHeader, dict[tensor_codec.Key, torch.Tensor]]:
    """`read_pulled` with the whole PullHeader."""
    first = next(call, None)
    if not isinstance(first, pb.PullResponse) or first.WhichOneof("item") != "header":
        raise RuntimeError(f"{what} on {server_name(shard)}: the stream did not start with a PullHeader")
    return first.header, tensor_codec.decode(_pulled_chunks(call, what, shard))


def chunk_of(response) -> tensor_codec.Chunk | None:
    """The tensor chunk a reply stream's item carries (a `PullResponse`, or a bare Chunk from a server in this
    process), None for another item (a header, a stamp)."""
    if isinstance(response, tensor_codec.Chunk):
        return response
    return response.chunk if response.WhichOneof("item") == "chunk" else None


def _pulled_chunks(call, what: str, shard: int):
    for response in call:
        if (chunk := chunk_of(response)) is None:
            raise RuntimeError(f"{what} on {server_name(shard)}: a second PullHeader in the middle of the stream")
        yield chunk
