"""PendingRows: what a served table's lookup returns while its rows are still on the servers (ps, hybrid) or
with their owners (sharded).

A lookup is a round trip: a call to each server holding its rows, or under sharded an exchange with every
worker. Made one table at a time, a forward of T tables makes T round trips (sharded: 2T exchanges); TorchRec
makes two exchanges for all its tables, because its collection module sees every table's ids at once. A
user's model calls its tables one by one, so instead each lookup returns a `PendingRows`, a tensor of the
lookup's shape and dtype with no data, and the lookups wait together. The first use of any of them (any torch
function or Tensor method, through `__torch_function__`) fetches every waiting lookup's rows at once (`flush`:
one call per server; sharded, one exchange of ids and one of rows), and the use then runs on the real result,
a plain tensor in the autograd graph like any lookup's. Reading its shape, dtype or device fetches nothing.

A path that reaches the tensor's data without passing through torch's Python API (a C++ extension handed it
directly) raises, naming the operation: it never reads rows that have not arrived.

`WaitingLookups` keeps a forward's waiting lookups for their owner (fixed tables, dynamic tables): at most
`LOOKUPS_PER_EXCHANGE` wait, and `flush` has the owner turn them all into results at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from gradsync.tables.row_partition import LOOKUPS_PER_EXCHANGE

# torch's stubs type these descriptors of the class as the values they give an instance
_METADATA = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
    torch.Tensor.__len__,
    torch.Tensor.numel,
}
"""What a pending lookup answers from its own shape, fetching nothing."""


class PendingRows(torch.Tensor):
    """A lookup's result of `shape` and `dtype` that `flush()` (fetching every waiting lookup's rows) makes
    real (`resolve`)."""

    _flush: Callable[[], None]
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, flush: Callable[[], None]):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
        out._flush, out._value = flush, None
        return out

    def __init__(self, shape: torch.Size, dtype: torch.dtype, flush: Callable[[], None]):
        super().__init__()

    def resolve(self, value: torch.Tensor) -> None:
        """Become `value` (the lookup's result): every later use of this tensor is a use of it."""
        self._value = value

    def value(self) -> torch.Tensor:
        """The real result, fetched with every waiting lookup's if it has not arrived yet.

        Raises:
            RuntimeError: the exchange that was to fetch it was refused (a bad id, workers out of step): the
                forward that made this lookup failed, and its result does not exist.
        """
        if self._value is None:
            self._flush()
        if self._value is None:
            raise RuntimeError(
                "gradsync: the rows of this table lookup never arrived: the call or exchange that "
                "fetched them failed (see the error its forward raised); run the forward again"
            )
        return self._value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(PendingRows, PendingRows.value, (args, kwargs))
        return func(*args, **kwargs)

    # torch's stubs type its disabled default as a plain function; a subclass's is this classmethod (torch's docs)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"gradsync: {func} was given the result of a served table lookup below torch's Python "
            "API, before its rows arrived; pass it through a torch function first (e.g. "
            "torch.as_tensor(rows) * 1), and report the call that did this to gradsync"
        )


def resolved(tree):
    """`tree` (a module's output: tensors in tuples, lists, dicts) with every pending lookup made real; `tree`
    itself where it holds none."""
    if not any(isinstance(leaf, PendingRows) for leaf in pytree.tree_leaves(tree)):
        return tree
    return pytree.tree_map_only(PendingRows, PendingRows.value, tree)


class WaitingLookups:
    """A forward's lookups waiting for their rows, in model order, each with the `PendingRows` it returned;
    `results(lookups)` (the owner's: fetch every lookup's rows, keep what the step needs) makes them real."""

    def __init__(self, results: Callable[[list], list[torch.Tensor]]):
        self._results = results
        self._waiting: list[tuple[object, PendingRows]] = []

    def add(self, lookup, shape: torch.Size, dtype: torch.dtype) -> PendingRows:
        """`lookup`'s result, pending; the ones already waiting are fetched first when `LOOKUPS_PER_EXCHANGE`
        wait."""
        if len(self._waiting) == LOOKUPS_PER_EXCHANGE:
            self.flush()
        pending = PendingRows(shape, dtype, self.flush)
        self._waiting.append((lookup, pending))
        return pending

    def flush(self) -> None:
        """Every waiting lookup's result made real, with gradients whatever the mode of the use that asks."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        with torch.enable_grad():
            results = self._results([lookup for lookup, _ in waiting])
        for (_, pending), result in zip(waiting, results):
            pending.resolve(result)
