"""The chaos soak (bench/chaos.py), briefly: an elastic async job with a worker joining, one killed and a
server stopped and continued; every acknowledged push applied, nothing of the job left behind."""
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.job  # every test here starts processes

BENCH = os.path.join(ROOT, "bench", "chaos.py")


@pytest.mark.timeout(300)
def test_a_short_chaos_soak_accounts_for_every_push_and_leaves_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    bench = subprocess.Popen([sys.executable, BENCH, "--minutes", "0.1", "--workers", "2", "--servers", "1",
                              "--min-workers", "1", "--event-every", "1.5", "--stop-every", "2", "--stop-seconds", "1",
                              "--startup-timeout", "90", "--sizes", "32", "32", "10", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = bench.communicate(timeout=270)[0]
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGTERM)  # the bench kills the job's processes on its way out
        text = bench.communicate(timeout=25)[0]
    result = json.loads(out.read_text())
    kinds = [e["kind"] for e in result["events"]]
    assert kinds.count("join") >= 1 and kinds.count("kill") >= 1 and kinds.count("stop") >= 1, kinds
    assert kinds.count("cont") == kinds.count("stop"), kinds
    joins = [e for e in result["events"] if e["kind"] == "join"]
    assert all("worker" in e for e in joins), joins  # else the bench waits out --startup-timeout for it to join
    assert result["launcher_code"] == 0 and result["error"] is None, text
    pushes = result["pushes"]
    assert pushes["killed"] == len(result["killed"]) >= 1
    assert pushes["acknowledged"] > 0 and pushes["rejected"] == {"0": 0}
    for applied in pushes["applied"].values():
        assert pushes["acknowledged"] <= applied <= pushes["acknowledged"] + pushes["killed"], pushes
    assert not pushes["problems"], pushes["problems"]  # the same per worker and server
    assert result["processes_left"] == [] and result["namespaces_left"] == []
    for check in ("job ended", "pushes accounted", "no process left", "no namespace left"):
        assert result["checks"][check]["ok"], (check, result["checks"][check], text)
