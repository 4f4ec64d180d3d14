"""The outside world's gRPC client of a run's parameter servers: `gradsync.client.Client`.

`Client` talks to every shard of a run (addresses and token from the run
directory's `grpc-<shard>.json` files, or one address and a token). Pulls
gather all shards into one state dict, each shard's tensors at one version;
pushes route each gradient to the shard that owns it and push to every shard,
since in sync mode each server waits for every worker. Every call has a
deadline; failures raise builtin exceptions naming the call, the shard, its
address and the elapsed time (ValueError: the server refused the input;
TimeoutError: the deadline passed; PermissionError: bad token, or a call the
token does not allow; ConnectionError: server unreachable, another job's server
(`read_endpoints`' job id, checked at the first call), or TLS on one side only
or another certificate (`tls`); RuntimeError: anything else, such as
RESOURCE_EXHAUSTED when the endpoint already serves as many outside calls as it
takes at once). The job's own workers call through a Client's channels too (`job_calls`); the command line's
`gradsync status` and `gradsync pull` print and save what it answers (`gradsync.cli.job_status`).
"""

from __future__ import annotations

import os
import re
import time

import grpc
import torch

from gradsync.core import settings
from gradsync.core.buckets import Entry, join_pieces
from gradsync.core.emulated_network import reachable
from gradsync.core.job_names import server_name
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import gradsync_pb2_grpc as pb_grpc
from gradsync.proto import tensor_codec
from gradsync.tables.placement import check_ids, join_rows, split_ids
from gradsync.transport.grpc import tls
from gradsync.transport.grpc.endpoint_files import read_endpoints
from gradsync.transport.grpc.reply_streams import read_pulled

_SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
_MAYBE_TLS = re.compile(r"socket closed|handshake|ssl|tls", re.IGNORECASE)
"""What gRPC's detail says when TLS may be why a connection failed (a plain client at a TLS endpoint sees only
"Socket closed"): then `tls` asks the endpoint."""
_TLS_PROBE_S = 5.0

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: ValueError,
    grpc.StatusCode.FAILED_PRECONDITION: ValueError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionError,
    grpc.StatusCode.UNAVAILABLE: ConnectionError,
}


class Client:
    """Calls on all parameter servers of one run.

    Args:
        address_or_run_dir: a run directory holding grpc-<shard>.json files, one "host:port" (shard 0),
            or {shard: "host:port"}.
        token: the bearer token; default: the one in the run directory.
        timeout: deadline in seconds of each call (pull, push and checkpoint may override it).
        root_cert: path of a PEM certificate to trust (default: GRADSYNC_TLS_CERT, the one a job's endpoints serve
            with); given, the client speaks TLS.
    """

    def __init__(
        self,
        address_or_run_dir: str | dict[int, str],
        token: str | None = None,
        timeout: float = 10.0,
        root_cert: str | None = None,
    ):
        self._job = ""  # the job the run directory names, checked at the first call (`_reach`)
        if isinstance(address_or_run_dir, dict):
            self.addresses = dict(address_or_run_dir)
        elif os.path.isdir(address_or_run_dir):
            self.addresses, run_token, self._job = read_endpoints(address_or_run_dir)
            self._run_dir = address_or_run_dir
            token = token or run_token
        else:
            self.addresses = {0: address_or_run_dir}
        for address in self.addresses.values():
            if not reachable(address.rsplit(":", 1)[0]):
                raise ConnectionError(
                    f"{address} is inside an emulated network (a job of gradsync run --link), not reachable from "
                    "here: run this inside the job's hub namespace, `ip netns exec gsnet<id>hub gradsync ...` "
                    "(gradsync run printed it at start; `ip netns list` shows it)"
                )
        if not token:
            raise ValueError(
                f"no token for {address_or_run_dir!r}: pass token=... (a run directory's grpc-<shard>.json has it)"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout = timeout
        self.root_cert = root_cert or settings.TLS_CERT.read() or None
        credentials = None
        if self.root_cert is not None:
            if not os.path.isfile(self.root_cert):
                raise FileNotFoundError(
                    f"no TLS certificate {self.root_cert!r}: give the PEM file the endpoints "
                    "serve with (GRADSYNC_TLS_CERT of the job)"
                )
            with open(self.root_cert, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        # channels and metadata are public: the job's own calls (gradsync.transport.grpc.job_calls) go through them too
        self.channels = {
            shard: grpc.secure_channel(a, credentials) if credentials else grpc.insecure_channel(a)
            for shard, a in self.addresses.items()
        }
        self._stubs = {shard: pb_grpc.ParameterServerStub(c) for shard, c in self.channels.items()}
        # Pull and Push move tensors: their chunks go as pre-serialized bytes and come back as views of the
        # received bytes (tensor_codec.encode_messages / message_parser), not through protobuf objects.
        self._pulls = {
            shard: c.unary_stream(
                f"/{_SERVICE}/Pull",
                request_serializer=pb.PullRequest.SerializeToString,
                response_deserializer=tensor_codec.message_parser(pb.PullResponse),
            )
            for shard, c in self.channels.items()
        }
        self._pull_rows = {
            shard: c.unary_stream(
                f"/{_SERVICE}/PullRows",
                request_serializer=pb.PullRowsRequest.SerializeToString,
                response_deserializer=tensor_codec.message_parser(pb.PullResponse),
            )
            for shard, c in self.channels.items()
        }
        self._pushes = {
            shard: c.stream_unary(
                f"/{_SERVICE}/Push",
                request_serializer=tensor_codec.serialize,
                response_deserializer=pb.PushResponse.FromString,
            )
            for shard, c in self.channels.items()
        }
        self.metadata = (("authorization", f"Bearer {token}"),)
        self._owners: dict[str, int] | None = None
        self._pieces: list[Entry] | None = None
        self._tables: dict[str, dict] | None = None

    def error(self, call: str, shard: int, start: float, e: grpc.RpcError) -> Exception:
        """The builtin exception for `call` on `shard` failing with `e`, naming the address and elapsed time
        (since `start`, a `time.monotonic()`), and TLS with its fix when TLS is why (`tls`)."""
        kind = _ERRORS.get(e.code(), RuntimeError)
        where = (
            f"{call} on {server_name(shard)} at {self.addresses[shard]} failed after {time.monotonic() - start:.2f} s"
        )
        why = (
            tls.mismatch(self.addresses[shard], self.root_cert, min(self.timeout, _TLS_PROBE_S))
            if kind is ConnectionError and _MAYBE_TLS.search(e.details() or "")
            else None
        )
        return kind(f"{where}: TLS: {why}" if why else f"{where}: {e.code().name}: {e.details()}")

    def _reach(self) -> None:
        """Before the first call of a client of a run directory: check that each shard serves the job the run
        directory names (its endpoint files), not another job's server now at the address of one that ended."""
        job, self._job = self._job, ""  # once; and the Health calls below do not come back here
        if not job:
            return
        try:
            for shard in self._stubs:
                try:
                    served = self._unary("Health", shard, pb.HealthRequest()).job
                    other = None if served == job else f"serves job {served or '(unnamed)'}, not job {job}"
                except PermissionError:
                    other = f"refuses the token of job {job}"
                if other:
                    raise ConnectionError(
                        f"{self.addresses[shard]} {other} that {os.path.join(self._run_dir, f'grpc-{shard}.json')} "
                        "names: that job has ended and another listens there; give the run directory of a running "
                        "job (gradsync run prints it at start)"
                    )
        except BaseException:
            self._job = job
            raise

    def _unary(self, call: str, shard: int, request, timeout: float | None = None):
        self._reach()
        start = time.monotonic()
        try:
            return getattr(self._stubs[shard], call)(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise self.error(call, shard, start, e) from None

    def health(self) -> dict[int, dict]:
        """Per shard: ready, version, the names of its parameters and buffers, the pieces of split
        parameters, the embedding tables it holds rows of, and the id of the job it belongs to."""
        out = {}
        for shard in self._stubs:
            r = self._unary("Health", shard, pb.HealthRequest())
            out[shard] = {
                "shard_id": r.shard_id,
                "ready": r.ready,
                "version": r.version,
                "job": r.job,
                "parameters": list(r.parameters),
                "buffers": list(r.buffers),
                "pieces": [Entry(p.name, tuple(p.shape), 0, p.numel, p.start) for p in r.pieces],
                "tables": {
                    t.name: {
                        "shape": tuple(t.shape),
                        "dtype": t.dtype,
                        "num_servers": t.num_servers,
                        "rows_held": t.rows_held,
                    }
                    for t in r.tables
                },
            }
        return out

    def stats(self) -> dict[int, dict]:
        """Per shard: version, workers_seen, pushes_applied/rejected, steps_skipped, max_staleness and the
        staleness histogram, max_lead (ssp), pushes_by_worker (async, ssp), steps_without (worker_loss drop),
        workers_replaced (worker_loss wait), replica (replicas 1), pid and host, bytes_in/out, the calls its
        endpoint received by method name, and per embedding table its rows, bytes, rows pulled and pushed and
        max_staleness."""
        out = {}
        for shard in self._stubs:
            r = self._unary("GetStats", shard, pb.GetStatsRequest())
            out[shard] = {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields if f.name != "shard_id"}
            out[shard]["workers_seen"] = list(r.workers_seen)
            out[shard]["calls"] = dict(r.calls)
            out[shard]["staleness_histogram"] = dict(r.staleness_histogram)
            out[shard]["pushes_by_worker"] = dict(r.pushes_by_worker)
            out[shard]["steps_without"] = {step: list(w.ids) for step, w in r.steps_without.items()}
            out[shard]["workers_replaced"] = dict(r.workers_replaced)
            if not r.HasField("replica"):  # a job without replicas
                del out[shard]["replica"]
            out[shard]["tables"] = {
                t.name: {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields if f.name != "name"} for t in r.tables
            }
        return out

    def tables(self) -> dict[str, dict]:
        """Every embedding table served row-wise: its shape, dtype and number of servers (asked once, then
        cached)."""
        if self._tables is None:
            self._tables = {n: t for h in self.health().values() for n, t in h["tables"].items()}
        return self._tables

    def pull_rows(self, table: str, ids, timeout: float | None = None) -> torch.Tensor:
        """Rows `ids` (global row ids, any order, repeats allowed) of an embedding table, shape (len(ids), dim),
        one call per shard holding any of them."""
        self._reach()
        info = self.tables().get(table)
        if info is None:
            raise KeyError(f"this run serves no table {table!r}: it serves {sorted(self.tables())}")
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        check_ids(table, ids, info["shape"][0])
        unique, inverse = torch.unique(ids, return_inverse=True)
        parts = split_ids(unique, info["num_servers"])
        calls = {
            s: self._pull_rows[s](
                pb.PullRowsRequest(table=table, ids=unique[where].tolist()),
                timeout=timeout or self.timeout,
                metadata=self.metadata,
            )
            for s, (where, _) in parts.items()
        }
        rows = torch.empty(unique.numel(), info["shape"][1], dtype=getattr(torch, info["dtype"]))
        start = time.monotonic()
        for s, call in calls.items():
            try:
                rows[parts[s][0]] = read_pulled(call, "PullRows", s)[1][table]
            except grpc.RpcError as e:
                raise self.error("PullRows", s, start, e) from None
        return rows[inverse]

    def pieces(self) -> list[Entry]:
        """Every piece of a parameter split across shards: its name, whole shape, start and numel (asked once,
        then cached)."""
        if self._pieces is None:
            self._pieces = [p for h in self.health().values() for p in h["pieces"]]
        return self._pieces

    def owners(self) -> dict[str, int]:
        """The shard that owns each parameter and buffer (asked once, then cached)."""
        if self._owners is None:
            self._owners = {
                name: shard for shard, h in self.health().items() for name in h["parameters"] + h["buffers"]
            }
        return self._owners

    def _route(self, names) -> dict[int, list[str]]:
        if len(self._stubs) == 1:
            return {next(iter(self._stubs)): list(names)}
        owners, tables = self.owners(), self.tables()
        unknown = sorted(set(names) - owners.keys() - tables.keys())
        if unknown:
            raise ValueError(f"no server of this run owns {unknown[:5]}: check the names against model.state_dict()")
        routes: dict[int, list[str]] = {shard: [] for shard in self._stubs}
        for name in names:
            for shard in routes if name in tables else [owners[name]]:  # every shard holds rows of a table
                routes[shard].append(name)
        return routes

    def pull_versioned(
        self, names=None, timeout: float | None = None, whole: bool = True
    ) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        """Tensors by name from every shard (each shard's at one version), and that version by shard.

        Args:
            names: a subset of parameter/buffer names; None: everything.
            whole: join the pieces of a parameter split across shards (False: the pieces as the
                shards hold them, `name[start:end]`).
        """
        self._reach()
        if whole and names is not None:
            split = {p.name for p in self.pieces()}
            names = [n for n in names if n not in split] + [p.key for p in self.pieces() if p.name in names]
        routes = {shard: [] for shard in self._stubs} if names is None else self._route(names)
        calls = {
            shard: self._pulls[shard](
                pb.PullRequest(worker=-1, names=wanted), timeout=timeout or self.timeout, metadata=self.metadata
            )
            for shard, wanted in routes.items()
            if names is None or wanted
        }
        start = time.monotonic()
        tensors: dict[str, torch.Tensor] = {}
        versions: dict[int, int] = {}
        by_shard: dict[int, dict] = {}
        for shard, call in calls.items():
            try:
                versions[shard], by_shard[shard] = read_pulled(call, "Pull", shard)
                tensors.update(by_shard[shard])
            except grpc.RpcError as e:
                raise self.error("Pull", shard, start, e) from None
        if not whole:
            return tensors, versions
        tensors = join_pieces(tensors, self.pieces())
        for name, info in self.tables().items():  # each shard sent its rows of a table under the table's name
            if name in tensors:
                tensors[name] = join_rows(
                    {s: p[name] for s, p in by_shard.items() if name in p}, info["shape"], info["num_servers"]
                )
        return tensors, versions

    def pull(self, names=None, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The run's state dict (or the named subset), each shard's part at one version."""
        return self.pull_versioned(names, timeout)[0]

    def push(
        self, grads: dict[str, torch.Tensor], version: int | dict[int, int], worker: int, timeout: float | None = None
    ) -> dict[int, int]:
        """Send gradients by parameter name to the shards that own them; returns the version of each of those
        shards once it applied them.

        A shard that owns none of `grads` gets no push (the endpoint refuses a push without a gradient).
        To push flat bucket gradients, pass `bucket.views(flat)` for each bucket (views, no copies).

        Args:
            version: the version the gradients were computed at: one for all shards, or by shard
                (as `pull_versioned` returns).
            worker: the id to push under. From outside the job (the run directory's token), async jobs
                only, an id of your own: W .. 65535, none that a worker of the job holds; with the job's
                member token, the worker's index 0 .. W-1.
        """
        self._reach()
        grads = split_pieces(grads, self.pieces())
        routes = {shard: names for shard, names in self._route(grads).items() if names}
        if not routes:
            raise ValueError("push: no gradients to send (grads is empty)")
        if isinstance(version, int):
            version = {shard: version for shard in self._stubs}
        missing = sorted(set(routes) - set(version))
        if missing:
            raise ValueError(f"push: no version for shards {missing}: pass the versions pull_versioned returned")

        def messages(shard):
            yield pb.PushRequest(header=pb.PushHeader(worker=worker, version=version[shard]))
            yield from tensor_codec.encode_messages({n: grads[n] for n in routes[shard]}, pb.PushRequest)

        start = time.monotonic()
        futures = {
            shard: self._pushes[shard].future(messages(shard), timeout=timeout or self.timeout, metadata=self.metadata)
            for shard in routes
        }
        out = {}
        for shard, fut in futures.items():
            try:
                out[shard] = fut.result().version
            except grpc.RpcError as e:
                raise self.error("Push", shard, start, e) from None
        return out

    def checkpoint(self, timeout: float | None = None) -> dict[int, tuple[str, int]]:
        """Make every shard write its checkpoint now; returns (path on the server, version) by shard."""
        out = {}
        for shard in self._stubs:
            r = self._unary("Checkpoint", shard, pb.CheckpointRequest(), timeout)
            out[shard] = (r.path, r.version)
        return out

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_pieces(grads: dict[str, torch.Tensor], pieces: list[Entry]) -> dict[str, torch.Tensor]:
    """`grads` with each split parameter's gradient cut into the pieces the shards own (views, no copies)."""
    out = {n: g for n, g in grads.items() if n not in {p.name for p in pieces}}
    out.update({p.key: p.piece(grads[p.name]) for p in pieces if p.name in grads})
    return out
