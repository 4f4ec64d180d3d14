"""Consistency rules in one process: sync averages in worker order, bad pushes change nothing."""
import pytest
import torch

from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.ps.async_rules import AsyncRule, SSPRule
from gradsync.ps.server import make_rule
from gradsync.ps.sync_rule import SyncRule
from gradsync.ps.messages import Agreement, Committed, Push
from gradsync.core.errors import GradientError
from gradsync.ps.shard import ShardState

from shards import ALL, grads_of, make_shard


def _sync_flats(order):
    """The shard's values after one sync step whose three pushes arrive in `order`."""
    shard, _ = make_shard()
    rule = SyncRule(shard, num_workers=3, nonfinite="raise")
    futures = [rule.commit(w, 0, Push(grads_of(w, shard), ALL)) for w in order]
    assert [f.wait().version for f in futures] == [1, 1, 1]
    return shard.flats


def test_sync_result_is_bit_identical_whatever_the_arrival_order():
    """Float addition is not associative, so summing in arrival order would give different bits for different
    orders (checked below on these very gradients): the rule must sum in worker order."""
    flats = {tuple(order): _sync_flats(order) for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0])}
    shard, params = make_shard()  # the values it starts from; SGD(lr=0.5, momentum=0.9)'s first step: p - 0.5 g
    [bucket] = shard.buckets
    start = torch.cat([params[e.name].detach().flatten()[e.start:e.start + e.numel] for e in bucket.entries])
    mean = sum(grads_of(w, shard)[0].double() for w in range(3)) / 3
    torch.testing.assert_close(flats[(0, 1, 2)][0].double(), start.double() - 0.5 * mean, rtol=1e-6, atol=1e-4)
    for order, got in flats.items():
        assert all(a.equal(b) for a, b in zip(got, flats[(0, 1, 2)])), order
    sums = {order: [sum((grads_of(w, shard)[i] for w in order[1:]), grads_of(order[0], shard)[i])
                    for i in range(len(shard.buckets))] for order in flats}
    assert any(not all(a.equal(b) for a, b in zip(s, sums[(0, 1, 2)])) for s in sums.values())  # orders do differ


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda g: [g[0][:-1]] + g[1:], r"is \(\d+,\) torch.float32, expected"),
        (lambda g: [g[0].double()] + g[1:], "torch.float64"),
        (lambda g: g + g, "sent 2 bucket gradients"),
    ],
)
def test_bad_push_is_refused_and_changes_nothing(mutate, match):
    shard, _ = make_shard()
    before = [f.clone() for f in shard.flats]
    for rule in (SyncRule(shard, 2, "raise"), AsyncRule(shard, 2, "raise")):
        with pytest.raises(GradientError, match=match):
            rule.commit(0, 0, Push(mutate(grads_of(0, shard)), ALL)).wait()
    assert all(a.equal(b) for a, b in zip(before, shard.flats))
    assert shard.stats.pushes_rejected == 2 and shard.version == 0


def test_async_rejects_a_version_from_the_future_and_tracks_staleness():
    shard, _ = make_shard()
    rule = AsyncRule(shard, 2, "raise")
    with pytest.raises(GradientError, match=r"version 5 .* \(a version from the future\)"):
        rule.commit(0, 5, Push(grads_of(0, shard), ALL)).wait()
    assert rule.commit(0, 0, Push(grads_of(0, shard), ALL)).wait().version == 1
    assert rule.commit(1, 0, Push(grads_of(1, shard), ALL)).wait().version == 2
    assert shard.stats.max_staleness == 1


def test_sync_nan_with_raise_fails_every_waiting_worker_and_keeps_the_parameters():
    shard, _ = make_shard()
    before = [f.clone() for f in shard.flats]
    rule = SyncRule(shard, 2, "raise")
    waiting = rule.commit(0, 0, Push(grads_of(0, shard), ALL))
    bad = grads_of(1, shard)
    bad[0][1] = float("nan")
    with pytest.raises(GradientError, match="from worker 1"):
        rule.commit(1, 0, Push(bad, ALL)).wait()
    with pytest.raises(GradientError, match="from worker 1"):
        waiting.wait()
    assert all(a.equal(b) for a, b in zip(before, shard.flats))


def test_a_cuda_shard_is_refused_without_cuda():
    from gradsync.ps.server import ParameterServer

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="server_device 'cuda' asked for, but this server has no CUDA device"):
        ParameterServer(0, 2, "sync", "raise", device="cuda")


@pytest.mark.parametrize("local_rank,device", [(None, 0), ("2", 2), ("6", 2)])
def test_servers_of_a_machine_spread_over_its_gpus(local_rank, device, monkeypatch):
    """'cuda': the GPU the server's LOCAL_RANK names, modulo the GPUs it sees (4 here); 'cuda:N' that one."""
    from gradsync.ps.server import ParameterServer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert ParameterServer(0, 2, "sync", "raise", device="cuda").device == torch.device("cuda", device)
    assert ParameterServer(0, 2, "sync", "raise", device="cuda:3").device == torch.device("cuda", 3)


@pytest.mark.gpu
@pytest.mark.job  # the shard averages with the Triton kernels, which Triton compiles with ptxas, a process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sync_on_a_cuda_shard_matches_the_cpu_shard():
    cpu, params = make_shard()
    buckets = cpu.buckets
    gpu = ShardState(0, buckets, params, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
                     device="cuda")
    for shard in (cpu, gpu):
        rule = SyncRule(shard, num_workers=3, nonfinite="raise")
        futures = [rule.commit(w, 0, Push(grads_of(w, shard), ALL)) for w in range(3)]
        assert [f.wait().version for f in futures] == [1, 1, 1]
    for a, b in zip(cpu.flats, gpu.flats):
        assert b.device.type == "cuda"
        torch.testing.assert_close(a, b.cpu(), rtol=0, atol=1e-5)


def test_entries_no_worker_sent_are_skipped_and_partly_sent_ones_averaged_over_all_workers():
    shard, params = make_shard()
    shard.optimizer = torch.optim.SGD(list(shard.params.values()), lr=0.5, momentum=0.9, weight_decay=0.1)
    reference = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    ref_opt = torch.optim.SGD(list(reference.values()), lr=0.5, momentum=0.9, weight_decay=0.1)
    (bucket,) = shard.buckets
    index = {e.name: i for i, e in enumerate(bucket.entries)}
    rule = SyncRule(shard, num_workers=2, nonfinite="raise")
    for step, present in enumerate([({"b"}, {"b"}), ({"w", "b"}, {"b"}), (set(), {"w"})]):
        grads = [grads_of(10 * step + w, shard)[0] for w in range(2)]
        absent = [tuple(index[n] for n in index if n not in present[w]) for w in range(2)]
        for g, missing in zip(grads, absent):  # a worker sends zeros where it has no gradient
            for i in missing:
                bucket.entries[i].view(g).zero_()
        futures = [rule.commit(w, step, Push([grads[w]], [absent[w]])) for w in range(2)]
        assert [f.wait().version for f in futures] == [step + 1] * 2
        for name, tensor in reference.items():  # torch.optim skips a .grad of None: weight decay too
            sent = [e.view(g) for g in grads for e in bucket.entries if e.name == name]
            used = [s for s, p in zip(sent, present) if name in p]
            tensor.grad = (sum(used) / 2).clone() if used else None
        ref_opt.step()
        for name, tensor in reference.items():
            assert torch.allclose(shard.params[name], tensor, rtol=0, atol=1e-5), (step, name)
        if step == 0:  # no worker sent w: weight decay and momentum left it exactly as it was
            assert shard.params["w"].equal(params["w"])


def ssp_shard():
    torch.manual_seed(0)
    params = {"w": torch.zeros(2, requires_grad=True)}
    buckets = plan_buckets(ModelSpec.of(params, {}).params, 1, 10**9)
    return ShardState(0, buckets, params, {}, OptimizerSpec.one_group(torch.optim.SGD, {"lr": 1.0}))


def test_ssp_with_staleness_0_is_lock_step_and_averages_over_w():
    shard = ssp_shard()
    rule = SSPRule(shard, num_workers=2, nonfinite="raise", staleness=0)
    first = rule.commit(0, 0, Push([torch.tensor([2.0, 4.0])], ALL))
    assert not first.done() and shard.flats[0].tolist() == [-1.0, -2.0]  # applied at once, scaled by 1/W
    second = rule.commit(1, 0, Push([torch.tensor([4.0, 0.0])], ALL))
    assert (first.wait().snapshot is second.wait().snapshot and first.wait().version == 2
            and shard.flats[0].tolist() == [-3.0, -2.0])
    rule.commit(1, 2, Push([torch.tensor([2.0, 2.0])], ALL))  # applied at once ...
    assert first.wait().snapshot.flats[0].tolist() == [-3.0, -2.0]  # ... but not in the snapshot worker 0 goes on from
    assert shard.stats.staleness_histogram == {0: 2, 1: 1} and shard.stats.max_lead == 0


def test_ssp_holds_a_worker_more_than_k_steps_ahead_until_the_slowest_catches_up():
    shard = ssp_shard()
    rule = SSPRule(shard, num_workers=2, nonfinite="raise", staleness=1)
    g = [torch.ones(2)]
    assert rule.commit(0, 0, Push(g, ALL)).done()  # one step ahead: allowed
    ahead = rule.commit(0, 1, Push(g, ALL))
    assert not ahead.done() and shard.stats.max_lead == 1  # would be two ahead: held
    assert rule.commit(1, 0, Push(g, ALL)).done() and ahead.done()
    held = rule.commit(0, 3, Push(g, ALL))
    assert not held.done()
    rule.worker_left(1, 1)  # the slowest left: nobody waits for it
    assert held.wait().version == 4


def test_staleness_is_only_for_ssp():
    from gradsync.config import ConfigError, JobConfig

    with pytest.raises(ConfigError, match=r"staleness=2: it bounds --mode ssp"):
        JobConfig(strategy="ps", mode="async", servers=1, world_size=2, staleness=2)
    with pytest.raises(ConfigError, match=r"staleness=-1"):
        JobConfig(strategy="ps", mode="ssp", servers=1, world_size=2, staleness=-1)
    with pytest.raises(ConfigError, match=r"allreduce strategy is synchronous"):
        JobConfig(strategy="allreduce", mode="ssp", servers=0, world_size=2)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_every_rule_resolves_to_a_committed_at_the_version_after_the_step(mode):
    """One worker's push is the whole step under every rule: each resolves to a `Committed` at version 1 with
    the shard at one SGD step from the push (ssp with the snapshot it goes on from, which is that state)."""
    shard, params = make_shard()
    before = [f.clone() for f in shard.flats]
    committed = make_rule(mode, shard, 1, "raise").commit(0, 0, Push(grads_of(0, shard), ALL)).wait()
    assert isinstance(committed, Committed) and committed.version == 1 and committed.partial is None
    expected = [f - 0.5 * g for f, g in zip(before, grads_of(0, shard))]  # SGD lr 0.5, first step: no momentum yet
    assert all(torch.equal(f, e) for f, e in zip(shard.flats, expected))
    if mode == "ssp":
        assert committed.snapshot.version == 1 and torch.equal(committed.snapshot.flats[0], expected[0])
    else:
        assert committed.snapshot is None


def test_a_held_sync_step_resolves_to_its_partial_of_the_norm():
    shard, _ = make_shard()
    grads = grads_of(0, shard)
    before = shard.flats[0].clone()
    committed = SyncRule(shard, 1, "raise").commit(0, 0, Push(grads, ALL, agree=Agreement(2.0, False))).wait()
    assert committed.version == 0 and committed.snapshot is None and committed.partial.version == 0
    assert committed.partial.value == pytest.approx(float(grads[0].double().pow(2).sum()), rel=1e-12)
    assert torch.equal(shard.flats[0], before)  # held: nothing applied before the workers finish it
