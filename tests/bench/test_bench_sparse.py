"""bench/sparse.py: the cost model's prediction beside a sharded row (fitted on the W = 2 rows only), and a smoke
run at its tiny size (the TorchRec rows say "not installed" where torchrec does not import, as in CI)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import ROOT

BENCH = pathlib.Path(ROOT) / "bench"
sys.path.insert(0, str(BENCH))
import sparse as bench  # noqa: E402

from gradsync.compare import costmodel  # noqa: E402


def _row(config: str, workers: int, step_s: float) -> dict:
    return dict(rows=10**5, workers=workers, config=config, step_s=step_s, touched_rows=350.0)


def test_prediction_beside_sharded_rows_is_fitted_on_the_w2_rows_only():
    truth = costmodel.Fit(compute_s_per_sample=2e-5, s_per_byte=3e-9, latency_s=4e-4, runs=(), residuals=())
    step = lambda config, w: truth.step_s(bench.costmodel_config(_row(config, w, 1.0), 4), w, cores=2)  # noqa: E731
    rows = [_row(c, 2, step(c, 2)) for c in ("allreduce-sparse", "ps", "hybrid", "sharded")]
    rows += [_row("sharded", 4, 2 * step("sharded", 4)),  # measured twice as slow as the model: not fitted
             _row("torchrec-tw", 2, 0.5), dict(rows=10**6, workers=2, config="sharded", step_s=0.1, touched_rows=1.0)]
    bench.predict(rows, fields=4, cores=2)
    fitted, at_4, torchrec, alone = rows[3], rows[4], rows[5], rows[6]
    assert fitted["predicted_step_s"] == pytest.approx(fitted["step_s"], rel=1e-6)
    assert fitted["predicted"] == "fitted here"
    assert at_4["predicted_step_s"] == pytest.approx(step("sharded", 4), rel=1e-6)
    assert at_4["predicted_vs_measured"] == pytest.approx(0.5, rel=1e-6)
    assert at_4["predicted"] == "predicted from W = 2"
    assert "predicted" not in torchrec and "predicted" not in rows[0]
    assert alone["predicted"].startswith("no fit: ")  # one W = 2 run at 10^6 rows


@pytest.mark.job
@pytest.mark.timeout(300)
def test_sparse_bench_runs_sharded_beside_hybrid_and_allreduce(tmp_path):
    out = tmp_path / "sparse.json"
    configs = ["allreduce-sparse", "hybrid", "sharded", "torchrec-tw", "torchrec-rw"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "sparse.py"), "--rows", "10000", "--workers", "2", "--configs", *configs,
         "--optimizer", "sgd", "--ids", "flat", "--steps", "2", "--warmup", "1", "--repeats", "1", "--timeout", "240",
         "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["results"]}
    assert list(rows) == configs and result["ids"] == "flat"
    for config in ("allreduce-sparse", "hybrid", "sharded"):
        assert result["parity_check"][config] <= 1e-5, (config, result["parity_check"])
        assert rows[config]["step_s"] > 0 and rows[config]["cpu_s_per_step"] > 0
    sharded, hybrid = rows["sharded"], rows["hybrid"]
    assert sharded["server_peak_rss"] == 0 and hybrid["server_peak_rss"] > 0
    # flat ids: each worker's 512 x 4 lookups touch ~2,000 distinct rows of 10^4, about half owned by the other
    assert 1500 < sharded["touched_rows"] <= 2048
    # gradsync's counters: each of worker 0's ~1,000 ids owned by worker 1 goes out (8 bytes), its row comes back
    # and its gradient goes to the owner at the step (4 x 32 each), beside the MLP's ring
    assert sharded["busiest_link_bytes_per_step"] >= sharded["bytes_per_step"] > 1000 * (8 + 2 * 4 * 32)
    assert sharded["predicted"] == "fitted here" and sharded["predicted_step_s"] > 0
    for config in ("torchrec-tw", "torchrec-rw"):
        try:
            import torchrec  # noqa: F401
        except ImportError:
            assert rows[config]["skipped"].startswith("not installed"), rows[config]
        else:
            assert result["parity_check"][config] <= 1e-5 and rows[config]["step_s"] > 0
    assert "| sharded (RowSGD) |" in done.stdout
