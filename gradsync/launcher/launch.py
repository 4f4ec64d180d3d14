"""`gradsync.launch`: run a function on every worker of a local job, servers and workers forked from a
fork server that has imported torch and gradsync once (`launcher.forked`); returns the workers' results.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback

import torch

from gradsync.config import JobConfig
from gradsync.core.settings import LAUNCHED, RANK
from gradsync.launcher.forked import become_rank, rank_starter
from gradsync.launcher.local_job import job_config, network_and_store, offer_join, rank_environments, temporary_run_dir
from gradsync.launcher.restarts import replacement_environment, restarting
from gradsync.launcher.supervision import RankProcess, kill_all, supervise
from gradsync.membership.departures import Results
from gradsync.runtime import cluster
from gradsync.runtime.failures import record_failure, say_failure
from gradsync.runtime.leaving import shutdown
from gradsync.runtime.start import init


def _run_function(env: dict, call: bytes, result_path: str, namespace: str | None) -> None:
    """Body of a forked rank: become the rank `env` describes (`forked.become_rank`), init, then fn(*args)
    (`call`, pickled by the launcher) on workers; a failure is recorded for the launcher."""
    try:
        become_rank({**env, LAUNCHED.env: "1"}, namespace)
        fn, args = _unpickle_call(call)
        init()
        result = fn(*args)
        shutdown()
        torch.save(result, result_path)
    except BaseException:
        say_failure(record_failure(cluster.running(), int(env[RANK.env]), traceback.format_exc()))
        os._exit(1)


def _unpickle_call(call: bytes):
    """(fn, args) as `launch` pickled them; the error of a function the rank cannot find says why."""
    try:
        return pickle.loads(call)
    except AttributeError as e:
        if "__main__" not in str(e) and "__mp_main__" not in str(e):
            raise
        raise AttributeError(
            f"{e}: gradsync.launch's function must be defined at the top level of its module, since each rank "
            'imports the main script again without running its `if __name__ == "__main__":` block (nor '
            "another function's body): move the function there, or into a module of its own"
        ) from e


def launch(
    fn,
    *,
    strategy: str,
    workers: int,
    servers: int | None = None,
    mode: str = "sync",
    args: tuple = (),
    timeout: float | None = None,
    link: str | None = None,
    server_link: str | None = None,
    **settings,
) -> Results:
    """Run `fn(*args)` on each worker of a local job and return the results in worker order.

    Every rank's environment is this process's at the call, plus the job's settings (as a subprocess's
    would be, though the ranks are forked from a fork server started once).

    In an async or ssp ps job a worker that dies (killed, or exited without an exception and without
    gradsync.shutdown()) does not stop the job: its result is None, the returned list's `departures` says
    who left, when and at which step (also said on stderr), and the run directory (GRADSYNC_RUN_DIR on
    every rank) has the join.json that `gradsync run --join` takes.

    Args:
        fn: a picklable (module-level) function; it runs after `gradsync.init()` (a `gradsync.init()`
            call inside it joins this job, and so does a `gradsync.shutdown()`).
        strategy: 'ps', 'allreduce', 'hybrid' or 'sharded'; workers: W >= 1; servers: S (>= 1 for ps and
            hybrid, 0 for allreduce and sharded; None: 1 for ps and hybrid, 0 for allreduce and sharded, as
            `gradsync run`).
        mode: 'sync', 'async' or 'ssp'.
        timeout: seconds for the whole job (None: no limit).
        link: a tc rate (100mbit, 1gbit...): each rank in its own network namespace behind a link of that
            rate (`gradsync.launcher.netem`; root and iproute2); None: every rank on loopback.
        server_link: the parameter servers' links at this rate instead (with `link`): a slow server link.
        settings: other JobConfig fields (nonfinite, compression, step_timeout, ...); those not given come
            from the GRADSYNC_* environment, else their defaults.
    Raises:
        JobFailed: naming the rank that caused the failure, with its traceback (or, in an async or ssp job,
            the departures when every worker left).
    """
    if sys._getframe(1).f_globals.get("__name__") == "__mp_main__":  # a rank runs the calling script's top level
        raise RuntimeError(
            "gradsync.launch() was called again while a rank imported your script (each rank imports the "
            "script that called launch, to find the function it runs): put the call under "
            '`if __name__ == "__main__":`'
        )
    config = job_config("gradsync.launch", strategy, workers, servers, mode, **settings)
    call = pickle.dumps((fn, args))  # here, so that an unpicklable function fails before any rank starts
    return restarting(config, lambda config, restarts: _launched(config, call, timeout, link, server_link, restarts))


def _launched(
    config: JobConfig, call: bytes, timeout: float | None, link: str | None, server_link: str | None, restarts: int
):
    """One run of the job `launch` starts (the `restarts`-th restart of the whole job): its ranks, supervised;
    their results."""
    with contextlib.ExitStack() as stack:
        network, store = network_and_store(stack, config, 0, link, server_link)
        run_dir = temporary_run_dir(stack, "gradsync-launch-")
        offer_join(config, run_dir, store, network)
        context, _ = rank_starter()
        environments = rank_environments(config, store.port, run_dir, network, restarts)
        ranks: list[RankProcess] = []

        def start(rank: int, extra: dict[str, str]) -> RankProcess:
            result_path = os.path.join(run_dir, f"result-{rank}.pt")
            namespace = network.namespaces[rank] if network else None
            env = {**os.environ, **environments[rank], **extra}
            proc = context.Process(target=_run_function, args=(env, call, result_path, namespace), daemon=False)
            proc.start()
            return RankProcess(rank, proc)

        try:
            ranks.extend(start(rank, {}) for rank in range(config.world_size))
            departures = supervise(
                config, ranks, run_dir, store, timeout, lambda rank, n: start(rank, replacement_environment(n))
            )
            paths = [os.path.join(run_dir, f"result-{rank}.pt") for rank in range(config.servers, config.world_size)]
            # fn's return values, any picklable object, from the job's own ranks through a 0700 directory
            return Results(
                [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths], departures
            )
        finally:
            kill_all(ranks)
