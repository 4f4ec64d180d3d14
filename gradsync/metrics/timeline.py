"""The step timeline (GRADSYNC_TIMELINE, `gradsync compare --timeline`): when each piece of a step left the
worker, reached and was applied on its server, and came back.

A worker's `Timeline` records one `PieceEvents` per lane and step: under ps each piece (a server's bucket) of a step
over torch RPC (sync, async, ssp; pieces that left during the backward included), and each server's header push (buffers
and rows, no gradient); under allreduce each bucket DDP exchanges; under sharded also each all-to-all among the workers
(a lookup's ids with their counts and its rows in the forward, the row gradients at the step: `Timeline.all_to_all`, its
`left` and `back` around the call, its bytes those to and from the other workers). `left` and `back` are taken on the
worker; `arrived` (every worker's part of the piece is in) and `applied` (the optimizer stepped on it) on the server, by
its `PieceStamps`, and sent back in the piece's reply (`Stamped`). Every time is wall-clock seconds (`time.time()`):
ranks on one machine, or in network namespaces on it, share that clock, so the worker's and the server's events are on
one axis; across machines the clocks' skew (NTP: milliseconds) shifts the server's events against the worker's.

Off, a worker records nothing (`timed` calls straight through) and a server only notes two clock readings
per piece, which it sends only to a worker that asks. A pipelined step over gRPC records the same lanes
(the server's events travel as a `PieceStamp` before each bucket of the reply). Other paths record no lane
yet: whole steps (gRPC on one machine, a held sync step under clipping or a GradScaler). Async and ssp
servers apply a push whole: their pieces have no server events.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from gradsync.core import settings

KEPT_STEPS = 100
"""Steps whose timeline a worker keeps (the newest): a step holds an event per piece."""

HEAD = None
"""The bucket of a header lane: a server's push that carries the step's buffers and rows, no gradient."""


@dataclasses.dataclass
class PieceEvents:
    """One lane of a step: a piece (ps: `server`, its bucket; allreduce: `server` None, DDP's bucket index)
    or a header (`bucket` HEAD). Times are wall-clock seconds; `arrived` and `applied` are the server's (None
    under allreduce, for a header, or when the piece was answered without being applied: a dropped step)."""

    server: int | None
    bucket: int | None
    bytes_sent: float
    left: float
    bytes_received: float | None = None  # None until it is back: the reply's
    arrived: float | None = None
    applied: float | None = None
    back: float | None = None
    exchange: str | None = None  # sharded: a collective among the workers and what it carried ('a2a emb.weight rows')

    def returned(self, nbytes: float, arrived: float | None = None, applied: float | None = None) -> None:
        """Its reply is in, now: the reply's bytes and the server's events."""
        self.back, self.bytes_received, self.arrived, self.applied = time.time(), nbytes, arrived, applied

    @property
    def lane(self) -> str:
        """'s0 b3', 's0 head', 'bucket 3' (allreduce), or 'a2a emb.weight rows', 'all-gather end' (sharded)."""
        if self.exchange is not None:
            return self.exchange
        if self.server is None:
            return f"bucket {self.bucket}"
        return f"s{self.server} " + ("head" if self.bucket is HEAD else f"b{self.bucket}")


class Stamped(NamedTuple):
    """A piece's reply with its server's events, for a worker that asked for them."""

    value: object
    arrived: float | None
    applied: float | None


class PieceStamps:
    """A server's events of its buckets in the current sync step: when every worker's part was in, when the
    optimizer stepped on it. Call `arrived` and `applied` with the shard lock held."""

    def __init__(self, buckets: int):
        self._at: list[tuple[int, float, float | None] | None] = [None] * buckets  # (version, arrived, applied)

    def arrived(self, b: int, version: int) -> None:
        self._at[b] = (version, time.time(), None)

    def applied(self, buckets) -> None:
        now = time.time()
        for b in buckets:
            version, arrived, _ = self._at[b]
            self._at[b] = (version, arrived, now)

    def reply(self, b: int, value, version: int, stamped: bool):
        """`value`, or with `stamped` the `Stamped` reply: bucket `b`'s events in the step at `version` (None
        for those it has not had: a step dropped before the bucket was complete)."""
        if not stamped:
            return value
        at = self._at[b]
        return Stamped(value, *at[1:]) if at is not None and at[0] == version else Stamped(value, None, None)


class Timeline:
    """A worker's per-step events (`steps`: the newest `KEPT_STEPS`, each {"step", "pieces": [PieceEvents as
    dicts]}). `on`: GRADSYNC_TIMELINE, read once."""

    def __init__(self, on: bool | None = None):
        self.on = settings.TIMELINE.read() if on is None else on
        self.steps: collections.deque[dict] = collections.deque(maxlen=KEPT_STEPS)
        self._current: list[PieceEvents] = []
        self._sizes: Mapping[tuple, float] = {}

    def begin(self) -> None:
        """A context's first forward: the events of one that ended without a step are dropped."""
        self._current = []

    def expect(self, sizes: Mapping[tuple, float]) -> None:
        """The bytes each lane of the step sends, by (server, bucket or HEAD): read when the step is committed
        (a piece may have left during the backward, before its step knew them)."""
        self._sizes = sizes

    def timed(self, lane: tuple[int, int | None], call, *args, **kwargs):
        """`call(*args, **kwargs)`, a call that returns a torch future, with its lane's events (ps): `left`
        now, the bytes `expect` gives, and when it completes `back`, the reply's bytes and a `Stamped` reply's
        server events (unwrapped). Off: the call alone."""
        events = self.lane(lane)
        return call(*args, **kwargs) if events is None else self._track(events, call, args, kwargs)

    def lane(self, lane: tuple[int, int | None]) -> PieceEvents | None:
        """A ps lane's events, `left` now (gRPC's streams note its reply themselves: `PieceEvents.returned`);
        None when off."""
        if not self.on:
            return None
        events = PieceEvents(*lane, 0, time.time())
        self._current.append(events)
        return events

    def exchanged(self, bucket: int, nbytes: float, call, *args):
        """`call(*args)`, which launches the allreduce of DDP's bucket `bucket` (`nbytes` through the link each
        way) and returns its future, with the bucket's events. Off: the call alone."""
        if not self.on:
            return call(*args)
        events = PieceEvents(None, bucket, nbytes, time.time(), nbytes)
        self._current.append(events)
        return self._track(events, call, args, {})

    def all_to_all(self, what: str, bytes_sent: float, bytes_received: float, left: float) -> None:
        """An all-to-all among the workers that began at `left` (wall clock) and is over now: its lane `what`,
        the bytes it sent to and got from the other workers. Off: nothing."""
        if self.on:
            self._current.append(
                PieceEvents(None, None, bytes_sent, left, bytes_received, back=time.time(), exchange=f"a2a {what}")
            )

    def gathered_after(self, what: str, bytes_sent: float, bytes_received: float, left: float) -> None:
        """An all-gather among the workers that began at `left` after the newest step was kept (`committed`)
        and is over now: its lane 'all-gather `what`' in that step's lanes. Off: nothing."""
        if self.on and self.steps:
            events = PieceEvents(
                None, None, bytes_sent, left, bytes_received, back=time.time(), exchange=f"all-gather {what}"
            )
            self.steps[-1]["pieces"].append(dataclasses.asdict(events) | {"lane": events.lane})

    def _track(self, events: PieceEvents, call, args, kwargs):
        """`call`'s future, whose reply completes `events` (already among the step's)."""

        def back(fut):
            value = fut.value()
            stamps: Sequence[float | None] = ()
            if isinstance(value, Stamped):
                value, *stamps = value
            known = events.bytes_received  # an allreduce bucket's, given at the start
            events.returned(getattr(value, "nbytes", 0) if known is None else known, *stamps)
            return value

        return call(*args, **kwargs).then(back)

    def committed(self, step: int) -> None:
        """The step numbered `step` (1 for the job's first) is over: keep its events."""
        if self.on:
            for e in self._current:
                if e.server is not None:  # a ps lane: its bytes from `expect`
                    e.bytes_sent = self._sizes.get((e.server, e.bucket), 0)
            self.steps.append(
                {"step": step, "pieces": [dataclasses.asdict(e) | {"lane": e.lane} for e in self._current]}
            )
            self._current, self._sizes = [], {}
