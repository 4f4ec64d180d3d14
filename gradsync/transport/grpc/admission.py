"""Who may make which call of a gRPC endpoint, how many at once, and how long a client may keep a stream waiting.

Two bearer tokens: the job's member token opens every call; the outside token opens
the named calls only (a job call is refused with PERMISSION_DENIED); an endpoint
given one token treats every caller that holds it as a member. `BearerAuth`
refuses a call with neither, with UNAUTHENTICATED and before its request is read.
`Admission` runs members' calls at once and outside calls in a bounded number of
slots (one more is refused with RESOURCE_EXHAUSTED), and `IdleWatch` cancels, with
DEADLINE_EXCEEDED, a call whose client sends nothing of its request stream, or reads
nothing of its reply stream, for the caller's idle limit. The service raises `Refused`
for any call it turns down; its handler turns it into the status code.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections.abc import Iterator

import grpc

from gradsync.core.waiting import THREAD_STOP_S

JOB_CALLS = frozenset(
    {
        "JobPull",
        "JobPush",
        "JobFinish",
        "JobOptimizerState",
        "JobLoadOptimizerState",
        "JobLoadValues",
        "JobCheckpoint",
        "JobProbe",
    }
)


class Refused(Exception):
    """A call turned down: its status code and the message that names why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


MEMBER, OUTSIDE = "member", "outside"
_MIN_WAKE_S = 0.01
"""The shortest sleep of the idle-call watcher: a deadline a rounding error away wakes it once more, not in a
busy loop."""


class Credentials:
    """The bearer tokens of one endpoint: who a call's metadata says it comes from."""

    def __init__(self, token: str, member_token: str | None):
        self._outside = f"Bearer {token}".encode()
        self._member = None if member_token is None else f"Bearer {member_token}".encode()

    def role(self, metadata) -> str | None:
        """MEMBER, OUTSIDE, or None for a missing or wrong token. Without a member token every caller that
        holds the token is a member (an endpoint with one credential)."""
        given = dict(metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if self._member is not None and hmac.compare_digest(given, self._member):
            return MEMBER
        if hmac.compare_digest(given, self._outside):
            return OUTSIDE if self._member is not None else MEMBER
        return None


class IdleWatch:
    """One thread that cancels, with DEADLINE_EXCEEDED, every call whose stream waits on its client longer than
    its limit: for the next request message, or for the client to read the reply message sent last (the time
    the handler spends on a message does not count)."""

    def __init__(self):
        self._waiting: dict[object, tuple[float, object, str]] = {}  # key -> (deadline, context, details)
        self._wake = float("inf")  # when the watching thread wakes next
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gradsync-grpc-idle", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self, context, limit: float, details: str):
        """While inside, the call `context` waits on its client: past `limit` seconds it is cancelled."""
        key, deadline = object(), time.monotonic() + limit
        with self._cond:
            self._waiting[key] = (deadline, context, details)
            if deadline < self._wake:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._waiting.pop(key, None)

    def requests(self, request_iterator, context, limit: float, what: str) -> Iterator:
        """`request_iterator`, each wait for its next message bounded by `limit` seconds."""
        details = (
            f"{what}: the client sent nothing for {limit:g} s, the endpoint's limit for an idle request "
            "stream; send the whole stream at once"
        )
        while True:
            with self.waiting(context, limit, details):
                try:
                    message = next(request_iterator)
                except StopIteration:
                    return
            yield message

    def replies(self, replies: Iterator, context, limit: float, what: str) -> Iterator:
        """`replies`, each message's wait for the client to read it (flow control) bounded by `limit` seconds."""
        details = f"{what}: the client read nothing for {limit:g} s, the endpoint's limit for an unread reply stream"
        for message in replies:
            with self.waiting(context, limit, details):
                yield message

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(THREAD_STOP_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                late = [(k, c, d) for k, (deadline, c, d) in self._waiting.items() if deadline <= now]
                for key, _, _ in late:
                    del self._waiting[key]
                if not late:
                    self._wake = min((deadline for deadline, _, _ in self._waiting.values()), default=float("inf"))
                    self._cond.wait(None if self._wake == float("inf") else max(self._wake - now, _MIN_WAKE_S))
                    continue
            for _, context, details in late:
                _cancel(context, grpc.StatusCode.DEADLINE_EXCEEDED, details)


def _cancel(context, code: grpc.StatusCode, details: str) -> None:
    """End a running call with `code` and `details` from another thread than its handler's (whose wait for
    the next request then raises): through the call's cancel-with-status, else a plain CANCELLED."""
    try:
        context._rpc_event.call.cancel(code.value[0], details)  # noqa: SLF001 (grpcio has no public way)
    except (AttributeError, TypeError):
        context.cancel()


class Admission:
    """Who may make which call, and how many outside calls run at once."""

    def __init__(self, credentials: Credentials, outside_calls: int, idle_timeout: float, member_idle: float):
        self.credentials = credentials
        self.outside_calls = outside_calls
        self._outside = threading.BoundedSemaphore(outside_calls)
        self.idle = IdleWatch()
        self.idle_timeout = {MEMBER: member_idle, OUTSIDE: idle_timeout}

    @contextlib.contextmanager
    def admitted(self, name: str, context):
        """Run one call of method `name`: a member's at once; an outside one in one of the outside slots, or
        refused (a job call, with PERMISSION_DENIED; when every slot is taken, with RESOURCE_EXHAUSTED).
        Yields the caller's role."""
        role = self.credentials.role(context.invocation_metadata())
        if role == MEMBER:
            yield role
            return
        if name in JOB_CALLS:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} is a call of the job's own workers, which hold the job's member credential; "
                "clients outside the job use the named calls (Pull, Push, PullRows, ...)",
            )
        if not self._outside.acquire(blocking=False):
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{name}: this endpoint already runs {self.outside_calls} calls from outside the job, "
                "as many as it serves at once; retry later",
            )
        try:
            yield role
        finally:
            self._outside.release()

    def requests(self, request_iterator, context, role: str, name: str) -> Iterator:
        """A call's request stream, each wait for the client's next message bounded by the role's idle limit."""
        return self.idle.requests(request_iterator, context, self.idle_timeout[role], f"{name} from {role}")

    def replies(self, replies: Iterator, context, role: str, name: str) -> Iterator:
        """A call's reply stream, each wait for the client to read a message bounded by the role's idle limit."""
        return self.idle.replies(replies, context, self.idle_timeout[role], f"{name} from {role}")


class BearerAuth(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and without reading the request, a call whose token is missing or wrong."""

    def __init__(self, credentials: Credentials):
        self._credentials = credentials

    def intercept_service(self, continuation, details):
        if self._credentials.role(details.invocation_metadata) is not None:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None

        def refuse(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send 'authorization: Bearer <token>' metadata with the run's "
                "token (grpc-<shard>.json in the run directory)",
            )

        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return kind(refuse)
