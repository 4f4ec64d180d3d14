"""The run directory's grpc-<shard>.json files: atomic, owner-only, one per shard, consistent."""
from __future__ import annotations

import json
import os
import stat

import pytest

from gradsync.transport.grpc.endpoint_files import read_endpoints, write_endpoints


def test_each_server_adds_its_own_owner_only_file(tmp_path):
    write_endpoints(str(tmp_path), 1, "127.0.0.1:5001", "tok", "job1")
    path = write_endpoints(str(tmp_path), 0, "127.0.0.1:5000", "tok", "job1")
    assert path == str(tmp_path / "grpc-0.json")
    assert read_endpoints(str(tmp_path)) == ({0: "127.0.0.1:5000", 1: "127.0.0.1:5001"}, "tok", "job1")
    for name in ("grpc-0.json", "grpc-1.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["grpc-0.json", "grpc-1.json"]  # no temporary files left


def test_rewrite_replaces_the_entry(tmp_path):
    write_endpoints(str(tmp_path), 0, "127.0.0.1:5000", "tok")
    write_endpoints(str(tmp_path), 0, "127.0.0.1:6000", "tok")
    assert read_endpoints(str(tmp_path)) == ({0: "127.0.0.1:6000"}, "tok", "")


def test_missing_malformed_and_inconsistent_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no grpc-<shard>.json"):
        read_endpoints(str(tmp_path))
    write_endpoints(str(tmp_path), 0, "127.0.0.1:5000", "tok")
    write_endpoints(str(tmp_path), 1, "127.0.0.1:5001", "other")
    with pytest.raises(ValueError, match="disagree on the token"):
        read_endpoints(str(tmp_path))
    write_endpoints(str(tmp_path), 1, "127.0.0.1:5001", "tok", "another job")
    with pytest.raises(ValueError, match="disagree on the token or the job"):
        read_endpoints(str(tmp_path))
    (tmp_path / "grpc-1.json").write_text(json.dumps({"shard": 2, "address": "a", "token": "tok"}))
    with pytest.raises(ValueError, match="says it is shard 2"):
        read_endpoints(str(tmp_path))
    (tmp_path / "grpc-1.json").write_text("{not json")
    with pytest.raises(ValueError, match="grpc-1.json is not a gradsync endpoint file"):
        read_endpoints(str(tmp_path))
