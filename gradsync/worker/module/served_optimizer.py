"""The optimizer state of the ps strategy, which lives on the servers, answered by the user's own optimizer.

`serve_state` makes the optimizer instance the user built (`trainer.optimizer`, the same object) answer
`state_dict()` and `load_state_dict()` with the servers' state, so a snapshot routine written for a single
process saves and restores the real state. Its `param_groups` stay the user's, so an LR scheduler or a
hand-written `group["lr"] = ...` changes what the next step sends the servers (`changed_options`).
`state_dict()` gathers the servers' optimizer state into torch's layout (parameter indices in group order, a
split parameter's pieces joined), and `load_state_dict()` takes such a dict, from gradsync or from
single-process training, and hands each server its part. Its `step()` is the `user_optimizer.StepGuard`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradsync.core.buckets import Entry
from gradsync.core.optimizer_spec import group_options, join_state, split_state


class ServedState:
    """The servers' optimizer state, in the layout of the user's optimizer.

    Args:
        optimizer: the user's optimizer instance, whose groups these are.
        names: each group's parameter names, in group order.
        entries: each server's bucket entries (whole parameters and pieces of split ones).
        gather: returns {server: {"state": {entry key: state}, "groups": [...]}} from every server.
        scatter: sends {server: (state by entry key, group options)} to every server.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        names: tuple[tuple[str, ...], ...],
        entries: dict[int, list[Entry]],
        gather: Callable[[], dict],
        scatter: Callable[[dict], None],
    ):
        self.param_groups = optimizer.param_groups
        self._names = names
        self._entries = entries
        self._gather = gather
        self._scatter = scatter

    def state_dict(self) -> dict:
        """The servers' optimizer state in torch's layout, as the single-process optimizer's `state_dict()`."""
        pieces = {}
        for answer in self._gather().values():
            pieces.update(answer["state"])
        whole = join_state(pieces, [e for entries in self._entries.values() for e in entries])
        state, groups, index = {}, [], 0
        for group, names in zip(self.param_groups, self._names):
            ids = list(range(index, index + len(names)))
            state.update({i: whole[n] for i, n in zip(ids, names) if n in whole})
            groups.append({**group_options(group), "params": ids})
            index += len(names)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state dict in torch's layout (from `state_dict()`, or from this optimizer class in a single
        process over the same model and groups): the groups' options here, the state on the servers.

        Raises:
            ValueError: the dict has other groups or group sizes than this optimizer (nothing is changed).
        """
        groups = state_dict["param_groups"]
        sizes = [len(n) for n in self._names]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(
                f"the optimizer state dict has groups of {[len(g['params']) for g in groups]} parameters, this "
                f"optimizer {sizes}: load a state dict of the same optimizer over the same model and groups"
            )
        by_name = {}
        for group, names in zip(groups, self._names):
            for i, name in zip(group["params"], names):
                if i in state_dict["state"]:
                    by_name[name] = state_dict["state"][i]
        options = [group_options(g) for g in groups]
        self._scatter({s: (split_state(by_name, entries), options) for s, entries in self._entries.items()})
        for group, new in zip(self.param_groups, options):
            group.update(new)


def serve_state(optimizer: torch.optim.Optimizer, state: ServedState) -> None:
    """Make `optimizer` answer `state_dict()` and `load_state_dict()` with the servers' `state`."""
    # the instance's own methods, replaced (the class's stay)
    optimizer.state_dict = state.state_dict  # type: ignore[method-assign]
    optimizer.load_state_dict = state.load_state_dict  # type: ignore[method-assign]
