"""Checkpoints: written atomically through the Checkpoint call, read back bit for bit, verified on load."""
from __future__ import annotations

import os

import pytest
import torch

from gradsync.ps import reshard, shard_file
from grpc_harness import make_server, served


def _grads(seed: int, names) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in names.items()}


@pytest.mark.timeout(60)
def test_checkpoint_call_writes_state_that_loads_back_bit_for_bit(tmp_path):
    server = make_server("async", workers=1, momentum=0.9)
    shapes = {n: p.shape for n, p in server.shard.params.items()}
    with served(server, checkpoint_dir=str(tmp_path)) as (_, client):
        for step in range(3):  # momentum buffers make the optimizer state non-trivial
            client.push(_grads(step, shapes), step, worker=1)
        (path, version), = client.checkpoint().values()
    assert path == str(tmp_path / "shard-0.ckpt") and version == 3
    assert os.listdir(tmp_path) == ["shard-0.ckpt"]
    state = shard_file.load(path)
    assert state["version"] == 3 and state["shard_id"] == 0
    live = server.state_dict()
    for name, value in {**state["params"], **state["buffers"]}.items():
        assert torch.equal(value, live[name]), name
    live_opt = server.optimizer_state()
    assert live_opt["groups"] == state["optimizer"]["groups"] and live_opt["state"].keys() == shapes.keys()
    for key, s in live_opt["state"].items():
        assert torch.equal(s["momentum_buffer"], state["optimizer"]["state"][key]["momentum_buffer"])

    fresh = make_server("async", workers=1, momentum=0.9)
    reshard.restore(fresh.shard, [state])
    assert fresh.shard.version == 3
    step = _grads(99, shapes)
    for s in (server, fresh):
        with served(s) as (_, client):
            client.push(step, 3, worker=1)
    after, restored = server.state_dict(), fresh.state_dict()
    assert all(torch.equal(after[n], restored[n]) for n in after)  # the optimizer state came back too


def test_load_refuses_corrupt_and_foreign_files(tmp_path):
    server = make_server("async", workers=1)
    path, _ = shard_file.save(server.shard, str(tmp_path))
    blob = bytearray(open(path, "rb").read())
    blob[-10] ^= 0xFF
    bad = tmp_path / "flipped.ckpt"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="SHA-256 does not match"):
        shard_file.load(str(bad))
    torch.save({"params": {}}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="bad magic header"):
        shard_file.load(str(tmp_path / "plain.pt"))


@pytest.mark.timeout(60)
def test_checkpoint_without_directory_is_refused():
    with served(make_server("async", workers=1)) as (_, client):
        with pytest.raises(ValueError, match="FAILED_PRECONDITION.*no checkpoint directory"):
            client.checkpoint()
