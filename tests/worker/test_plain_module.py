"""The user's module stays an ordinary PyTorch module under every strategy and table layout (`worker.module.plain_module`):
a fixed table served by rows (ps, hybrid) or split over the workers (sharded), a dynamic table on the servers, the
workers or as replicas (allreduce), a dense head. One job per layout (`plain_models.plain_module_job`)."""
import pytest
import torch

from gradsync.worker.module.plain_module import check_gatherable

from jobs import make_mlp
from plain_models import ROWS, TableNet, dense_load_job, plain_copies, plain_module_job

LAYOUTS = [("ps", 2, 2), ("hybrid", 2, 1), ("sharded", 2, 0), ("allreduce", 2, 0)]


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,workers,servers", LAYOUTS, ids=[s for s, _, _ in LAYOUTS])
def test_the_module_saves_copies_loads_and_leaves_as_an_ordinary_module(launch, strategy, workers, servers):
    results = launch(plain_module_job, strategy=strategy, workers=workers, servers=servers)
    keys = list(TableNet().state_dict())
    for out in results:
        trained = out["trained"]
        assert list(trained) == keys and trained["emb.weight"].shape == (ROWS, 4)
        assert trained["tags.ids"].numel() > 0
        assert equal(out["module_state"], trained)
        assert out["types"] == "TableNet" and out["attached"] == [] and not out["names_internals"]
        assert equal(out["loaded"], trained) and equal(out["copied"], trained) and out["trained_moved"]
        assert equal(out["round_trip"], trained)
        assert "size mismatch for emb.weight" in out["bad_load"] and equal(out["after_bad_load"], trained)
        parts = {k: TableNet().state_dict()[k] if k.split(".")[0] in ("head", "emb") else v for k, v in trained.items()}
        assert equal(out["loaded_parts"], parts)
        assert equal(out["loaded_fresh"], TableNet().state_dict())
        assert equal(out["trained_again"], trained)
        final = out["after_shutdown"]
        assert equal(final["state"], trained) and final["attached"] == [] and final["weight_is_parameter"]
        assert final["resident_rows"] == trained["tags.ids"].numel()
        assert not final["names_internals"]
    assert all(equal(out["trained"], results[0]["trained"]) for out in results)


@pytest.mark.job
@pytest.mark.timeout(120)
def test_a_load_goes_to_the_servers_over_grpc_too(launch):
    for out in launch(dense_load_job, strategy="ps", workers=2, servers=2, transport="grpc"):
        assert equal(out["copied"], out["trained"]) and equal(out["loaded"], make_mlp().state_dict())
        assert "size mismatch for 0.weight" in out["bad_load"] and equal(out["after_bad_load"], out["loaded"])
        assert equal(out["trained_again"], out["trained"])


def test_a_module_outside_any_job_is_left_as_it_is():
    model = TableNet()
    out = plain_copies(model)
    assert out["attached"] == [] and equal(out["loaded"], model.state_dict()) and out["trained_moved"]


def test_a_table_larger_than_the_memory_here_is_refused_in_one_line_naming_it():
    with pytest.raises(MemoryError, match=r"table 'emb.weight' \(1000000000000 x 8 torch.float32, 29802.3 GiB\) is "
                                          r"larger than the memory available .*--checkpoint-dir"):
        check_gatherable("emb.weight", (10**12, 8), torch.float32)
    check_gatherable("emb.weight", (1000, 8), torch.float32)
