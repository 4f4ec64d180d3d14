"""The piece size a ps job chooses when bucket_cap_mb is unset: the closed form from the measured bandwidth,
worker 0's choice shared through the store, and torch RPC's measurement itself."""
import math

import pytest
import torch

import gradsync
from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.core.transport_capabilities import capabilities
from gradsync.worker.pipeline.piece_size import (LARGEST_MB, PIECE_CPU_S, SMALLEST_MB, SPLIT_S_PER_BYTE, best_piece_mb,
                                        overhead_s, pipeline_pays, pipelined, step_plan, whole_step_overhead_s)

MB = 2**20


ISSUE = [12288 * 128 * 4, 128 * 4, 128 * 128 * 4, 128 * 4, 128 * 30 * 4, 30 * 4]  # issue 17's MLP, 6.4 MB
REFERENCE = [12288 * 512 * 4, 512 * 4, 512 * 512 * 4, 512 * 4, 512 * 30 * 4, 30 * 4]  # 26 MB, one 25 MB layer
DIGITS = [64 * 128 * 4, 128 * 4, 128 * 128 * 4, 128 * 4, 128 * 10 * 4, 10 * 4]  # examples/digits.py, 104 KB


def test_the_best_piece_balances_the_pipelines_fill_against_the_cpu_per_piece():
    model, bandwidth = sum(ISSUE), 12.5e6  # behind 100 Mbit/s
    chosen = best_piece_mb(ISSUE, servers=1, workers=2, bandwidth=bandwidth)
    assert chosen * MB == pytest.approx(math.sqrt(model * PIECE_CPU_S * bandwidth / 2))
    assert 0.2 < chosen < 0.3
    fill_and_cpu = lambda p: 2 * p / bandwidth + model * PIECE_CPU_S / p  # noqa: E731 (W p / B + M c / (S p))
    assert fill_and_cpu(chosen * MB) < min(fill_and_cpu(chosen * MB * 2), fill_and_cpu(chosen * MB / 2))
    at_1gbit = best_piece_mb(REFERENCE, 2, 2, 125e6)
    assert at_1gbit == pytest.approx(math.sqrt(sum(REFERENCE) * PIECE_CPU_S * 125e6 / 4) / MB) and at_1gbit < 1.5
    assert best_piece_mb(ISSUE, 1, 2, 1e12) == LARGEST_MB and best_piece_mb([1000], 1, 2, 1e6) == SMALLEST_MB
    assert best_piece_mb(REFERENCE, 1, 2, None) == LARGEST_MB  # not measured (gRPC)


def test_on_a_fast_link_a_piece_cuts_no_parameter_when_its_copies_would_cost_more():
    fast = 3e9  # loopback: the balance would cut the 25 MB layer into ~6 MB pieces
    chosen = best_piece_mb(REFERENCE, 1, 2, fast)
    assert chosen * MB == REFERENCE[0]  # the smallest piece that cuts nothing: the largest parameter
    balanced = math.sqrt(sum(REFERENCE) * PIECE_CPU_S * fast / 2)
    assert overhead_s(chosen * MB, REFERENCE, 1, 2, fast) < overhead_s(balanced, REFERENCE, 1, 2, fast)
    assert overhead_s(balanced, REFERENCE, 1, 2, fast) - overhead_s(balanced, REFERENCE[1:], 1, 2, fast) > \
        SPLIT_S_PER_BYTE * REFERENCE[0] * 0.99  # the cut layer's copies are what tips it


def test_a_pipeline_pays_where_a_whole_steps_second_crossing_of_the_busiest_link_costs_more():
    # a whole step: the busiest link's bytes twice in a row; the worker's M, or a server's W M / S
    assert whole_step_overhead_s(ISSUE, 2, 2, 12.5e6) == pytest.approx(sum(ISSUE) / 12.5e6)
    assert whole_step_overhead_s(ISSUE, 1, 4, 12.5e6) == pytest.approx(4 * sum(ISSUE) / 12.5e6)
    assert whole_step_overhead_s(ISSUE, 4, 2, 12.5e6) == pytest.approx(sum(ISSUE) / 12.5e6)
    for sizes, servers, bandwidth, pays in [
        (ISSUE, 2, 12.5e6, True),  # issue 17's workload behind 100 Mbit/s: 0.51 s whole against ~60 ms
        (REFERENCE, 2, 125e6, True),  # the reference workload at 1 Gbit/s
        (DIGITS, 1, 125e6, False),  # 104 KB at 1 Gbit/s: 1.7 ms whole against ~3 ms of pieces
        (DIGITS, 1, 12.5e6, True),  # the same behind 100 Mbit/s: 17 ms whole
        (REFERENCE, 2, 1e9, False),  # at 8 Gbit/s the cut 25 MB layer's copies cost more than the overlap saves
    ]:
        piece = best_piece_mb(sizes, servers, 2, bandwidth) * MB
        expected = overhead_s(piece, sizes, servers, 2, bandwidth) < whole_step_overhead_s(sizes, servers, 2, bandwidth)
        assert pipeline_pays(piece, sizes, servers, 2, bandwidth) is expected is pays, (sum(sizes), bandwidth)


def test_worker_0_plans_and_every_other_worker_takes_its_plan(store):
    measured = []
    measure = lambda: measured.append(1) or 12.5e6  # noqa: E731
    first = JobConfig(strategy="ps", servers=1, world_size=3, rank=1)
    second = JobConfig(strategy="ps", servers=1, world_size=3, rank=2)
    chosen = step_plan(first, store, ISSUE, measure, True)
    assert chosen == (best_piece_mb(ISSUE, 1, 2, 12.5e6), True) and measured == [1]
    assert step_plan(second, store, ISSUE, lambda: pytest.fail("only worker 0 measures"), True) == chosen
    given = JobConfig(strategy="ps", servers=1, world_size=3, rank=2, bucket_cap_mb=3.0)
    assert step_plan(given, store, ISSUE, lambda: pytest.fail("a set value is not measured"), True) == (3.0, True)


@pytest.mark.parametrize("host,setting,plan", [
    ("10.99.0.1", "auto", (LARGEST_MB, False)),  # behind a link: whole steps, the largest buckets
    ("127.0.0.1", "auto", None),  # on loopback the link is the CPUs: pieces (BENCHMARKS.md, "Piece sizes")
    ("10.99.0.1", "on", None),  # asked for
])
def test_a_small_model_behind_a_fast_link_goes_whole_unless_asked(store, host, setting, plan):
    first = JobConfig(strategy="ps", servers=1, world_size=3, rank=1, master_addr=host, pipeline=setting)
    second = JobConfig(strategy="ps", servers=1, world_size=3, rank=2, master_addr=host, pipeline=setting)
    expected = plan or (best_piece_mb(DIGITS, 1, 2, 125e6), True)
    assert step_plan(first, store, DIGITS, lambda: 125e6, True) == expected
    assert step_plan(second, store, DIGITS, lambda: pytest.fail("only worker 0 measures"), True) == expected
    # a plan that is not a pipeline (gRPC on loopback, or off) stays one, and measures nothing
    store.delete_key(StoreKeys.PIECE_MB)
    assert step_plan(first, store, ISSUE, lambda: None, False) == (LARGEST_MB, False)


def _measured(name: str) -> tuple[float, int, float]:
    from gradsync.runtime.cluster import current
    from gradsync.transport.registry import transport

    trainer = gradsync.Trainer(torch.nn.Linear(300, 300), torch.optim.SGD, lr=0.1)
    bandwidth = transport(name).worker.bandwidth(current().config, current().store)
    chosen = float(current().store.get(StoreKeys.PIECE_MB).decode())
    return bandwidth, trainer._strategy.model_sizes(0)["largest_piece"], chosen


@pytest.mark.job
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["rpc", "grpc"])
def test_each_transport_measures_a_bandwidth_and_the_plan_follows_it(launch, name):
    (bandwidth, piece, chosen), = launch(_measured, strategy="ps", workers=1, servers=2, timeout=50,
                                         args=(name,), transport=name, pipeline="on")
    assert 1e6 < bandwidth < 1e12  # loopback: between 1 MB/s and 1 TB/s
    model = 300 * 300 + 300
    # the plan follows the choice: 2 servers share the model; pieces of at most the chosen size
    assert min(model // 2, int(chosen * 2**20) // 4) == piece


@pytest.mark.parametrize("setting,transport,host,expected", [
    ("auto", "rpc", "127.0.0.1", True), ("auto", "grpc", "127.0.0.1", False), ("auto", "grpc", "localhost", False),
    ("auto", "grpc", "10.99.0.1", True), ("on", "grpc", "127.0.0.1", True), ("off", "rpc", "10.99.0.1", False),
])
def test_a_sync_step_is_a_pipeline_except_over_grpc_on_one_machine(setting, transport, host, expected):
    """On loopback gRPC's pipeline threads cost more than its overlap saves (BENCHMARKS.md, "gRPC against torch
    RPC"), torch RPC's not; across machines, or behind an emulated link (the store on the hub's address), both
    pipeline."""
    config = JobConfig(strategy="ps", servers=1, world_size=2, master_addr=host, transport=transport,
                       pipeline=setting)
    assert pipelined(config, capabilities(transport)) is expected


def test_the_window_holds_a_quarter_mb_per_worker_and_two_pieces_at_least():
    """Unanswered bytes per server grow with W: at W = 4, 0.25 MB per server left a 100mbit server link idle
    (BENCHMARKS.md, "The window of unanswered pieces")."""
    from types import SimpleNamespace

    from gradsync.transport.base import IN_FLIGHT_MB, window

    pieces = lambda nbytes: {0: [SimpleNamespace(nbytes=nbytes)] * 40}  # noqa: E731
    assert window(pieces(MB // 8), 2) == math.ceil(2 * IN_FLIGHT_MB * 8) == 4  # 0.5 MB of 1/8 MB pieces
    assert window(pieces(MB // 8), 4) == 8 and window(pieces(MB // 8), 8) == 16
    assert window(pieces(25 * MB), 4) == 2  # whole large parameters: two in flight
