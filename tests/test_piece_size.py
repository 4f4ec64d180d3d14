"""The piece size a ps job chooses when bucket_cap_mb is unset: the closed form from the measured bandwidth,
worker 0's choice shared through the store, and torch RPC's measurement itself."""
import math

import pytest
import torch

import gradsync
from gradsync.config import JobConfig
from gradsync.worker.piece_size import LARGEST_MB, PIECE_CPU_S, SMALLEST_MB, best_piece_mb, piece_mb

MB = 2**20


def test_the_best_piece_balances_the_pipelines_fill_against_the_cpu_per_piece():
    model, bandwidth = 6.4e6, 12.5e6  # issue 17's workload behind 100 Mbit/s
    chosen = best_piece_mb(int(model), servers=1, workers=2, bandwidth=bandwidth)
    assert chosen * MB == pytest.approx(math.sqrt(model * PIECE_CPU_S * bandwidth / 2))
    assert 0.2 < chosen < 0.3
    step = lambda p: 2 * p / bandwidth + model * PIECE_CPU_S / p  # noqa: E731 (W p / B + M c / (S p))
    assert step(chosen * MB) < min(step(chosen * MB * 2), step(chosen * MB / 2))
    assert best_piece_mb(26 * MB, 2, 2, 125e6) == pytest.approx(math.sqrt(26 * MB * PIECE_CPU_S * 125e6 / 4) / MB)
    assert best_piece_mb(26 * MB, 1, 2, 1e12) == LARGEST_MB and best_piece_mb(1000, 1, 2, 1e6) == SMALLEST_MB
    assert best_piece_mb(26 * MB, 1, 2, None) == LARGEST_MB  # not measured (gRPC)


def test_worker_0_chooses_and_every_other_worker_takes_its_choice(store):
    measured = []
    measure = lambda: measured.append(1) or 12.5e6  # noqa: E731
    first = JobConfig(strategy="ps", servers=1, world_size=3, rank=1)
    second = JobConfig(strategy="ps", servers=1, world_size=3, rank=2)
    chosen = piece_mb(first, store, int(6.4e6), measure)
    assert chosen == best_piece_mb(int(6.4e6), 1, 2, 12.5e6) and measured == [1]
    assert piece_mb(second, store, int(6.4e6), lambda: pytest.fail("only worker 0 measures")) == chosen
    given = JobConfig(strategy="ps", servers=1, world_size=3, rank=2, bucket_cap_mb=3.0)
    assert piece_mb(given, store, int(6.4e6), lambda: pytest.fail("a set value is not measured")) == 3.0


def _measured() -> tuple[float, int]:
    from gradsync.runtime.cluster import current
    from gradsync.transport.rpc import RpcTransport

    trainer = gradsync.Trainer(torch.nn.Linear(300, 300), torch.optim.SGD, lr=0.1)
    return RpcTransport.bandwidth(current().config), trainer._strategy.model_sizes(0)["largest_piece"]


@pytest.mark.timeout(60)
def test_torch_rpc_measures_a_bandwidth_and_the_plan_follows_it():
    (bandwidth, piece), = gradsync.launch(_measured, strategy="ps", workers=1, servers=2, timeout=50)
    assert 1e6 < bandwidth < 1e12  # loopback: between 1 MB/s and 1 TB/s
    assert piece == (300 * 300 + 300) // 2  # the model's 361 KB is below any piece chosen: one bucket per server
