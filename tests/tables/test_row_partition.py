"""The sharded strategy's row partition and exchange plan (`tables.row_partition`), in one process."""
import pytest
import torch

from gradsync.tables.row_partition import ExchangePlan, local_index, owned_rows, owners

MASK = (1 << 64) - 1


def splitmix64_finaliser(x: int) -> int:
    """SplitMix64's finaliser on Python integers: the reference the torch version must reproduce."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("rows", [1000, (1 << 16) + 3])  # the second crosses owned_rows' chunk of ids
def test_every_row_is_owned_once_by_the_owner_its_hash_names(workers, rows):
    parts = [owned_rows(rows, w, workers) for w in range(workers)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(rows))  # every row once
    for w, part in enumerate(parts):
        assert torch.equal(part, part.sort().values)  # ascending: the local order
        assert torch.equal(local_index(part, part), torch.arange(part.numel()))
        for r in part[:: max(1, part.numel() // 20)].tolist():  # an independent computation of the owner
            assert splitmix64_finaliser(r) % workers == w
    if workers > 1:  # the hash spreads the rows: no worker holds more than twice its share
        assert max(p.numel() for p in parts) < 2 * rows / workers


def test_owner_of_ids_across_the_whole_int64_range_matches_the_unsigned_hash():
    ids = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345])
    for workers in (2, 3, 5):
        expected = [splitmix64_finaliser(i & MASK) % workers for i in ids.tolist()]
        assert owners(ids, workers).tolist() == expected


def test_exchange_plan_groups_ids_by_owner_on_uneven_batches():
    workers = 4
    ids = torch.arange(40)
    plan = ExchangePlan.of(ids, workers)
    sent = owners(ids[plan.order], workers)
    assert torch.equal(sent, sent.sort().values)  # grouped, owner 0 first
    assert plan.counts == torch.bincount(owners(ids, workers), minlength=workers).tolist()
    assert sorted(plan.order.tolist()) == list(range(40))  # a permutation: every id travels once
    one_owner = owned_rows(40, 2, workers)[:3]  # a batch whose ids all belong to worker 2
    assert ExchangePlan.of(one_owner, workers).counts == [0, 0, 3, 0]
    empty = ExchangePlan.of(torch.empty(0, dtype=torch.int64), workers)  # an empty batch sends only counts
    assert empty.counts == [0] * workers and empty.order.numel() == 0
