"""A sharded lookup's PendingRows: its shape costs nothing, its first use fetches every waiting lookup at once,
and the use runs on the real result inside the autograd graph; a result never fetched raises, never reads."""
import pytest
import torch
import torch.nn.functional as F

from gradsync.worker.rows.pending_rows import PendingRows, resolved
from gradsync.worker.rows.served_tables import output_shape


class _Lookups:
    """Lookups of the rows `leaf` that wait until `flush`, which counts its calls."""

    def __init__(self, leaf: torch.Tensor):
        self.leaf, self.waiting, self.flushes = leaf, [], 0

    def look_up(self, ids: list[int]) -> PendingRows:
        pending = PendingRows(torch.Size((len(ids), self.leaf.shape[1])), self.leaf.dtype, self.flush)
        self.waiting.append((pending, torch.tensor(ids)))
        return pending

    def flush(self) -> None:
        waiting, self.waiting = self.waiting, []
        if waiting:
            self.flushes += 1
        for pending, ids in waiting:
            pending.resolve(F.embedding(ids, self.leaf))


def test_the_first_use_fetches_every_waiting_lookup_and_gradients_reach_the_rows():
    leaf = torch.arange(12.0).view(4, 3).requires_grad_()
    lookups = _Lookups(leaf)
    a, b = lookups.look_up([0, 1, 1]), lookups.look_up([3])
    assert (a.shape, b.size(0), a.dim(), len(a), a.numel(), a.dtype) == ((3, 3), 1, 2, 3, 9, torch.float32)
    assert lookups.flushes == 0  # its shape is its own
    loss = (torch.cat([a, b]) * torch.tensor([[1.0], [2.0], [3.0], [4.0]])).sum()
    assert lookups.flushes == 1 and not lookups.waiting
    assert float(loss.detach()) == sum(w * float(leaf[i].detach().sum()) for w, i in zip([1, 2, 3, 4], [0, 1, 1, 3]))
    loss.backward()
    assert torch.equal(leaf.grad, torch.tensor([[1.0] * 3, [5.0] * 3, [0.0] * 3, [4.0] * 3]))
    assert torch.equal(a + 0, F.embedding(torch.tensor([0, 1, 1]), leaf))  # later uses: the same result


def test_methods_in_place_ops_and_outputs_use_the_real_result():
    leaf = torch.ones(2, 2)
    lookups = _Lookups(leaf)
    a = lookups.look_up([0, 1])
    a.mul_(3)  # in place on the real result
    assert a.tolist() == [[3.0, 3.0], [3.0, 3.0]] and lookups.flushes == 1
    b = lookups.look_up([1])
    out = resolved({"rows": (b, 1)})
    assert type(out["rows"][0]) is torch.Tensor and torch.equal(out["rows"][0], leaf[1:])
    plain = {"x": torch.zeros(1)}
    assert resolved(plain) is plain  # nothing waiting: the output itself


def test_a_lookup_whose_exchange_was_refused_raises_when_used():
    def refuse():
        raise ValueError("table 't' has rows 0..3, but a batch looked up id 9")

    pending = PendingRows(torch.Size((1, 2)), torch.float32, refuse)
    with pytest.raises(ValueError, match="looked up id 9"):
        pending.sum()
    never = PendingRows(torch.Size((1, 2)), torch.float32, lambda: None)
    with pytest.raises(RuntimeError, match="never arrived"):
        never + 1


def test_below_the_python_api_it_raises_rather_than_read_missing_rows():
    pending = PendingRows(torch.Size((1, 2)), torch.float32, lambda: None)
    with torch._C.DisableTorchFunctionSubclass(), pytest.raises(RuntimeError, match="before its rows arrived"):
        torch.add(pending, 1)


def test_a_pending_lookup_has_the_shape_its_module_would_return():
    emb, bag = torch.nn.Embedding(10, 3), torch.nn.EmbeddingBag(10, 3)
    last = torch.nn.EmbeddingBag(10, 3, include_last_offset=True)
    ids, flat, offsets = torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    for module, args in [(emb, (ids,)), (emb, (flat,)), (bag, (ids,)), (bag, (flat, offsets)), (last, (flat, offsets))]:
        assert output_shape(module, *args) == module(*args).shape
    with pytest.raises(ValueError, match="a 1-D input with offsets, got a 1-D input without offsets"):
        output_shape(bag, flat)
