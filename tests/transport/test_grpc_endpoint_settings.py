"""The README's settings of the gRPC endpoint, through `gradsync run`: GRADSYNC_GRPC_HOST and
GRADSYNC_GRPC_PORT (server i on port + i), GRADSYNC_TOKEN (the outside clients' token), and
GRADSYNC_TLS_CERT / GRADSYNC_TLS_KEY (TLS only: the job's own workers trust the certificate too)."""
import json
import shutil
import socket

import pytest

from helpers import SUPPORT, run_cli, self_signed

pytestmark = pytest.mark.job  # every test here starts processes

_SCRIPT = """import json, os, sys
sys.path.insert(0, {support!r})
import gradsync, jobs
from gradsync.client import Client
gradsync.init()
state = jobs.train_mlp(3)
if gradsync.worker_rank() == 0:
    run = os.environ["GRADSYNC_RUN_DIR"]
    with Client(run, root_cert={cert!r}) as client:
        pulled = client.pull()
    with Client(run, timeout=2) as default:  # trusts GRADSYNC_TLS_CERT, the certificate the endpoints serve with
        by_default = default.pull()
    endpoints = {{}}
    for shard in (0, 1):
        with open(os.path.join(run, f"grpc-{{shard}}.json")) as f:
            endpoints[shard] = json.load(f)
    same = all(pulled[k].equal(v) and by_default[k].equal(v) for k, v in state.items())
    print("RESULT " + json.dumps({{"endpoints": endpoints, "same": same}}), flush=True)
gradsync.shutdown()
"""


def _free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free now (another process may take one before the job binds it)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free run of ports")


@pytest.mark.timeout(150)
def test_run_serves_its_endpoint_where_the_settings_say_with_tls_and_the_given_token(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the self-signed test certificate")
    cert, key = self_signed(tmp_path)
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT.format(support=SUPPORT, cert=cert))
    port = _free_ports(2)
    env = {"GRADSYNC_GRPC_HOST": "127.0.0.1", "GRADSYNC_GRPC_PORT": str(port), "GRADSYNC_TOKEN": "t0ken-of-the-job",
           "GRADSYNC_TLS_CERT": cert, "GRADSYNC_TLS_KEY": key}
    done = run_cli("run", "--strategy", "ps", "--transport", "grpc", "--workers", "2", "--servers", "2",
                   "--run-dir", str(tmp_path / "run"), str(script), timeout=140, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["same"]
    for shard in (0, 1):
        assert result["endpoints"][str(shard)]["address"] == f"127.0.0.1:{port + shard}"
        assert result["endpoints"][str(shard)]["token"] == "t0ken-of-the-job"
    assert result["endpoints"]["0"]["job"] == result["endpoints"]["1"]["job"] != ""  # the job's id, one for both
