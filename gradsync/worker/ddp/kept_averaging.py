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

import torch


class Layout:
    """The averaging's buckets: the trainable parameters in reverse order, the first bucket at most `caps[0]`
    bytes and the others `caps[1]` (a larger parameter alone), each of one dtype."""

    def __init__(self, params: list[torch.Tensor], caps: tuple[int, int]):
        self.buckets: list[list[int]] = [[]]  # indices into params
        size = 0
        for i in reversed(range(len(params))):
            nbytes = params[i].numel() * params[i].element_size()
            cap = caps[len(self.buckets) > 1]
            other_dtype = self.buckets[-1] and params[self.buckets[-1][0]].dtype != params[i].dtype
            if self.buckets[-1] and (size + nbytes > cap or other_dtype):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
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

    def grads(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's gradient (in `params`' order) as a view of `flats`, the layout's buffers."""
        out = []
        for p in self.params:
            b, offset, n = self.where[id(p)]
            out.append(flats[b][offset : offset + n].view_as(p))
        return out


class _Step:
    """One step's buffers: this worker's own gradients (`own`), their averages as they come (`averaged`)."""

    def __init__(self, layout: Layout):
        self.own = [torch.empty(n, dtype=dtype) for n, dtype in zip(layout.sizes, layout.dtypes)]
        self.filled = [0] * len(layout.sizes)
        self.averaged: list[torch.futures.Future] = [torch.futures.Future() for _ in layout.sizes]
        self.launched = 0  # buckets averaged so far (in the layout's order)


class KeptAveraging:
    """The hook (`hook`, for `DDP.register_comm_hook(None, ...)`) and the steps it keeps."""

    def __init__(
        self, params: list[torch.Tensor], caps: tuple[int, int], workers: int, group: Callable, step: Callable[[], int]
    ):
        """`caps`: the `Layout`'s; `group()`: the group to average over now; `step()`: the number of the step in
        flight."""
        self.layout = Layout(params, caps)
        self.workers, self.group, self.step = workers, group, step
        self.kept: dict[int, _Step] = {}
        self.broken = False  # a collective of the step in flight failed
        self.deferred = False  # a replacement's first step: averaged in `replay`, once its GradScaler is known

    def hook(self, state, bucket):  # no annotations: DDP checks them
        """DDP's bucket `bucket`: its gradients into the step's buffers; answered once the buffers it spans are
        averaged (its gradients then hold the averages)."""
        number = self.step()
        if number not in self.kept:
            self.kept = {n: s for n, s in self.kept.items() if n == number - 1}
            self.kept[number] = _Step(self.layout)
        step = self.kept[number]
        params, grads, spans = bucket.parameters(), bucket.gradients(), set()
        for p, g in zip(params, grads):
            b, offset, n = self.layout.where[id(p)]
            step.own[b][offset : offset + n].copy_(g.reshape(-1))
            step.filled[b] += n
            spans.add(b)
        while step.launched < len(step.own) and step.filled[step.launched] == self.layout.sizes[step.launched]:
            self._average(step, step.launched)
            step.launched += 1
        buffer = bucket.buffer()

        def fill(_):
            for p, g in zip(params, grads):
                b, offset, n = self.layout.where[id(p)]
                g.copy_(step.averaged[b].value()[offset : offset + n].view_as(g))
            return buffer

        return torch.futures.collect_all([step.averaged[b] for b in sorted(spans)]).then(fill)

    def _average(self, step: _Step, b: int) -> None:
        """Average bucket `b` of `step` over the group, into a tensor of its own (the own gradients kept)."""
        out = step.own[b] * (1.0 / self.workers)  # as DDP's allreduce scales: bit for bit
        if self.broken or self.deferred:
            step.averaged[b].set_result(out)
            return

        def done(fut):
            try:
                fut.value()
            except RuntimeError:  # a worker died: the generation is over
                self.broken = True
            step.averaged[b].set_result(out)

        self.group().allreduce([out]).get_future().then(done)

    def replay(self, number: int) -> list[torch.Tensor]:
        """Average step `number`'s kept gradients again over the group now, in the layout's order; each
        parameter's average (in `params`' order).

        Raises:
            RuntimeError: a collective failed (another death).
        """
        averaged = []
        for own in self.kept[number].own:
            out = own * (1.0 / self.workers)
            self.group().allreduce([out]).wait()
            averaged.append(out)
        return self.layout.grads(averaged)

    def rescale(self, number: int, factor: float) -> None:
        """Multiply step `number`'s kept gradients by `factor` (a replacement's first step: from its GradScaler's
        scale to the one the others' loss had, a power of two: exact)."""
        if factor != 1.0:
            for own in self.kept[number].own:
                own.mul_(factor)
