"""Every private PyTorch (and standard-library) interface gradsync relies on, in one place.

Each is used because the public API has no equivalent, said per item. Each function names the private names it
uses (`_uses`), checked at its first call: a torch without one fails there with one line naming it and the torch
version (`TorchChanged`), not deep inside a job. `tests/core/test_torch_internals.py` checks each name and each
behaviour against the installed torch; the suite passes on the versions `TESTED_TORCH` lists (setup.py admits
newer ones, which these checks guard).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import importlib
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

TESTED_TORCH = ("2.13", "2.14")
"""The torch versions (major.minor) the whole suite passed on (`make test`, `make test-torch-next`)."""

__all__ = [
    "TESTED_TORCH",
    "TorchChanged",
    "tree_flatten",
    "tree_unflatten",
    "start_dist_autograd",
    "current_context_id",
    "set_rpc_timeout",
    "current_rpc_agent",
    "rpc_init_count",
    "RPC_STORE_PREFIX",
    "RPC_MEMBER_LIST",
    "RPC_JOIN_TOKEN",
    "rpc_join_token",
    "RPC_JOIN_DONE",
    "RPC_TIMEOUT_TEXT",
    "ddp_shadow_round",
    "ddp_push_rebuilt_params",
    "forkserver_pid",
    "short_fork_server_folder",
    "fork_fork_server",
    "forget_fork_server",
    "cpp_log_level",
    "take_over_step",
    "before_clip_grad_norm",
    "importing_main_for_a_child",
    "quiet_resource_tracker",
    "sparse_parts",
    "gloo_group",
]


class TorchChanged(RuntimeError):
    """The installed torch (or Python) lacks a private name gradsync relies on."""


def _require(name: str, user: str) -> None:
    """Resolve `name` ('module:attribute.attribute'), or raise TorchChanged naming it, `user` and the versions."""
    module, _, attributes = name.partition(":")
    try:
        found = importlib.import_module(module)
        for attribute in filter(None, attributes.split(".")):
            found = getattr(found, attribute)
    except (ImportError, AttributeError):
        raise TorchChanged(
            f"gradsync needs {name.replace(':', '.')} (in {user}), which torch {torch.__version__} on Python "
            f"{sys.version.split()[0]} does not have: gradsync was tested on torch {', '.join(TESTED_TORCH)}; "
            f"install one of those (pip install 'torch~={TESTED_TORCH[-1]}.0'), or a gradsync that supports this "
            "torch"
        ) from None


def _uses(*names: str):
    """Decorator: check the private `names` a function uses ('module:attribute.attribute') at its first call."""

    def decorate(fn):
        checked: list[bool] = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not checked:
                for name in names:
                    _require(name, f"gradsync's {fn.__name__}")
                checked.append(True)
            return fn(*args, **kwargs)

        call.private_names = names  # type: ignore[attr-defined]  # a mark on the wrapper
        return call

    return decorate


@_uses("torch.utils._pytree:tree_flatten")
def tree_flatten(tree) -> tuple[list, object]:
    """The tensors (leaves) of any nested output and its structure: DDP's own way to find them."""
    return torch.utils._pytree.tree_flatten(tree)


@_uses("torch.utils._pytree:tree_unflatten")
def tree_unflatten(leaves: list, spec) -> object:
    """`tree_flatten`'s output rebuilt from `leaves`."""
    return torch.utils._pytree.tree_unflatten(leaves, spec)


@_uses("torch.distributed.autograd:_init")
def start_dist_autograd(rank: int) -> None:
    """Make `dist_autograd.context()` usable in a process without an RPC agent (the gRPC transport): the
    agent's start does this, and nothing public does it alone."""
    dist_autograd._init(rank)


@_uses("torch.distributed.autograd:_current_context")
def current_context_id() -> int | None:
    """The id of the active dist_autograd context, or None outside one (no public accessor)."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


@_uses(
    "torch.distributed:ProcessGroup._set_default_backend",
    "torch.distributed:ProcessGroup._register_backend",
    "torch.distributed:ProcessGroupGloo._set_sequence_number_for_group",
)
def gloo_group(store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo process group of `size` ranks over `store` (its keys under a prefix of the caller's), made without
    the default group: `dist.new_group` is a collective of every rank of that group, which a group formed after
    a death cannot call. Its collectives are its own methods (`group.allreduce([t])`): `dist.broadcast` and
    others refuse a group that `dist.new_group` did not register."""
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


@_uses("torch:Tensor._values", "torch:Tensor._indices")
def sparse_parts(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's rows and indices as they are stored: the public `values()`/`indices()` refuse an
    uncoalesced tensor (an embedding's sparse gradient is one), and coalescing would copy it."""
    return grad._values(), grad._indices()


@_uses("torch.distributed.rpc:_set_rpc_timeout")
def set_rpc_timeout(seconds: float) -> None:
    """The default timeout of later RPCs (init_rpc takes one for start-up only)."""
    rpc._set_rpc_timeout(seconds)


@_uses("torch.distributed.rpc:api._get_current_rpc_agent")
def current_rpc_agent():
    """This process's RPC agent: its metrics (calls still open) and its join, for leaving a dynamic group
    without torch's graceful shutdown, which would call every member."""
    return rpc.api._get_current_rpc_agent()


@_uses("torch.distributed.rpc:_init_counter")
def rpc_init_count() -> int:
    """How many times this process has started RPC: torch prefixes its store keys with it."""
    return rpc._init_counter


# How torch's dynamic RPC group (init_rpc without world_size) keeps its members in the store.
RPC_STORE_PREFIX = "rpc_prefix_{}"
"""The prefix of torch's RPC keys in the rendezvous store, formatted with `rpc_init_count()`."""
RPC_MEMBER_LIST = "names/_ALL_WORKER_INFOS"
"""The store key listing the group's members as `name-rank,` entries."""
RPC_JOIN_TOKEN = "RpcGroupManagementToken"
"""The store key of the token a rank holds while it joins or leaves the group."""
RPC_JOIN_DONE = "Done"
"""The value torch's waiters wait for under `rpc_join_token(holder)`."""
RPC_TIMEOUT_TEXT = "RPC ran for more than set timeout"
"""How torch's RuntimeError for an RPC past its timeout begins (torch raises no TimeoutError of its own)."""


def rpc_join_token(holder: str) -> str:
    """The token value (and the key waiters watch) of `holder` joining."""
    return f"Token_for_{holder}_join"


@_uses(
    "torch._C._distributed_c10d:Reducer._rebuild_buckets",
    "torch._C._distributed_c10d:Reducer._get_zeros_like_grad_buckets",
    "torch._C._distributed_c10d:Reducer._run_comm_hook",
)
def ddp_shadow_round(reducer) -> tuple[list, list]:
    """One backward pass's collectives of DDP's `reducer` with zero gradients, for a worker that ran out of
    data (DDP's own `join()` does the same through these calls; it has no form that a dist_autograd
    context can use). Returns the reducer's buckets and the futures of their communication hooks, in the
    order the reducer reduces them."""
    reducer._rebuild_buckets()  # DDP's once-per-job bucket rebuild broadcasts; joined workers take part
    buckets = reducer._get_zeros_like_grad_buckets()
    futures = [reducer._run_comm_hook(bucket) for bucket in buckets]
    return buckets, futures


@_uses("torch._C._distributed_c10d:Reducer._push_all_rebuilt_params")
def ddp_push_rebuilt_params(reducer) -> None:
    """Let a worker that never stepped take part in DDP's bucket rebuild (after `ddp_shadow_round`)."""
    reducer._push_all_rebuilt_params()


@_uses("multiprocessing.forkserver:_forkserver._forkserver_pid")
def forkserver_pid() -> int:
    """The pid of this process's fork server (the parent of the ranks it starts; no public accessor)."""
    server: Any = multiprocessing.forkserver._forkserver  # its private attributes are untyped
    return server._forkserver_pid


@_uses("multiprocessing.util:get_temp_dir")
def short_fork_server_folder() -> None:
    """Make the folder where multiprocessing puts its fork server's socket (`util.get_temp_dir`, a private folder
    made once per process under TMPDIR) under /tmp when TMPDIR is so long that the socket's path would pass
    AF_UNIX's 107 bytes (pytest's tmp_path does: "AF_UNIX path too long"). Nothing public moves it."""
    longest = os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8, "listener-" + "x" * 8)
    if len(os.fsencode(longest)) <= 100:
        return
    saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        multiprocessing.util.get_temp_dir()  # made now, kept for the process, removed at its exit
    finally:
        tempfile.tempdir = saved


@_uses(
    "multiprocessing.forkserver:_forkserver._lock",
    "multiprocessing.forkserver:_forkserver._forkserver_address",
    "multiprocessing.forkserver:main",
    "multiprocessing.connection:arbitrary_address",
    "multiprocessing.util:is_abstract_socket_namespace",
)
def fork_fork_server() -> None:
    """Start multiprocessing's fork server as a fork of this process, which has imported what its children need,
    rather than as a new interpreter that imports it all again (what `forkserver.ensure_running` does). The same
    server (`forkserver.main`) and the same state in this process afterwards; it must hold no thread but the main
    one (import-time native pools excepted, as in any fork server); once this process has died, however, the
    server removes this process's multiprocessing folder (`util.get_temp_dir`, which holds its socket), which a
    SIGKILLed process leaves. Nothing public starts a fork server from a fork."""
    server: Any = multiprocessing.forkserver._forkserver  # its private attributes are untyped
    with server._lock:
        if server._forkserver_pid is not None:
            raise RuntimeError("this process has a fork server already")
        multiprocessing.resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # private
            listener.bind(address)
            if not multiprocessing.util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # EOF on alive_r, once every holder of alive_w is gone, ends the server
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    keep = sorted({0, 1, 2, listener.fileno(), alive_r})
                    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
                        if high > low + 1:  # closerange(n, n) closes every fd from n on (python 3.11)
                            os.closerange(low + 1, high)  # as a new interpreter: only the fds passed to it
                    multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
                except SystemExit:  # EOF on alive_r: its parent died, maybe by SIGKILL: remove the socket's folder
                    shutil.rmtree(os.path.dirname(address), ignore_errors=True)
                except Exception:  # noqa: BLE001 -- said here: the launcher sees only a refused connection
                    sys.excepthook(*sys.exc_info())
                finally:
                    os._exit(0)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


@_uses("multiprocessing.forkserver:_forkserver._forkserver_alive_fd")
def forget_fork_server() -> None:
    """In a process the fork server forked: multiprocessing as a new `python SCRIPT` finds it. No start method
    chosen (the fork server's child has 'forkserver' set, so a `DataLoader(num_workers>0)` would start its workers
    through a fork server of the rank's own), and no fork server known: the one inherited is the launcher's (its
    address, its pid), and its lock is held (`fork_fork_server` forks inside it), so the rank's first
    `ensure_running` would wait forever. The rank's copy of the pipe whose end tells the fork server that its
    launcher is gone is closed, so the fork server exits, and its ranks with it, when the launcher dies, not when
    the last rank does. The launcher's resource tracker stays the rank's: it cleans up after a rank that was killed.
    Nothing public resets any of it."""
    server: Any = multiprocessing.forkserver._forkserver  # its private attributes are untyped
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server.__init__()  # the module's functions are bound to this instance: reset it, not replace it
    multiprocessing.set_start_method(None, force=True)


def cpp_log_level() -> ctypes.c_int32:
    """torch's C++ log level, writable (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL): TORCH_CPP_LOG_LEVEL sets it once, when
    torch is imported, and no public call sets it later. c10's FLAGS_caffe2_log_level, which c10d reads at each line."""
    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))  # loaded already: the same one
    return ctypes.c_int32.in_dll(c10, "FLAGS_caffe2_log_level")


def take_over_step(optimizer: torch.optim.Optimizer, step) -> Callable[..., Any]:
    """Make `step` the optimizer's `step` (called with the same arguments); returns the step it replaces. torch's
    LR schedulers track an optimizer's steps by wrapping its `step` (marked `_wrapped_by_lr_sched`, setting
    `_opt_called` when called): the new step carries the mark, so a scheduler built later leaves it in place, and
    sets `_opt_called` itself, so no scheduler warns that the optimizer never stepped or was replaced. Nothing
    public lets a scheduler watch another step."""
    replaced = optimizer.step

    # the schedulers' marks are private attributes torch's stubs do not declare
    def tracked(*args, **kwargs):
        result = step(*args, **kwargs)
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return result

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]  # the instance's step, replaced
    return replaced


@_uses("torch.nn.utils.clip_grad:_get_total_norm")
def before_clip_grad_norm(hook) -> None:
    """Call `hook(grads)` at each `torch.nn.utils.clip_grad_norm_` with the gradients it found, under whatever name
    the script imported it: wraps clip_grad's `_get_total_norm`, which it looks up at each call. Nothing public
    observes a call."""
    module = torch.nn.utils.clip_grad
    inner = module._get_total_norm

    def total_norm(tensors, *args, **kwargs):
        hook(tensors)
        return inner(tensors, *args, **kwargs)

    module._get_total_norm = total_norm


def importing_main_for_a_child() -> bool:
    """Whether this process is a spawned (or fork server's) child importing the parent's main script before it
    runs its target: a DataLoader worker under the 'spawn' or 'forkserver' start method does so. multiprocessing
    marks it on the current process (`_inheriting`) and says so publicly only in an error."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker of this process (a launcher: its ranks share it) so that it cleans
    up what a rank stopped by a signal left registered (the named semaphores of a 'spawn' or 'forkserver'
    DataLoader) without its "leaked semaphore objects" warning: a rank the launcher stops cannot release them,
    and the warning would blame the user's script. The tracker is a new interpreter that takes this process's
    -W options (`sys.warnoptions`) at its start, its only configuration."""
    quiet = "ignore:resource_tracker:UserWarning"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)
    multiprocessing.resource_tracker.ensure_running()
