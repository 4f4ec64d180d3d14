"""gradsync.DynamicEmbedding: an embedding layer for ids of any int64 value, holding at most `capacity` rows
(a `DynamicTable`, whose docstring states the admission and eviction rules exactly).

In a process with no job it is a local table. A forward in training mode with gradients enabled records: it
counts sightings and lookups, creates admitted ids' rows and gathers the looked-up rows into a leaf tensor that
requires grad. `step(optimizer)` after the backward applies a row optimizer (gradsync.RowSGD / RowAdagrad) to
those rows with their gradients (an id's occurrences summed, over every recording forward since the last step)
and ends the step (eviction), so a plain training loop is:

    loss = loss_fn(model(batch)); loss.backward(); dense_optimizer.step(); table.step(gradsync.RowSGD(lr=0.1))

Any other forward (eval mode, `torch.no_grad()`) only reads: resident ids' rows, zeros for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.tables.dynamic_table import DynamicTable
from gradsync.tables.row_init import HashedUniform

MODES = (None, "sum", "mean")
STATE_KEYS = (
    "ids",
    "weight",
    "last_step",
    "lookups",
    "waiting_ids",
    "waiting_sightings",
    "waiting_last_step",
    "step",
    "counters",
)
"""A DynamicEmbedding's keys in its module's state_dict (each behind the module's prefix)."""
_REQUIRED_KEYS = ("ids", "weight")


class Recorded(NamedTuple):
    """A step's recording forwards of one table: the distinct `ids` looked up (ascending) and the `occurrences`
    of each; the distinct resident `slots` looked up and their `grads` (an id's occurrences summed)."""

    ids: torch.Tensor
    occurrences: torch.Tensor
    slots: torch.Tensor
    grads: torch.Tensor


class DynamicEmbedding(nn.Module):
    """Rows for ids of any int64 value, created on admission with `init(ids)` ([len(ids), dim] of `dtype`;
    default: `HashedUniform(dim, seed)`, uniform in [-1, 1) / sqrt(dim) by a fixed hash of the id and `seed`),
    at most `capacity` resident after each step. `mode=None` works like nn.Embedding (output
    ids.shape + (dim,)); "sum" / "mean" like nn.EmbeddingBag (2-D ids, or 1-D with `offsets`;
    `per_sample_weights` with "sum"). Ids not admitted read zeros (and count in a "mean" bag's size).

    `state_dict()` holds `ids` (resident, ascending int64) and `weight` (their rows in that order), and the
    admission and eviction state: `last_step` and `lookups` per row, `waiting_ids` (ascending) with
    `waiting_sightings` and `waiting_last_step`, `step` (the next step) and `counters` (admitted, filtered,
    evicted). `load_state_dict` needs only `ids` and `weight`; the local row optimizer's state is not saved
    and starts fresh after a load.
    """

    def __init__(
        self,
        dim: int,
        *,
        capacity: int,
        init: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mode: str | None = None,
        admit_after: int = 1,
        admit_probability: float | None = None,
        evict: str = "lru",
        ttl_steps: int | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        super().__init__()
        name = f"DynamicEmbedding(dim={dim}, capacity={capacity})"
        if mode not in MODES:
            raise ValueError(
                f"{name}: mode={mode!r} is not accepted; pass None (like nn.Embedding), 'sum' or "
                "'mean' (like nn.EmbeddingBag)"
            )
        self.mode = mode
        self.table = DynamicTable(
            dim,
            capacity=capacity,
            init=init or HashedUniform(dim, seed, dtype),
            admit_after=admit_after,
            admit_probability=admit_probability,
            evict=evict,
            ttl_steps=ttl_steps,
            dtype=dtype,
            seed=seed,
            name=name,
        )
        self._recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(ids, distinct slots, their leaf rows) of each recording forward since the last step."""
        self.served = None
        """Inside a ps or hybrid job (`worker.rows.served_dynamic`): a function answering the resident rows and the
        counters summed over the servers, which hold the rows; None: the rows are here."""

    @property
    def resident_rows(self) -> int:
        """Rows resident now in the whole table (inside a ps or hybrid job: summed over the servers)."""
        return len(self.table) if self.served is None else self.served()["resident_rows"]

    @property
    def counters(self) -> dict[str, int]:
        """admitted: rows created; filtered: lookups of ids not admitted (read as zeros); evicted: rows evicted
        (inside a ps or hybrid job: summed over the servers)."""
        if self.served is None:
            return dict(self.table.counters)
        return {k: v for k, v in self.served().items() if k != "resident_rows"}

    def extra_repr(self) -> str:
        t = self.table
        return (
            f"{t.dim}, capacity={t.capacity}, mode={self.mode!r}, admit_after={t.admit_after}, "
            f"admit_probability={t.admit_probability}, evict={t.evict!r}, ttl_steps={t.ttl_steps}"
        )

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = self.checked_ids(ids, offsets, per_sample_weights)
        recording = self.training and torch.is_grad_enabled()
        slots = self.table.lookup(ids, self.table.step) if recording else self.table.find(ids)
        unique, index = torch.unique(slots, return_inverse=True)
        rows = self.table.weight[unique.clamp(min=0)]
        rows[unique < 0] = 0
        if recording:
            rows.requires_grad_()
            self._recorded.append((ids, unique, rows))
        return self.embed(index, rows, offsets, per_sample_weights)

    def embed(
        self,
        index: torch.Tensor,
        rows: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """The output from each lookup's position `index` in `rows` (ids.shape)."""
        if self.mode is None:
            return F.embedding(index, rows)
        return F.embedding_bag(index, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def step(self, optimizer) -> None:
        """Apply the row optimizer `optimizer` to the rows looked up since the last step with their gradients,
        then end the step (eviction). Pass the same optimizer every step."""
        recorded = self.take_recorded()
        if recorded.slots.numel():
            self.table.apply(optimizer, recorded.slots, recorded.grads)
        self.table.end_step(self.table.step)

    def take_recorded(
        self, grad_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda rows: rows.grad
    ) -> Recorded:
        """What the recording forwards since the last step looked up, and their gradients (`grad_of(rows)` of
        each forward's leaf rows: `.grad`, or a dist_autograd context's); the record starts afresh."""
        recorded, self._recorded = self._recorded, []
        if not recorded:
            none = torch.zeros(0, dtype=torch.int64)
            return Recorded(none, none, none, torch.zeros(0, self.table.dim, dtype=self.table.dtype))
        ids, per_slots, rows = zip(*recorded)
        distinct, occurrences = torch.unique(torch.cat([i.reshape(-1) for i in ids]), return_counts=True)
        slots = torch.cat(per_slots)
        grads = torch.cat([g if (g := grad_of(r)) is not None else torch.zeros_like(r) for r in rows])
        resident = slots >= 0
        unique, inverse = torch.unique(slots[resident], return_inverse=True)
        summed = grads.new_zeros((unique.numel(), self.table.dim)).index_add_(0, inverse, grads[resident])
        return Recorded(distinct, occurrences, unique, summed)

    def output_shape(self, ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Size:
        """The shape of `embed`'s output for the (checked) `ids` and `offsets`, computing nothing."""
        if self.mode is None:
            return torch.Size((*ids.shape, self.table.dim))
        return torch.Size((ids.shape[0] if offsets is None else offsets.numel(), self.table.dim))

    def checked_ids(self, ids, offsets=None, per_sample_weights=None) -> torch.Tensor:
        """`ids` as int64, refused (naming the table) unless an integer tensor, with offsets only for a bag."""
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError(
                f"{self.table.name}: offsets and per_sample_weights are for mode='sum' or 'mean' "
                "(like nn.EmbeddingBag); this table has mode=None (like nn.Embedding)"
            )
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype.is_floating_point
            or ids.dtype.is_complex
            or ids.dtype in (torch.bool, torch.uint64)
        ):
            got = f"a tensor of dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else f"a {type(ids).__name__}"
            raise TypeError(
                f"{self.table.name}: ids must be an integer tensor (int64 ids of any value), got {got}; "
                "pass torch.as_tensor(ids, dtype=torch.int64) (64-bit ids beyond 2**63 - 1 as "
                "their two's-complement int64)"
            )
        return ids.long()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, value in self.table.state().items():
            destination[prefix + key] = value

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        mine = {
            k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        unexpected_keys.extend(prefix + k for k in mine if k not in STATE_KEYS)
        absent = [prefix + k for k in _REQUIRED_KEYS if k not in mine]
        missing_keys.extend(absent)
        if not absent:
            try:
                self.table.load({k: v for k, v in mine.items() if k in STATE_KEYS})
            except ValueError as e:
                error_msgs.append(str(e))
            self._recorded.clear()
