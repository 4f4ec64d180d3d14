"""Gradients that leave during the backward: a ps step's pieces sent as the backward produces them.

A `GradientStream` hooks the trainable leaves one forward ran on. When the backward has produced the
gradient of every entry of a bucket, that bucket's piece is packed from the context, encoded and handed to
the step's `Pipeline` at the next leaf's hook (when its server's window has room, else with the step), the
way DDP's reducer starts a bucket's allreduce once it is ready. A bucket whose entries did not all get a
gradient (an unused branch) travels with the step, from the context's gradients.

Every piece is numbered (`Piece.seq`), and the step's head names the piece of each bucket that counts, so
a guess that turns out wrong costs bytes, never correctness: a second backward into the same context
(accumulation without `trainer.no_sync()`) makes the buckets it touches travel again with the step, summed
by the context; a step that then travels whole (a GradScaler) voids the pieces (`Push.seq`). Backward passes
inside `trainer.no_sync()` send nothing, and a bucket they touched waits for the step. Whether to stream is
decided per context by the worker (`PSStrategy`): after a step that needed neither of those fixes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch

from gradsync.core.buckets import Bucket
from gradsync.ps.messages import Piece

_SEQ = itertools.count(time.time_ns())
"""Piece and push numbers: increasing within a process, and across its restarts (the clock)."""


def next_seq() -> int:
    return next(_SEQ)


class GradientStream:
    """One context's pieces that left during its backward. `leaves`: the trainable leaves by name the forward
    ran on; `buckets`: each server's bucket plan; `gradients()`: the context's gradients by leaf so far;
    `encode(flat, bucket)`: the wire payload of a packed bucket gradient; `pipeline`: the step's
    `transport.rpc.Pipeline` (`room(server)`, `send(piece)`), None to only watch; `quiet()`: whether a
    backward runs inside `trainer.no_sync()`.

    A hook keeps no gradient: a bucket the backward completed is packed from the context at the next leaf's
    hook, once the context holds it (a reference held past the hook would make the context copy the
    gradient instead of taking it). The last bucket the backward completes travels with the step."""

    def __init__(
        self,
        leaves: dict[str, torch.Tensor],
        buckets: dict[int, list[Bucket]],
        gradients,
        encode,
        pipeline,
        quiet: Callable[[], bool],
    ):
        self.leaves = leaves
        self.buckets = buckets
        self.gradients = gradients
        self.encode = encode
        self.pipeline = pipeline
        self.quiet = quiet
        self.sent: dict[tuple[int, int], Piece] = {}  # bucket -> the piece that left (its seq names it)
        self.touched: set[str] = set()  # leaves a backward produced a gradient for
        self.resend: set[tuple[int, int]] = set()  # buckets a later backward added to (or that no_sync held)
        self._ready: list[tuple[int, int]] = []  # complete, not sent yet
        self._lock = threading.Lock()
        self._of: dict[str, list[tuple[int, int]]] = {}
        self._missing: dict[tuple[int, int], int] = {}
        for s, per in buckets.items():
            for b, bucket in enumerate(per):
                names = {e.name for e in bucket.entries}
                self._missing[(s, b)] = len(names)
                for n in names:
                    self._of.setdefault(n, []).append((s, b))
        self._handles = [leaf.register_hook(self._hook(name)) for name, leaf in leaves.items() if name in self._of]

    def _hook(self, name: str):
        def on_grad(grad: torch.Tensor) -> None:
            with self._lock:
                self._produced(name)

        return on_grad

    def _produced(self, name: str) -> None:
        self._flush()
        again = name in self.touched
        self.touched.add(name)
        if again or self.quiet():  # the context sums this backward's gradient with an earlier one's
            self.resend.update(self._of[name])
            return
        for key in self._of[name]:
            self._missing[key] -= 1
            if self._missing[key] == 0 and self.pipeline is not None:
                self._ready.append(key)

    def _flush(self) -> None:
        """Send the complete buckets the window has room for, packed from the context."""
        self._ready = [key for key in self._ready if key not in self.resend]
        if not self._ready:
            return
        grads = self.gradients()
        while self._ready and self.pipeline.room(self._ready[0][0]):
            s, b = self._ready.pop(0)
            bucket = self.buckets[s][b]
            flat, absent = bucket.pack([e.piece(dense(grads[self.leaves[e.name]])) for e in bucket.entries])
            piece = Piece(s, b, self.encode(flat, bucket), absent, next_seq())
            self.pipeline.send(piece)
            self.sent[(s, b)] = piece

    def close(self) -> dict[tuple[int, int], Piece]:
        """Stop listening; returns the pieces that left and still count (their buckets got no gradient since)."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            return {key: piece for key, piece in self.sent.items() if key not in self.resend}


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense tensor (a sparse table's, when its table is not served by rows)."""
    return grad.to_dense() if grad.is_sparse else grad
