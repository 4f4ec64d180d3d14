"""Smoke test of bench/dynamic.py: every part at a tiny size (speed under ps only; torchrec where it imports),
one run; the JSON has each part's figures, and the ones that do not depend on timing hold exactly."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.job  # memory and speed start jobs

CAPACITY, BATCH, WORKERS, LOOKUPS = 2000, 500, 2, 20_000


@pytest.mark.timeout(240)
def test_dynamic_bench_writes_every_part(tmp_path):
    out = tmp_path / "dynamic.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "dynamic.py"), "--lookups", str(LOOKUPS), "--capacity",
         str(CAPACITY), "--batch", str(BATCH), "--sample-every", "5", "--empty-steps", "4", "--empty-capacity", "50",
         "--strategies", "ps", "--steps", "2", "--warmup", "1", "--repeats", "1", "--tr-rows", "500",
         "--tr-batches", "3", "--stream-args", "--steps 4 --vocab 2000 --batch-size 64 --test-size 400",
         "--out", str(out)],
        capture_output=True, text=True, timeout=220, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())

    memory = result["memory"]
    steps = LOOKUPS // (BATCH * WORKERS)
    assert memory["steps"] == steps and memory["lookups"] == LOOKUPS
    rows = memory["rows_bound"]
    assert rows["looks"] == 2 * steps and rows["looks_over_bound"] == 0 and rows["result"] == "PASS", rows
    assert rows["max_excess"] > 0  # the stream overfills the table within steps
    counters = memory["counters"]
    assert counters["admitted"] - counters["evicted"] == CAPACITY and counters["filtered"] == 0, counters
    assert memory["bytes_per_row"] == {"row": 64, "optimizer": 4, "index": 112}
    assert len(memory["servers"]) == 2 and all(s["max_rss"] > 0 and s["empty_rss"] > 0 for s in memory["servers"])
    assert [s["step"] for s in memory["samples"]] == list(range(0, steps, 5)) + [steps - 1]
    assert memory["rss_result"] in ("PASS", "FAIL") and memory["flat_result"] in ("PASS", "FAIL")

    speed = result["speed"]
    assert set(speed["configs"]) == {"ps dynamic", "ps fixed"}
    assert speed["configs"]["ps dynamic"]["resident_rows"] == CAPACITY  # filled up before the timed steps
    for config in speed["configs"].values():
        assert config["steps_per_s"] > 0 and config["server_cpu_us_per_id"] >= 0
        assert len(config["repeats"][0]["step_times_s"]) == 2
    assert speed["ratios"]["ps"]["dynamic_over_fixed"] > 0

    quality = result["quality"]
    assert quality["capacity"] == quality["distinct_ids"] // 2
    assert set(quality["tables"]) == {"unbounded", "dynamic lru", "dynamic lfu", "hashed"}
    for name in ("dynamic lru", "dynamic lfu"):
        assert quality["tables"][name]["resident_rows"] <= 4 * quality["capacity"]  # 4 fields
    assert quality["tables"]["unbounded"]["resident_rows"] > 4 * quality["capacity"]
    assert set(quality["checks"]) == {"lru", "lfu"}
    assert all(0 < t["auc"] < 1 for t in quality["tables"].values())

    torchrec = result["torchrec"]
    try:
        import torchrec as _  # noqa: F401
    except ImportError:
        assert torchrec["skipped"].startswith("not installed")
    else:
        assert 0 < torchrec["auc"] < 1 and torchrec["throughput"]["torchrec_ids_per_s"] > 0
    assert "speed: ps dynamic / fixed steps/s" in done.stdout and "memory: server 1: RSS" in done.stdout
