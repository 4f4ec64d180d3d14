"""Embedding tables served row-wise (ps and hybrid) match single-process training, and bad lookups fail
clearly. Pairwise coverage of W in {1, 2, 4}, S in {1, 2} and the three table optimizers per strategy."""
import math

import pytest
import torch

import gradsync
from sparse_models import (BATCH, HOT, ROWS_BAG, ROWS_EMB, TABLES, ClickNet, huge_table, lookup_out_of_range,
                           reference_clicks, train_clicks, train_on_meta_tables)
from helpers import max_diff

pytestmark = pytest.mark.job  # every test here starts processes

STEPS = 20
CASES = [
    ("ps", 1, 1, "sgd"), ("ps", 2, 2, "adagrad"), ("ps", 4, 2, "sgd"), ("ps", 2, 1, "momentum"),
    ("hybrid", 1, 2, "adagrad"), ("hybrid", 2, 1, "sgd"), ("hybrid", 4, 2, "adagrad"), ("hybrid", 2, 2, "momentum"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy,workers,servers,optimizer", CASES)
def test_served_tables_match_single_process(launch, strategy, workers, servers, optimizer):
    states = launch(train_clicks, strategy=strategy, workers=workers, servers=servers,
                    args=(optimizer, STEPS), step_timeout=60, timeout=140)
    reference = reference_clicks(optimizer, STEPS, workers)
    start = ClickNet().state_dict()
    for state in states:
        assert max_diff(state, reference) <= 1e-5
    for key in TABLES:
        assert (states[0][key] - start[key]).abs().max() > 1e-3  # the tables trained
    assert torch.equal(states[0]["emb.weight"][0], start["emb.weight"][0])  # the padding row never moves


@pytest.mark.timeout(120)
def test_sparse_true_embeddings_train_the_same(launch):
    states = launch(train_clicks, strategy="hybrid", workers=2, servers=2, args=("sgd", 5, True),
                    step_timeout=60, timeout=110)
    assert max_diff(states[0], reference_clicks("sgd", 5, 2)) <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ps", "hybrid"])
def test_meta_tables_are_initialised_on_the_servers_and_counted_async(launch, strategy):
    (stats, state), _ = launch(train_on_meta_tables, strategy=strategy, mode="async", workers=2, servers=2,
                               args=(6,), step_timeout=60, timeout=110)
    for name, rows in (("bag.weight", ROWS_BAG), ("emb.weight", ROWS_EMB)):
        per_server = [stats[s]["tables"][name] for s in (0, 1)]
        assert [t["rows"] for t in per_server] == [math.ceil(rows / 2), rows // 2]
        assert sum(t["bytes"] for t in per_server) == state[name].nbytes
        assert all(t["rows_pushed"] > 0 for t in per_server)
        # a push is stale by at most the other worker's pushes (6 per shard), not by the shard's whole version
        assert all(t["max_staleness"] <= 6 for t in per_server)
        assert bool(torch.isfinite(state[name]).all()) and state[name].std() > 0.5  # N(0, 1) rows, trained
    # lookups per step: W workers x (B x HOT bag ids + B ids), at most; the pulls counted them all
    pulled = sum(stats[s]["tables"][n]["rows_pulled"] for s in (0, 1) for n in TABLES)
    assert 0 < pulled <= 2 * 6 * BATCH * (HOT + 1)
    assert torch.equal(state["emb.weight"][0], torch.zeros(4))  # the padding row: zeros, never moved


@pytest.mark.timeout(90)
def test_id_out_of_range_names_table_and_id(launch):
    with pytest.raises(gradsync.JobFailed, match=rf"table 'emb.weight' has rows 0..{ROWS_EMB - 1}, but a batch "
                                                  rf"looked up id {ROWS_EMB + 5}"):
        launch(lookup_out_of_range, strategy="ps", workers=2, servers=2, step_timeout=20, timeout=80)


@pytest.mark.timeout(90)
def test_table_larger_than_the_servers_memory_is_refused_at_start(launch):
    with pytest.raises(gradsync.JobFailed, match=r"table '0.weight' needs \d+\.\d\d GiB on server 0 .* "
                                                  r"use more servers"):
        launch(huge_table, strategy="ps", workers=1, servers=1, step_timeout=20, timeout=80)


@pytest.mark.timeout(120)
def test_tables_dense_serves_no_table_and_trains_them_as_dense_parameters(launch):
    """README: `tables="dense"` serves none, even where plain SGD would let "auto" serve them."""
    from sparse_models import train_clicks_dense_tables

    results = launch(train_clicks_dense_tables, strategy="ps", workers=2, args=(5,), timeout=110)
    reference = reference_clicks("sgd", 5, 2)
    for state, sizes in results:
        assert sizes["tables"] == 0  # nothing served: the tables travel in the dense buckets
        assert max_diff(state, reference) <= 1e-5
        assert max_diff(state, ClickNet().state_dict()) > 1e-4  # and they trained
