"""A sync step over gRPC as a pipeline (JobPushHeader.pieces): a bucket is applied and sent back while the next
is still on its way up; the values are the mean SGD step bit for bit; malformed pipelines are refused."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec
from gradsync.ps.messages import Piece, PipelineHead, Push
from gradsync.transport.grpc.job_calls import read_pieces
from grpc_harness import MEMBER_TOKEN, each_worker, job_transports, make_server, served

LR = 0.1
MEMBER = (("authorization", f"Bearer {MEMBER_TOKEN}"),)
JOB_PUSH = "/gradsync.ParameterServer/JobPush"


def _grads(server, workers: int, seed: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(b.numel, generator=g) for b in server.shard.buckets] for _ in range(workers)]


def _header(buckets: int, worker: int, **fields) -> pb.JobPushRequest:
    return pb.JobPushRequest(header=pb.JobPushHeader(worker=worker, version=0, pieces=True,
                                                     absent=[pb.AbsentEntries()] * buckets, **fields))


def _tensor(key, tensor: torch.Tensor) -> list[pb.JobPushRequest]:
    return [pb.JobPushRequest(chunk=c) for c in tensor_codec.encode_all({key: tensor})]


@pytest.mark.timeout(60)
def test_a_bucket_comes_back_applied_before_the_next_bucket_is_pushed():
    """Two workers' pipelined JobPushes send bucket 0, then stop; bucket 0's values (the mean SGD step) come
    back while neither has sent bucket 1 (events, not timings); then the rest, the version and the buffers."""
    workers = 2
    server = make_server("sync", workers=workers, lr=LR)
    buckets = server.shard.buckets
    assert len(buckets) > 1
    before = server.pull()
    grads = _grads(server, workers)
    buffers = [{"norm.running_mean": torch.full((4,), 1.0 + w)} for w in range(workers)]
    go_on = threading.Event()
    first_back: dict[int, tuple[int, bool]] = {}  # worker: (the bucket that came back first, go_on set then)
    replies: dict[int, tuple] = {}

    def requests(w):
        yield _header(len(buckets), w)
        yield from (pb.JobPushRequest(chunk=c) for c in tensor_codec.encode_all(buffers[w]))
        yield from _tensor(0, grads[w][0])
        assert go_on.wait(30)
        for b in range(1, len(buckets)):
            yield from _tensor(b, grads[w][b])

    def push(w, channel):
        call = channel.stream_stream(JOB_PUSH, request_serializer=pb.JobPushRequest.SerializeToString,
                                     response_deserializer=tensor_codec.message_parser(pb.PullResponse))
        stream = iter(call(requests(w), timeout=30, metadata=MEMBER))
        first = next(stream)
        first_back[w] = (first.key, go_on.is_set())
        replies[w] = read_pieces(_chained(first, stream), "JobPush", 0)

    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        threads = [threading.Thread(target=push, args=(w, channel)) for w in range(workers)]
        for t in threads:
            t.start()
        end = time.monotonic() + 30
        while len(first_back) < workers and time.monotonic() < end and any(t.is_alive() for t in threads):
            time.sleep(0.01)
        go_on.set()
        for t in threads:
            t.join(30)
    assert first_back == {w: (0, False) for w in range(workers)}
    after = server.pull()
    assert after.version == 1
    for w in range(workers):
        header, tensors = replies[w]
        assert header.version == 1
        for b, was in enumerate(before.flats):
            mean = (grads[0][b] + grads[1][b]) * (1.0 / workers)
            assert torch.equal(tensors[b], was.add(mean, alpha=-LR)) and torch.equal(tensors[b], after.flats[b]), b
        assert torch.equal(tensors["norm.running_mean"], torch.full((4,), 1.5))


def _chained(first, rest):
    yield first
    yield from rest


@pytest.mark.timeout(60)
def test_the_job_transport_pipelines_a_step_and_reads_back_the_snapshot_after_it():
    """GrpcTransport.push_pieces: every worker's replies are the server's snapshot after the step, bit for bit,
    a bucket no worker sent a gradient for is left alone, and the schedule's options reach the server."""
    workers = 2
    server = make_server("sync", workers=workers, lr=LR)
    buckets = server.shard.buckets
    grads = _grads(server, workers, seed=5)
    every = tuple(range(len(buckets[-1].entries)))
    replies = {}
    with served(server) as (endpoint, _), job_transports(endpoint, server, workers) as transports:
        before = transports[0].pull()[0]

        def push(w):
            pieces = [Piece(0, b, None if b == len(buckets) - 1 else grads[w][b],
                            every if b == len(buckets) - 1 else ()) for b in reversed(range(len(buckets)))]
            head = PipelineHead(buffers={"norm.running_mean": torch.zeros(4)}, options={0: {"lr": LR / 2}})
            replies[w] = transports[w].push_pieces({0: 0}, {0: head}, pieces)[0]

        each_worker(push, workers)
    after = server.pull()
    assert after.version == 1
    for w in range(workers):
        assert replies[w].version == 1
        assert all(torch.equal(a, b) for a, b in zip(replies[w].flats, after.flats))
        assert torch.equal(replies[w].buffers["norm.running_mean"], torch.zeros(4))
    for b, was in enumerate(before.flats[:-1]):
        mean = (grads[0][b] + grads[1][b]) * (1.0 / workers)
        assert torch.equal(after.flats[b], was.add(mean, alpha=-LR / 2)), b
    assert torch.equal(after.flats[-1], before.flats[-1])


def _refused(server, messages) -> tuple[grpc.StatusCode, str]:
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        call = channel.stream_stream(JOB_PUSH, request_serializer=pb.JobPushRequest.SerializeToString)
        try:
            list(call(iter(messages), timeout=10, metadata=MEMBER))
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


CASES = {
    "a buffer after a bucket": ("sync", lambda n, g: [_header(n, 0), *_tensor(0, g[0]),
                                                      *_tensor("norm.running_mean", torch.ones(4))],
                                "buffer 'norm.running_mean' came after a bucket"),
    "held for a norm": ("sync", lambda n, g: [_header(n, 0, norm_type=2.0)], "with norm_type 2.0"),
    "an async job": ("async", lambda n, g: [_header(n, 0)], "in async mode"),
    "short absence lists": ("sync", lambda n, g: [_header(1, 0)], "1 absence lists for its"),
    "a NaN bucket": ("sync1", lambda n, g: [_header(n, 0), *_tensor(0, torch.full_like(g[0], float("nan")))],
                     "non-finite gradient (NaN or Inf) for parameter 'fc2.bias' from worker 0"),  # averaged at once
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_pipeline_is_refused_naming_the_field_and_applies_nothing(case):
    mode, messages, expected = CASES[case]
    server = make_server(mode.rstrip("1"), workers=1 if mode.endswith("1") else 2, lr=LR)
    before = server.pull()
    code, details = _refused(server, messages(len(server.shard.buckets), _grads(server, 1)[0]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in details, (code, details)
    after = server.pull()
    assert after.version == 0 and all(torch.equal(a, b) for a, b in zip(after.flats, before.flats))


def test_reading_a_pipelined_reply_refuses_one_without_its_header():
    chunks = list(tensor_codec.encode_all({0: torch.ones(3)}))
    with pytest.raises(RuntimeError, match="ended without its PullHeader"):
        read_pieces(iter(pb.PullResponse(chunk=c) for c in chunks), "JobPush", 0)
    header = pb.PullResponse(header=pb.PullHeader(shard_id=0, version=1))
    with pytest.raises(RuntimeError, match="a second PullHeader"):
        read_pieces(iter([header, header]), "JobPush", 0)
