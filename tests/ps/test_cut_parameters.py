"""A parameter larger than `bucket_cap_mb`, cut into pieces, in every mode, over both transports and one or two
servers: with one worker every mode is single-process training; with two, async and ssp apply every push.

The pieces are 0.25 MB, so that a worker keeps at most 2 of them unanswered per server (`transport.base.window`)
while a server holds 3 or more of its buckets: the case where async and ssp jobs hung at their first step (a
staged piece was answered only once its push was whole, and the push waited for the pieces behind it)."""
import pytest
import torch

import gradsync
from elastic_jobs import GRAD, LR, Constant, train_constant_and_stats
from gradsync.core.buckets import ModelSpec, by_server, plan_buckets
from gradsync.transport.base import window
from helpers import max_diff
from jobs import make_mlp, reference_mlp, train_mlp_and_stats

CAP_MB = 0.25
WIDE = 512  # the MLP's hidden width: its 512 x 512 weight (1 MB) is cut into 4 pieces
SIZE = 8 * 2**16  # Constant's elements (2 MB): 4 pieces on each of two servers
STEPS = 6
ONE_WORKER = [("sync", 1, "rpc"), ("sync", 2, "grpc"), ("async", 1, "rpc"), ("async", 2, "rpc"), ("async", 1, "grpc"),
              ("ssp", 1, "grpc"), ("ssp", 2, "rpc")]
"""Every pair of mode, number of servers and transport once (pairwise), and async over torch RPC, where the hang
was, with one server and with two."""


def _buckets(model: torch.nn.Module, servers: int) -> dict[int, list]:
    spec = ModelSpec.of(dict(model.named_parameters()), {})
    return by_server(plan_buckets(spec.params, servers, int(CAP_MB * 2**20), split=True), servers)


@pytest.mark.parametrize("model,workers", [(lambda: make_mlp(hidden=WIDE), 1), (lambda: Constant(SIZE), 2)])
@pytest.mark.parametrize("servers", [1, 2])
def test_each_server_holds_more_pieces_of_a_cut_parameter_than_a_worker_keeps_unanswered(model, workers, servers):
    buckets = _buckets(model(), servers)
    cut = [b for per in buckets.values() for b in per if not b.entries[0].whole]
    assert len({b.entries[0].name for b in cut}) == 1 and all(len(b.entries) == 1 for b in cut)
    assert all(len(per) > window(buckets, workers) == 2 for per in buckets.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,servers,transport", ONE_WORKER)
def test_one_worker_with_a_cut_parameter_trains_as_a_single_process(launch, mode, servers, transport):
    state, stats = launch(train_mlp_and_stats, strategy="ps", mode=mode, workers=1, servers=servers,
                          transport=transport, args=(STEPS, 0.1, 0.9, 0.0, WIDE), bucket_cap_mb=CAP_MB,
                          step_timeout=30)[0]
    assert max_diff(state, reference_mlp(STEPS, 1, momentum=0.9, hidden=WIDE)) <= 1e-5
    if mode != "sync":  # every push applied whole on every server
        assert [s["pushes_by_worker"] for s in stats.values()] == [{0: STEPS}] * servers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("transport", ["rpc", "grpc"])
def test_two_workers_with_a_cut_parameter_have_every_push_applied(launch, mode, transport):
    """`Constant`: every push moves each weight by -LR * GRAD (ssp: by half that, at W = 2), so the weights
    say how many pushes each server applied, element by element."""
    results = launch(train_constant_and_stats, strategy="ps", mode=mode, workers=2, servers=2, transport=transport,
                     args=(STEPS, SIZE), bucket_cap_mb=CAP_MB, step_timeout=30)
    for state, stats in results:
        assert [s["pushes_by_worker"] for s in stats.values()] == [{0: STEPS, 1: STEPS}] * 2
        per_push = -LR * GRAD * (0.5 if mode == "ssp" else 1.0)
        assert torch.equal(state["w"], torch.full((SIZE,), per_push * 2 * STEPS))
