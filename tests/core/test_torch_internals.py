"""Each private interface in `gradsync.core.torch_internals` against the installed torch: a torch that
changes one fails here, naming it, instead of inside a job."""
import inspect
import multiprocessing.forkserver
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.core import torch_internals as ti
from gradsync.launcher import procfs
from helpers import ROOT, SUPPORT, gone


def test_the_installed_torch_is_a_tested_one_and_setup_py_keeps_newer_ones():
    assert ".".join(torch.__version__.split(".")[:2]) in ti.TESTED_TORCH
    with open(os.path.join(ROOT, "setup.py")) as f:
        requirement = re.search(r'"torch[^"]*"', f.read()).group(0)
    assert requirement == f'"torch>={ti.TESTED_TORCH[0]}"'  # no upper bound that would downgrade a user's torch


def test_every_private_name_a_function_uses_is_in_this_torch():
    checked = [f for f in vars(ti).values() if callable(f) and hasattr(f, "private_names")]
    assert len(checked) >= 14
    for f in checked:
        for name in f.private_names:
            ti._require(name, f.__name__)  # raises TorchChanged naming it


def test_a_private_name_this_torch_lacks_fails_at_first_use_in_one_line_naming_it_and_the_versions():
    calls = []

    @ti._uses("torch.distributed.autograd:_current_context", "torch.nn.utils.clip_grad:_gone_in_a_later_torch")
    def relies():
        calls.append(1)

    with pytest.raises(ti.TorchChanged) as failed:
        relies()
    text = str(failed.value)
    assert "\n" not in text and calls == []
    assert "torch.nn.utils.clip_grad._gone_in_a_later_torch (in gradsync's relies)" in text
    assert f"torch {torch.__version__}" in text and "tested on torch 2.13, 2.14" in text


@pytest.mark.job
def test_contexts_start_without_an_rpc_agent_and_name_their_id():
    """start_dist_autograd and current_context_id, in a fresh process (the agent's state is per process)."""
    code = ("import torch.distributed.autograd as d\nfrom gradsync.core import torch_internals as ti\n"
            "ti.start_dist_autograd(3)\nassert ti.current_context_id() is None\n"
            "with d.context() as cid:\n    assert ti.current_context_id() == cid, (cid, ti.current_context_id())\n"
            "assert ti.current_context_id() is None\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_DYNAMIC_GROUP = """
import torch.distributed as dist, torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler
from gradsync.core import torch_internals as ti
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
register_rendezvous_handler("probe", lambda url, **kw: iter([(store, 0, None)]))
count = ti.rpc_init_count()
rpc.init_rpc("w0", rank=0, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method="probe://",
                                                                             _transports=["uv"]))
ti.set_rpc_timeout(7.0)
print(dist.PrefixStore(ti.RPC_STORE_PREFIX.format(count), store).get(ti.RPC_MEMBER_LIST).decode(),
      ti.rpc_init_count() - count, ti.current_rpc_agent().get_worker_info().name, rpc.get_rpc_timeout())
rpc.shutdown(graceful=False)
"""


@pytest.mark.job
def test_a_dynamic_rpc_group_keeps_its_members_where_gradsync_edits_them():
    """rpc_group reads and edits torch's member list under torch's per-init prefix, and leaves through the
    current agent: a one-member dynamic group (init_rpc without world_size) in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _DYNAMIC_GROUP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["w0-0,", "1", "w0", "7.0"]


def test_the_group_join_token_is_the_one_gradsync_releases():
    """A joiner that died holding torch's join token is replaced by releasing it as torch does."""
    utils = inspect.getsource(rpc._utils._group_membership_management)
    assert f'"{ti.RPC_JOIN_TOKEN}"' in utils and f'"{ti.RPC_JOIN_DONE}"' in utils
    assert 'f"Token_for_{name}_{join_or_leave}"' in utils and ti.rpc_join_token("w1") == "Token_for_w1_join"


def test_ddp_reducer_offers_the_calls_of_a_shadow_round():
    reducer = torch._C._distributed_c10d.Reducer
    for name in ("_rebuild_buckets", "_get_zeros_like_grad_buckets", "_run_comm_hook", "_push_all_rebuilt_params"):
        assert hasattr(reducer, name), (f"DDP's Reducer has no {name}: "
                                        "gradsync's trainer.join() under allreduce needs it")
    assert "reducer" in inspect.getsource(DDP.__init__)


def test_pytree_round_trips_a_nested_output():
    out = {"a": torch.ones(2), "b": [torch.zeros(1), (3, torch.full((1,), 2.0))]}
    leaves, spec = ti.tree_flatten(out)
    assert len(leaves) == 4
    back = ti.tree_unflatten(leaves, spec)
    assert back["b"][1][0] == 3 and torch.equal(back["b"][1][1], torch.full((1,), 2.0))


def test_sparse_parts_are_an_uncoalesced_gradients_stored_rows_and_indices():
    """An embedding's sparse gradient is uncoalesced (an id looked up twice is stored twice): public values()
    refuses it; sparse_parts gives what is stored, the bytes DDP's sparse allreduce moves."""
    table = torch.nn.Embedding(5, 3, sparse=True)
    table(torch.tensor([1, 4, 1])).sum().backward()
    grad = table.weight.grad
    assert not grad.is_coalesced()
    with pytest.raises(RuntimeError):
        grad.values()
    values, indices = ti.sparse_parts(grad)
    assert indices.tolist() == [[1, 4, 1]]
    assert torch.equal(values, torch.ones(3, 3))


@pytest.mark.job
@pytest.mark.timeout(60)
def test_forkserver_pid_is_the_running_fork_server():
    context = multiprocessing.get_context("forkserver")
    multiprocessing.forkserver.ensure_running()
    pid = ti.forkserver_pid()
    assert isinstance(pid, int) and pid > 0
    assert procfs.parent(pid) == os.getpid()
    assert context is not None


def _fork_server_forgotten() -> tuple:
    """In a child of the fork server: whether it held the fork server's liveness pipe, its start method, and after
    `forget_fork_server`: whether it still holds the pipe, its start method, the fork server it knows and whether
    a fork server's lock is free, as in a new process."""
    server = multiprocessing.forkserver._forkserver
    alive = server._forkserver_alive_fd
    held = alive is not None and os.fstat(alive) is not None
    method = multiprocessing.get_start_method(allow_none=True)
    ti.forget_fork_server()
    fd_open = True
    try:
        os.fstat(alive)
    except OSError:
        fd_open = False
    free = server._lock.acquire(blocking=False)
    return (held, method, fd_open, server._forkserver_alive_fd, multiprocessing.get_start_method(allow_none=True),
            ti.forkserver_pid(), server._forkserver_address, free)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_fork_server_child_forgets_the_fork_server_as_a_new_process_knows_none():
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        assert pool.apply(_fork_server_forgotten) == (True, "forkserver", False, None, None, None, None, True)


_FORKED_SERVER = """
import multiprocessing, os, sys, tempfile
import numpy, torch  # numpy's native thread pool starts at import, as in any fork server's parent
from gradsync.core import torch_internals as ti
from gradsync.launcher import procfs
launchers_file = tempfile.NamedTemporaryFile()
ti.fork_fork_server()
server = ti.forkserver_pid()
parent = procfs.parent(server)
from test_torch_internals import _fork_server_forgotten
with multiprocessing.get_context("forkserver").Pool(1) as pool:  # children served as by a new interpreter's
    child_parent = pool.apply(os.getppid)
    files = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]  # now it serves
    forgotten = pool.apply(_fork_server_forgotten)  # forked inside the fork server's lock: a child must free it
print(server, parent == os.getpid(), child_parent == server, launchers_file.name not in files,
      forgotten == (True, "forkserver", False, None, None, None, None, True), flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_fork_server_forked_from_its_launcher_serves_its_children_and_ends_with_the_launcher():
    # in this file's folder, and tests/support/ for the helpers it imports: the child imports it
    path = os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])
    launcher = subprocess.Popen([sys.executable, "-c", _FORKED_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=os.path.dirname(__file__), env={**os.environ, "PYTHONPATH": path})
    server = None
    try:
        server, *checks = launcher.stdout.readline().split()
        server = int(server)
        # the launcher's child, the parent of the children it serves, holding none of the launcher's files; its
        # children forget it as a new process knows none
        assert checks == ["True", "True", "True", "True"]
        assert not gone(server)
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not gone(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(server), "the fork server outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        if server is not None and not gone(server):  # a failed check leaves no process behind
            os.kill(server, signal.SIGKILL)


_LONG_TMPDIR = """
import multiprocessing.forkserver, multiprocessing.util, os
from gradsync.core import torch_internals as ti
ti.short_fork_server_folder()
multiprocessing.forkserver.ensure_running()  # its socket in that folder: "AF_UNIX path too long" under the long TMPDIR
print(os.path.dirname(multiprocessing.util.get_temp_dir()))
"""


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_fork_server_starts_under_a_tmpdir_too_long_for_its_socket(tmp_path):
    long = tmp_path / ("d" * 90)
    long.mkdir()
    done = subprocess.run([sys.executable, "-c", _LONG_TMPDIR], capture_output=True, text=True, timeout=50,
                          env={**os.environ, "TMPDIR": str(long)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/tmp"


_LOG_LEVEL = """
import sys, torch.distributed as dist
from gradsync.core import torch_internals as ti
level = ti.cpp_log_level()
print(level.value)
dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
sys.stderr.write("set to ERROR\\n")
sys.stderr.flush()
level.value = 2
dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
"""


@pytest.mark.job
def test_the_cpp_log_level_is_the_one_torch_read_and_setting_it_takes_effect():
    """cpp_log_level: TORCH_CPP_LOG_LEVEL=INFO at import is 0, and c10d's INFO lines stop once it is ERROR."""
    done = subprocess.run([sys.executable, "-c", _LOG_LEVEL], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCH_CPP_LOG_LEVEL": "INFO"})
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr
    before, after = done.stderr.split("set to ERROR\n")
    assert "[c10d]" in before and after == "", done.stderr


_LEAKS_A_SEMAPHORE = """
import multiprocessing, os, sys
from gradsync.core import torch_internals as ti
if sys.argv[1] == "quiet":
    ti.quiet_resource_tracker()
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, registered with the resource tracker
os._exit(0)  # as a process stopped by a signal: nothing released
"""


@pytest.mark.job
@pytest.mark.timeout(60)
@pytest.mark.parametrize("tracker", ["quiet", "plain"])
def test_a_quiet_resource_tracker_cleans_up_a_stopped_process_without_its_leak_warning(tracker):
    done = subprocess.run([sys.executable, "-c", _LEAKS_A_SEMAPHORE, tracker], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0
    assert ("leaked semaphore objects" in done.stderr) == (tracker == "plain"), done.stderr
