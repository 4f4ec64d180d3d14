"""The end of a step of a dynamic table whose ids are spread over several servers (each a `DynamicTable` of
its ids), by the single-process rule: the bounds by `capacity` are over the whole table, so the rows a
server evicts depend on every server's rows.

Each server first ends the step locally (`DynamicTable.expire`: `ttl_steps`, a rule per row) and answers its
resident rows and waiting ids with its first candidates for eviction: the rows and waiting ids that go first
there (`DynamicTable.smallest_rows`), as many as it expects to lose (`ps.dynamic_shard`). When the whole table
holds more than `capacity` rows (or waiting ids), the `excess` rows that go first overall are among each
server's own `excess` first: the caller takes the `excess` smallest keys of the candidates (ids are distinct,
so the keys are) and tells each server which of its ids to evict. That choice is the rule's whenever no
server that sent only part of its rows has every one of them chosen (its others have larger keys); otherwise
the caller asks each server for its own `excess` first (`smallest`) and chooses among those. A step under
capacity costs the one exchange of counts; one over capacity one more (the ids), two where the candidates
fell short; under ps the sync push's replies bring the counts (`ps.dynamic_shard.step_end`), so a step costs
no call under capacity, one over it. A server that holds the whole table (S = 1) evicts by itself in the first.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Holders(Protocol):
    """The holders of a dynamic table's parts (servers, or workers under sharded), asked together."""

    def end(self, step: int) -> dict[int, dict]:
        """Every holder's end of step `step`: by table, (rows, waiting ids, candidate row ids, their keys,
        candidate waiting ids, their keys)."""

    def first_to_go(self, step: int, counts: dict[int, dict[str, tuple[int, int]]]) -> dict[int, dict]:
        """Of each holder asked, by table, its first (rows, waiting ids) `counts` to go: (row ids, their keys,
        waiting ids, their keys)."""

    def evict(self, step: int, plans: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Each holder evicts, by table, (its row ids, its waiting ids) of `plans`."""


def end_step(
    step: int, capacities: dict[str, int], servers: list[int], holders: Holders, ended: dict | None = None
) -> dict[str, tuple[int, int]]:
    """End step `step` of the dynamic tables (`capacities`: each table's capacity) held by `servers`, through
    `holders`: each one's `end` (`ended`: those answers by server, already had with the push's replies); where
    the candidates fall short, `first_to_go`; then `evict`. Returns each table's (rows, waiting ids) over all
    servers once the step has ended."""
    if ended is None:
        ended = holders.end(step)
    totals = {t: tuple(sum(ended[s][t][k] for s in servers) for k in (0, 1)) for t in capacities}
    excess = {t: (totals[t][0] - cap, totals[t][1] - cap) for t, cap in capacities.items()}
    over = {t: e for t, e in excess.items() if max(e) > 0}
    if not over:
        return totals
    plan: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {s: {} for s in servers}
    for t, (rows, waiting) in over.items():
        evicted = first_overall({s: (ended[s][t][2:4], ended[s][t][0]) for s in servers}, rows)
        forgotten = first_overall({s: (ended[s][t][4:6], ended[s][t][1]) for s in servers}, waiting)
        if evicted is None or forgotten is None:
            plan = _asked(step, over, ended, servers, holders)
            break
        for s in servers:
            plan[s][t] = (evicted[s], forgotten[s])
    holders.evict(step, plan)
    return {t: (min(rows, capacities[t]), min(waiting, capacities[t])) for t, (rows, waiting) in totals.items()}


def _asked(step: int, over: dict[str, tuple[int, int]], ended: dict, servers: list[int], holders: Holders) -> dict:
    """The eviction plan by server from each server's own `excess` first (`first_to_go`), every one of them
    held by the chooser: the rule's choice whatever the candidates were."""
    counts = {
        s: {t: tuple(min(ended[s][t][k], max(e[k], 0)) for k in (0, 1)) for t, e in over.items()} for s in servers
    }
    answers = holders.first_to_go(step, counts)
    plan: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {s: {} for s in servers}
    for t, (rows, waiting) in over.items():
        evicted = first_overall({s: (answers[s][t][:2], counts[s][t][0]) for s in servers}, rows)
        forgotten = first_overall({s: (answers[s][t][2:], counts[s][t][1]) for s in servers}, waiting)
        assert evicted is not None and forgotten is not None  # each server's own first ones are enough
        for s in servers:
            plan[s][t] = (evicted[s], forgotten[s])
    return plan


def first_overall(
    parts: dict[int, tuple[tuple[torch.Tensor, torch.Tensor], int]], count: int
) -> dict[int, torch.Tensor] | None:
    """Of every server's ((ids, keys [n, k]) of its n first, in key order, of `held` it holds), the ids of the
    `count` smallest keys overall, by server (a prefix of each server's); None when that is not decided: a server
    that sent fewer than it holds has every one it sent among them (one it did not send might be too).
    A selection key by key over the servers' runs of equal keys so far (`kthvalue` of their values, then where
    the threshold falls in each run: `searchsorted`), so a server's part is never gathered."""
    servers = list(parts)
    sent = {s: parts[s][0][0].numel() for s in servers}
    if count <= 0:
        return {s: parts[s][0][0][:0] for s in servers}
    if sum(sent.values()) < count:
        return None
    columns = {s: parts[s][0][1].t().contiguous() for s in servers}  # a server's keys, key by key
    start, end = dict.fromkeys(servers, 0), dict(sent)  # each server's run of keys equal so far
    left = count  # still to take beyond each server's `start`
    for k in range(columns[servers[0]].shape[0]):
        runs = {s: columns[s][k, start[s] : end[s]] for s in servers}
        values = torch.cat(list(runs.values()))
        if left == 0 or left >= values.numel():
            break
        threshold = values.kthvalue(left).values
        for s, run in runs.items():
            below = int(torch.searchsorted(run, threshold))
            end[s] = start[s] + int(torch.searchsorted(run, threshold, right=True))
            start[s] += below
            left -= below
    for s in servers:  # the rest of the runs of equal keys, in server order
        taken = min(left, end[s] - start[s])
        start[s] += taken
        left -= taken
    out = {s: parts[s][0][0][: start[s]].clone() for s in servers}
    if any(sent[s] < parts[s][1] and start[s] == sent[s] for s in servers):
        return None
    return out
