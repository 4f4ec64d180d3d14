"""Many machines: two network namespaces as two hosts on one switch, one `torchrun` node in each, and a
gradsync job across them ends bit for bit as the same job on one machine (docs/guide.md, "Many machines").

The hosts are the rank namespaces of `netem.Network` (host n at 10.213.0.<n + 2> on its device link0, the
bridge in the hub namespace; links at 10gbit, never the bottleneck). Each node also runs in a PID namespace
of its own (`unshare --pid`), so TensorPipe takes the two for two machines, as it would real ones: between
processes of one PID namespace its cma channel reads tensors straight from the other process's memory,
around the network. What the user sets is what these tests set: TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to
the host's device, GRADSYNC_STRATEGY (and GRADSYNC_SERVERS), and torchrun's rendezvous: static
(--node-rank, --master-addr, --master-port), or c10d with `--rdzv-conf is_host=1` on the endpoint's node and
`--local-addr` on every node (see `_c10d`). Every process of a node is killed, and every namespace removed,
whatever the test's outcome.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from gradsync.launcher import netem
from gradsync.launcher.netem import Link, Network
from helpers import SUPPORT, needs_root, run_cli
from jobs import reference_mlp

pytestmark = pytest.mark.job

NODE_JOB = os.path.join(SUPPORT, "node_job.py")
STEPS = 4
PORT = 29500  # inside the job's own namespaces: nothing else listens there
_NODE_TIMEOUT_S = 60
_SETTINGS = {"GRADSYNC_STARTUP_TIMEOUT": "30", "GRADSYNC_STEP_TIMEOUT": "30"}
JOBS = {"ps": {"GRADSYNC_STRATEGY": "ps", "GRADSYNC_SERVERS": "2"}, "allreduce": {"GRADSYNC_STRATEGY": "allreduce"}}
"""The job under each strategy: ps with S = 2 servers (node 0's two processes) and W = 2 workers (node 1's);
allreduce with W = 4 workers, two per node."""
WORKERS = {"ps": 2, "allreduce": 4}


def _static(net: Network, node: int) -> list[str]:
    """torchrun's static rendezvous: node 0's agent hosts the store at --master-addr:--master-port."""
    return ["--node-rank", str(node), "--master-addr", net.address(0), "--master-port", str(PORT)]


def _c10d(net: Network, node: int) -> list[str]:
    """torchrun's c10d rendezvous. Two of its guesses fail inside namespaces (where this machine's hostname
    resolves to 127.0.0.1, /etc/hosts): it hosts the rendezvous store on the node whose hostname's addresses
    include the endpoint's (none here: every agent waits as a client for a store no one hosts), hence
    `is_host`; and it names a node, and hands the workers the store of node 0, by `socket.getfqdn()`
    ('localhost' here: the other node's workers would look for it on their own host), hence `--local-addr`."""
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.address(0)}:{PORT}", "--rdzv-id", "many-machines",
            "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=30", "--local-addr", net.address(node)]


def _environment(strategy: str) -> dict[str, str]:
    """This environment without another job's placement or settings, and the job's."""
    placement = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME",
                 "GLOO_SOCKET_IFNAME"}
    own = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSYNC_", "TORCHELASTIC_")) and
           k not in placement}
    return {**own, **_SETTINGS, **JOBS[strategy]}


def _kill_every_process_in(namespace: str) -> None:
    """The processes this test started inside `namespace` (its nodes' agents and ranks), killed by pid."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


def _run_nodes(net: Network, strategy: str, rendezvous, out) -> list[str]:
    """One torchrun node in each host's namespace, each with two processes; returns each node's output after
    both ended (a node still running _NODE_TIMEOUT_S after the start fails the test). Kills whatever they left
    running."""
    env = {**_environment(strategy), "TP_SOCKET_IFNAME": netem.DEVICE, "GLOO_SOCKET_IFNAME": netem.DEVICE}
    logs = [out / f"node{node}.txt" for node in range(2)]
    nodes = []
    try:
        for node in range(2):
            argv = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc-per-node", "2", *rendezvous(net, node), NODE_JOB, str(out), str(STEPS)]
            with open(logs[node], "w") as log:
                nodes.append(subprocess.Popen(net.command(node, argv), env=env, cwd=out, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        codes, deadline = [], time.monotonic() + _NODE_TIMEOUT_S
        for node in nodes:
            try:
                codes.append(node.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(f"still running after {_NODE_TIMEOUT_S} s")
    finally:
        for namespace in net.namespaces:
            _kill_every_process_in(namespace)
        for node in nodes:
            node.wait(timeout=10)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(f"node {n} ({c}):\n{t[-4000:]}" for n, (c, t) in enumerate(zip(codes, texts)))
    return texts


def _results(out, workers: int) -> list[tuple[dict, dict]]:
    """Each worker's (final state dict, what it said of its place) from `node_job.py`'s files in `out`."""
    return [(torch.load(out / f"worker-{w}.pt"), json.loads((out / f"worker-{w}.json").read_text()))
            for w in range(workers)]


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """`one_machine(strategy)`: each worker's final state of the same job under `gradsync run` on loopback, run
    once per module."""
    @functools.cache
    def run(strategy: str) -> list[dict]:
        out = tmp_path_factory.mktemp(f"one-machine-{strategy}")
        flags = ["--strategy", strategy, "--workers", str(WORKERS[strategy])]
        flags += ["--servers", JOBS[strategy]["GRADSYNC_SERVERS"]] if "GRADSYNC_SERVERS" in JOBS[strategy] else []
        done = run_cli("run", *flags, NODE_JOB, str(out), str(STEPS), timeout=50, env=_SETTINGS)
        assert done.returncode == 0, done.stderr
        states = [state for state, _ in _results(out, WORKERS[strategy])]
        expected = reference_mlp(STEPS, WORKERS[strategy])  # and it is the single-process training, to parity
        for state in states:
            torch.testing.assert_close(state, expected, rtol=1e-5, atol=1e-6)
        return states

    return run


def _nothing_left(net: Network) -> None:
    """None of the network's namespaces is left, and no link of ours appeared in this (the root) namespace."""
    assert [ns for ns in netem.leftovers() if ns.startswith(net.job)] == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True).stdout
    assert net.job not in links and netem.DEVICE not in links


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="a host's PID namespace needs unshare (util-linux)")
@pytest.mark.timeout(130)  # the one-machine run (once per strategy, 50 s at most), then the nodes (60 s)
@pytest.mark.parametrize("strategy,rendezvous", [("ps", _static), ("allreduce", _static), ("ps", _c10d)],
                         ids=["ps-static", "allreduce-static", "ps-c10d"])
def test_torchrun_on_two_hosts_ends_bit_for_bit_as_on_one_machine(strategy, rendezvous, one_machine, tmp_path):
    expected = one_machine(strategy)
    net = Network(Link.parse("10gbit"), 2)
    try:
        with net:
            _run_nodes(net, strategy, rendezvous, tmp_path)
    finally:
        _nothing_left(net)
    workers = WORKERS[strategy]
    results = _results(tmp_path, workers)
    servers = int(JOBS[strategy].get("GRADSYNC_SERVERS", 0))
    # the first S ranks are the servers: under ps node 0 holds both, node 1 both workers; allreduce two per node
    placed = [(place["rank"], place["address"]) for _, place in results]
    assert placed == [(servers + w, net.address((servers + w) // 2)) for w in range(workers)]
    for _, place in results:
        assert place["devices"] == ["link0", "lo"] and place["workers"] == workers
        assert place["master_addr"] == net.address(0)  # node 0's store, static or c10d
    for (state, _), same in zip(results, expected):
        assert list(state) == list(same)
        different = [name for name in state if not torch.equal(state[name], same[name])]
        assert different == [], f"not bit for bit as on one machine: {different}"
