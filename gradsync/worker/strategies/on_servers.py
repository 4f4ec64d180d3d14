"""What ps and hybrid share: parameter servers that hold the model's tables (`worker.rows.served.ServedRows`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradsync.transport.base import WorkerTransport
    from gradsync.worker.rows.served import ServedRows


class OnServers:
    """A strategy's calls on its servers, the tables' waiting calls (a step's evictions) sent first."""

    transport: WorkerTransport
    rows: ServedRows

    def server_stats(self) -> dict[int, dict]:
        self.rows.settle()
        return self.transport.stats()

    def checkpoint_servers(self, directory: str, base: str | None = None) -> dict[int, tuple[str, int]]:
        self.rows.settle()
        return self.transport.checkpoint(directory, base)

    @property
    def servers_hold_dynamic(self) -> bool:
        return self.rows.holds_dynamic
