"""Every server of a launched job serves gRPC: clients outside the RPC world read the live job."""
import pytest

from helpers import max_diff
from jobs import reference_mlp, train_then_read_over_grpc


@pytest.mark.timeout(150)
def test_servers_of_a_job_serve_grpc_with_owner_only_endpoint_files(launch):
    result = launch(train_then_read_over_grpc, strategy="ps", workers=1, servers=2, args=(3,))[0]
    state, pulled = result["state"], result["pulled"]
    assert result["pieces"], "SGD lets the plan split a parameter across the 2 servers; the client joins it"
    assert max_diff(state, reference_mlp(3, 1)) <= 1e-5  # what the job trained, so what the clients must read
    assert sorted(pulled) == sorted(state)
    for name in state:
        assert pulled[name].dtype == state[name].dtype and pulled[name].equal(state[name]), name
    assert result["versions"] == {0: 3, 1: 3}
    assert result["modes"] == [0o600, 0o600]
    assert all(result["stats"][shard]["version"] == 3 for shard in (0, 1)), result["stats"]
    assert "| 0 |" in result["status"] and "| 1 |" in result["status"], result["status"]
    assert isinstance(result["cli_weights"], dict), result["cli_weights"]
    assert all(result["cli_weights"][k].equal(state[k]) for k in state)


@pytest.mark.timeout(150)
def test_embedding_tables_are_read_over_grpc_rows_whole_and_in_status(launch):
    from sparse_models import ROWS_EMB, TABLES, train_then_read_tables_over_grpc

    result = launch(train_then_read_tables_over_grpc, strategy="ps", workers=1, servers=2, args=(4,))[0]
    state = result["state"]
    assert result["rows"].equal(state["emb.weight"][result["ids"]])  # repeats and both servers' rows, in order
    assert sorted(result["pulled"]) == sorted(state)
    assert all(result["pulled"][k].equal(state[k]) for k in state)  # tables joined from both servers' rows
    for name in TABLES:
        per_shard = [result["stats"][s]["tables"][name] for s in (0, 1)]
        assert sum(t["rows"] for t in per_shard) == state[name].shape[0]
        assert all(t["rows_pushed"] > 0 and t["rows_pulled"] > 0 for t in per_shard)
        assert f"| {name} | 0 |" in result["status"] and f"| {name} | 1 |" in result["status"], result["status"]
    assert f"has rows 0..{ROWS_EMB - 1}, but a batch looked up id {ROWS_EMB}" in result["out_of_range"]
