"""One server's rows of one embedding table, its row optimizer state and counters.

Server `s` of S holds rows s, s + S, s + 2S, ... of the table, at local
indices 0, 1, 2, ... Pulls read rows by local index; a step hands the row
optimizer the unique local rows and their gradients, and touches nothing
else. Callers hold the shard's lock.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from gradsync.core.buckets import TensorSpec
from gradsync.core.errors import GradientError
from gradsync.ps.layout import TableLayout
from gradsync.ps.server_table import ServerTable
from gradsync.tables.placement import out_of_range, rows_on
from gradsync.tables.row_optim import saved_state, take_saved_state


@dataclasses.dataclass
class TableStats:
    """Counters of one table shard (gRPC `GetStats`, `gradsync status`)."""

    rows: int = 0
    bytes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    max_staleness: int = 0
    admitted: int = 0  # a dynamic table's rows created, lookups of ids not admitted, rows evicted (`DynamicTable`)
    filtered: int = 0
    evicted: int = 0


class TableShard(ServerTable):
    """Rows `server`, `server + S`, ... of table `spec`, with their row optimizer (whose lr follows optimizer
    group `group`'s schedule, when it is the exact row-wise form of that group's optimizer)."""

    def __init__(
        self,
        spec: TensorSpec,
        server: int,
        num_servers: int,
        values: torch.Tensor | None,
        optimizer,
        padding_idx: int | None = None,
        group: int | None = None,
    ):
        rows, dim = spec.shape
        self.spec = spec
        self.server, self.num_servers = server, num_servers
        self.rows = rows_on(rows, server, num_servers)
        self.optimizer = optimizer
        self.group = group  # the dense optimizer's group whose learning rate this table's rows follow, or None
        check_fits(spec, self.rows, optimizer, server)
        if values is None:  # a table built on the meta device: initialised here, as nn.Embedding would
            generator = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) + server)
            values = torch.randn(self.rows, dim, generator=generator, dtype=spec.dtype)
            if padding_idx is not None and padding_idx % num_servers == server:
                values[padding_idx // num_servers] = 0
        if tuple(values.shape) != (self.rows, dim) or values.dtype != spec.dtype:
            raise ValueError(
                f"table {spec.name!r}: server {server} got rows {tuple(values.shape)} {values.dtype}, "
                f"expected {(self.rows, dim)} {spec.dtype}"
            )
        self.values = values.contiguous()
        self.state = optimizer.new_state(self.rows, dim, spec.dtype)
        self._stats = TableStats(rows=self.rows, bytes=self.values.nbytes)
        self._taken = 0  # rows taken from checkpoint parts (`take`)
        self._keep_before = False  # keep the rows the step that closes now changes (`closing`)
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None  # those rows, ascending, and their old values

    @property
    def stats(self) -> TableStats:
        return self._stats

    def layout(self) -> TableLayout:
        return TableLayout(tuple(self.spec.shape), self.spec.dtype, self.num_servers, self.rows)

    def indexed_rows(self) -> torch.Tensor:
        return self.values

    def pull(self, ids: torch.Tensor, before: bool = False) -> torch.Tensor:
        """A copy of the local rows `ids`; `before`: as they were when the last closed step began (`closing`)."""
        self.check_ids(ids, "pull")
        self._stats.rows_pulled += ids.numel()
        rows = self.values.index_select(0, ids)
        if before and self._before is not None:
            changed, old = self._before  # the rows the last step changed, ascending, and their values before it
            at = torch.searchsorted(changed, ids).clamp_(max=max(len(changed) - 1, 0))
            hit = changed[at] == ids if len(changed) else torch.zeros_like(ids, dtype=torch.bool)
            rows[hit] = old[at[hit]]
        return rows

    def closing(self, keep_before: bool) -> None:
        self._keep_before, self._before = keep_before, None

    def check_ids(self, ids, what: str, worker: int | str = "a client") -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise GradientError(f"{worker}: {what} of table {self.spec.name!r} needs a 1-D int64 tensor of row ids")
        bad = out_of_range(ids, self.rows)
        if bad is not None:
            raise GradientError(
                f"{worker}: {what} of table {self.spec.name!r} names local row {bad}, this server "
                f"holds 0..{self.rows - 1}"
            )

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """The local indices of global row ids that this server holds; raises GradientError naming an id
        that is out of the table or held by another server."""
        rows = self.spec.shape[0]
        bad = out_of_range(ids, rows)
        if bad is not None:
            raise GradientError(f"table {self.spec.name!r} has rows 0..{rows - 1}, not {bad}")
        elsewhere = ids[ids % self.num_servers != self.server]
        if elsewhere.numel():
            raise GradientError(
                f"row {int(elsewhere[0])} of table {self.spec.name!r} is on server "
                f"{int(elsewhere[0]) % self.num_servers}, not {self.server} (row r is on r % "
                f"{self.num_servers})"
            )
        return ids // self.num_servers

    def check_push(self, worker: int, ids, grads) -> None:
        """Validate one worker's row gradients (unique local ids, one row of the table's dim each)."""
        self.check_ids(ids, "a push", f"worker {worker}")
        dim = self.spec.shape[1]
        if (
            not isinstance(grads, torch.Tensor)
            or tuple(grads.shape) != (ids.numel(), dim)
            or grads.dtype != self.spec.dtype
        ):
            described = f"{tuple(grads.shape)} {grads.dtype}" if isinstance(grads, torch.Tensor) else type(grads)
            raise GradientError(
                f"worker {worker}: row gradients of table {self.spec.name!r} are {described}, "
                f"expected {(ids.numel(), dim)} {self.spec.dtype}"
            )
        if ids.unique().numel() != ids.numel():
            raise GradientError(
                f"worker {worker}: a push of table {self.spec.name!r} repeats row ids: sum "
                "the gradients of each row first"
            )

    def checkpoint(self, full: bool = True) -> dict:
        """Copies of the rows and the row optimizer's state, with the server and number of servers holding them
        (whole, `full` or not: a fixed table keeps no track of what changed)."""
        return {
            "values": self.values.clone(),
            "state": saved_state(self.state),
            "server": self.server,
            "num_servers": self.num_servers,
        }

    def take(self, saved: dict) -> None:
        """Take the rows of a `checkpoint()` of this table (written by any server of any number of servers)
        that this server holds, with their row optimizer state (a dynamic table's part holds none)."""
        if "values" not in saved:
            return
        held = saved["values"].shape[0]
        rows = saved["server"] + torch.arange(held) * saved["num_servers"]  # global ids, in the saved order
        mine = (rows % self.num_servers == self.server).nonzero().view(-1)
        local = rows[mine] // self.num_servers
        self.values[local] = saved["values"][mine]
        take_saved_state(self.state, local, saved["state"], mine)
        self._taken += mine.numel()

    def complete(self) -> bool:
        return self._taken == self.rows

    def missing(self) -> str:
        return (
            f"{self._taken} of the {self.rows} rows of embedding table {self.spec.name!r} that server "
            f"{self.server} needs (served row by row here)"
        )

    def set_lr(self, lr: float) -> None:
        """A schedule set the learning rate of this table's group."""
        self.optimizer = dataclasses.replace(self.optimizer, lr=float(lr))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One row optimizer step on the unique local rows `ids` (with `closing`'s keep_before, their values
        before it kept)."""
        if self._keep_before:
            changed = ids.sort().values
            self._before = (changed, self.values.index_select(0, changed))
        if ids.numel():
            self.optimizer.step(self.values, self.state, ids, grads)
            self._stats.rows_pushed += ids.numel()


def check_fits(spec: TensorSpec, rows: int, optimizer, server: int) -> None:
    """Refuse a table shard that this machine's free memory cannot hold, naming the size it needs."""
    dim = spec.shape[1]
    need = rows * dim * spec.dtype.itemsize + optimizer.state_bytes(rows, dim, spec.dtype)
    free = available_memory()
    if free is not None and need > free:
        raise MemoryError(
            f"embedding table {spec.name!r} needs {need / 2**30:.2f} GiB on server {server} ({rows:,} rows x {dim} "
            f"{str(spec.dtype).removeprefix('torch.')} plus the row optimizer's state), but only "
            f"{free / 2**30:.2f} GiB are free: use more servers (--servers) or a smaller table"
        )


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
