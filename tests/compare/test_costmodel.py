"""gradsync.compare.costmodel: the traffic formulas, the fit, crossover and verdict, against closed-form values."""
import dataclasses

import numpy as np
import pytest

from gradsync.compare.costmodel import (Config, Fit, Run, confidence, contention, crossover, fit, latency_per_step,
                                link_crossover, table_crossover, traffic, verdict, wire_bytes)
from gradsync.tables.row_partition import LOOKUPS_PER_EXCHANGE

TRUE = Fit(compute_s_per_sample=1e-3, s_per_byte=1e-8, latency_s=1e-4, runs=(), residuals=())
SYNTHETIC = {  # (config, W): (bytes through the busiest link, messages), worked out by hand below
    ("allreduce", 2): (400_000, 2),  # a ring: 2 (W-1)/W x 400 KB, 2 (W-1) messages
    ("allreduce", 4): (600_000, 6),
    ("allreduce", 8): (700_000, 14),
    # 2 servers, pieces of 10^4 elements: the server link pulls W/2 x 20 KB of rows, then takes W/2 x (400 KB
    # of gradients + 20 KB of rows) in while W/2 x 400 KB of weights go out, and W x 40 KB (every worker's
    # part of the first piece) before any reply
    ("ps", 2): (20_000 + 420_000 + 80_000, 4),
    ("ps", 4): (2 * (20_000 + 420_000) + 160_000, 4),
    ("ps", 8): (4 * (20_000 + 420_000) + 320_000, 4),
    # the ring, and through the one server W x 20 KB of rows pulled, then as much pushed
    ("hybrid", 2): (400_000 + 80_000, 6),
    ("hybrid", 4): (600_000 + 160_000, 10),
    ("hybrid", 8): (700_000 + 320_000, 18),
}


def synthetic_config(strategy: str, batch: int) -> Config:
    return {"allreduce": Config("allreduce", batch, dense=100_000),
            "ps": Config("ps", batch, dense=100_000, row_bytes=20_000, servers=2, piece=10_000),
            "hybrid": Config("hybrid", batch, dense=100_000, row_bytes=20_000, servers=1)}[strategy]


def synthetic_runs(noise: float = 0.0) -> list[Run]:
    """Runs whose step times are TRUE's parameters on the hand-worked bytes and messages of SYNTHETIC (not the
    model's own formulas): two batches, W = 2, 4, 8, allreduce, ps and hybrid, ps with a compute split."""
    rng = np.random.default_rng(0)
    runs = []
    for batch in (16, 64):
        for (strategy, workers), (nbytes, messages) in SYNTHETIC.items():
            jitter = 1 + noise * rng.uniform(-1, 1)
            compute = TRUE.compute_s_per_sample * batch
            step = compute + TRUE.s_per_byte * nbytes + TRUE.latency_s * messages
            runs.append(Run(synthetic_config(strategy, batch), workers, step * jitter,
                            compute_s=compute if strategy == "ps" else None))
    return runs


def test_synthetic_runs_traffic_is_the_hand_worked_one():
    for (strategy, workers), expected in SYNTHETIC.items():
        assert traffic(synthetic_config(strategy, 1), workers) == expected, (strategy, workers)


def test_wire_bytes():
    assert wire_bytes(1000, "none") == 4000
    assert wire_bytes(1000, "fp16") == wire_bytes(1000, "bf16") == 2000
    assert wire_bytes(1000, "int8") == 1000 + 4 * 4  # ceil(1000 / 256) = 4 scales
    assert wire_bytes(512, "int8") == 512 + 4 * 2


def test_traffic_formulas():
    assert traffic(Config("allreduce", 1, dense=1000), 4) == (2 * 3 / 4 * 4000, 6)
    assert traffic(Config("allreduce", 1, dense=1000, compression="fp16"), 4) == (2 * 3 / 4 * 2000, 6)
    assert traffic(Config("allreduce", 1, dense=1000, tables=1000), 2) == (8000, 2)
    assert traffic(Config("allreduce", 1, dense=1000, compression="int8"), 4) == (3 * 1016, 3)  # all-gather
    assert traffic(Config("allreduce", 1, dense=1000), 1) == (0, 0)
    # ps, one piece per server: rows in, then the piece's gradients in before its weights go out (4 workers
    # per server: 4 x 500 rows, 4 x (4000 + 1000 rows) pushed, 4 x 4000 sent back)
    assert traffic(Config("ps", 1, dense=1000, row_bytes=500, servers=2), 8) == (4 * (4000 + 4000 + 1000), 4)
    assert traffic(Config("ps", 1, dense=1000, servers=1), 2) == (2 * 8000, 2)
    assert traffic(Config("ps", 1, dense=1000, servers=1, compression="int8"), 8) == (8 * (1016 + 4000), 2)
    # more servers than workers: a worker's own link is the busiest, 500 rows in, 4500 out while 4000 come back,
    # and its first piece (63 elements of 1000 / 16, 252 bytes) out before any comes back
    assert traffic(Config("ps", 1, dense=1000, row_bytes=500, servers=16), 8) == (500 + 4500 + 252, 4)
    assert traffic(Config("hybrid", 1, dense=1000, row_bytes=500, servers=2), 4) == (6000 + 2 * 2 * 500, 10)
    assert traffic(Config("hybrid", 1, dense=1000, row_bytes=500, servers=2, compression="int8"), 4) == (
        3 * 1016 + 2 * 2 * 500, 7)


def test_sparse_allreduce_is_an_allgather_of_the_rows_growing_with_w():
    # 1000 dense elements, 4 sparse tables of 10^6 elements (free on the wire), 540 bytes of touched rows
    # (with their indices)
    sparse = Config("allreduce", 1, dense=1000, tables=4 * 10**6, row_bytes=540, sparse_tables=4)
    assert traffic(sparse, 4) == (2 * 3 / 4 * 4000 + 3 * 540, 6 + 3 * 3 * 4)
    assert traffic(sparse, 8) == (2 * 7 / 8 * 4000 + 7 * 540, 14 + 3 * 7 * 4)
    assert traffic(sparse, 1) == (0, 0)
    # a ps with S servers serving the same rows without their indices (500 bytes), no dense part: its
    # busiest link carries max(W / S, 1) x 2 x 500 (rows pulled, gradients pushed)
    rows_only = dataclasses.replace(sparse, dense=0)
    ps = {s: Config("ps", 1, dense=0, row_bytes=500, servers=s) for s in (1, 2, 3)}
    assert [traffic(rows_only, w)[0] for w in (2, 4, 8)] == [540, 1620, 3780]  # (W - 1) x 540
    assert [traffic(ps[2], w)[0] for w in (2, 4, 8)] == [1000, 2000, 4000]  # W / 2 x 1000
    # bytes alone (1 s per byte, no latency): ps at S = 1 never overtakes sparse allreduce (W x 1000 against
    # (W - 1) x 540); at S = 2 from W = 14 ((W - 1) 540 > 500 W for W > 13.5); at S = 3 from W = 3
    line = Fit(compute_s_per_sample=1e-3, s_per_byte=1.0, latency_s=0.0, runs=(), residuals=())
    assert crossover(line, rows_only, ps[1], link=1.0) is None
    assert crossover(line, rows_only, ps[2], link=1.0) == 14
    assert crossover(line, rows_only, ps[3], link=1.0) == 3
    with pytest.raises(ValueError, match="sparse_tables=2 is an allreduce setting"):
        Config("ps", 1, dense=10, servers=1, sparse_tables=2)


def test_a_pipelined_ps_step_is_bounded_by_its_busiest_direction_plus_one_piece():
    # S = 1, fp32, P equal pieces of p = e / P: pushes a = W 4 p and replies b = W 4 p per piece through the
    # server's link; the pipeline (a two-stage flow shop) ends after P a + b: W 4 (e + p)
    for pieces in (1, 2, 10, 1000):
        config = Config("ps", 1, dense=1000, servers=1, piece=1000 // pieces)
        assert traffic(config, 4)[0] == 4 * 4 * (1000 + 1000 // pieces)
    # fp16 pushes (2 bytes) are the short stage: replies W 4 e, after the first piece's pushes W 2 p
    assert traffic(Config("ps", 1, dense=1000, servers=1, compression="fp16", piece=100), 4)[0] == 4 * (4000 + 200)
    # no piece given: the whole shard is one, push then reply
    assert traffic(Config("ps", 1, dense=1000, servers=2), 4)[0] == 2 * 8000
    with pytest.raises(ValueError, match="piece=-1"):
        Config("ps", 1, dense=10, servers=1, piece=-1)


def test_step_time():
    ring = Config("allreduce", 32, dense=1000)
    assert TRUE.step_s(ring, 4) == pytest.approx(0.032 + 6000e-8 + 6e-4, rel=1e-12)
    assert TRUE.step_s(ring, 4, link=1e9) == pytest.approx(0.032 + 6000e-9 + 6e-4, rel=1e-12)
    assert TRUE.throughput(ring, 4) == pytest.approx(4 * 32 / (0.032 + 6000e-8 + 6e-4), rel=1e-12)


def test_async_is_the_slower_of_worker_and_server():
    config = Config("ps", 32, dense=1000, servers=1, mode="async")
    assert TRUE.step_s(config, 8) == pytest.approx(0.032 + 8000e-8 + 2e-4, rel=1e-12)  # worker-bound: push, reply
    assert TRUE.step_s(config, 8, link=1e3) == pytest.approx(8 * 4000 / 1e3, rel=1e-12)  # server-bound: overlapped


def test_fit_recovers_exact_parameters():
    got = fit(synthetic_runs())
    for name in ("compute_s_per_sample", "s_per_byte", "latency_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-9)
    assert got.max_rel_error < 1e-9


def test_fit_with_noise_stays_close():
    got = fit(synthetic_runs(noise=0.01))
    assert got.compute_s_per_sample == pytest.approx(TRUE.compute_s_per_sample, rel=0.02)
    assert got.s_per_byte == pytest.approx(TRUE.s_per_byte, rel=0.1)
    assert got.latency_s == pytest.approx(TRUE.latency_s, rel=0.5)
    assert 0 < got.max_rel_error < 0.02


def test_fit_refuses_unidentifiable_runs():
    config = Config("allreduce", 32, dense=1000)
    with pytest.raises(ValueError, match="cannot separate"):
        fit([Run(config, 4, 0.1), Run(config, 4, 0.11), Run(config, 4, 0.09)])
    with pytest.raises(ValueError, match="cannot separate"):  # one W: messages follow the batch
        fit([Run(Config("allreduce", 32, dense=d), 2, 0.1) for d in (10, 100, 1000)])


def test_fit_refuses_async_mixed_links_and_nothing():
    runs = synthetic_runs()
    with pytest.raises(ValueError, match="sync runs only"):
        fit(runs + [Run(Config("ps", 8, dense=10, servers=1, mode="async"), 2, 0.1)])
    with pytest.raises(ValueError, match="one link at a time"):
        fit(runs + [Run(runs[0].config, 2, 0.1, link=1e9)])
    with pytest.raises(ValueError, match="no runs"):
        fit([])


def test_sharded_is_the_dense_ring_and_two_all_to_alls_of_the_rows_not_growing_with_w():
    # 1000 dense elements, 2 tables split across the workers, 500 bytes of rows looked up per worker and step
    sharded = Config("sharded", 1, dense=1000, tables=4 * 10**6, row_bytes=500, sharded_tables=2)
    assert traffic(sharded, 4) == (2 * 3 / 4 * 4000 + 2 * 3 / 4 * 500, 6 + 2 + 3)  # both lookups in one exchange
    assert traffic(sharded, 8) == (2 * 7 / 8 * 4000 + 2 * 7 / 8 * 500, 14 + 2 + 3)
    assert traffic(sharded, 1) == (0, 2 + 3)  # one worker owns every row: nothing crosses a link
    many = dataclasses.replace(sharded, sharded_tables=LOOKUPS_PER_EXCHANGE + 1)  # two exchanges of lookups
    assert traffic(many, 4)[1] == 6 + 2 * 2 + 3
    rows_only = dataclasses.replace(sharded, dense=0)
    sparse = Config("allreduce", 1, dense=0, tables=4 * 10**6, row_bytes=500, sparse_tables=2)
    assert [traffic(rows_only, w)[0] for w in (2, 4, 8)] == [500, 750, 875]  # below 2 x 500 at any W
    assert [traffic(sparse, w)[0] for w in (2, 4, 8)] == [500, 1500, 3500]  # the all-gather grows with W
    with pytest.raises(ValueError, match="sharded_tables=2 is a sharded setting"):
        Config("hybrid", 1, dense=10, servers=1, sharded_tables=2)
    with pytest.raises(ValueError, match="strategy='sharded' has no servers, got servers=1"):
        Config("sharded", 1, dense=10, servers=1)


def test_config_errors_name_the_value_and_fix():
    with pytest.raises(ValueError, match="mode='ssp' is not modelled.*mode='sync' and mode='async'"):
        Config("ps", 8, dense=10, servers=1, mode="ssp")
    with pytest.raises(ValueError, match="needs servers >= 1, got servers=0"):
        Config("hybrid", 8, dense=10)
    with pytest.raises(ValueError, match="compression='zip'"):
        Config("allreduce", 8, dense=10, compression="zip")
    with pytest.raises(ValueError, match="step_s=0"):
        Run(Config("allreduce", 8, dense=10), 2, 0)


# 1 GB/s, no latency: allreduce of 1e6 table elements moves 8e6 (W-1)/W bytes, ps W x 1e6 bytes of rows
# (0.5e6 pulled, 0.5e6 pushed): ps is faster up to W = 6 (6e6 < 6.67e6); at W = 7 allreduce is (6.86e6 < 7e6).
RING = Config("allreduce", 10, dense=0, tables=1_000_000)
PS = Config("ps", 10, dense=0, row_bytes=500_000, servers=1)
LINE = Fit(compute_s_per_sample=1e-3, s_per_byte=0.0, latency_s=0.0, runs=(), residuals=())


def test_crossover():
    assert crossover(LINE, PS, RING, link=1e9) == 7
    assert crossover(LINE, RING, PS, link=1e9) == 7
    assert crossover(LINE, RING, Config("allreduce", 10, dense=0, tables=2_000_000), link=1e9) is None


def test_table_crossover():
    # W = 4: allreduce 0.01 + 6e-9 t s per step against ps's 0.014: ps is ahead from t > 666,666.7 elements
    assert table_crossover(LINE, RING, PS, workers=4, link=1e9) == 666_667
    assert table_crossover(LINE, PS, RING, workers=4, link=1e9) == 666_667
    assert table_crossover(LINE, PS, PS, workers=4, link=1e9) is None


def test_verdict():
    calibrated = fit(synthetic_runs())
    line = Fit(1e-3, 0.0, 0.0, runs=calibrated.runs, residuals=calibrated.residuals)
    text = verdict(line, {"allreduce": RING, "ps": PS}, workers=4, link=1e9)
    # ps: 0.01 + 4e6 / 1e9 = 0.014 s per step, 4 x 10 / 0.014 = 2857 samples/s; allreduce 0.016 s
    assert text.startswith("At W = 4 on a link of 8 Gbit/s, ps wins: 2,857 samples/s, 1.14x allreduce. "
                           "The crossover is at W = 7: ps is faster below it, allreduce from there on. "
                           "Confidence is high: the model reproduces its 18 fitted runs within 0%")
    assert text.endswith("Fitted at W = 2, 4, 8; anything else is an extrapolation.")
    with pytest.raises(ValueError, match="give at least 2"):
        verdict(line, {"ps": PS}, workers=4)


def test_confidence_flags_exact_and_negative_fits():
    runs = tuple(synthetic_runs()[i] for i in (0, 6, 1))  # allreduce, hybrid, allreduce: no compute split
    text = verdict(Fit(1e-3, -1e-9, 0.0, runs=runs, residuals=(0.0,) * 3), {"a": RING, "b": PS}, workers=4)
    assert "exactly determined by 3 measurements (3 runs' step times, 0 compute splits)" in text
    assert "cost per byte came out negative" in text


def test_confidence_is_one_grade_the_lowest_that_any_reason_allows():
    exact = fit(synthetic_runs())  # residuals within 0%: high on its own
    assert confidence(exact).startswith("Confidence is high: the model reproduces its 18 fitted runs within 0%")
    text = confidence(exact, [("moderate", "reason one"), ("low", "reason two")])
    assert text.startswith("Confidence is low: the model reproduces its 18 fitted runs within 0% (max relative "
                           "error); reason one; reason two. Fitted at W = 2, 4, 8")
    assert confidence(exact, [("moderate", "one")]).startswith("Confidence is moderate: ")
    assert text.count("onfidence") == 1


def test_link_crossover():
    # W = 4: allreduce 6000 bytes, 6 messages; ps with 4 servers 8000 bytes, 2 messages. Constant parts
    # 0.0106 and 0.0102 s: equal at 2e-7 s per byte (4e-4 / 2000), a 5 MB/s link
    ring, ps = Config("allreduce", 10, dense=1000), Config("ps", 10, dense=1000, servers=4)
    assert link_crossover(TRUE, ring, ps, 4) == pytest.approx(5e6, rel=1e-9)
    assert link_crossover(TRUE, ps, ring, 4) == pytest.approx(5e6, rel=1e-9)
    assert TRUE.throughput(ps, 4, link=1e7) > TRUE.throughput(ring, 4, link=1e7)  # ps on faster links
    assert TRUE.throughput(ring, 4, link=1e6) > TRUE.throughput(ps, 4, link=1e6)
    assert link_crossover(TRUE, ring, Config("allreduce", 10, dense=2000), 4) is None  # ring leads at any rate
    with pytest.raises(ValueError, match="sync configs"):
        link_crossover(TRUE, ring, Config("ps", 10, dense=1000, servers=1, mode="async"), 4)


def test_fit_holds_a_negative_parameter_at_zero():
    # runs made with a negative latency: a plain least-squares fit would return it and predict negative steps
    made = Fit(compute_s_per_sample=1e-3, s_per_byte=1e-8, latency_s=-2e-4, runs=(), residuals=())
    runs = [Run(config, w, made.step_s(config, w)) for config in (Config("allreduce", 16, dense=100_000),
                                                                  Config("ps", 64, dense=50_000, servers=1))
            for w in (2, 4, 8)]
    got = fit(runs)
    assert got.latency_s == 0 and got.pinned == ("latency per message",)
    assert got.compute_s_per_sample > 0 and got.s_per_byte > 0
    assert "held the latency per message at zero" in verdict(got, {"a": RING, "b": PS}, workers=4)
    assert fit(synthetic_runs()).pinned == ()


def test_fit_divides_out_time_sliced_compute():
    # W workers on 2 cores: compute takes W / 2 times as long from W = 3 on; the fit recovers a worker's own
    runs = []
    for run in synthetic_runs():
        config, w = run.config, run.workers
        compute = TRUE.compute_s_per_sample * config.batch * contention(w, 2) if run.compute_s else None
        runs.append(Run(config, w, TRUE.step_s(config, w, cores=2), compute_s=compute, cores=2))
    got = fit(runs)
    assert got.compute_s_per_sample == pytest.approx(TRUE.compute_s_per_sample, rel=1e-9)
    assert got.max_rel_error < 1e-9
    assert contention(8, 2) == 4 and contention(2, 2) == contention(8, None) == 1
    config = Config("allreduce", 32, dense=1000)
    assert TRUE.step_s(config, 8, cores=2) - TRUE.step_s(config, 8) == pytest.approx(3 * 0.032, rel=1e-9)


def test_latency_per_step_is_the_same_fit_with_a_fixed_cost_that_w_does_not_multiply():
    one_w = tuple(Run(c, 2, TRUE.step_s(c, 2)) for c in (RING, Config("ps", 10, dense=1000, servers=1)))  # 2 each
    fixed = latency_per_step(Fit(1e-3, 1e-8, 1e-4, runs=one_w, residuals=(0.0, 0.0)))
    assert (fixed.latency_s, fixed.step_overhead_s) == (0.0, pytest.approx(2e-4, rel=1e-12))
    assert fixed.step_s(RING, 2) == pytest.approx(TRUE.step_s(RING, 2), rel=1e-12)  # the fitted runs agree
    assert fixed.step_s(RING, 8) == pytest.approx(TRUE.step_s(RING, 8) - 12e-4, rel=1e-12)  # 2, not 14 messages
    with pytest.raises(ValueError, match=r"exchanged \[2, 6\] messages per step"):
        latency_per_step(Fit(1e-3, 1e-8, 1e-4, runs=(one_w[0], Run(RING, 4, 0.1)), residuals=(0.0, 0.0)))
