"""A calibrated cost model of a training step: fit on measured runs, predict allreduce, ps, hybrid and sharded at
scale.

Three parameters are fitted (`fit`): compute seconds per sample, seconds per byte on a link, and seconds
per message (latency). A step is compute followed by communication, with no overlap between the two:

    step_s = compute_s_per_sample * batch + s_per_byte * bytes + latency_s * messages

where `bytes` is what the busiest link carries in one direction over a step (links are full duplex: what a
node sends and what it receives move at once; a phase that waits for the one before adds its bytes, and a
pipelined sync ps step overlaps its pushes and replies but for one piece) and `messages` the sequential
exchanges on the critical path (`traffic`). With e gradient elements of c bytes
each on the wire (`wire_bytes`: fp32 4, fp16/bf16 2; int8 1 plus a 4-byte scale per DEFAULT_BLOCK_SIZE
elements) and W workers:

- allreduce (ring): reduce-scatter then all-gather, (W-1)/W e c bytes each: 2 (W-1)/W e c bytes,
  2 (W-1) messages; int8 is an all-gather (as gradsync does it): (W-1) e c bytes, W-1 messages. Embedding
  tables with dense gradients are dense parameters here: e counts them.
- allreduce with sparse table gradients (`sparse_tables` > 0: `nn.Embedding(..., sparse=True)`, DDP's
  sparse allreduce, which gloo runs as all-gathers of each table's sizes, indices and rows): the dense
  part as above, and every worker receives every other worker's touched rows: (W-1) row_bytes through
  each link (a ring all-gather forwards as much as it receives), 3 (W-1) more messages per table. The
  table elements themselves cost nothing on the wire; the bytes grow with W, where a ps server's
  share, W / S row_bytes, grows too but is split over S servers, and every worker also sums and applies
  all W workers' rows (CPU the model does not count).
- sync ps, S servers, pipelined (`RpcTransport.push_pieces`): a worker first pulls its table rows in the
  forward (`row_bytes`, a phase of its own), then pushes a header (its rows' gradients, `row_bytes`) and
  its gradients piece by piece, e c bytes, and each piece comes back as 4 p bytes of fp32 weights as soon
  as its server has every worker's part; so pushes and replies overlap, each direction of a full-duplex
  link at its own rate, and a step is bounded by its busiest link and direction, plus what cannot
  overlap: the first piece's pushes before any reply, and the last piece's replies after every push (one
  piece, the largest: `piece` elements, p; without it the whole shard, e / S, is one piece and a step is
  push then reply, a whole step). A server's link carries W / S of the workers' bytes, and W
  parts of each of its pieces; a worker's link its own:
      server: W / S (row_bytes + max(e c + row_bytes, 4 e)) + W min(c, 4) p
      worker:         row_bytes + max(e c + row_bytes, 4 e)  +   min(c, 4) p
  bytes = the larger, 2 messages (4 with rows). The CPU a piece costs (`worker.pipeline.piece_size.PIECE_CPU_S`) is
  part of the fitted fixed cost per step, measured at the fit's W; it grows with W (a server takes W parts of
  each piece, and pieces chosen by bandwidth, `worker.pipeline.piece_size`, shrink as 1 / sqrt(W)), which the model
  does not count. Compression shrinks the push direction.
  With few large pieces the two directions overlap less than this assumes, so it is optimistic there
  (bench/costmodel_link.py; BENCHMARKS.md, "Behind an emulated link", has every ratio).
- hybrid: the dense part as allreduce, plus the row pull and the row push through the servers:
  2 max(W / S, 1) row_bytes, 4 more messages.
- sharded (`sharded_tables` tables split by row over the W workers): the dense part as allreduce, plus the
  rows' all-to-alls (ids out and rows back in the forward, row gradients to their owners at the step): a
  worker's link carries, each way, the share of its rows owned elsewhere, (W-1)/W row_bytes, twice:
  2 (W-1)/W row_bytes (an owner answers as many rows as it asks for, on average), and 2 more messages per
  `LOOKUPS_PER_EXCHANGE` tables (a forward's lookups used together travel together: their ids with their
  counts, one `all_to_all_single`, and their rows, another; a third, the ids that did not fit, only until the
  capacity settles: not modelled; a model that uses each table's result before the next lookup pays 2 per
  table) plus three per step (the end of the forward; the step's flags; the gradients of every table, back
  along the forward's routes).
  Unlike the
  all-gather of sparse allreduce, the bytes through a link stay near 2 row_bytes as W grows.
- async ps (no barrier): a worker's step is the larger of its own compute + exchange (its link carries
  e c + 4 e + 2 row_bytes, 2 or 4 messages) and its share of the servers' link time, max(W / S, 1)
  (4 e + row_bytes): without a barrier one worker's push overlaps another's reply. Throughput per worker.

`fit` refuses async runs (the max makes the model non-linear): fit on sync runs, then predict async.

Runs that all exchanged the same number of messages m (a `gradsync compare` at one W, unless hybrid or
tables add exchanges) measure m x latency, not how it grows with the messages: `latency_per_step` turns it into a fixed
cost per step (`Fit.step_overhead_s`), which a ring's 2 (W-1) messages do not multiply. Behind an emulated
link it comes out far above any network latency: it is software and link-shaping overhead per step, and
predicts better taken per step than per message (bench/costmodel_link.py; BENCHMARKS.md, "Behind an emulated
link").

Time-sliced runs: W workers (one thread each) that compute at once on a machine of C < W cores take W / C
times as long (`contention`). A run measured that way says so (`Run.cores`) and the fit divides it out, so
the fitted compute is a worker's own; `Fit.step_s(..., cores=C)` predicts such a machine again, without
`cores` a machine per worker.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from gradsync.core.strategies import STRATEGIES, Dense, Tables, traits
from gradsync.metrics.traffic import FP32, ITEMSIZE, allreduce_bytes, wire_bytes
from gradsync.tables.row_partition import LOOKUPS_PER_EXCHANGE

MODES = ("sync", "async")
PARAMETERS = ("compute per sample", "cost per byte", "latency per message")


@dataclasses.dataclass(frozen=True)
class Config:
    """A job on a paradigm, without its scale (W, link). `batch`: samples per worker per step; `dense`:
    elements of the dense parameters; `tables`: elements of the embedding tables, which allreduce averages
    as dense parameters and ps / hybrid keep on the servers; `row_bytes`: the rows a ps / hybrid worker
    pulls per step (and pushes back as gradients), or under allreduce with `sparse_tables` the rows (and
    their indices) a worker's batch touches, its part of the all-gather; `sparse_tables`: allreduce only,
    how many tables have sparse gradients (each its own all-gather); `sharded_tables`: sharded only, how many
    tables are split across the workers (each its own all-to-alls; `row_bytes` then the rows a worker looks
    up per step); `piece`: sync ps, elements of the largest piece a server applies and answers on its own
    (0: the whole shard, dense / servers)."""

    strategy: str
    batch: int
    dense: int
    tables: int = 0
    row_bytes: int = 0
    servers: int = 0
    mode: str = "sync"
    compression: str = "none"
    sparse_tables: int = 0
    piece: int = 0
    sharded_tables: int = 0

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not modelled: use one of {tuple(STRATEGIES)}")
        strategy = traits(self.strategy)
        if self.mode == "ssp":
            raise ValueError("mode='ssp' is not modelled: predict its bounds with mode='sync' and mode='async'")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not modelled: use one of {MODES}")
        if self.compression not in ITEMSIZE:
            raise ValueError(f"compression={self.compression!r} is not modelled: use one of {tuple(ITEMSIZE)}")
        if strategy.servers and self.servers < 1:
            raise ValueError(f"strategy={self.strategy!r} needs servers >= 1, got servers={self.servers}")
        if self.sparse_tables and strategy.tables is not Tables.REPLICATED:
            raise ValueError(
                f"sparse_tables={self.sparse_tables} is an allreduce setting, got strategy="
                f"{self.strategy!r}: ps and hybrid move rows anyway (row_bytes), leave it 0"
            )
        if self.piece < 0:
            raise ValueError(f"piece={self.piece}: elements of the largest piece, 0 (the whole shard) or more")
        if self.sharded_tables and strategy.tables is not Tables.SHARDED:
            raise ValueError(
                f"sharded_tables={self.sharded_tables} is a sharded setting, got strategy={self.strategy!r}: leave it 0"
            )
        if strategy.tables is Tables.SHARDED and self.servers:  # (allreduce's formula leaves servers out)
            raise ValueError(f"strategy={self.strategy!r} has no servers, got servers={self.servers}: leave it 0")
        if self.sparse_tables < 0 or self.sharded_tables < 0:
            raise ValueError(
                f"sparse_tables={self.sparse_tables}, sharded_tables={self.sharded_tables}: counts of tables, 0 or more"
            )
        if self.mode == "async" and strategy.dense is not Dense.SERVERS:
            raise ValueError(f"mode='async' is a ps mode, got strategy={self.strategy!r}: use strategy='ps'")


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured job: its config, W, the link (bytes/s; None for loopback), the median step seconds
    and, where known, its compute / communication split, the bytes a worker sent + received per step, and
    the cores its workers shared (None: a machine, or enough cores, per worker)."""

    config: Config
    workers: int
    step_s: float
    link: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    bytes_per_step: float | None = None
    cores: int | None = None

    def __post_init__(self):
        if self.workers < 1 or not self.step_s > 0:
            raise ValueError(
                f"a run needs workers >= 1 and step_s > 0, got workers={self.workers}, "
                f"step_s={self.step_s}: pass the measured median step seconds"
            )


def contention(workers: int, cores: int | None) -> float:
    """How many times longer a worker's compute takes when W workers compute at once on `cores` cores
    (one thread each): W / cores above one worker per core, else 1; None: a machine per worker."""
    return max(1.0, workers / cores) if cores else 1.0


def traffic(config: Config, workers: int) -> tuple[float, int]:
    """(bytes through the busiest link in one direction, sequential messages) per sync step."""
    if workers < 1:
        raise ValueError(f"workers={workers}: need at least 1")
    share = max(workers / config.servers, 1) if config.servers else 0
    strategy = traits(config.strategy)
    if strategy.tables is Tables.REPLICATED and config.sparse_tables:
        dense_bytes, messages = allreduce_bytes(config.dense, workers, config.compression)
        return dense_bytes + (workers - 1) * config.row_bytes, messages + 3 * (workers - 1) * config.sparse_tables
    if strategy.tables is Tables.REPLICATED:
        return allreduce_bytes(config.dense + config.tables, workers, config.compression)
    if strategy.tables is Tables.SHARDED:
        dense_bytes, messages = allreduce_bytes(config.dense, workers, config.compression)
        exchanges = -(-config.sharded_tables // LOOKUPS_PER_EXCHANGE)  # a forward's lookups, used together
        return dense_bytes + 2 * (workers - 1) / workers * config.row_bytes, messages + 2 * exchanges + 3
    if strategy.dense is Dense.SERVERS:
        return _ps_pipeline(config, workers), _ps_messages(config)
    dense_bytes, messages = allreduce_bytes(config.dense, workers, config.compression)
    return dense_bytes + 2 * share * config.row_bytes, messages + 4


def _ps_pipeline(config: Config, workers: int) -> float:
    """Bytes through the busiest link and direction of a pipelined sync ps step, with what cannot overlap (the
    module docstring's formula)."""
    busiest = config.row_bytes + max(
        wire_bytes(config.dense, config.compression) + config.row_bytes, FP32 * config.dense
    )
    piece = config.piece or -(-config.dense // config.servers)
    alone = min(wire_bytes(piece, config.compression), FP32 * piece)
    return max(workers / config.servers * busiest + workers * alone, busiest + alone)


def _ps_exchange(config: Config) -> int:
    """Bytes one async ps worker moves per step, phase after phase: rows in, gradients out, weights in."""
    return wire_bytes(config.dense, config.compression) + FP32 * config.dense + 2 * config.row_bytes


def _ps_messages(config: Config) -> int:
    return 4 if config.row_bytes else 2


@dataclasses.dataclass(frozen=True)
class Fit:
    """Fitted parameters, the fitted runs' relative errors (predicted / measured - 1), the parameters
    the fit held at zero (`PARAMETERS` names; a negative value would have fitted better), and a fixed
    cost per step (`latency_per_step`)."""

    compute_s_per_sample: float
    s_per_byte: float
    latency_s: float
    runs: tuple[Run, ...]
    residuals: tuple[float, ...]
    pinned: tuple[str, ...] = ()
    step_overhead_s: float = 0.0

    @property
    def max_rel_error(self) -> float:
        return max(abs(r) for r in self.residuals)

    def step_s(self, config: Config, workers: int, link: float | None = None, cores: int | None = None) -> float:
        """Predicted seconds per step of one worker; `link` (bytes/s) replaces the fitted per-byte cost;
        `cores`: the W workers share that many cores (`contention`)."""
        s_per_byte = self.s_per_byte if link is None else 1 / link
        compute = self.compute_s_per_sample * config.batch * contention(workers, cores)
        if config.mode == "async":
            own = (
                compute
                + s_per_byte * _ps_exchange(config)
                + self.latency_s * _ps_messages(config)
                + self.step_overhead_s
            )
            share = max(workers / config.servers, 1)
            return max(own, s_per_byte * share * (FP32 * config.dense + config.row_bytes))
        nbytes, messages = traffic(config, workers)
        return compute + s_per_byte * nbytes + self.latency_s * messages + self.step_overhead_s

    def throughput(self, config: Config, workers: int, link: float | None = None) -> float:
        """Predicted samples per second of all W workers together."""
        return workers * config.batch / self.step_s(config, workers, link)


def fit(runs: list[Run]) -> Fit:
    """Least squares on relative errors, every parameter >= 0 (a negative cost would predict negative
    step times): every run's step time, and its compute time where measured."""
    if not runs:
        raise ValueError("no runs to fit: measure at least 3 sync runs")
    if any(r.config.mode != "sync" for r in runs):
        raise ValueError(
            "fit takes sync runs only (async is a max, not linear): leave the async runs out "
            "and predict them from the fit"
        )
    links = {r.link for r in runs}
    if len(links) > 1:
        raise ValueError(f"runs on links {sorted(links, key=str)}: fit the runs of one link at a time")
    steps = [[r.config.batch * contention(r.workers, r.cores), *traffic(r.config, r.workers)] for r in runs]
    rows, targets = [], []
    for r, step in zip(runs, steps):
        rows.append(step)
        targets.append(r.step_s)
        if r.compute_s:  # a zero compute split is no measurement
            rows.append([step[0], 0, 0])
            targets.append(r.compute_s)
    design, measured = np.array(rows, dtype=float), np.array(targets, dtype=float)
    weighted = design / measured[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    if np.any(scale == 0) or np.linalg.matrix_rank(weighted / np.where(scale == 0, 1, scale), tol=1e-9) < 3:
        seen = sorted({(r.config.strategy, r.workers, round(traffic(r.config, r.workers)[0])) for r in runs})
        raise ValueError(
            "these runs cannot separate compute per sample, cost per byte and latency per message "
            f"(strategy, W, link bytes seen: {seen}): add runs that vary the batch, the bytes (model size "
            "or strategy) and the messages (W, or allreduce next to ps) independently"
        )
    params = _nonnegative_lstsq(weighted / scale, np.ones(len(measured))) / scale
    residuals = tuple(float(np.dot(params, step)) / r.step_s - 1 for step, r in zip(steps, runs))
    pinned = tuple(name for name, value in zip(PARAMETERS, params) if value == 0)
    compute, per_byte, latency = map(float, params)  # in `PARAMETERS` order
    return Fit(compute, per_byte, latency, runs=tuple(runs), residuals=residuals, pinned=pinned)


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every parameter >= 0: the best of the plain solutions with some parameters held at
    zero (exact for so few parameters; all free first, so a non-negative plain solution is kept as it is)."""
    best, best_cost = None, np.inf
    for free in itertools.product((True, False), repeat=design.shape[1]):
        if not any(free):
            continue
        params = np.zeros(design.shape[1])
        params[list(free)] = np.linalg.lstsq(design[:, list(free)], target, rcond=None)[0]
        cost = float(np.sum((design @ params - target) ** 2))
        if np.all(params >= 0) and cost < best_cost:
            best, best_cost = params, cost
    assert best is not None  # each parameter alone fits the positive costs with a positive value
    return best


def latency_per_step(fit: Fit) -> Fit:
    """`fit` with its latency as a fixed cost per step, for runs that all exchanged the same number of
    messages m: they measure m x latency, not its growth with the messages. Raises ValueError when their
    message counts differ (then the latency was measured per message)."""
    counts = {traffic(r.config, r.workers)[1] for r in fit.runs}
    if len(counts) != 1:
        raise ValueError(
            f"the fitted runs exchanged {sorted(counts)} messages per step: their latency is "
            "measured per message, keep it there"
        )
    fixed = fit.step_overhead_s + fit.latency_s * counts.pop()
    return dataclasses.replace(fit, latency_s=0.0, step_overhead_s=fixed)


def crossover(
    fit: Fit, first: Config, second: Config, link: float | None = None, max_workers: int = 1024, min_workers: int = 2
) -> int | None:
    """The smallest W in min_workers + 1..max_workers where the faster of the two (in samples/s) is not the
    one faster at W = min_workers; None if the same one leads throughout."""

    def ahead(w: int) -> bool:
        return fit.throughput(first, w, link) > fit.throughput(second, w, link)

    lead = ahead(min_workers)
    return next((w for w in range(min_workers + 1, max_workers + 1) if ahead(w) != lead), None)


def link_crossover(fit: Fit, first: Config, second: Config, workers: int) -> float | None:
    """The link rate (bytes/s) at which the faster of two sync configs at W = `workers` changes (one leads
    on faster links, the other on slower); None when the same one leads at every rate. Throughputs
    W b1 / (a1 + s n1) and W b2 / (a2 + s n2) at s seconds per byte are equal at one s at most:
    s = (b2 a1 - b1 a2) / (b1 n2 - b2 n1)."""
    if "async" in (first.mode, second.mode):
        raise ValueError("link_crossover compares sync configs: an async step is a max, not linear in the link")
    (n1, m1), (n2, m2) = traffic(first, workers), traffic(second, workers)
    a1 = fit.compute_s_per_sample * first.batch + fit.latency_s * m1 + fit.step_overhead_s
    a2 = fit.compute_s_per_sample * second.batch + fit.latency_s * m2 + fit.step_overhead_s
    slope = first.batch * n2 - second.batch * n1
    if slope == 0:
        return None
    s_per_byte = (second.batch * a1 - first.batch * a2) / slope
    return 1 / s_per_byte if s_per_byte > 0 else None


def table_crossover(
    fit: Fit, first: Config, second: Config, workers: int, link: float | None = None, max_elements: int = 10**12
) -> int | None:
    """The smallest embedding table size (elements, given to both configs) where the faster of the two is
    not the one faster without tables; None if the same one leads up to `max_elements`. Step time is
    linear in the table size (allreduce moves every row, ps and hybrid only the rows looked up), so there
    is at most one crossing: found by bisection."""

    def ahead(elements: int) -> bool:
        one, two = (dataclasses.replace(c, tables=elements) for c in (first, second))
        return fit.throughput(one, workers, link) > fit.throughput(two, workers, link)

    lead, low, high = ahead(0), 0, max_elements
    if ahead(high) == lead:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if ahead(middle) == lead else (low, middle)
    return high


GRADES = ("low", "moderate", "high")
"""Confidence grades, lowest first."""


def confidence(fit: Fit, doubts: Sequence[tuple[str, str]] = ()) -> str:
    """One sentence with one grade (`GRADES`) on how far the fit can be trusted: the grade its residuals
    earn, lowered by what weakens it, each reason named. `doubts`: (the highest grade it allows, why) from
    outside the fit, such as how the runs were made."""
    measurements = len(fit.runs) + sum(1 for r in fit.runs if r.compute_s)
    if measurements <= 3:
        reasons = [
            (
                "low",
                f"the fit is exactly determined by {measurements} measurements ({len(fit.runs)} runs' "
                f"step times, {measurements - len(fit.runs)} compute splits), so there is no residual "
                "to judge it by",
            )
        ]
    else:
        worst = fit.max_rel_error
        grade = "high" if worst < 0.1 else "moderate" if worst < 0.3 else "low"
        reasons = [
            (grade, f"the model reproduces its {len(fit.runs)} fitted runs within {worst:.0%} (max relative error)")
        ]
    values = (fit.compute_s_per_sample, fit.s_per_byte, fit.latency_s)
    negative = [name for name, value in zip(PARAMETERS, values) if value < 0]
    if negative:
        reasons.append(
            ("low", f"the fitted {' and '.join(negative)} came out negative, so the model does not describe these runs")
        )
    if fit.pinned:
        reasons.append(
            (
                "moderate",
                f"the fit held the {' and '.join(fit.pinned)} at zero (a negative value "
                "fitted these runs better), so the model describes them only roughly",
            )
        )
    reasons += doubts
    grade = min((g for g, _ in reasons), key=GRADES.index)
    workers = sorted({r.workers for r in fit.runs})
    return (
        f"Confidence is {grade}: {'; '.join(why for _, why in reasons)}. Fitted at W = "
        f"{', '.join(map(str, workers))}; anything else is an extrapolation."
    )


def verdict(fit: Fit, configs: dict[str, Config], workers: int, link: float | None = None) -> str:
    """Plain sentences: which paradigm wins at this W and link, where it crosses the runner-up, confidence."""
    if len(configs) < 2:
        raise ValueError(f"verdict compares paradigms: got {len(configs)} config(s), give at least 2")
    speed = {name: fit.throughput(c, workers, link) for name, c in configs.items()}
    winner, runner = sorted(speed, key=speed.__getitem__, reverse=True)[:2]
    where = "the measured link" if link is None else f"a link of {8 * link / 1e9:g} Gbit/s"
    text = (
        f"At W = {workers} on {where}, {winner} wins: {speed[winner]:,.0f} samples/s, "
        f"{speed[winner] / speed[runner]:.2f}x {runner}. "
    )
    w = crossover(fit, configs[winner], configs[runner], link)
    if w is None:
        text += f"It stays ahead of {runner} at every W from 2 to 1024. "
    else:
        first, then = (runner, winner) if w <= workers else (winner, runner)
        text += f"The crossover is at W = {w}: {first} is faster below it, {then} from there on. "
    return text + confidence(fit)
