"""Serving one parameter server's gRPC service: `serve_grpc` starts a gRPC server whose handlers admit each
call (`gradsync.transport.grpc.admission`: the two tokens, the outside calls' slots, idle streams) and hand it to the
`Servicer` (`gradsync.transport.grpc.servicer`); `GrpcEndpoint` is the running endpoint."""

from __future__ import annotations

import concurrent.futures

import grpc

from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import tensor_codec
from gradsync.transport.grpc.admission import MEMBER, Admission, BearerAuth, Credentials, Refused
from gradsync.transport.grpc.servicer import SERVICE, Servicer, request_parser


def _guarded(
    name: str,
    method,
    admission: Admission,
    streaming_request: bool,
    streaming_response: bool,
    takes_role: bool,
    failure,
):
    """The handler of method `name`: admitted (`Admission`), its request and reply streams watched for a client
    that neither sends nor reads, `Refused` turned into the call's status code; any other exception of a
    member's call is told to `failure` (`Servicer.failure`: the server's own failure, or a refusal)."""

    def run(request, context, role):
        if streaming_request:
            request = admission.requests(request, context, role, name)
        return method(request, context, role == MEMBER) if takes_role else method(request, context)

    if streaming_response:

        def call_stream(request, context):
            try:
                with admission.admitted(name, context) as role:
                    try:
                        yield from admission.replies(run(request, context, role), context, role, name)
                    except Exception as e:
                        raise failure(e, name) if role == MEMBER else e  # noqa: B904 (it may be e itself; e stays the context)
            except Refused as e:
                context.abort(e.code, str(e))

        return call_stream

    def call(request, context):
        try:
            with admission.admitted(name, context) as role:
                try:
                    return run(request, context, role)
                except Exception as e:
                    raise failure(e, name) if role == MEMBER else e  # noqa: B904 (it may be e itself; e stays the context)
        except Refused as e:
            context.abort(e.code, str(e))

    return call


def _handlers(servicer: Servicer, admission: Admission) -> grpc.GenericRpcHandler:
    """Every method of the service: its request parser, the servicer's handler (counted, admitted, guarded),
    its serializer."""
    unary, unary_stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    stream_unary, stream_stream = grpc.stream_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler
    methods = {  # name: (kind, handler, request class, response serializer)
        "Health": (unary, servicer.health, pb.HealthRequest, pb.HealthResponse.SerializeToString),
        "GetStats": (unary, servicer.get_stats, pb.GetStatsRequest, pb.GetStatsResponse.SerializeToString),
        "Checkpoint": (unary, servicer.checkpoint, pb.CheckpointRequest, pb.CheckpointResponse.SerializeToString),
        "Pull": (unary_stream, servicer.pull, pb.PullRequest, tensor_codec.serialize),
        "Push": (stream_unary, servicer.push, pb.PushRequest, pb.PushResponse.SerializeToString),
        "PullRows": (unary_stream, servicer.pull_rows, pb.PullRowsRequest, tensor_codec.serialize),
        "JobPull": (unary_stream, servicer.job_pull, pb.JobPullRequest, tensor_codec.serialize),
        "JobPush": (stream_stream, servicer.job_push, pb.JobPushRequest, tensor_codec.serialize),
        "JobFinish": (unary_stream, servicer.job_finish, pb.JobFinishRequest, tensor_codec.serialize),
        "JobOptimizerState": (unary, servicer.job_optimizer_state, pb.PlainData, pb.PlainData.SerializeToString),
        "JobLoadOptimizerState": (
            unary,
            servicer.job_load_optimizer_state,
            pb.PlainData,
            pb.PlainData.SerializeToString,
        ),
        "JobLoadValues": (unary, servicer.job_load_values, pb.PlainData, pb.PlainData.SerializeToString),
        "JobCheckpoint": (unary, servicer.job_checkpoint, pb.PlainData, pb.PlainData.SerializeToString),
        "JobProbe": (unary, servicer.job_probe, pb.PlainData, pb.PlainData.SerializeToString),
    }

    def handler(name, kind, method, request_cls, serialize):
        def counted(request, context, *member):
            servicer.count(name)
            return method(request, context, *member)

        streaming_request = kind in (stream_unary, stream_stream)
        guarded = _guarded(
            name,
            counted,
            admission,
            streaming_request,
            kind in (unary_stream, stream_stream),
            takes_role=name == "Push",
            failure=servicer.failure,
        )
        return kind(guarded, request_parser(request_cls, chunks=streaming_request), serialize)

    return grpc.method_handlers_generic_handler(SERVICE, {n: handler(n, *m) for n, m in methods.items()})


class GrpcEndpoint:
    """A running gRPC endpoint: `.address` ("host:port"), `.port`, `.stop(grace)`."""

    def __init__(self, server: grpc.Server, host: str, port: int, admission: Admission):
        self._server = server
        self._admission = admission
        self.port = port
        self.address = f"{host}:{port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop accepting calls, let running ones finish for up to `grace` seconds, then cancel them."""
        self._server.stop(grace).wait(grace + 5.0)
        self._admission.idle.stop()


def serve_grpc(
    server_obj,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str,
    member_token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    checkpoint_dir: str | None = None,
    step_timeout: float = 300.0,
    max_workers: int | None = None,
    outside_calls: int = 8,
    idle_timeout: float = 10.0,
    job: str = "",
) -> GrpcEndpoint:
    """Serve one `ParameterServer` over gRPC (returns at once; the endpoint runs on its own threads).

    Args:
        server_obj: the `ParameterServer`; it may get its model (become ready) later.
        host, port: where to listen; port 0 picks a free port (see `.port`). Keep loopback unless you need more.
        token: the bearer token of clients outside the job (`new_token()` makes one): the named calls only.
        member_token: the bearer token of the job's own workers, which may also make the job calls; None: one
            credential, `token`, for every caller (each is then a member: keep such an endpoint private).
        tls_cert, tls_key: paths of a PEM certificate and key; with both, the endpoint speaks TLS only.
        checkpoint_dir: where `Checkpoint` writes `shard-<id>.ckpt`; None refuses Checkpoint calls.
        step_timeout: longest a push waits for its consistency rule (the client's deadline may cut it shorter),
            and longest a member's request stream may wait between two messages.
        max_workers: handler threads of the members; default leaves room for every worker of a sync step to
            wait at once. Outside calls have `outside_calls` threads more.
        outside_calls: how many calls from outside the job run at once; one more is refused
            (RESOURCE_EXHAUSTED).
        idle_timeout: longest an outside request stream (Push) may wait between two messages before it is
            cancelled (DEADLINE_EXCEEDED).
        job: the id of the job the server belongs to, which Health answers (`endpoints.job_id`).
    Returns:
        The running endpoint.
    """
    if not token:
        raise ValueError(
            "serve_grpc needs a non-empty token: pass token=gradsync.transport.grpc.endpoint_files.new_token()"
        )
    if member_token is not None and (not member_token or member_token == token):
        raise ValueError(
            "member_token must be a non-empty token other than token (new_token() makes one), "
            "or None for an endpoint with one credential"
        )
    if (tls_cert is None) != (tls_key is None):
        raise ValueError(f"TLS needs both tls_cert and tls_key, got tls_cert={tls_cert!r}, tls_key={tls_key!r}")
    if outside_calls < 1 or idle_timeout <= 0:
        raise ValueError(
            f"outside_calls must be >= 1 and idle_timeout > 0 seconds, got outside_calls="
            f"{outside_calls!r}, idle_timeout={idle_timeout!r}"
        )
    credentials = Credentials(token, member_token)
    admission = Admission(credentials, outside_calls, idle_timeout, step_timeout)
    threads = (max_workers or max(8, 2 * server_obj.num_workers + 4)) + outside_calls
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradsync-grpc"),
        handlers=[_handlers(Servicer(server_obj, checkpoint_dir, step_timeout, job), admission)],
        interceptors=[BearerAuth(credentials)],
    )
    target = f"{host}:{port}"
    try:
        if tls_cert is not None and tls_key is not None:  # both or neither (above)
            with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
                tls = grpc.ssl_server_credentials([(k.read(), c.read())])
            bound = server.add_secure_port(target, tls)
        else:
            bound = server.add_insecure_port(target)
        if not bound:
            raise OSError(f"gRPC could not listen on {target}: pick another host/port (port 0 picks a free one)")
    except BaseException:
        admission.idle.stop()
        raise
    server.start()
    return GrpcEndpoint(server, host, bound, admission)
