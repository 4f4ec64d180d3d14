"""Which of a worker's numbered pieces still count (`Piece.seq`): the one rule the sync rule and async
staging share.

A worker numbers every piece and push from one increasing counter. A piece supersedes the same bucket's
earlier ones from that worker, so one numbered at or below the highest seen for its bucket is void (it left
during a backward that another followed, and came late); a whole push numbered `seq` voids every piece that
worker numbered below it (`Push.seq`).
"""

from __future__ import annotations


class PieceNumbers:
    """The highest piece number seen per (worker, bucket). Not thread-safe: call under the owner's lock."""

    def __init__(self, buckets: int):
        self.buckets = buckets
        self._latest: dict[tuple[int, int], int] = {}

    def take(self, worker: int, bucket: int, seq: int) -> bool:
        """Note `worker`'s piece of `bucket` numbered `seq`; False when it is void (superseded before it came)."""
        if seq <= self._latest.get((worker, bucket), 0):
            return False
        self._latest[(worker, bucket)] = seq
        return True

    def void_below(self, worker: int, seq: int) -> None:
        """A whole push numbered `seq` came from `worker`: its pieces numbered below it are void."""
        for b in range(self.buckets):
            self._latest[(worker, b)] = max(seq, self._latest.get((worker, b), 0))

    def forget(self, worker: int) -> None:
        """`worker` was replaced (a new process, numbering its pieces from the start): forget the dead one's."""
        for b in range(self.buckets):
            self._latest.pop((worker, b), None)
