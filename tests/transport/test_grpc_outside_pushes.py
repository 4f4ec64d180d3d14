"""An outside client's Push cannot speak for a worker of the job, and a push that is empty or names an
out-of-range worker changes nothing: refused with a status naming the problem, the parameters bitwise the same,
the version unchanged."""
from __future__ import annotations

import grpc
import pytest
import torch

from gradsync.transport.grpc.client import Client
from gradsync.core.buckets import ModelSpec
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto.tensor_codec import encode_all
from gradsync.ps.messages import Push
from grpc_harness import MEMBER_TOKEN, TOKEN, each_worker, job_transports, make_server, model_state, served

OUTSIDE = (("authorization", f"Bearer {TOKEN}"),)
MEMBER = (("authorization", f"Bearer {MEMBER_TOKEN}"),)
LR = 0.1


def _bits(server) -> dict[str, bytes]:
    return {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in server.state_dict().items()}


def _push(channel, worker: int, tensors: dict[str, torch.Tensor], metadata=OUTSIDE, version: int = 0):
    """A raw Push: (status code, details, the reply's version or None)."""
    messages = [pb.PushRequest(header=pb.PushHeader(worker=worker, version=version))]
    messages += [pb.PushRequest(chunk=c) for c in encode_all(tensors)]
    try:
        reply = channel.stream_unary("/gradsync.ParameterServer/Push")(
            iter(m.SerializeToString() for m in messages), timeout=5, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details(), None
    return grpc.StatusCode.OK, "", pb.PushResponse.FromString(reply).version


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_an_outside_push_as_a_live_worker_never_enters_the_step(mode):
    """Before: the push went into the sync step as worker 0, and worker 0's own push then failed the job
    ("worker 0 committed twice")."""
    workers = 2
    server = make_server(mode, workers=workers, lr=LR)
    buckets = server.shard.buckets
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        before = _bits(server)
        for worker in (0, 1, 2):
            code, details, _ = _push(channel, worker, {"fc1.bias": torch.ones(16)})
            assert code == grpc.StatusCode.PERMISSION_DENIED, (worker, code, details)
            assert f"runs a {mode} job, whose steps take the pushes of its 2 workers only" in details
        assert _bits(server) == before and server.shard.version == 0

        with job_transports(endpoint, server, workers) as transports:
            start = transports[0].pull()[0]
            replies = {}

            def step(w):
                grads = [torch.full((b.numel,), float(w + 1)) for b in buckets]
                replies[w] = transports[w].push({0: 0}, {0: Push(grads, [()] * len(buckets))})[0]

            each_worker(step, workers, join_s=20)
    assert sorted(replies) == [0, 1] and server.shard.version == {"sync": 1, "ssp": 2}[mode]  # ssp: one per push
    for flat, was in zip(server.pull().flats, start.flats):  # the workers' mean, (1 + 2) / 2, and nothing else
        assert torch.allclose(flat, was - LR * torch.full_like(was, 1.5), atol=1e-6)


@pytest.mark.timeout(30)
def test_async_outside_pushes_use_ids_of_their_own():
    """In an async job an outside client pushes under an id >= W that no worker (joined ones included)
    holds; a member, with the member token, pushes under its own."""
    workers = 2
    server = make_server("async", workers=workers, lr=LR)
    params, buffers = model_state()
    server.register(7, ModelSpec.of(params, buffers), None).wait()  # a worker that joined the running job
    grads = {"fc1.bias": torch.ones(16)}
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        before = _bits(server)
        for worker in (0, 1, 7):
            code, details, _ = _push(channel, worker, grads)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (worker, code, details)
            assert f"PushHeader.worker {worker} is a worker of this job" in details and "2 .. 65535" in details
        assert _bits(server) == before and server.shard.version == 0
        assert _push(channel, 2, grads) == (grpc.StatusCode.OK, "", 1)
        assert _push(channel, 65535, grads, version=1) == (grpc.StatusCode.OK, "", 2)
        assert _push(channel, 0, grads, metadata=MEMBER, version=2) == (grpc.StatusCode.OK, "", 3)
        with Client(endpoint.address, token=TOKEN) as client:
            with pytest.raises(PermissionError, match="PERMISSION_DENIED: PushHeader.worker 1 is a worker"):
                client.push(grads, 3, worker=1)
    assert server.stats()["pushes_by_worker"] == {2: 1, 65535: 1, 0: 1}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("metadata", [OUTSIDE, MEMBER], ids=["outside", "member"])
def test_empty_and_out_of_range_pushes_change_nothing(metadata):
    """Before: a push with no tensors, or from worker 2^31-1, was applied and bumped the version."""
    server = make_server("async", workers=1, lr=LR)
    cases = [  # (worker, tensors, what the refusal says)
        (1, {}, "PushRequest carries no gradient (no tensor)"),
        (1, {"norm.running_mean": torch.zeros(4)}, "PushRequest carries no gradient (only buffers)"),
        (2**31 - 1, {"fc1.bias": torch.ones(16)},
         f"PushHeader.worker {2**31 - 1} is not a worker id: expected 0 .. 65535"),
        (65536, {"fc1.bias": torch.ones(16)}, "PushHeader.worker 65536 is not a worker id"),
        (-1, {"fc1.bias": torch.ones(16)}, "PushHeader.worker -1 is not a worker id"),
        (-(2**63), {"fc1.bias": torch.ones(16)}, "is not a worker id"),
    ]
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        before = _bits(server)
        for worker, tensors, expected in cases:
            code, details, _ = _push(channel, worker, tensors, metadata=metadata)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in details, (worker, code, details)
            assert _bits(server) == before and server.shard.version == 0, worker
        assert server.stats()["pushes_applied"] == 0 and server.stats()["pushes_rejected"] == len(cases)
        assert _push(channel, 1, {"fc1.bias": torch.ones(16)}, metadata=metadata) == (grpc.StatusCode.OK, "", 1)
