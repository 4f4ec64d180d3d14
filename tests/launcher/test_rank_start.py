"""`gradsync run` forks its ranks from a fork server that imported torch once (GRADSYNC_RANK_START=fork, the
default) or starts each as a new `python SCRIPT` process (exec): a script sees the same in both, its exit status
and failures read the same, and it ends as python ends (non-daemon threads joined, atexit run)."""
import json
import os

import pytest

from helpers import run_cli

_PROBE = """import atexit, json, os, sys, threading, time
import numpy, torch
import gradsync

gradsync.init()
me = gradsync.worker_rank()
out = {OUT!r}
if me is not None:  # a worker
    seen = dict(name=__name__, argv=sys.argv, file=__file__, path0=sys.path[0], threads=torch.get_num_threads(),
                env={{k: v for k, v in os.environ.items() if k.startswith(("GRADSYNC_", "RANK", "WORLD_SIZE",
                                                                        "MASTER_", "OMP_", "PROBE_"))}},
                torch_draw=torch.rand(1).item(), numpy_draw=int(numpy.random.randint(2**31)))
    with open(os.path.join(out, f"seen-{{me}}.json"), "w") as f:
        json.dump(seen, f)
    def late():
        time.sleep(0.5)
        open(os.path.join(out, f"thread-{{me}}"), "w").close()
    threading.Thread(target=late).start()  # not a daemon: python waits for it before atexit
    atexit.register(lambda: open(os.path.join(out, f"atexit-{{me}}"), "w").close())
gradsync.shutdown()
"""

_PER_JOB = ("GRADSYNC_RUN_DIR", "GRADSYNC_ERROR_FILE", "GRADSYNC_STACK_FILE", "GRADSYNC_EARLY_STDERR",
            "GRADSYNC_STDERR_FD", "GRADSYNC_TOKEN", "GRADSYNC_LAUNCHER_PID", "MASTER_PORT", "GRADSYNC_RANK_START")
"""What differs between the two jobs beside how they start: their files, token, launcher and store port."""


def _probe(tmp_path, start: str) -> list[dict]:
    out = tmp_path / start
    out.mkdir()
    script = tmp_path / f"probe_{start}.py"
    script.write_text(_PROBE.format(OUT=str(out)))
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", str(script), "--lr", "0.1", timeout=100,
                   env={"GRADSYNC_RANK_START": start, "PROBE_LAUNCHER_ONLY": "1"})
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["atexit-0", "atexit-1", "seen-0.json", "seen-1.json", "thread-0", "thread-1"]
    seen = [json.loads((out / f"seen-{w}.json").read_text()) for w in range(2)]
    for s in seen:
        s["env"] = {k: v for k, v in s["env"].items() if k not in _PER_JOB}
    return seen


@pytest.mark.job
@pytest.mark.timeout(200)
def test_a_forked_rank_sees_what_a_new_process_sees(tmp_path):
    forked, fresh = _probe(tmp_path, "fork"), _probe(tmp_path, "exec")
    script = str(tmp_path / "probe_fork.py")
    for w, rank in enumerate(forked):
        assert rank["name"] == "__main__"
        assert rank["argv"] == [script, "--lr", "0.1"] and rank["file"] == script
        assert rank["path0"] == str(tmp_path)
        assert rank["threads"] == 1 and rank["env"]["OMP_NUM_THREADS"] == "1"  # not the fork server's thread count
        assert rank["env"]["RANK"] == str(w) and rank["env"]["PROBE_LAUNCHER_ONLY"] == "1"
    for forked_rank, fresh_rank in zip(forked, fresh):
        assert forked_rank["env"] == fresh_rank["env"]
        assert forked_rank["threads"] == fresh_rank["threads"]
    # each rank's global random states are its own, as in new processes (not the fork server's, shared)
    assert forked[0]["torch_draw"] != forked[1]["torch_draw"] and fresh[0]["torch_draw"] != fresh[1]["torch_draw"]
    assert forked[0]["numpy_draw"] != forked[1]["numpy_draw"]


_EXITS = """import sys
import gradsync
gradsync.init()
if gradsync.worker_rank() == 1:
    sys.exit({code})
gradsync.shutdown()
"""


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("code, said", [("3", "code 3"), ("'no more data'", "code 1")])
def test_a_forked_rank_exits_with_the_status_python_gives(tmp_path, code, said):
    script = tmp_path / "exits.py"
    script.write_text(_EXITS.format(code=code))
    done = run_cli("run", "--strategy", "allreduce", "--workers", "2", str(script), timeout=100)
    assert done.returncode == 1
    assert f"rank 1 (worker1) exited ({said}) without gradsync.shutdown()" in done.stderr, done.stderr
    if "data" in code:
        assert "no more data" in done.stderr


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_traceback_starts_at_the_script_and_a_bad_start_is_refused(tmp_path):
    script = tmp_path / "early.py"
    script.write_text("def load():\n    raise KeyError('shard 9')\nload()\n")
    done = run_cli("run", "--strategy", "allreduce", "--workers", "1", str(script), timeout=50)
    assert done.returncode == 1 and "KeyError: 'shard 9'" in done.stderr
    trace = done.stderr[done.stderr.index("Traceback"):]
    assert trace.splitlines()[1].startswith(f'  File "{script}", line 3'), trace
    assert "forked.py" not in trace and "multiprocessing" not in trace
    script.write_text("x = (1,\n")
    done = run_cli("run", "--strategy", "allreduce", "--workers", "1", str(script), timeout=50)
    assert done.returncode == 1 and "SyntaxError: '(' was never closed" in done.stderr
    assert "Traceback" not in done.stderr and "forked.py" not in done.stderr, done.stderr  # as python shows it
    done = run_cli("run", "--strategy", "allreduce", "--workers", "1", str(script), timeout=50,
                   env={"GRADSYNC_RANK_START": "spawn"})
    assert done.returncode == 2
    assert "GRADSYNC_RANK_START" in done.stderr and "spawn" in done.stderr and "exec" in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_gradsync_launch_ranks_take_their_thread_count_and_random_states_as_new_processes(launch):
    from jobs import threads_and_draws

    (threads0, torch0, numpy0), (threads1, torch1, numpy1) = launch(threads_and_draws, strategy="allreduce",
                                                                    workers=2)
    assert threads0 == threads1 == 1  # OMP_NUM_THREADS=1 of every rank, not what the fork server read
    assert torch0 != torch1 and numpy0 != numpy1
