"""The gRPC service through the Client: consistent pulls, sync and async pushes against closed-form SGD, stats,
shards."""
from __future__ import annotations

import re

import pytest
import torch

from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.cli.job_status import pull_to_file, status_table
from gradsync.transport.grpc.client import Client
from gradsync.core.job_names import StoreKeys
from gradsync.core.buckets import ModelSpec, TensorSpec
from gradsync.transport.grpc.endpoint_files import write_endpoints
from gradsync.transport.grpc.server import serve_grpc
from gradsync.ps.messages import Push
from grpc_harness import (MEMBER_TOKEN, TOKEN, each_worker, job_transport, job_transports, make_server, model_state,
                          served)

LR = 0.1


def _grads(seed: int, server) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in server.shard.params.items()}


@pytest.mark.timeout(60)
def test_pull_is_the_shard_state_bit_for_bit_with_its_version(grpc_server):
    server, _, client = grpc_server("async", workers=1)
    state, versions = client.pull_versioned()
    assert versions == {0: 0}
    live = server.state_dict()
    assert list(state) == list(live)
    for name, value in live.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    subset = client.pull(["fc1.bias", "norm.steps"])
    assert list(subset) == ["fc1.bias", "norm.steps"] and int(subset["norm.steps"]) == 7
    with pytest.raises(ValueError, match=r"INVALID_ARGUMENT: PullRequest\.names.*'nope'"):
        client.pull(["nope"])


@pytest.mark.timeout(60)
def test_sync_push_from_w_clients_applies_the_mean_sgd_step_once(grpc_server):
    """W clients holding the job's member token push by name as its workers 0..W-1: one mean step."""
    workers = 3
    server, endpoint, _ = grpc_server("sync", workers=workers, lr=LR)
    before = {n: p.detach().clone() for n, p in server.shard.params.items()}
    grads = [_grads(w, server) for w in range(workers)]
    del grads[2]["fc1.bias"]  # a parameter a worker leaves out counts as a zero gradient
    results: dict[int, object] = {}

    def push(w):
        with Client(endpoint.address, token=MEMBER_TOKEN) as c:
            results[w] = c.push(grads[w], 0, worker=w)

    each_worker(push, workers)
    assert results == {w: {0: 1} for w in range(workers)}
    after = server.state_dict()
    for name, p in before.items():
        gs = [g.get(name, torch.zeros_like(p)) for g in grads]
        mean = torch.stack(gs).sum(0) * (1.0 / workers)
        assert torch.equal(after[name], p.add(mean, alpha=-LR)), name
    stats = server.shard.stats
    assert (stats.version, stats.pushes_applied, stats.workers_seen) == (1, 1, {0, 1, 2})


def _equal_snapshots(a, b) -> bool:
    return (a.version == b.version and len(a.flats) == len(b.flats)
            and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.flats, b.flats))
            and list(a.buffers) == list(b.buffers)
            and all(torch.equal(a.buffers[n], b.buffers[n]) for n in a.buffers))


@pytest.mark.timeout(60)
def test_job_calls_move_flat_buckets_and_reply_with_the_snapshot_after_the_step():
    """JobPull is the server's snapshot; W JobPushes (bucket gradients by index, absent entries, buffers) apply
    the mean SGD step once and each replies with the snapshot after it, bit for bit."""
    workers = 2
    server = make_server("sync", workers=workers, lr=LR)
    buckets = server.shard.buckets
    assert len(buckets) > 1
    g = torch.Generator().manual_seed(7)
    grads = [[torch.randn(b.numel, generator=g) for b in buckets] for _ in range(workers)]
    grads[1][0] = None  # worker 1 has no gradient in bucket 0
    absent = [[()] * len(buckets), [tuple(range(len(buckets[0].entries)))] + [()] * (len(buckets) - 1)]
    buffers = [{"norm.running_mean": torch.full((4,), 1.0 + w), "norm.steps": torch.tensor(8 + w)}
               for w in range(workers)]
    replies = {}
    with served(server) as (endpoint, _), job_transports(endpoint, server, workers) as transports:
        before = transports[0].pull()[0]
        assert _equal_snapshots(before, server.pull()) and before.version == 0

        def push(w):
            replies[w] = transports[w].push({0: 0}, {0: Push(grads[w], absent[w], buffers[w])})[0]

        each_worker(push, workers)
    after = server.pull()
    assert after.version == 1 and all(_equal_snapshots(replies[w], after) for w in range(workers))
    for b, (flat, was) in enumerate(zip(after.flats, before.flats)):
        mean = torch.stack([gs[b] for gs in grads if gs[b] is not None]).sum(0) * (1.0 / workers)
        assert torch.equal(flat, was.add(mean, alpha=-LR)), b
    assert torch.equal(after.buffers["norm.running_mean"], torch.full((4,), 1.5))
    assert int(after.buffers["norm.steps"]) == 8  # integer buffers: worker 0's
    stats = server.stats()
    assert (stats["pushes_applied"], stats["pushes_rejected"]) == (1, 0)


@pytest.mark.timeout(60)
def test_job_transport_refuses_a_dtype_it_cannot_carry_before_registering():
    server = make_server("async", workers=1)
    spec = ModelSpec(params=(), buffers=(TensorSpec("phase", (2,), torch.complex64),))
    with served(server) as (endpoint, _):
        transport = job_transport(endpoint, server, 0)
        with pytest.raises(ValueError, match=r"'phase': dtype torch.complex64 cannot be sent.*--transport rpc"):
            transport.register(spec, {0: None})
        assert not transport.store.check([StoreKeys.GRPC_SPEC.format(0, 0)])
        transport.close()


@pytest.mark.timeout(60)
def test_async_push_applies_at_once_and_records_staleness(grpc_server):
    server, _, client = grpc_server("async", workers=2, lr=LR)
    state0 = client.pull()
    g0, g1 = _grads(0, server), _grads(1, server)
    assert client.push(g0, 0, worker=2) == {0: 1}  # outside clients: ids of their own, >= W
    state1 = client.pull()
    for name, g in g0.items():
        assert torch.equal(state1[name], state0[name].add(g, alpha=-LR)), name
    assert client.push(g1, 0, worker=3) == {0: 2}  # computed at version 0: one step stale
    state2, versions = client.pull_versioned()
    assert versions == {0: 2}
    for name, g in g1.items():
        assert torch.equal(state2[name], state1[name].add(g, alpha=-LR)), name
    stats = client.stats()[0]
    assert stats["version"] == 2 and stats["pushes_applied"] == 2 and stats["pushes_rejected"] == 0
    assert stats["workers_seen"] == [2, 3] and stats["max_staleness"] == 1
    grad_bytes = sum(p.numel() * 4 for p in server.shard.params.values())
    assert stats["bytes_in"] == 2 * grad_bytes
    assert stats["bytes_out"] == 3 * sum(t.numel() * t.element_size() for t in state0.values())


@pytest.mark.timeout(60)
def test_sync_push_without_the_other_workers_times_out_naming_the_call(grpc_server):
    server, _, client = grpc_server("sync", workers=2, member=True, timeout=0.5)
    with pytest.raises(TimeoutError, match=r"Push on ps0 at 127\.0\.0\.1:\d+ failed after \d+\.\d+ s") as info:
        client.push(_grads(0, server), 0, worker=0)
    # the timeout fired, not something earlier (how much later depends on the machine's load: no upper bound)
    assert float(re.search(r"failed after (\d+\.\d+) s", str(info.value)).group(1)) >= 0.45
    assert server.shard.version == 0


@pytest.mark.timeout(60)
def test_not_ready_server_answers_health_and_refuses_the_rest():
    from gradsync.ps.server import ParameterServer

    server = ParameterServer(0, 2, "sync", "raise")
    with served(server) as (_, client):
        assert client.health()[0]["ready"] is False
        with pytest.raises(ValueError, match="FAILED_PRECONDITION: server 0 has no model yet"):
            client.pull()
        assert "| 0 | 127.0.0.1:" in status_table(client)


@pytest.mark.timeout(60)
def test_run_dir_client_gathers_and_routes_across_shards(tmp_path):
    servers = [make_server("async", workers=1, lr=LR, num_servers=2, shard=s) for s in range(2)]
    endpoints = [serve_grpc(s, token=TOKEN, member_token=MEMBER_TOKEN, job="job-a") for s in servers]
    try:
        for shard, e in enumerate(endpoints):
            write_endpoints(str(tmp_path), shard, e.address, TOKEN, "job-a")
        with Client(str(tmp_path)) as client:
            params, buffers = model_state()
            state, versions = client.pull_versioned()
            assert versions == {0: 0, 1: 0}
            assert sorted(state) == sorted({**params, **buffers})
            assert all(torch.equal(state[n], t) for n, t in {**params, **buffers}.items())
            owners = client.owners()
            assert {owners[n] for n in params} == {0, 1}
            g = torch.ones(16)
            owner = owners["fc1.bias"]
            assert client.push({"fc1.bias": g}, versions, worker=1) == {owner: 1}  # only its owner gets a push
            assert torch.equal(client.pull(["fc1.bias"])["fc1.bias"], params["fc1.bias"].add(g, alpha=-LR))
            other = {n: torch.ones_like(p) for n, p in params.items() if owners[n] != owner}
            assert client.push(other, 0, worker=1) == {1 - owner: 1}
            table = status_table(client)
            out = tmp_path / "out.pt"
            assert pull_to_file(client, str(out)) == {0: 1, 1: 1}
        saved = torch.load(out, weights_only=True)
        for name, p in params.items():
            pushed = torch.ones_like(p) if name in other or name == "fc1.bias" else torch.zeros_like(p)
            assert torch.equal(saved[name], p.add(pushed, alpha=-LR)), name
        lines = table.splitlines()
        assert lines[0].startswith("| shard | address | ready | version") and len(lines) == 4
        assert lines[2].split(" | ")[2:5] == ["yes", "1", "1"]
    finally:
        for e in endpoints:
            e.stop(0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["health", "pull", "push"])
def test_a_run_dir_client_refuses_a_server_of_another_job_at_the_address_its_files_name(call, tmp_path):
    server = make_server("async", workers=1, lr=LR)
    before = server.state_dict()
    endpoint = serve_grpc(server, token=TOKEN, member_token=MEMBER_TOKEN, job="job-b")  # the job there now
    calls = {"health": lambda c: c.health(), "pull": lambda c: c.pull(),
             "push": lambda c: c.push({"fc1.bias": torch.ones(16)}, 0, worker=1)}
    try:
        write_endpoints(str(tmp_path), 0, endpoint.address, TOKEN, "job-a")  # left by job-a, which has ended
        with Client(str(tmp_path)) as client, pytest.raises(ConnectionError) as refused:
            calls[call](client)
        assert str(refused.value) == (
            f"{endpoint.address} serves job job-b, not job job-a that {tmp_path}/grpc-0.json names: that job has "
            "ended and another listens there; give the run directory of a running job (gradsync run prints it "
            "at start)")
        write_endpoints(str(tmp_path), 0, endpoint.address, "job-a's token", "job-a")
        with Client(str(tmp_path)) as client, pytest.raises(ConnectionError, match=(
                f"{endpoint.address} refuses the token of job job-a that {tmp_path}/grpc-0.json names: that job "
                "has ended")):
            calls[call](client)
        assert all(torch.equal(server.state_dict()[n], t) for n, t in before.items())  # nothing pushed
        write_endpoints(str(tmp_path), 0, endpoint.address, TOKEN, "job-b")
        with Client(str(tmp_path)) as client:
            calls[call](client)
    finally:
        endpoint.stop(0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_chunk_tensors_pull_and_push_bit_for_bit(dtype):
    """Parameters of several chunks, of sizes that are no multiple of a chunk, both ways through the endpoint."""
    from gradsync.core.buckets import ModelSpec, plan_buckets
    from gradsync.ps.messages import Setup
    from gradsync.ps.server import ParameterServer

    g = torch.Generator().manual_seed(5)
    params = {"big": torch.randn(700_001, generator=g).to(dtype), "small": torch.randn(3, 5, generator=g).to(dtype)}
    spec = ModelSpec.of({n: p.requires_grad_() for n, p in params.items()}, {})
    setup = Setup.of(plan_buckets(spec.params, 1, 1 << 30), params, {}, {},
                     OptimizerSpec.one_group(torch.optim.SGD, {"lr": LR}))
    server = ParameterServer(0, 1, "async", "raise")
    server.register(0, spec, setup).wait()
    with served(server) as (_, client):
        state, versions = client.pull_versioned()
        for name, value in params.items():
            assert state[name].dtype == dtype and torch.equal(state[name], value), name
        grads = {n: torch.randn(p.shape, generator=g).to(dtype) for n, p in params.items()}
        assert client.push(grads, versions, worker=1) == {0: 1}
        after = client.pull()
        for name, value in params.items():
            expected = value.clone().add_(grads[name], alpha=-LR)
            assert torch.equal(after[name].view(torch.int16), expected.view(torch.int16)), name
