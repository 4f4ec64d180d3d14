"""Injected faults: the job fails within its timeouts, naming the rank that caused it; no rank outlives the job."""
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest

import gradsync
import killed_launcher
from fault_injection import Fault, read_stamp, train_then_leave, train_with_fault
from gradsync.runtime import cluster
from gradsync.runtime.store import connect_store
from gradsync.config import JobConfig
from gradsync.launcher import procfs
from gradsync.launcher.local_job import host_store, temporary_run_dir
from gradsync.membership.heartbeat import Heartbeat
from helpers import CLI, HEADLINE, SUPPORT, gone as _gone, run_cli, run_failing_script

STEP_TIMEOUT = 4.0
SLACK = 8.0  # heartbeat period, the launcher's poll, killing the ranks, on a loaded 2-core machine

JOBS = [("ps", 1, "sync", "rpc"), ("ps", 1, "async", "rpc"), ("ps", 1, "sync", "grpc"), ("ps", 1, "async", "grpc"),
        ("allreduce", 0, "sync", "rpc")]


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers,mode,transport", JOBS)
def test_a_stopped_worker_is_named_within_the_step_timeout(launch, strategy, servers, mode, transport, tmp_path):
    fault = Fault(1, 3, "stop", str(tmp_path))
    with pytest.raises(gradsync.JobFailed) as info:
        launch(train_then_leave, strategy=strategy, workers=2, servers=servers, mode=mode,
               args=(fault, 6), step_timeout=STEP_TIMEOUT, shutdown_timeout=1.5, timeout=80,
               transport=transport)
    failed_after = time.time() - read_stamp(tmp_path, "fault")
    headline = str(info.value).splitlines()[0]
    assert headline.startswith(f"rank {servers + 1} (worker1) stopped responding: no heartbeat for "), headline
    assert "its process is stopped (SIGSTOP" in headline
    assert failed_after < STEP_TIMEOUT + SLACK
    if mode == "async":  # worker0 trained on, and its shutdown gave up waiting for worker1 in time
        assert read_stamp(tmp_path, "shutdown-0") < 1.5 + SLACK  # not the default 30 s shutdown_timeout


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers,transport", [("ps", 1, "rpc"), ("ps", 1, "grpc"), ("allreduce", 0, "rpc")])
def test_uneven_data_fails_at_once_naming_the_worker_that_left(launch, strategy, servers, transport, tmp_path):
    fault = Fault(1, 9, "leave", str(tmp_path))
    with pytest.raises(gradsync.JobFailed) as info:
        launch(train_with_fault, strategy=strategy, workers=2, servers=servers, args=(fault, 10),
               step_timeout=60, timeout=80, transport=transport)
    assert time.time() - read_stamp(tmp_path, "fault") < 60 / 2  # not after the 60 s step timeout
    message = str(info.value)
    assert message.startswith(f"rank {servers} (worker0) failed with exit code 1"), message
    assert "worker 1 left the job (its training function returned, or it called gradsync.shutdown) after 9 steps" \
        in message
    assert "DistributedSampler(..., drop_last=True)" in message


def test_shutdown_returns_within_its_timeout_when_a_worker_never_leaves(capfd):
    config = JobConfig(strategy="ps", servers=1, world_size=3, rank=1, transport="grpc", shutdown_timeout=1.0)
    store = host_store(0)
    cluster.set_running(cluster.Cluster(config, store, Heartbeat(store, config)))
    start = time.monotonic()
    gradsync.shutdown()
    assert time.monotonic() - start < 1.0 + SLACK  # not the default 30 s shutdown_timeout
    assert "shutdown waited 1 s (shutdown_timeout) for worker1 to leave the job" in capfd.readouterr().err


def test_shutdown_returns_after_the_heartbeat_thread_has_ended():
    """No thread of gradsync's may be inside a store call when the script after shutdown() ends: interpreter exit
    aborts it (SIGABRT, `terminate called without an active exception`; seen on a grpc job behind a link)."""
    config = JobConfig(strategy="ps", servers=1, world_size=2, rank=1, transport="grpc", shutdown_timeout=5.0)
    store, before = host_store(0), set(threading.enumerate())
    cluster.set_running(cluster.Cluster(config, store, Heartbeat(store, config)))
    [beating] = [t for t in threading.enumerate() if t not in before and t.name == "gradsync-heartbeat"]
    gradsync.shutdown()
    assert not beating.is_alive()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the sockets that listen on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, _, state = line.split()[1:4]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


@pytest.mark.parametrize("host", ["launcher", "rank 0"])
def test_the_rendezvous_store_listens_on_its_address_only(host):
    if host == "launcher":
        store = host_store(0)
    else:
        store = connect_store(JobConfig(strategy="allreduce", servers=0, master_port=0))
    assert _listening(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or [::]


def _run_dir(stderr: str) -> str:
    return re.search(r"gradsync: run dir (\S+)", stderr).group(1)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_run_takes_timeouts_from_flags_and_environment_and_removes_its_run_dir(tmp_path):
    script = tmp_path / "settings.py"
    script.write_text("import os\nprint(os.environ['GRADSYNC_STEP_TIMEOUT'], os.environ['GRADSYNC_SHUTDOWN_TIMEOUT'],"
                      " os.environ['GRADSYNC_STARTUP_TIMEOUT'])\n")
    done = run_cli("run", "--strategy", "allreduce", "--workers", "1", "--step-timeout", "7", str(script),
                   env={"GRADSYNC_SHUTDOWN_TIMEOUT": "9", "GRADSYNC_STARTUP_TIMEOUT": "11"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7.0", "9.0", "11.0"]
    assert not os.path.exists(_run_dir(done.stderr))
    chosen = tmp_path / "chosen"
    done = run_cli("run", "--strategy", "allreduce", "--workers", "1", str(script),
                   env={"GRADSYNC_RUN_DIR": str(chosen), "GRADSYNC_STEP_TIMEOUT": "5"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "5.0"
    assert _run_dir(done.stderr) == str(chosen) and chosen.is_dir()


@pytest.mark.job
@pytest.mark.timeout(90)
def test_a_worker_exception_in_async_mode_is_the_headline(tmp_path):
    script = tmp_path / "async_raise.py"
    script.write_text(f"import sys; sys.path.insert(0, {SUPPORT!r})\n"
                      "import gradsync, fault_injection\n"
                      "gradsync.init()\n"
                      "fault_injection.train_with_fault(fault_injection.Fault(1, 3, 'raise'), 30)\n"
                      "gradsync.shutdown()\n")
    done = run_cli("run", "--strategy", "ps", "--mode", "async", "--workers", "2", str(script), timeout=80)
    assert done.returncode == 1
    headline = done.stderr[done.stderr.index("gradsync: rank"):]
    assert headline.startswith("gradsync: rank 2 (worker1) failed with exit code 1:"), done.stderr
    assert "RuntimeError: worker 1 broke on purpose at step 3" in headline
    assert "SIGABRT" not in done.stderr


@pytest.mark.job
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,servers,join,transport",
                         [("allreduce", 0, False, "rpc"), ("allreduce", 0, True, "rpc"), ("ps", 1, False, "rpc"),
                          ("ps", 1, False, "grpc")],
                         ids=["allreduce", "allreduce in join", "ps", "ps over grpc"])
def test_a_worker_that_exits_without_shutdown_is_the_headline_not_the_healthy_one(strategy, servers, join, transport,
                                                                                   tmp_path):
    train = "fault_injection.train_in_join" if join else "fault_injection.train_with_fault"
    body = f"gradsync.init()\n{train}(fault_injection.Fault(1, 3, 'exit'), 30)\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", strategy, "--workers", "2", "--step-timeout",
                                          str(STEP_TIMEOUT), "--transport", transport)
    # how the leaving process ends is torch's teardown's choice: exit 0, SIGABRT, or a hang until it is killed
    assert re.match(rf"gradsync: rank {servers + 1} \(worker1\) exited \((code 0|then torch's teardown ended it with "
                    r"SIGABRT|its process hangs in torch's teardown)\) without gradsync.shutdown\(\)( while the "
                    r"others were training|, so the job cannot end)", headline), stderr


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_ps_script_that_ends_without_shutdown_fails_at_once_not_after_the_step_timeout(mode, tmp_path):
    """Every worker trains to the end and exits without gradsync.shutdown(): the first seen is named as soon as it
    has exited, long before step_timeout (60 s) would end the servers' wait for it to leave; in an elastic job (ssp)
    it is a departure, and the last one's ends the job."""
    script = tmp_path / "job.py"
    script.write_text(f"import sys; sys.path.insert(0, {SUPPORT!r})\nimport gradsync, fault_injection\n"
                      "gradsync.init()\nfault_injection.train_with_fault(fault_injection.Fault(-1, -1, 'none'), 3)\n")
    done = run_cli("run", "--strategy", "ps", "--mode", mode, "--workers", "2", "--step-timeout", "60", str(script),
                   timeout=40)
    assert done.returncode == 1, done.stderr
    if mode == "ssp":
        assert "every worker left the job, so it cannot finish: worker" in done.stderr, done.stderr
        assert "exited without calling gradsync.shutdown()" in done.stderr, done.stderr
        return
    assert re.search(r"gradsync: rank [12] \(worker[01]\) exited \(code 0\) without gradsync.shutdown\(\), so the job "
                     r"cannot end \(the servers wait for it to leave\): every worker must call gradsync.shutdown\(\)",
                     done.stderr), done.stderr
    assert len(HEADLINE.findall(done.stderr)) == 1, done.stderr


@pytest.mark.job
@pytest.mark.timeout(180)
def test_an_allreduce_worker_training_outside_join_is_explained_not_an_abort(tmp_path):
    body = "gradsync.init()\nfault_injection.train_in_join(fault_injection.Fault(-1, -1, 'none'), 10, outside=1)\ngradsync.shutdown()\n"
    stderr, headline = run_failing_script(tmp_path, body, "--strategy", "allreduce", "--workers", "2",
                                          "--step-timeout", str(STEP_TIMEOUT))
    assert headline.startswith("gradsync: rank 1 (worker1) failed"), stderr  # the worker outside, not worker 0
    assert "RuntimeError: worker 1 did not enter trainer.join() within 2 s (half the step timeout) of worker 0 " \
           "entering it: every worker must train inside `with trainer.join():`" in headline, stderr


_FOREVER = """import sys
sys.path.insert(0, {support!r})
{pid_file}
import gradsync, fault_injection
gradsync.init()
fault_injection.train_with_fault(fault_injection.Fault(0, 2, "mark", {pids!r}), 10**6)
"""


@pytest.mark.job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,servers,workers,sig", [  # two ranks at least, each: a server and a worker for ps
    ("ps", 1, 1, signal.SIGTERM), ("ps", 1, 1, signal.SIGKILL),
    ("allreduce", 0, 2, signal.SIGHUP), ("allreduce", 0, 2, signal.SIGINT)],
    ids=["ps-SIGTERM", "ps-SIGKILL", "allreduce-SIGHUP", "allreduce-SIGINT (Ctrl-C)"])
def test_no_rank_outlives_a_killed_gradsync_run(strategy, servers, workers, sig, tmp_path, monkeypatch):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    # run directories of its own (another launcher, the other pytest worker's, removes abandoned ones), short enough
    # that the launcher's multiprocessing folder (pymp-*) is made inside it too
    own_tmp = pathlib.Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    script = tmp_path / "forever.py"
    script.write_text(_FOREVER.format(support=SUPPORT, pids=str(pids_dir),
                                      pid_file=killed_launcher.pid_file_code(pids_dir)))
    stderr = tmp_path / "stderr"
    command = [*CLI, "run", "--strategy", strategy, "--workers", str(workers), str(script)]
    try:
        with killed_launcher.started(command, stderr, env={**os.environ, "TMPDIR": str(own_tmp)}) as launcher:
            launcher.wait_for(lambda: (pids_dir / "fault").exists(), "the job did not start")  # worker 0 at step 2
            ranks = killed_launcher.read_pids(pids_dir, servers + workers)
            # and the fork server, which removes a SIGKILLed launcher's pymp-* folder
            launcher.watched = [*ranks, procfs.parent(ranks[0])]
            assert len(list(own_tmp.glob("pymp-*"))) == 1
            returncode = launcher.stop(sig)
            assert launcher.survivors(within=5) == []
        assert list(own_tmp.glob("pymp-*")) == []
        run_dir = _run_dir(stderr.read_text())
        if sig != signal.SIGKILL:  # README: SIGTERM, SIGHUP or Ctrl-C stop every rank, exit 128 + the signal
            assert returncode == 128 + sig
            assert f"gradsync: stopped by {sig.name}: every rank was stopped" in stderr.read_text()
        else:  # the launcher could not remove its run directory: the next one does
            assert os.path.exists(run_dir)
            monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
            with contextlib.ExitStack() as stack:
                temporary_run_dir(stack, "gradsync-run-")
        assert not os.path.exists(run_dir)
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)


_WAITING = """import os, sys, time
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)  # until its launcher is killed
"""


@pytest.mark.job
@pytest.mark.timeout(150)
def test_a_run_dir_is_one_jobs_until_its_launcher_ends_even_by_sigkill(tmp_path):
    run_dir, started = tmp_path / "run", tmp_path / "started"
    waiting, quick = tmp_path / "waiting.py", tmp_path / "quick.py"
    waiting.write_text(_WAITING)
    quick.write_text("print('ran')\n")
    job = ["--strategy", "allreduce", "--workers", "1", "--run-dir", str(run_dir)]
    with open(tmp_path / "stderr", "w") as out:
        first = subprocess.Popen([*CLI, "run", *job, str(waiting), str(started)], stderr=out, start_new_session=True)
    rank = None
    try:
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not start"
            time.sleep(0.1)
        rank = int(started.read_text())
        second = run_cli("run", *job, str(quick))
        assert (second.returncode, second.stdout) == (2, ""), second.stderr
        assert second.stderr == (f"gradsync: error: {run_dir} is the run dir of a running job (its launcher is pid "
                                 f"{first.pid}): give this job another --run-dir, or wait for pid {first.pid} to end "
                                 "(or stop it)\n")
        first.kill()  # SIGKILL: its lease stays in the run dir, held by no one
        first.wait(timeout=30)
        for name in ("grpc-0.json", "stats-0.json", "join.json", "error-0.txt"):  # as an ended job leaves them
            (run_dir / name).write_text("{}")
        third = run_cli("run", *job, str(quick))
        assert (third.returncode, third.stdout) == (0, "ran\n"), third.stderr
        assert sorted(os.listdir(run_dir)) == []  # the earlier job's files removed, its own lease released
    finally:
        if first.poll() is None:
            first.kill()
        if rank is not None and not _gone(rank):
            os.kill(rank, signal.SIGKILL)
