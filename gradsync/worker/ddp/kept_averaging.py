"""The gradient averaging of an allreduce job whose dead workers are replaced (worker_loss wait): DDP's comm hook
over the workers' generation group (`worker.ddp.generations`), in a layout of its own, keeping this worker's own
gradients of each step, so that a step a death broke is averaged again with the replacement's part.

DDP's buckets do not fit: DDP rebuilds them after its first iteration in the order the gradients came, and a
replacement's DDP is in its first iteration when the others' are not. So the averaging has a fixed layout: the
trainable parameters in reverse order (the order a backward reaches them), cut into buckets of at most
bucket_cap_mb (`Layout`). As DDP hands a bucket over, the hook copies its gradients into the step's flat buffers of
that layout and averages each buffer once it is whole, in the layout's order, as DDP's own allreduce does: scaled
by 1 / W, then all-reduced. DDP's own group is this worker alone, so DDP never communicates by itself.

The buffers of the last two steps are kept. When a collective fails (a worker died: the generation is over), the
hook answers the rest of the step at once and the step is `broken`: its averages are not to be used. Once the next
generation is formed, `replay` averages the kept buffers of a step again, in the same order, while the replacement's
hook averages its own in the same layout: the same sums as without the death, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

import torch


class Layout:
    """The averaging's buckets: the trainable parameters in reverse order, each bucket closed once it holds
    `caps[0]` bytes or more (the first) or `caps[1]` (the others), as DDP's, each of one dtype."""

    def __init__(self, params: list[torch.Tensor], caps: tuple[int, int], sparse: AbstractSet[int] = frozenset()):
        """`sparse`: the ids of the parameters whose gradients are sparse (tables with sparse=True): no bucket's,
        averaged one by one after the buckets (`sparse`, in `params`' order)."""
        self.sparse = [i for i, p in enumerate(params) if id(p) in sparse]
        self.buckets: list[list[int]] = [[]]  # indices into params
        size = 0
        for i in reversed([i for i, p in enumerate(params) if id(p) not in sparse]):
            full = size >= caps[len(self.buckets) > 1]  # as DDP's: a bucket closes once it holds its cap or more
            if self.buckets[-1] and (full or params[self.buckets[-1][0]].dtype != params[i].dtype):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += params[i].numel() * params[i].element_size()
        self.dtypes = [params[b[0]].dtype for b in self.buckets]
        self.where: dict[int, tuple[int, int, int]] = {}  # id(param) -> (bucket, offset, elements)
        self.sizes: list[int] = []
        for b, indices in enumerate(self.buckets):
            offset = 0
            for i in indices:
                self.where[id(params[i])] = (b, offset, params[i].numel())
                offset += params[i].numel()
            self.sizes.append(offset)
        self.params = params

    def grads(self, flats: list[torch.Tensor], sparse: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's gradient (in `params`' order): a view of `flats`, the layout's buffers, or one of
        `sparse` (in `self.sparse`'s order)."""
        out, rows = [], iter(sparse)
        for p in self.params:
            if id(p) in self.where:
                b, offset, n = self.where[id(p)]
                out.append(flats[b][offset : offset + n].view_as(p))
            else:
                out.append(next(rows))
        return out


class _Step:
    """One step's buffers: this worker's own gradients (`own`), the tensors their averages go to (`out`), the
    averages as they come (`averaged`). `own` and `out` are taken over from the step two before (`reused`):
    allocating them anew each step costs a step's page faults."""

    def __init__(self, layout: Layout, reused: _Step | None):
        if reused is None:
            self.own = [torch.empty(n, dtype=dtype) for n, dtype in zip(layout.sizes, layout.dtypes)]
            self.out = [torch.empty_like(own) for own in self.own]
        else:
            self.own, self.out = reused.own, reused.out
        self.filled = [0] * len(layout.sizes)
        self.averaged: list[torch.futures.Future] = [torch.futures.Future() for _ in layout.sizes]
        self.launched = 0  # buckets averaged so far (in the layout's order)
        self.sparse_own: dict[int, torch.Tensor] = {}  # index of a sparse parameter -> its own gradient, coalesced
        self.sparse_averaged: dict[int, torch.futures.Future] = {i: torch.futures.Future() for i in layout.sparse}


class KeptAveraging:
    """The hook (`hook`, for `DDP.register_comm_hook(None, ...)`) and the steps it keeps."""

    def __init__(
        self,
        params: list[torch.Tensor],
        caps: tuple[int, int],
        sparse: set[int],
        workers: int,
        group: Callable,
        step: Callable[[], int],
        began: Callable[[], None],
    ):
        """`caps`, `sparse`: the `Layout`'s; `group()`: the group to average over now; `step()`: the number of the
        step in flight; `began()`: called as a step's first bucket comes, before any of its averaging."""
        self.layout = Layout(params, caps, sparse)
        self.workers, self.group, self.step, self.began = workers, group, step, began
        self.kept: dict[int, _Step] = {}
        self.broken = False  # a collective of the step in flight failed
        self.deferred = False  # a replacement's first step: averaged in `replay`, once its GradScaler is known

    def hook(self, state, bucket):  # no annotations: DDP checks them
        """DDP's bucket `bucket`: its gradients into the step's buffers; answered once the buffers it spans are
        averaged (its gradients then hold the averages)."""
        number = self.step()
        if number not in self.kept:
            reused = self.kept.get(number - 2)
            self.kept = {n: s for n, s in self.kept.items() if n == number - 1}
            self.kept[number] = _Step(self.layout, reused)
            self.began()
        step = self.kept[number]
        params, grads, spans = bucket.parameters(), bucket.gradients(), set()
        if bucket.buffer().is_sparse:  # a table with sparse=True: a bucket of its own
            index = next(i for i in self.layout.sparse if self.layout.params[i] is params[0])
            step.sparse_own[index] = bucket.buffer().coalesce()
            self._launch(step)
            return step.sparse_averaged[index]
        for p, g in zip(params, grads):
            b, offset, n = self.layout.where[id(p)]
            step.own[b][offset : offset + n].copy_(g.reshape(-1))
            step.filled[b] += n
            spans.add(b)
        self._launch(step)
        buffer = bucket.buffer()

        def fill(_):
            for p, g in zip(params, grads):
                b, offset, n = self.layout.where[id(p)]
                g.copy_(step.averaged[b].value()[offset : offset + n].view_as(g))
            return buffer

        return torch.futures.collect_all([step.averaged[b] for b in sorted(spans)]).then(fill)

    def _launch(self, step: _Step) -> None:
        """Average each bucket of `step` now whole, in the layout's order; once every bucket is, and every sparse
        gradient is in, the sparse gradients, in order (every worker launches them alike, whatever order its DDP
        hands them over in)."""
        while step.launched < len(step.own) and step.filled[step.launched] == self.layout.sizes[step.launched]:
            b = step.launched
            self._average(step.own[b], step.averaged[b], step.out[b])
            step.launched += 1
        if step.launched == len(step.own) and len(step.sparse_own) == len(self.layout.sparse):
            for i in self.layout.sparse:
                if not step.sparse_averaged[i].done():
                    self._average(step.sparse_own[i], step.sparse_averaged[i])

    def _average(self, own: torch.Tensor, averaged: torch.futures.Future, out: torch.Tensor | None = None) -> None:
        """Average `own` over the group into `out` (a new tensor when None; `own` kept), the result in
        `averaged`."""
        out = torch.mul(own, 1.0 / self.workers, out=out)  # as DDP's allreduce scales: bit for bit
        if self.broken or self.deferred:
            averaged.set_result(out)
            return

        def done(fut):
            try:
                result = fut.value()[0]
            except RuntimeError:  # a worker died: the generation is over
                self.broken = True
                result = out
            averaged.set_result(result)

        self.group().allreduce([out]).get_future().then(done)

    def replay(self, number: int) -> list[torch.Tensor]:
        """Average step `number`'s kept gradients again over the group now, in the layout's order; each
        parameter's average (in `params`' order).

        Raises:
            RuntimeError: a collective failed (another death).
        """
        step = self.kept[number]
        averaged = [self._averaged_now(own) for own in step.own]
        return self.layout.grads(averaged, [self._averaged_now(step.sparse_own[i]) for i in self.layout.sparse])

    def _averaged_now(self, own: torch.Tensor) -> torch.Tensor:
        """`own` averaged over the group, waited for."""
        out = own * (1.0 / self.workers)
        work = self.group().allreduce([out])
        work.wait()
        return work.result()[0] if out.is_sparse else out

    def rescale(self, number: int, factor: float) -> None:
        """Multiply step `number`'s kept gradients by `factor` (a replacement's first step: from its GradScaler's
        scale to the one the others' loss had, a power of two: exact)."""
        if factor != 1.0:
            step = self.kept[number]
            for own in [*step.own, *step.sparse_own.values()]:
                own.mul_(factor)
