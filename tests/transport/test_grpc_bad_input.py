"""Bad input never changes a server: a matrix of malformed pushes and pulls, then a seeded fuzz test."""
from __future__ import annotations

import random

import grpc
import pytest
import torch

from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto.tensor_codec import encode_all, encode_messages
from gradsync.ps.messages import Push
from grpc_harness import MEMBER_TOKEN, TOKEN, job_transport, make_server, model_state, served

METADATA = (("authorization", f"Bearer {TOKEN}"),)  # a client outside the job
MEMBER = (("authorization", f"Bearer {MEMBER_TOKEN}"),)  # the job's own workers
LR = 0.1
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
OUTSIDE_ID = 2  # a worker id of an outside client of the 2-worker servers below


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in state.items()}


def _header(worker=OUTSIDE_ID, version=0) -> pb.PushRequest:
    return pb.PushRequest(header=pb.PushHeader(worker=worker, version=version))


def _chunks(tensors: dict[str, torch.Tensor], chunk_bytes: int = 1 << 20) -> list[pb.PushRequest]:
    return [pb.PushRequest(chunk=c) for c in encode_all(tensors, chunk_bytes)]


def _send(channel, messages, method="Push", metadata=None) -> tuple[grpc.StatusCode, str]:
    """Send raw messages (protobuf objects or bytes, any iterable) and return the status code and details; job
    calls carry the member token, the others the outside token, unless `metadata` says otherwise."""
    raw = (m if isinstance(m, bytes) else m.SerializeToString() for m in messages)
    metadata = metadata or (MEMBER if method.startswith("Job") else METADATA)
    path = f"/gradsync.ParameterServer/{method}"
    try:
        if method == "Push":
            channel.stream_unary(path)(raw, timeout=10, metadata=metadata)
        elif method == "JobPush":
            list(channel.stream_stream(path)(raw, timeout=10, metadata=metadata))
        elif method in ("Pull", "JobPull"):
            list(channel.unary_stream(path)(next(raw), timeout=10, metadata=metadata))
        else:
            channel.unary_unary(path)(next(raw), timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _ones(name, shape=(16,), dtype=torch.float32):
    return {name: torch.ones(shape, dtype=dtype)}


def _edited(messages: list[pb.PushRequest], index: int, **fields) -> list[pb.PushRequest]:
    out = [pb.PushRequest.FromString(m.SerializeToString()) for m in messages]
    for k, v in fields.items():
        if k == "shape":
            del out[index].chunk.shape[:]
            out[index].chunk.shape.extend(v)
        else:
            setattr(out[index].chunk, k, v)
    return out


W1 = _chunks({"fc1.weight": torch.ones(16, 8)}, chunk_bytes=128)  # 4 chunks
CASES = {
    "unknown parameter": ([_header()] + _chunks(_ones("nope")), "does not own"),
    "valid and unknown together": ([_header()] + _chunks({**_ones("fc1.bias"), **_ones("nope")}), "does not own"),
    "wrong dtype": ([_header()] + _chunks(_ones("fc1.bias", dtype=torch.float64)), "expected (16,) torch.float32"),
    "wrong shape": ([_header()] + _chunks(_ones("fc1.bias", (4, 4))), "expected (16,)"),
    "unknown dtype": ([_header()] + _chunks(_ones("fc1.bias"))[:0] + [pb.PushRequest(chunk=pb.Tensor(
        name="fc1.bias", dtype="float8", shape=[16], total_bytes=16, data=b"\1" * 16))], "Tensor.dtype"),
    "truncated tensor": ([_header()] + W1[:3], "truncated"),
    "missing chunk": ([_header()] + W1[:1] + W1[2:], "Tensor.offset"),
    "repeated chunk": ([_header()] + W1[:2] + W1[1:], "Tensor.offset"),
    "out of order": ([_header(), W1[1], W1[0]] + W1[2:], "Tensor.offset"),
    "chunk past the end": ([_header()] + _edited(W1, 3, data=W1[3].chunk.data + b"\0\0\0\0"), "Tensor.total_bytes"),
    "oversized tensor": ([_header()] + _edited(W1[:1], 0, shape=[1 << 30], total_bytes=4 << 30), "exceeds"),
    "shape and bytes disagree": ([_header()] + _edited(W1, 0, total_bytes=4), "Tensor.total_bytes"),
    "version from the future": ([_header(version=7)] + _chunks(_ones("fc1.bias")), "version from the future"),
    "negative worker id": ([_header(worker=-1)] + _chunks(_ones("fc1.bias")), "is not a worker id"),
    "NaN gradient": ([_header()] + _chunks({"fc1.bias": torch.full((16,), float("nan"))}), "non-finite"),
    "garbage bytes": ([_header().SerializeToString(), b"\xff\xfe\xfd garbage"], "not a valid PushRequest"),
    "empty stream": ([], "stream is empty"),
    "no header": (_chunks(_ones("fc1.bias")), "first message must be a PushHeader"),
    "second header": ([_header(), _header()] + _chunks(_ones("fc1.bias")), "only the first message"),
    "bucket in a named push": ([_header()] + [pb.PushRequest(chunk=c) for c in encode_all({0: torch.ones(4)})],
                               "only JobPush takes"),
}

BUCKETS = plan_buckets(ModelSpec.of(*model_state()).params, 1, cap_bytes=256)  # the servers' plan


def _job(tensors=None, absent=None, worker=0, version=0) -> list[pb.JobPushRequest]:
    absent = [()] * len(BUCKETS) if absent is None else absent
    header = pb.JobPushHeader(worker=worker, version=version, absent=[pb.AbsentEntries(entries=a) for a in absent])
    return [pb.JobPushRequest(header=header)] + [pb.JobPushRequest(chunk=c) for c in encode_all(tensors or {})]


JOB_CASES = {
    "bucket of no server": (_job({len(BUCKETS): torch.ones(4)}), f"Tensor.bucket {len(BUCKETS)} is not a bucket"),
    "wrong bucket size": (_job({0: torch.ones(BUCKETS[0].numel + 1)}), f"expected ({BUCKETS[0].numel},)"),
    "wrong bucket dtype": (_job({0: torch.ones(BUCKETS[0].numel, dtype=torch.float64)}), "torch.float32"),
    "short absence lists": (_job({0: torch.ones(BUCKETS[0].numel)}, absent=[()]), "1 absence lists"),
    "absent entry out of range": (_job(absent=[(99,)] + [()] * (len(BUCKETS) - 1)), "lists absent entries [99]"),
    "parameter by name": (_job({"fc1.bias": torch.ones(16)}), "unknown buffer 'fc1.bias'"),
    "NaN bucket": (_job({0: torch.full((BUCKETS[0].numel,), float("nan"))}), "non-finite"),
    "version from the future": (_job(version=3), "version from the future"),
    "bucket sent twice": (_job({0: torch.ones(BUCKETS[0].numel)}) + _job({0: torch.ones(BUCKETS[0].numel)})[1:],
                          "bucket 0 was sent twice"),
    "no header": (_job({0: torch.ones(BUCKETS[0].numel)})[1:], "first message must be a JobPushHeader"),
    "empty stream": ([], "stream is empty"),
}


@pytest.fixture(scope="module")
def endpoint():
    server = make_server("async", workers=2, lr=LR)
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        yield server, channel


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_push_is_refused_naming_the_field_and_changes_nothing(endpoint, case):
    server, channel = endpoint
    messages, expected = CASES[case]
    before = _bits(server.state_dict())
    code, details = _send(channel, messages)
    assert code in REFUSED and expected in details, (code, details)
    assert _bits(server.state_dict()) == before and server.shard.version == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(JOB_CASES))
def test_bad_job_push_is_refused_naming_the_field_and_changes_nothing(endpoint, case):
    server, channel = endpoint
    messages, expected = JOB_CASES[case]
    before = _bits(server.state_dict())
    code, details = _send(channel, messages, "JobPush")
    assert code in REFUSED and expected in details, (code, details)
    assert _bits(server.state_dict()) == before and server.shard.version == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["Push", "JobPush"])
def test_a_stream_of_many_tiny_tensors_is_refused_at_the_count_limit_and_the_server_keeps_serving(method):
    server = make_server("async", workers=1, lr=LR)
    shard = server.shard
    limit = (len(shard.params) if method == "Push" else len(shard.buckets)) + len(shard.buffers)
    header, message_cls = (_header(), pb.PushRequest) if method == "Push" else (_job()[0], pb.JobPushRequest)

    def tiny():  # 20,000 empty tensors, made as they are sent
        yield header
        for i in range(20_000):
            yield from encode_messages({f"t{i}": torch.empty(0)}, message_cls)

    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        before = server.pull()
        code, details = _send(channel, tiny(), method)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert f"is one tensor too many: this call accepts at most {limit}" in details, details
        transport = job_transport(endpoint, server, 0)
        grads = [torch.full((b.numel,), 0.5) for b in shard.buckets]
        after = transport.push({0: 0}, {0: Push(grads, [()] * len(grads))})[0]
        transport.close()
    assert after.version == 1
    for flat, was, grad in zip(after.flats, before.flats, grads):
        assert torch.equal(flat, was.add(grad, alpha=-LR))


@pytest.mark.timeout(60)
def test_sync_server_refuses_a_worker_outside_the_job():
    server = make_server("sync", workers=2, lr=LR)
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        before = _bits(server.state_dict())
        code, details = _send(channel, [_header(worker=5)] + _chunks(_ones("fc1.bias")), metadata=MEMBER)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "worker 5 is not a worker of this job" in details
        code, details = _send(channel, [_header(worker=5)] + _chunks(_ones("fc1.bias")))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "runs a sync job" in details
    assert _bits(server.state_dict()) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["Health", "GetStats", "Pull", "JobPull", "Checkpoint"])
def test_garbage_unary_requests_are_invalid_argument(endpoint, method):
    server, channel = endpoint
    code, details = _send(channel, [b"\x0a\xff\xff\xff\xff\xff"], method)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"not a valid {method}Request" in details


@pytest.mark.timeout(60)
def test_bad_pull_names_are_refused(endpoint):
    _, channel = endpoint
    code, details = _send(channel, [pb.PullRequest(names=["fc1.bias", "ghost"])], "Pull")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "PullRequest.names" in details and "ghost" in details


def _mutate(rng: random.Random, messages: list[pb.PushRequest], names: list[str]) -> list[bytes]:
    raw = [m.SerializeToString() for m in messages]
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(9)
        i = rng.randrange(len(raw)) if raw else 0
        if op == 0 and raw and raw[i]:  # flip a byte
            b = bytearray(raw[i])
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            raw[i] = bytes(b)
        elif op == 1 and raw:  # cut a message short
            raw[i] = raw[i][: rng.randrange(len(raw[i]) + 1)]
        elif op == 2 and raw:  # drop a message
            del raw[i]
        elif op == 3 and raw:  # repeat a message
            raw.insert(i, raw[i])
        elif op == 4 and len(raw) > 1:  # swap two messages
            j = rng.randrange(len(raw))
            raw[i], raw[j] = raw[j], raw[i]
        elif op == 5:  # random bytes
            raw.insert(i, rng.randbytes(rng.randrange(1, 64)))
        elif op in (6, 7) and raw:  # change one field of a parsed message
            m = pb.PushRequest.FromString(messages[0].SerializeToString())
            try:
                m = pb.PushRequest.FromString(raw[i])
            except Exception:
                pass
            if m.WhichOneof("item") == "header":
                if rng.random() < 0.5:
                    m.header.worker = rng.choice([-1, 0, 1, 2, 1 << 40])
                else:
                    m.header.version = rng.choice([0, 1, 2, 3, 1 << 63])
            else:
                field = rng.choice(["name", "dtype", "shape", "total_bytes", "offset", "data"])
                c = m.chunk
                if field == "name":
                    c.name = rng.choice(names + ["", "x" * 300])
                elif field == "dtype":
                    c.dtype = rng.choice(["float64", "int8", "bool", "float16", "", "complex64"])
                elif field == "shape":
                    del c.shape[:]
                    c.shape.extend(rng.choice([[], [0], [16], [-1], [4, 4], [1 << 62, 4]]))
                elif field == "total_bytes":
                    c.total_bytes = rng.choice([0, 1, 63, 64, 65, 1 << 63])
                elif field == "offset":
                    c.offset = rng.choice([0, 1, 64, 1 << 63])
                else:
                    c.data = rng.randbytes(rng.randrange(0, 200))
            raw[i] = m.SerializeToString()
        elif op == 8:  # a non-finite value in a real gradient
            name = rng.choice(names)
            raw += [m.SerializeToString() for m in _chunks({name: torch.full((16,), float("inf"))})]
    return raw


@pytest.mark.timeout(60)
def test_fuzzed_pushes_never_corrupt_the_server():
    """Random and mutated streams: each is refused with nothing changed, or applied as exactly one step."""
    rng = random.Random(1234)
    server = make_server("async", workers=2, lr=LR)
    names = list(server.shard.params)
    shapes = {n: p.shape for n, p in server.shard.params.items()}
    applied = 0
    with served(server) as (endpoint, client), grpc.insecure_channel(endpoint.address) as channel:
        reference = _bits(server.state_dict())
        for trial in range(300):
            version = server.shard.version
            chosen = rng.sample(names, rng.randint(1, len(names)))
            g = torch.Generator().manual_seed(trial)
            grads = {n: torch.randn(shapes[n], generator=g) for n in chosen}
            messages = ([_header(worker=rng.choice([2, 3]), version=version)]
                        + _chunks(grads, rng.choice([16, 64, 4096])))
            raw = _mutate(rng, messages, names) if trial % 8 else [rng.randbytes(rng.randrange(1, 100))
                                                                   for _ in range(rng.randrange(1, 4))]
            code, details = _send(channel, raw)
            now = _bits(server.state_dict())
            if code == grpc.StatusCode.OK:
                applied += 1
                assert server.shard.version == version + 1
                reference = now
            else:
                assert code in REFUSED + (grpc.StatusCode.PERMISSION_DENIED,), (trial, code, details)
                assert details, trial
                assert now == reference and server.shard.version == version, trial
        assert 0 < applied < 300
        # the server still works exactly: one clean push is one SGD step on the current state
        state = client.pull()
        grads = {n: torch.full(shapes[n], 0.5) for n in names}
        client.push(grads, server.shard.version, worker=OUTSIDE_ID)
        after = client.pull()
        for n in names:
            assert _bits({n: after[n]}) == _bits({n: state[n].add(grads[n], alpha=-LR)}), n
