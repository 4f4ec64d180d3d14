"""The dynamic torch RPC group of an elastic job (async and ssp ps): workers may die, leave, and join.

A static RPC group (`init_rpc(world_size=N)`) has a fixed list of members and a graceful shutdown that
waits for every one of them; nobody can join it. In a dynamic group (torch 2.13, `init_rpc(world_size=None)`)
a new member, holding a membership token in the store, reads the members listed there
(`names/_ALL_WORKER_INFOS`, `name-rank,` entries) and calls each of them before its init returns. A member
that died stays listed, so every later join would call it and fail, leaving the token taken; torch's
graceful leave calls every member too. So gradsync runs the group this way:

- servers join first, and each marks it in the store (`RPC_SERVING`); workers wait for all of them, since
  a worker calls servers only;
- one worker at a time joins (a lock in the store, taken over from a holder recorded gone), and takes
  itself off torch's list before it lets the next one in: every worker's join calls the servers only; but in
  a job whose servers keep replicas, whose dead server's replacement takes the dead one off the list and
  joins, calling every worker, so that they can reach it (so does a dead worker's replacement there: each
  takes the dead processes its launcher recorded off the list first);
- nobody leaves through torch's graceful shutdown: a worker stops its agent once its own calls are
  answered, servers once every worker has left (`leave`), after torch's own leave of the group (which
  marks the agent as shutting down, so that it does not log its closing connections). A server still
  logs one TensorPipe warning ("EOF") per worker that leaves while it runs;
- each agent has a store connection of its own (`transport.rpc.start_rpc`): a member answers a joiner by
  reading the store, which must not queue behind a blocking store call of its main thread.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.rpc as rpc

from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys, worker_name
from gradsync.core.torch_internals import (
    RPC_JOIN_DONE,
    RPC_JOIN_TOKEN,
    RPC_MEMBER_LIST,
    RPC_STORE_PREFIX,
    current_rpc_agent,
    rpc_init_count,
    rpc_join_token,
)
from gradsync.core.waiting import wait_until
from gradsync.membership import lost_servers
from gradsync.membership.member_keys import parse_gone


def join(config: JobConfig, store: dist.Store, init: Callable[[], None]) -> None:
    """Run `init` (this rank's rpc.init_rpc in the dynamic group) in gradsync's order. Every rank of an
    elastic job calls it; a worker that joins the running job too."""
    if config.is_server:
        if config.replacement:  # a dead server's (replicas 1): the dead one is off torch's list before it joins
            torch_store = _torch_store(store, rpc_init_count())
            with _MembershipLock(store, torch_store, config, config.startup_timeout, "startup_timeout"):
                _unlist_dead(torch_store, store)
                init()
        else:
            init()
        store.set(StoreKeys.RPC_SERVING.format(config.rank), "1")
        return
    try:
        store.wait(
            [StoreKeys.RPC_SERVING.format(s) for s in range(config.servers)],
            datetime.timedelta(seconds=config.startup_timeout),
        )
    except dist.DistError as e:
        raise RuntimeError(
            f"{config.name}: the servers did not start their RPC agents within "
            f"{config.startup_timeout:.0f} s (startup_timeout): {e}"
        ) from e
    torch_store = _torch_store(store, rpc_init_count())
    with _MembershipLock(store, torch_store, config, config.startup_timeout, "startup_timeout"):
        if config.replicated and config.replacement:  # dead workers stay listed: a join would call them
            _unlist_dead(torch_store, store)
        init()
        if not config.replicated:  # with replicas, a dead server's replacement joins and calls every worker
            _unlist(torch_store, config)


def leave(config: JobConfig, store: dist.Store, timeout: float) -> None:
    """Stop this rank's agent once its calls are answered (within `timeout` seconds), without torch's
    graceful shutdown, which would call every member. Before, torch's leave of the group (which takes this
    rank off torch's list, where a worker first puts itself back) marks the agent as shutting down, so that
    it does not log the closing of its connections as errors; it runs under the membership lock, since it
    rewrites the list."""
    agent = current_rpc_agent()
    deadline = time.monotonic() + timeout
    with contextlib.suppress(TimeoutError):  # e.g. the release of the last autograd context, sent when it closed
        wait_until(
            lambda: not int(agent.get_metrics()["agent.client_active_calls"]),
            deadline,
            f"{config.name}'s RPC calls to be answered",
        )
    try:
        if time.monotonic() < deadline:
            torch_store = _torch_store(store, rpc_init_count() - 1)
            with _MembershipLock(store, torch_store, config, deadline - time.monotonic(), "shutdown_timeout"):
                if not config.is_server and not config.replicated:
                    _relist(torch_store, config)
                agent.join(shutdown=True)
    except (RuntimeError, IndexError) as e:  # the agent stops all the same, logging its closing connections
        print(f"gradsync: {config.name} left the RPC group without torch's leave: {e}", file=sys.stderr, flush=True)
    finally:
        rpc.shutdown(graceful=False)


def _torch_store(store: dist.Store, init_counter: int) -> dist.Store:
    """The store as torch's RPC agent sees it: under gradsync's RPC prefix, then torch's per-init prefix."""
    return dist.PrefixStore(RPC_STORE_PREFIX.format(init_counter), dist.PrefixStore(StoreKeys.RPC, store))


def _unlist(torch_store: dist.Store, config: JobConfig) -> None:
    """Take this worker off torch's list of group members (hold the `_MembershipLock`)."""
    entry, listed = _entry(config), torch_store.get(RPC_MEMBER_LIST).decode()
    if entry not in listed:
        raise RuntimeError(
            f"{config.name} is not in torch's list of RPC group members ({listed!r}): this torch "
            "keeps dynamic RPC groups differently from torch 2.13, which gradsync expects"
        )
    torch_store.set(RPC_MEMBER_LIST, listed.replace(entry, "", 1))


def _unlist_dead(torch_store: dist.Store, store: dist.Store) -> None:
    """Take the processes recorded dead (`lost_servers.dead`: servers, and workers of a job with replicas) off
    torch's list of group members (hold the `_MembershipLock`): a member's join calls every member listed."""
    entries = [e for e in torch_store.get(RPC_MEMBER_LIST).decode().split(",") if e]
    kept = [e for e in entries if not lost_servers.dead(store, e.rpartition("-")[0])]
    torch_store.set(RPC_MEMBER_LIST, "".join(f"{e}," for e in kept))


def _relist(torch_store: dist.Store, config: JobConfig) -> None:
    """Put this worker back on torch's list, where torch's leave of the group removes it (hold the lock)."""
    torch_store.set(RPC_MEMBER_LIST, torch_store.get(RPC_MEMBER_LIST).decode() + _entry(config))


def _entry(config: JobConfig) -> str:
    name, rank = config.rpc_identity
    return f"{name}-{rank},"


class _MembershipLock:
    """Held by the one rank that changes the group now: a worker that joins (it holds torch's token inside,
    during its init and while it takes itself off torch's list), or a rank that leaves. A holder recorded
    gone (a worker that died while joining) is replaced, and torch's token, if it still names it, released."""

    def __init__(self, store: dist.Store, torch_store: dist.Store, config: JobConfig, timeout: float, setting: str):
        self.store, self.torch_store, self.config = store, torch_store, config
        self.timeout, self.setting = timeout, setting  # seconds to wait for it, and the setting they come from

    def __enter__(self):
        me, holder = self.config.rpc_identity[0], ""

        def held() -> bool:
            nonlocal holder
            holder = self.store.compare_set(StoreKeys.RPC_MEMBERSHIP, "", me).decode()
            if holder != me and self._gone(holder):
                self._release_token(holder)
                self.store.compare_set(StoreKeys.RPC_MEMBERSHIP, holder, "")
            return holder == me

        try:
            wait_until(held, time.monotonic() + self.timeout, "the job's RPC group membership")
        except TimeoutError:
            raise RuntimeError(
                f"{me} waited {self.timeout:.0f} s ({self.setting}) for {holder} to join or leave the job's RPC group"
            ) from None
        return self

    def __exit__(self, *exc):
        self.store.compare_set(StoreKeys.RPC_MEMBERSHIP, self.config.rpc_identity[0], "")

    def _gone(self, holder: str) -> bool:
        gone = parse_gone(self.store.get(StoreKeys.GONE))
        return any(worker_name(w) == holder for w in gone)

    def _release_token(self, holder: str) -> None:
        token = rpc_join_token(holder)
        if self.torch_store.compare_set(RPC_JOIN_TOKEN, token, "").decode() == "":
            self.torch_store.set(token, RPC_JOIN_DONE)  # torch's waiters wait for this key
