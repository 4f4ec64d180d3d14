"""Clients outside the job cannot stall its workers: outside calls run in slots of their own (one more is refused
with RESOURCE_EXHAUSTED), the job calls need the member token, and an idle request stream is cancelled with
DEADLINE_EXCEEDED once it has sent nothing for the endpoint's idle limit."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from gradsync.transport.grpc.client import Client
from gradsync.proto import gradsync_pb2 as pb
from gradsync.ps.messages import Push
from grpc_harness import MEMBER_TOKEN, TOKEN, each_worker, job_transports, make_server, served
from helpers import wait_until

OUTSIDE = (("authorization", f"Bearer {TOKEN}"),)
LR = 0.1
PUSH = "/gradsync.ParameterServer/Push"


def _idle_push(channel, release: threading.Event, header: bool):
    """An outside Push that sends (a header, or nothing) and then nothing until `release`: its future."""
    def messages():
        if header:
            yield pb.PushRequest(header=pb.PushHeader(worker=2, version=0)).SerializeToString()
        release.wait(60)

    return channel.stream_unary(PUSH).future(messages(), timeout=60, metadata=OUTSIDE)


@pytest.mark.timeout(40)
def test_idle_outside_pushes_never_stall_the_job_workers():
    workers, steps, idle, slots = 2, 3, 4.0, 8
    server = make_server("sync", workers=workers, lr=LR)
    buckets = server.shard.buckets
    release = threading.Event()
    with served(server, idle_timeout=idle, outside_calls=slots) as (endpoint, outside), \
            grpc.insecure_channel(endpoint.address) as channel, \
            Client(endpoint.address, token=MEMBER_TOKEN) as member:
        # as many idle pushes as the endpoint had handler threads before, and more: the first `slots` hold every
        # outside slot (counted once admitted), the others are refused at once
        idle_pushes = [_idle_push(channel, release, header=False) for _ in range(slots + 4)]
        wait_until(lambda: member.stats()[0]["calls"].get("Push", 0) == slots, "the idle pushes were not admitted")
        wait_until(lambda: sum(f.done() for f in idle_pushes) == 4, "the pushes past the slots were not refused")
        refused = [f for f in idle_pushes if f.done()]
        assert all(f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for f in refused), [f.code() for f in refused]
        assert f"already runs {slots} calls from outside the job" in refused[0].details()
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            outside.health()  # every outside slot is taken ...
        assert member.health()[0]["ready"]  # ... the members' calls are not

        # the job's workers train as if nothing were happening
        with job_transports(endpoint, server, workers) as transports:
            before = transports[0].pull()[0]
            replies: dict[int, list] = {w: [] for w in range(workers)}

            def train(w):
                for step in range(steps):
                    grads = [torch.full((b.numel,), float(w + 1 + step)) for b in buckets]
                    replies[w].append(transports[w].push({0: step}, {0: Push(grads, [()] * len(buckets))})[0])

            each_worker(train, workers)
        assert [len(r) for r in replies.values()] == [steps] * workers, "the workers' steps did not finish"
        assert [s.version for s in replies[0]] == list(range(1, steps + 1))
        expected = before.flats
        for step in range(steps):
            mean = sum(float(w + 1 + step) for w in range(workers)) / workers
            expected = [f - LR * torch.full_like(f, mean) for f in expected]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(replies[0][-1].flats, expected))

        # outside clients may not make the job calls, whatever the load
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/gradsync.ParameterServer/JobPull")(b"", timeout=5, metadata=OUTSIDE))
        assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED,)

        # the idle streams end at the idle limit, and the outside slots are free again
        admitted = [f for f in idle_pushes if f not in refused]
        wait_until(lambda: all(f.done() for f in admitted), "the idle pushes were never cancelled", 3 * idle + 10)
        assert all(f.code() == grpc.StatusCode.DEADLINE_EXCEEDED for f in admitted), [f.code() for f in admitted]
        assert f"sent nothing for {idle:g} s" in admitted[0].details()
        assert outside.health()[0]["ready"]
        release.set()
    assert server.shard.version == steps and server.shard.stats.pushes_applied == steps


@pytest.mark.timeout(30)
def test_a_slow_stream_that_keeps_sending_is_served_a_silent_one_cut_and_outside_job_calls_refused():
    """The idle limit bounds each wait for the next message, not the whole stream (a stream silent after its
    header is cut); and an outside client is refused every job call (PERMISSION_DENIED)."""
    server = make_server("async", workers=1, lr=LR)
    idle = 3.0
    bias = torch.ones(16)
    with served(server, idle_timeout=idle) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        def slow():
            yield pb.PushRequest(header=pb.PushHeader(worker=1, version=0)).SerializeToString()
            time.sleep(idle / 3)
            yield pb.PushRequest(chunk=pb.Tensor(name="fc1.bias", dtype="float32", shape=[16], total_bytes=64,
                                                 data=bias.numpy().tobytes())).SerializeToString()
            time.sleep(idle / 3)

        reply = pb.PushResponse.FromString(channel.stream_unary(PUSH)(slow(), timeout=20, metadata=OUTSIDE))
        assert reply.version == 1
        release = threading.Event()
        stalled = _idle_push(channel, release, header=True)  # a header, then nothing
        with pytest.raises(grpc.RpcError) as info:
            stalled.result(timeout=3 * idle + 10)
        release.set()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"Push from outside: the client sent nothing for {idle:g} s" in info.value.details()
        calls = {
            "JobPull": lambda: list(channel.unary_stream("/gradsync.ParameterServer/JobPull")(
                b"", timeout=5, metadata=OUTSIDE)),
            "JobPush": lambda: list(channel.stream_stream("/gradsync.ParameterServer/JobPush")(
                iter([b""]), timeout=5, metadata=OUTSIDE)),
            "JobFinish": lambda: list(channel.unary_stream("/gradsync.ParameterServer/JobFinish")(
                b"", timeout=5, metadata=OUTSIDE)),
            "JobOptimizerState": lambda: channel.unary_unary("/gradsync.ParameterServer/JobOptimizerState")(
                b"", timeout=5, metadata=OUTSIDE),
            "JobLoadOptimizerState": lambda: channel.unary_unary(
                "/gradsync.ParameterServer/JobLoadOptimizerState")(b"", timeout=5, metadata=OUTSIDE),
            "JobCheckpoint": lambda: channel.unary_unary(  # it writes files where it is told: members only
                "/gradsync.ParameterServer/JobCheckpoint")(b"", timeout=5, metadata=OUTSIDE),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "member credential" in info.value.details(), name
    assert server.shard.version == 1


@pytest.mark.timeout(40)
def test_an_outside_pull_left_unread_gives_its_slot_back_at_the_idle_limit():
    """A client that opens a Pull of a large model and reads nothing holds its outside slot only until the
    idle limit; then the call ends with DEADLINE_EXCEEDED and the slot serves others."""
    from gradsync.core.buckets import ModelSpec, plan_buckets
    from gradsync.core.optimizer_spec import OptimizerSpec
    from gradsync.ps.messages import Setup
    from gradsync.ps.server import ParameterServer

    params = {"big": torch.zeros(8 << 20).requires_grad_()}  # 32 MB: more than any flow-control window
    spec = ModelSpec.of(params, {})
    setup = Setup.of(plan_buckets(spec.params, 1, 1 << 30), params, {}, {},
                     OptimizerSpec.one_group(torch.optim.SGD, {"lr": LR}))
    server = ParameterServer(0, 1, "async", "raise")
    server.register(0, spec, setup).wait()
    idle = 3.0
    with served(server, idle_timeout=idle, outside_calls=1) as (endpoint, outside), \
            grpc.insecure_channel(endpoint.address) as channel:
        pull = channel.unary_stream("/gradsync.ParameterServer/Pull")(
            pb.PullRequest().SerializeToString(), timeout=60, metadata=OUTSIDE)
        next(pull)  # the header; then nothing is read
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            outside.health()  # the one outside slot is the unread pull's

        def served_again():
            try:
                return outside.health()[0]["ready"]
            except RuntimeError:
                return False

        wait_until(served_again, "the unread pull kept its slot", 3 * idle + 10)
        with pytest.raises(grpc.RpcError) as info:
            for _ in pull:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"Pull from outside: the client read nothing for {idle:g} s" in info.value.details()
