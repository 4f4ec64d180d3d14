"""How a job names things: its rendezvous store's keys, and its ranks' RPC names."""


class StoreKeys:
    """Every key and prefix gradsync uses in the rendezvous store (`{}`: a shard, worker or global rank index)."""

    FAILED = "gradsync/failed"
    ALIVE = "gradsync/alive/{}"
    MOVED = "gradsync/moved/{}"  # +1 at each heartbeat of rank {} (a worker) whose main thread moved since the last
    LEFT = "gradsync/left"
    GONE = "gradsync/gone"  # workers that left an elastic job without gradsync.shutdown(): `worker:how` lines
    TRAINERS = "gradsync/trainers"  # `worker,` entries: the workers that have begun to build their Trainer
    EXITED = "gradsync/exited"  # `worker,` entries: workers whose interpreter exited without gradsync.shutdown()
    WORKERS = "gradsync/workers"  # worker indices handed out: the job's workers, then one more per joiner
    EARLY_STDERR = "gradsync/early_stderr/{}"  # sha256 of what a rank wrote before init: a rank wrote that text
    JOB = "gradsync/job"  # an elastic job's settings (GRADSYNC_* variables, JSON), for workers that join it
    RPC_SERVING = "gradsync/rpc_serving/{}"  # server s is in the dynamic RPC group of an elastic job
    RPC_MEMBERSHIP = "gradsync/rpc_membership"  # the rank that joins or leaves that group now
    PROCESS_GROUP = "gradsync/pg"
    # allreduce with worker_loss wait: generations of the workers' group (`worker.ddp.generations`): the latest
    # number the launcher gave (+1 as it starts a replacement); a generation's registered members; the state a
    # survivor left for the replacements of a generation
    GENERATION = "gradsync/generation"
    GENERATION_MEMBERS = "gradsync/generation/{}/members"
    HEALING = "gradsync/generation/{}/healing"
    RPC = "gradsync/rpc"
    TOKEN = "gradsync/grpc_token"
    # the job's id, which its run directory's files name (`transport.grpc.endpoint_files.job_id`)
    JOB_ID = "gradsync/job_id"
    PIECE_MB = "gradsync/piece_mb"  # the bucket cap worker 0 chose from the bandwidth it measured (ps)
    PIPELINE = "gradsync/pipeline"  # on | off: whether the job's sync steps go as a pipeline, worker 0's plan (ps)
    GRPC_ADDRESS = "gradsync/grpc/address/{}"
    GRPC_SETUP = "gradsync/grpc/setup/{}"
    GRPC_SPEC = "gradsync/grpc/spec/{}/{}"
    GRPC_REGISTERED = "gradsync/grpc/registered/{}"
    CHECKPOINT = "gradsync/checkpoint/{}/{}"  # step, worker: that worker wrote its state of that step
    RUN = "gradsync/run"  # rank 0's decision (JSON): the run this job checkpoints, and the folder it resumes from
    JOINS = "gradsync/joins"  # how many times a worker has joined (trainer.join()): numbers the events
    JOINED = "gradsync/joined/{}"  # event number: the worker that joined
    JOIN_DONE = "gradsync/join_done/{}/{}"  # round, shard: that server saw every worker join that round
    JOIN_ENTERED = "gradsync/join_entered/{}"  # round: `worker,` entries, the workers that opened trainer.join()
    STEP_BEGUN = "gradsync/step_begun/{}/{}"  # worker, step parity: that worker's step as it began, its RNG states
    SCALER = "gradsync/scaler/{}/{}"  # worker, step parity: `step:JSON`, its GradScaler's state after that step
    # replicas 1, once a server died: shard -> the RPC name of the server that serves it (its primary), that keeps
    # its replica ('': none); a dead server's RPC name; server rank -> `replacement:shards` once its replacement
    # keeps the replicas of those shards
    SHARD_PRIMARY = "gradsync/shard_primary/{}"
    SHARD_REPLICA = "gradsync/shard_replica/{}"
    SERVER_DEAD = "gradsync/server_dead/{}"
    REPLICAS_KEPT = "gradsync/replicas_kept/{}"
    REJOINED = "gradsync/rejoined/{}"  # worker: `replacement:step`, its latest replacement built its Trainer there


def server_name(index: int) -> str:
    return f"ps{index}"


def worker_name(index: int) -> str:
    return f"worker{index}"
