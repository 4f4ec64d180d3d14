"""`--link RATE`: ranks in their own network namespaces behind shaped links; nothing is left behind."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import gradsync
from gradsync.launcher import leases, netem
from gradsync.config import ConfigError
from gradsync.core.settings import LINK
from gradsync.core.emulated_network import reachable
from gradsync.launcher.netem import Link, Network
import jobs
from jobs import reference_mlp, train_mlp
from helpers import CLI, NOISE, REFUSED_SCRIPT, SUPPORT, needs_root, run_cli
import killed_launcher


def _job(stderr: str) -> str:
    """The job id in gradsync run's hint `ip netns exec <job>hub gradsync status ...`."""
    return re.search(r"ip netns exec (gsnet[0-9a-f]{6})hub", stderr).group(1)


def _held_by_another_process(namespace: str) -> bool:
    """The namespace's network is held by a running launcher other than this process: another job's, on a
    shared machine (a lease this process still holds is a network it failed to remove)."""
    lease = os.path.join(netem.LEASES, namespace[:len(netem.PREFIX) + 6] + ".lease")
    mine = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    return os.path.exists(lease) and not leases.abandoned(lease) and os.path.realpath(lease) not in mine


def _nothing_left(job: str = "") -> None:
    """No namespace of the job (without one: of any job whose launcher is gone) is left, and no link of ours
    appeared in this (the root) namespace. Naming the job, or leaving out the networks that running launchers
    hold, keeps the check true while other jobs with links run on the machine."""
    if job:
        assert [ns for ns in netem.leftovers() if ns.startswith(job)] == []
    else:
        assert [ns for ns in netem.leftovers() if not _held_by_another_process(ns)] == []
    if shutil.which("ip") is None:  # a machine without iproute2: no job could have made a link
        return
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True).stdout
    assert netem.PREFIX not in links and netem.DEVICE not in links


@pytest.mark.parametrize("rate,bits", [("100mbit", 100_000_000), ("1gbit", 10**9), ("10Gbit", 10**10),
                                       ("1.5mbit", 1_500_000), ("125mbps", 10**9), ("64kibit", 65536)])
def test_rates_are_read_as_tc_reads_them(rate, bits):
    assert Link.parse(rate) == Link(bits)
    assert str(Link.parse(rate)) == f"{bits}bit"


@pytest.mark.parametrize("rate", ["fast", "100", "100mb", "-1gbit", "1 gbit"])
def test_a_rate_tc_cannot_read_is_refused_naming_it(rate):
    with pytest.raises(ConfigError, match=f"--link '{rate}' is not a tc rate: .* e.g. 100mbit"):
        Link.parse(rate)


def test_a_bad_server_link_rate_is_refused_naming_its_flag():
    with pytest.raises(ConfigError, match="--server-link 'slow' is not a tc rate"):
        Link.parse("slow", "--server-link")


@pytest.mark.job
@pytest.mark.timeout(60)
def test_server_link_without_link_is_refused_naming_both_flags():
    done = run_cli("run", "--server-link", "100mbit", "--strategy", "ps", "--workers", "1", REFUSED_SCRIPT)
    assert done.returncode == 2
    assert ("gradsync: error: --server-link 100mbit needs --link too, the rate of the workers' links: "
            "e.g. --link 1gbit --server-link 100mbit") in done.stderr


def test_a_rate_below_8kbit_is_refused():
    with pytest.raises(ConfigError, match="--link '10bit' is 10 bit/s: a link needs at least 8kbit"):
        Link.parse("10bit")


def test_tbf_bursts_4ms_at_the_rate_and_at_least_64_kib():
    assert Link.parse("10gbit").tbf() == ["rate", "10000000000bit", "burst", "5000000", "latency", "20ms"]
    assert Link.parse("100mbit").tbf() == ["rate", "100000000bit", "burst", "65536", "latency", "20ms"]


def test_refused_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: f"/usr/sbin/{tool}")  # iproute2 or not, here
    with pytest.raises(ConfigError, match=r"needs root \(this is uid 1000\): run as root, or without --link"):
        Network(Link.parse("1gbit"), 2)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_gradsync_run_refuses_when_iproute2_is_missing(tmp_path):
    done = run_cli("run", "--link", "1gbit", "--strategy", "ps", "--workers", "1", REFUSED_SCRIPT,
                   env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert (f"gradsync: error: --link needs iproute2, but 'ip' and 'tc' are not on PATH (PATH={tmp_path}): "
            "install iproute2, or run without --link") in done.stderr
    _nothing_left()


@pytest.mark.job
@needs_root
def test_a_failed_setup_removes_what_it_created(monkeypatch):
    monkeypatch.setattr(Link, "tbf", lambda self: ["rate", "fast"])
    net = Network(Link.parse("1gbit"), 2)
    with pytest.raises(ConfigError, match=r"--link: `tc -n gsnet\w+hub qdisc add dev port0 root tbf rate fast` "
                                          r"failed: .*run on such a machine, or without --link"):
        with net:
            pass
    _nothing_left(net.job)


@pytest.mark.job
@needs_root
def test_ranks_reach_each_other_through_shaped_links_and_nothing_is_left():
    with Network(Link.parse("100mbit"), 2) as net:
        for ns, dev in [(net.namespaces[0], netem.DEVICE), (net.namespaces[1], netem.DEVICE),
                        (net.hub, "port0"), (net.hub, "port1")]:
            shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                                   timeout=10, check=True).stdout
            assert "tbf" in shown and "rate 100Mbit" in shown, shown
        server = netem.in_namespace(net.namespaces[1], lambda: socket.create_server((Network.address(1), 0)))
        port = server.getsockname()[1]
        client = netem.in_namespace(net.namespaces[0],
                                    lambda: socket.create_connection((Network.address(1), port), timeout=10))
        server.settimeout(10)
        conn, (peer, _) = server.accept()
        client.sendall(b"across the bridge")
        conn.settimeout(10)
        assert peer == "10.213.0.2" and conn.recv(100) == b"across the bridge"
        for s in (client, conn, server):
            s.close()
        assert sorted(ns for ns in netem.leftovers() if ns.startswith(net.job)) == sorted([net.hub, *net.namespaces])
        assert netem.in_namespace(net.hub, lambda: reachable(Network.address(1)))
        assert not reachable(Network.address(1))  # from the root namespace: refused, nothing sent
        assert reachable("127.0.0.1") and reachable("10.1.2.3")
    _nothing_left(net.job)


@pytest.mark.job
@needs_root
def test_servers_sit_behind_the_server_link_and_workers_behind_the_link():
    with Network(Link.parse("1gbit"), 3, Link.parse("100mbit"), servers=1) as net:
        for rank, rate in [(0, "100Mbit"), (1, "1Gbit"), (2, "1Gbit")]:
            for ns, dev in [(net.namespaces[rank], netem.DEVICE), (net.hub, f"port{rank}")]:
                shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                       text=True, timeout=10, check=True).stdout
                assert f"rate {rate} " in shown, (rank, shown)
            assert net.environment(rank)[LINK.env] == str(Link.parse(rate.lower()))
    _nothing_left(net.job)


_JOB = """import socket, sys
import torch
sys.path.insert(0, {support!r})
import gradsync, jobs
gradsync.init()
{body}
gradsync.shutdown()
"""


@pytest.mark.job
@needs_root
@pytest.mark.timeout(150)  # the job, then two `gradsync status` processes (each imports torch)
def test_gradsync_run_trains_over_the_emulated_network_with_the_grpc_transport(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(support=SUPPORT, body="import helpers\nstate = jobs.train_mlp(4)\n"
                                  "names = [n for _, n in socket.if_nameindex()]\n"  # one write: ranks' lines never mix
                                  "diff = helpers.max_diff(state, jobs.reference_mlp(4, 2))\n"
                                  "line = f\"{gradsync.worker_rank()} {names} {diff}\"\n"
                                  "sys.stdout.write(line + '\\n')"))
    done = run_cli("run", "--link", "100mbit", "--strategy", "ps", "--transport", "grpc", "--workers", "2",
                   "--run-dir", str(tmp_path / "run"), str(script), timeout=110)
    assert done.returncode == 0, done.stderr
    hint = re.search(r"gradsync: ranks behind 100mbit links; `ip netns exec (gsnet[0-9a-f]{6}hub) gradsync status "
                     + re.escape(str(tmp_path / "run")) + "` reaches the job", done.stderr)
    assert hint, done.stderr
    status = lambda: run_cli("status", str(tmp_path / "run"), timeout=60)  # noqa: E731
    ended = status()  # the servers' final counters, from the run directory
    assert ended.returncode == 0 and "the job has ended" in ended.stdout and "| 0 | - | ended | 4 |" in ended.stdout
    for path in (tmp_path / "run").glob("stats-*.json"):  # as while the job runs: reach its endpoint
        path.unlink()
    outside = status()
    assert outside.returncode == 2
    assert "10.213.0.2:" in outside.stderr and "is inside an emulated network (a job of gradsync run --link)" \
        in outside.stderr
    lines = sorted(done.stdout.splitlines())
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["0 ['lo', 'link0']", "1 ['lo', 'link0']"]
    # every parameter of every worker, against single-process training (not the sum of one tensor)
    assert all(float(line.rsplit(" ", 1)[1]) <= 1e-5 for line in lines), lines
    _nothing_left(_job(done.stderr))


_LAUNCH = """import sys
sys.path.insert(0, {support!r})
import gradsync, jobs
if __name__ == "__main__":
    gradsync.launch(jobs.train_mlp, strategy="ps", workers=2, args=(2,), link="1gbit", timeout=40)
"""


@pytest.mark.job
@needs_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["gradsync run", "gradsync.launch"])
def test_a_job_behind_links_prints_nothing_a_user_cannot_act_on(launcher, tmp_path):
    """`make run`'s first lines: no c10d line that the store's hostname cannot be retrieved (no DNS answers in
    the emulated network), from the launcher that hosts the store in the hub or from a rank, forked or not."""
    script = tmp_path / "job.py"
    loud = ("TORCH_CPP_LOG_LEVEL",)  # gradsync must set it itself
    if launcher == "gradsync run":
        script.write_text(_JOB.format(support=SUPPORT, body="jobs.train_mlp(2)"))
        done = run_cli("run", "--link", "1gbit", "--strategy", "ps", "--workers", "2", str(script), timeout=50,
                       without=loud)
    else:
        script.write_text(_LAUNCH.format(support=SUPPORT))
        quiet = {k: v for k, v in os.environ.items() if k not in loud}
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=quiet)
    assert done.returncode == 0, done.stderr
    assert NOISE.findall(done.stdout + done.stderr) == [], done.stdout + done.stderr


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
def test_rpc_tensors_cross_the_link(tmp_path):
    """Not TensorPipe's cma channel, which copies between the processes' memory around the network."""
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(support=SUPPORT, body="torch.manual_seed(0)\n"
                                  "model = torch.nn.Sequential(torch.nn.Linear(jobs.IN, 1 << 15), "
                                  "torch.nn.Linear(1 << 15, jobs.OUT))\n"
                                  "jobs.run_loop(gradsync.Trainer(model, torch.optim.SGD, lr=0.01), 3)\n"
                                  "print(open('/sys/class/net/link0/statistics/tx_bytes').read().strip())"))
    done = run_cli("run", "--link", "1gbit", "--strategy", "ps", "--workers", "1", str(script), timeout=80)
    assert done.returncode == 0, done.stderr
    gradient_bytes = 4 * (jobs.IN * (1 << 15) + (1 << 15) + (1 << 15) * jobs.OUT + jobs.OUT)
    assert int(done.stdout) > 3 * gradient_bytes  # three pushes of every gradient, through the worker's link


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
def test_a_slow_server_link_bounds_the_ps_step_from_below(tmp_path):
    """Each step pushes every gradient into the server and brings the next weights back out of it, through
    the server's 10mbit link: no step can be faster than those bytes, one direction's, at that rate (the
    pieces' pushes and replies overlap on a full-duplex link; the workers' 1gbit links would allow ten times
    faster)."""
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(support=SUPPORT, body="import time\ntorch.manual_seed(0)\n"
                                  "model = torch.nn.Linear(1 << 14, jobs.OUT)\n"
                                  "trainer = gradsync.Trainer(model, torch.optim.SGD, lr=0.01)\n"
                                  "x, y = torch.randn(2, 1 << 14), torch.tensor([0, 1])\n"
                                  "from torch.distributed import autograd as dist_autograd\n"
                                  "for step in range(4):\n"
                                  "    if step == 1: start = time.monotonic()\n"
                                  "    with dist_autograd.context() as cid:\n"
                                  "        dist_autograd.backward(cid, "
                                  "[torch.nn.functional.cross_entropy(trainer.model(x), y)])\n"
                                  "        trainer.step(cid)\n"
                                  "print(time.monotonic() - start)"))
    done = run_cli("run", "--link", "1gbit", "--server-link", "10mbit", "--strategy", "ps", "--workers", "1",
                   str(script), timeout=80)
    assert done.returncode == 0, done.stderr
    assert "gradsync: ranks behind 1gbit links (servers behind 10mbit)" in done.stderr
    # 3 steps, each the gradients in while the weights go out; each crossing may start with a burst the idle
    # link saved up (tbf), so only the bytes beyond it are bounded by the rate
    link = Link.parse("10mbit")
    beyond_burst = 4 * ((1 << 14) * jobs.OUT + jobs.OUT) - link.burst_bytes
    assert float(done.stdout) > 0.9 * 3 * 8 * beyond_burst / link.bits_per_s
    _nothing_left(_job(done.stderr))


_WIDE = """import sys
import torch
sys.path.insert(0, {support!r})
import gradsync, jobs
gradsync.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(jobs.IN, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, jobs.OUT))
jobs.run_loop(gradsync.Trainer(model, torch.optim.SGD, lr=0.01), 6, log=True)
gradsync.shutdown()
"""


@pytest.mark.job
@needs_root
@pytest.mark.timeout(180)
def test_compare_runs_the_slow_server_link_scenario(tmp_path):
    """`compare --server-link`: every ps step carries the gradients into the server and the weights out of
    it through the server's 10mbit link, so its median step cannot be shorter than those bytes at that rate."""
    script = tmp_path / "wide.py"
    script.write_text(_WIDE.format(support=SUPPORT))
    out = tmp_path / "report"
    done = run_cli("compare", "--out", str(out), "--strategies", "ps", "--servers", "1", "--modes", "sync", "--link",
                   "1gbit", "--server-link", "10mbit", str(script), timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["ps sync S=1"] and not any("error" in r for r in runs.values())
    model_bits = 8 * 4 * (jobs.IN * 4096 + 4096 + 4096 * jobs.OUT + jobs.OUT)
    assert runs["ps sync S=1"]["step_s"] > 0.9 * 2 * model_bits / 10e6
    assert report["server_link"] == "10mbit" and report["link"] == "1gbit"
    assert "Slow server link: each parameter server behind 10mbit" in (out / "report.md").read_text()


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
def test_nothing_is_left_after_a_failed_job(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(_JOB.format(support=SUPPORT, body="raise ValueError('broken on purpose')"))
    done = run_cli("run", "--link", "1gbit", "--strategy", "allreduce", "--workers", "2", str(script), timeout=80)
    assert done.returncode == 1
    assert "ValueError: broken on purpose" in done.stderr
    _nothing_left(_job(done.stderr))


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nothing_is_left_after_a_signal_to_gradsync_run(sig, tmp_path):
    """SIGTERM: the launcher removes its network. SIGKILL: it cannot; the next network on the machine does."""
    script = tmp_path / "forever.py"
    script.write_text(_JOB.format(support=SUPPORT, body=f"open({str(tmp_path / 'up')!r}, 'w').close()\n"
                                  "jobs.train_mlp(10**6)"))
    stderr = tmp_path / "stderr"
    command = [*CLI, "run", "--link", "1gbit", "--strategy", "ps", "--workers", "1", str(script)]
    with killed_launcher.started(command, stderr) as launcher:
        launcher.wait_for(lambda: (tmp_path / "up").exists(), "the job did not start")
        job = _job(stderr.read_text())
        ours = [ns for ns in netem.leftovers() if ns.startswith(job)]
        assert len(ours) == 3  # the hub, the server's and the worker's namespaces
        assert launcher.stop(sig) == (128 + sig if sig == signal.SIGTERM else -sig)
    if sig == signal.SIGKILL:
        assert set(ours) <= set(netem.leftovers())
        assert set(ours) <= set(netem.remove_abandoned())
    _nothing_left(job)


@pytest.mark.job
@needs_root
@pytest.mark.timeout(90)
def test_launch_runs_forked_ranks_in_their_namespaces(launch):
    states = launch(train_mlp, strategy="allreduce", workers=2, args=(4,), link="1gbit", timeout=80)
    expected = reference_mlp(4, 2)
    for state in states:
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    _nothing_left()
