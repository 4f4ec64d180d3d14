"""The ps strategy over gRPC (`--transport grpc`): the job calls alone, no TensorPipe, open membership (its math:
test_parity, run per transport)."""
import pytest

import gradsync
from jobs import train_mlp, train_mlp_server_stats, train_with_outside_worker


@pytest.mark.timeout(150)
def test_grpc_workers_use_only_the_job_calls_one_push_per_server_per_step(launch):
    """Workers pull once before the first step, then make exactly one JobPush per server per step (its reply
    is the next snapshot); the named Pull and Push, for clients outside the job, are never called."""
    workers, steps = 2, 5
    results = launch(train_mlp_server_stats, strategy="ps", workers=workers, servers=2, args=(steps,), transport="grpc")
    for stats in results:  # as each worker saw them after its last step
        for shard in (0, 1):
            calls = stats[shard]["calls"]
            assert (calls.get("JobPush"), calls.get("JobPull")) == (workers * steps, workers), (shard, calls)
            assert "Pull" not in calls and "Push" not in calls, (shard, calls)
            assert stats[shard]["version"] == stats[shard]["pushes_applied"] == steps


@pytest.mark.timeout(150)
def test_async_grpc_job_lets_workers_join_and_leave(launch):
    results = launch(train_with_outside_worker, strategy="ps", mode="async", workers=2, servers=1, args=(10, 3),
                     transport="grpc")
    first = results[0]
    code, output = first["outsider"]
    assert code == 0, output
    stats = first["stats"][0]
    assert stats["workers_seen"] == [0, 1, 9]
    assert stats["pushes_applied"] == 10 + 3 + 1 + 2  # worker 0, worker 1 (left early), the outsider, worker 0 again
    assert stats["pushes_rejected"] == 0
    assert not first["rpc_agent"] and not results[1]["rpc_agent"]  # no TensorPipe agent on the workers


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(strategy="allreduce", workers=2, transport="grpc"), "grpc transport serves the ps strategy"),
        (dict(strategy="ps", workers=2, servers=1, transport="grpc", compression="int8"), "compression='int8'"),
        (dict(strategy="ps", workers=2, servers=1, transport="carrier-pigeon"), "unknown transport"),
    ],
)
def test_grpc_transport_refuses_what_it_cannot_carry(launch, settings, match):
    with pytest.raises(gradsync.config.ConfigError, match=match):
        launch(train_mlp, args=(1,), **settings)
