"""Bearer-token auth (refused calls change nothing) and TLS."""
from __future__ import annotations

import re
import shutil

import grpc
import pytest
import torch

from gradsync import cli
from gradsync.transport.grpc.endpoint_files import write_endpoints
from gradsync.transport.grpc.client import Client
from gradsync.proto import gradsync_pb2 as pb
from gradsync.proto import gradsync_pb2_grpc as pb_grpc
from gradsync.transport.grpc.server import serve_grpc
from grpc_harness import TOKEN, make_server, served
from helpers import self_signed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
                         ids=["missing", "wrong", "not-bearer"])
def test_every_call_without_the_token_is_refused_and_changes_nothing(metadata):
    server = make_server("async", workers=1)
    before = server.state_dict()
    with served(server) as (endpoint, _), grpc.insecure_channel(endpoint.address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        push = iter([
            pb.PushRequest(header=pb.PushHeader(worker=0, version=0)),
            pb.PushRequest(chunk=pb.Tensor(name="fc1.bias", dtype="float32", shape=[16], total_bytes=64,
                                           data=torch.ones(16).numpy().tobytes())),
        ])
        job_push = iter([
            pb.JobPushRequest(header=pb.JobPushHeader(worker=0, version=0, absent=[
                pb.AbsentEntries() for _ in server.shard.buckets])),
            pb.JobPushRequest(chunk=pb.Tensor(bucket=0, dtype="float32", shape=[server.shard.buckets[0].numel],
                                              total_bytes=4 * server.shard.buckets[0].numel,
                                              data=torch.ones(server.shard.buckets[0].numel).numpy().tobytes())),
        ])
        calls = {
            "Health": lambda: stub.Health(pb.HealthRequest(), timeout=5, metadata=metadata),
            "GetStats": lambda: stub.GetStats(pb.GetStatsRequest(), timeout=5, metadata=metadata),
            "Pull": lambda: list(stub.Pull(pb.PullRequest(), timeout=5, metadata=metadata)),
            "Push": lambda: stub.Push(push, timeout=5, metadata=metadata),
            "Checkpoint": lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=5, metadata=metadata),
            "JobPull": lambda: list(stub.JobPull(pb.JobPullRequest(), timeout=5, metadata=metadata)),
            "JobPush": lambda: list(stub.JobPush(job_push, timeout=5, metadata=metadata)),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "bearer token" in info.value.details()
    after = server.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert server.shard.stats.version == 0 and server.shard.stats.pushes_rejected == 0


@pytest.mark.timeout(60)
def test_client_with_a_wrong_token_gets_permission_error():
    server = make_server("async", workers=1)
    with served(server) as (endpoint, _):
        with Client(endpoint.address, token="wrong") as client:
            with pytest.raises(PermissionError, match="Health on ps0 .* UNAUTHENTICATED"):
                client.health()
            with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
                client.push({"fc1.bias": torch.ones(16)}, 0, worker=0)
    assert server.shard.version == 0


def test_serving_needs_a_token_and_both_tls_files():
    server = make_server("async", workers=1)
    with pytest.raises(ValueError, match="non-empty token"):
        serve_grpc(server, token="")
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        serve_grpc(server, token=TOKEN, tls_cert="cert.pem")
    with pytest.raises(ValueError, match="no token for"):
        Client("127.0.0.1:1")


@pytest.mark.job
@pytest.mark.timeout(60)
def test_tls_endpoint_serves_tls_clients_only(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the self-signed test certificate")
    cert, key = self_signed(tmp_path)
    server = make_server("async", workers=1)
    endpoint = serve_grpc(server, token=TOKEN, tls_cert=cert, tls_key=key)
    try:
        with Client(endpoint.address, token=TOKEN, root_cert=cert) as client:
            state = client.pull()
            assert torch.equal(state["fc1.weight"], server.state_dict()["fc1.weight"])
        with Client(endpoint.address, token=TOKEN, timeout=2) as plain:
            with pytest.raises((ConnectionError, RuntimeError)):
                plain.health()
    finally:
        endpoint.stop(0.5)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_a_tls_mismatch_says_tls_and_the_fix(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the self-signed test certificate")
    (tmp_path / "other").mkdir()
    cert, key = self_signed(tmp_path)
    other, _ = self_signed(tmp_path / "other")  # another certificate for 127.0.0.1, which the endpoint does not serve
    tls = serve_grpc(make_server("async", workers=1), token=TOKEN, tls_cert=cert, tls_key=key)
    plain = serve_grpc(make_server("async", workers=1), token=TOKEN)
    cases = [(tls.address, None, "the endpoint serves TLS and this client speaks plain gRPC: give the endpoint's "
              "certificate: --tls-cert PEM (default GRADSYNC_TLS_CERT), or Client(root_cert=PEM)"),
             (tls.address, other, f"the endpoint's TLS certificate is not signed by {other}, the certificate this "
              "client trusts: give the certificate the endpoint serves (the GRADSYNC_TLS_CERT of its job)"),
             (plain.address, cert, f"the endpoint serves plain gRPC, without TLS, and this client speaks TLS "
              f"(certificate {cert}): leave out --tls-cert and unset GRADSYNC_TLS_CERT (Client(root_cert=None))")]
    try:
        for address, root_cert, why in cases:
            with Client(address, token=TOKEN, timeout=5, root_cert=root_cert) as client:
                with pytest.raises(ConnectionError) as refused:
                    client.health()
            assert re.fullmatch(rf"Health on ps0 at {address} failed after [\d.]+ s: TLS: {re.escape(why)}",
                                str(refused.value)), (str(refused.value), why)
    finally:
        tls.stop(0.5)
        plain.stop(0.5)


@pytest.mark.job
@pytest.mark.timeout(60)
def test_status_and_pull_reach_a_tls_job_with_its_certificate_from_the_option_or_the_servers_variable(
        tmp_path, monkeypatch, capsys):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the self-signed test certificate")
    cert, key = self_signed(tmp_path)
    server = make_server("async", workers=1)
    endpoint = serve_grpc(server, token=TOKEN, tls_cert=cert, tls_key=key, job="job-a")
    run_dir, out = tmp_path / "run", tmp_path / "out.pt"
    run_dir.mkdir()
    write_endpoints(str(run_dir), 0, endpoint.address, TOKEN, "job-a")
    monkeypatch.delenv("GRADSYNC_TLS_CERT", raising=False)
    try:
        assert cli.main(["status", str(run_dir)]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"gradsync: error: Health on ps0 at {endpoint.address} failed after ") and \
            error.endswith(" s: TLS: the endpoint serves TLS and this client speaks plain gRPC: give the endpoint's "
                           "certificate: --tls-cert PEM (default GRADSYNC_TLS_CERT), or Client(root_cert=PEM)\n")
        assert cli.main(["status", str(run_dir), "--tls-cert", cert]) == 0
        rows = capsys.readouterr().out.splitlines()
        assert rows[2].split(" | ")[1:4] == [endpoint.address, "yes", "0"]
        monkeypatch.setenv("GRADSYNC_TLS_CERT", cert)  # the variable the job's servers serve with
        assert cli.main(["pull", str(run_dir), str(out)]) == 0
        assert capsys.readouterr().out == f"wrote {out} (versions by shard: {{0: 0}})\n"
        saved = torch.load(out, weights_only=True)
        assert saved.keys() == server.state_dict().keys()
        assert all(torch.equal(saved[n], t) for n, t in server.state_dict().items())
        with Client(str(run_dir)) as client:  # the Client's default too
            assert client.health()[0]["job"] == "job-a"
    finally:
        endpoint.stop(0.5)
