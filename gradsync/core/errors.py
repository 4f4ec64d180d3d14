"""The errors gradsync raises (a failed job, and what both strategies raise), worded in one place."""

from __future__ import annotations

import re


class JobFailed(RuntimeError):
    """A rank of a launched job failed; the message names it and holds its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class NoTablesToServe(ValueError):
    """The hybrid strategy found no embedding table it could serve in the model (`gradsync compare` skips
    such a run instead of counting it failed)."""


class Refusal(ValueError):
    """A parameter server refused a call for what the call carries: the caller's fault, not the server's (any
    other exception of a server's handler is the server's failure: `server_failure_error`); nothing was changed."""


class GradientError(Refusal):
    """A pushed gradient is unusable (wrong shape/dtype, non-finite, stale); nothing was changed."""


def nonfinite_error(name: str, worker: int | str) -> GradientError:
    """NaN/Inf in parameter `name`'s gradient from `worker` (an id, or words when no single worker is to blame)."""
    return GradientError(
        f"non-finite gradient (NaN or Inf) for parameter {name!r} from worker {worker}: "
        "lower the learning rate or check the loss; pass nonfinite='skip' to gradsync.init "
        "(or GRADSYNC_NONFINITE=skip) to drop such steps instead"
    )


def bad_id_error(table: str, rows: int, bad: int, worker: int) -> IndexError:
    """Worker `worker`'s batch looked up id `bad`, outside table `table`'s rows 0..rows-1 (sharded: every worker
    raises it, having exchanged nothing)."""
    return IndexError(
        f"table {table!r} has rows 0..{rows - 1}, but a batch looked up id {bad} on worker {worker}: "
        "fix the input ids (nothing was looked up or applied)"
    )


_BAD_ID_ON = re.compile(r"table '.*?' has rows 0\.\.\d+, but a batch looked up id -?\d+ on worker (\d+):")


_NONFINITE_FROM = re.compile(r"non-finite gradient \(NaN or Inf\) for parameter '.*?' from worker (\d+):")


_OUTSIDE_JOIN = re.compile(r"worker (\d+)(?:, worker \d+)* did not enter trainer\.join\(\)")


def blamed_worker(text: str) -> int | None:
    """The worker a failure's text names as its cause (the sender of a non-finite gradient in
    `nonfinite_error`, the first worker outside the block in `outside_join_error`, the worker whose batch held
    a bad id in `bad_id_error`), None when it names none."""
    found = _NONFINITE_FROM.search(text) or _OUTSIDE_JOIN.search(text) or _BAD_ID_ON.search(text)
    return int(found.group(1)) if found else None


_ANSWERING = re.compile(r"server \d+ failed answering worker (\d+)'s ")


def failed_answering(server: int, call: str, worker: int | None) -> str:
    """'server 0 failed answering worker 1's push' (`worker` None: 'a push')."""
    return f"server {server} failed answering " + (f"worker {worker}'s {call}" if worker is not None else f"a {call}")


def server_failure_error(server: int, call: str, worker: int | None, error: BaseException) -> RuntimeError:
    """Server `server` failed answering `call` (of `worker`, when known) with `error`, which is its own failure,
    not the call's: what the caller is answered."""
    return RuntimeError(
        f"{failed_answering(server, call, worker)} ({type(error).__name__}: {error}): the failure "
        "is the server's, headlined with its traceback"
    )


def answered_worker(text: str) -> int | None:
    """The worker whose call a server failed answering (`server_failure_error`), None when `text` names none."""
    found = _ANSWERING.search(text)
    return int(found.group(1)) if found else None


def _named(workers: list[int]) -> str:
    return ", ".join(f"worker {w}" for w in workers)


def no_trainer_error(missing: list[int], built: list[int], seconds: float) -> RuntimeError:
    """Workers `missing` did not begin to build their Trainer within `seconds` (startup_timeout) of `built` building
    theirs (allreduce: DDP's construction waits for every worker)."""
    return RuntimeError(
        f"{_named(missing)} did not build a gradsync.Trainer within startup_timeout ({seconds:.0f} s) of "
        f"{_named(built)} building its own: every worker must build one (building it is a collective that waits "
        "for every worker)"
    )


def outside_join_error(outside: list[int], inside: list[int], seconds: float) -> RuntimeError:
    """Workers `outside` did not open trainer.join() within `seconds` of `inside` opening it (allreduce)."""
    return RuntimeError(
        f"{_named(outside)} did not enter trainer.join() within {seconds:.0f} s (half the step timeout) of "
        f"{_named(inside)} entering it: every worker must train inside `with trainer.join():` (under allreduce a "
        "worker that trains outside it sends its gradients while the workers inside count the active workers, a "
        "collective mismatch). Open the block on every worker around the same loop"
    )


def model_mismatch_error(worker: int, diff: str) -> ValueError:
    """Worker `worker` built a different model than worker 0 (`diff` says how)."""
    return ValueError(
        f"worker {worker}'s model differs from worker 0's: {diff}. Every worker must build the "
        "same model (same classes, same constructor arguments)"
    )


def left_early_error(worker: int, steps: int, waiting: str) -> RuntimeError:
    """Worker `worker` left the job after `steps` steps, while `waiting` (who, at which step) needs it."""
    return RuntimeError(
        f"worker {worker} left the job (its training function returned, or it called gradsync.shutdown) after "
        f"{steps} steps, and {waiting} waits for it: in sync training every worker must take the same number "
        "of steps. Train inside `with trainer.join():` on every worker (workers with fewer batches join and the "
        "others go on), or give every worker the same number of batches (e.g. DistributedSampler(..., "
        "drop_last=True), or stop all workers at the smallest batch count), or use --mode async with the ps "
        "strategy"
    )


def step_twice_error(context_id: int) -> RuntimeError:
    """trainer.step(context_id) again for a context it already committed."""
    return RuntimeError(
        f"step({context_id}) was already called for this context: call trainer.step(context_id) "
        "once per dist_autograd.context(), after its backward"
    )


def init_in_a_child_error() -> RuntimeError:
    """gradsync.init() run while a spawned child (a DataLoader worker) imports the main script."""
    return RuntimeError(
        "gradsync.init() ran while a child process (a DataLoader worker with the 'spawn' or 'forkserver' start "
        "method) imported your script: such children import the main script again, so the training must not run "
        'at import. Put it under `if __name__ == "__main__":` (as python\'s multiprocessing requires), or use '
        "the DataLoader's default start method"
    )


def outside_context_error(context_id: int) -> RuntimeError:
    """trainer.step(context_id) where `context_id` is not the dist_autograd context open now."""
    return RuntimeError(
        f"trainer.step({context_id}) was called outside its dist_autograd context: call it inside "
        "the `with dist_autograd.context() as cid:` block, after dist_autograd.backward(cid, [loss])"
    )


def optimizer_step_error() -> RuntimeError:
    """optimizer.step() called by anyone but trainer.step."""
    return RuntimeError(
        "call trainer.step(context_id) once per step, inside the dist_autograd context after its backward, not "
        "optimizer.step() (nor scaler.step(optimizer): pass the scaler, trainer.step(cid, scaler)): the step's "
        "gradients live in its context, where trainer.step applies them (under ps the parameter servers apply the "
        "optimizer), and it steps your optimizer too, so LR schedulers see the step"
    )


def no_gradients_error(context_id: int) -> RuntimeError:
    """trainer.step(context_id) for a context whose backward produced no gradient."""
    return RuntimeError(
        f"step({context_id}) found no gradients in that context: call "
        "dist_autograd.backward(context_id, [loss]) in the same dist_autograd.context() before "
        "trainer.step(context_id)"
    )


def not_replaced_error(what: str) -> ValueError:
    """An allreduce job with worker_loss wait whose model or loop has `what`, which a replacement cannot rejoin yet."""
    return ValueError(
        f"worker_loss='wait' under the allreduce strategy with {what}: a dead worker's replacement does not rejoin "
        "such a job yet; pass --worker-loss fail with --checkpoint-dir/--checkpoint-every to resume after a death, "
        "or use the ps strategy, whose replacements take those too"
    )


def no_survivor_error(workers: int) -> RuntimeError:
    """Every worker of an allreduce job with worker_loss wait died at once: none holds the job's state."""
    return RuntimeError(
        f"all {workers} workers of the job died at once, so no live worker holds the state their replacements "
        "would continue from: resume the job from its latest checkpoint (--resume)"
    )
