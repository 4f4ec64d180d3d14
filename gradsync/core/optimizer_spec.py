"""The user's optimizer as data: its class, defaults and parameter groups by parameter name.

`OptimizerSpec.of` reads a `torch.optim.Optimizer` instance built over a
model's parameters (or parameter groups); under the ps strategy every server
rebuilds the same class with the same groups over its shard (`build`), each
parameter, or element range of a split parameter, in its group with the
group's options. `changed_options` gives what a schedule changed in the groups
since the options last sent, and `state_by_name` / `state_by_index` convert
an optimizer state dict between torch's layout (parameter indices in group
order) and one keyed by parameter name, which is how servers exchange it.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from gradsync.core.buckets import Entry


def as_optimizer(model: nn.Module, optimizer, kwargs: dict) -> torch.optim.Optimizer:
    """The optimizer instance of `Trainer(model, optimizer, **kwargs)`: `optimizer` itself, or, for the older
    form (a class and its keyword arguments), the class built over `model.parameters()`.

    Raises:
        TypeError: neither an instance nor a class of `torch.optim.Optimizer`, or keyword arguments with an
            instance.
        ValueError: the instance holds tensors that are not the model's, or leaves trainable ones out.
    """
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters(), **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "Trainer(model, optimizer): optimizer must be a torch.optim.Optimizer instance built over "
            "model.parameters() or parameter groups (torch.optim.AdamW(groups, lr=3e-4)), or a class followed "
            f"by its keyword arguments (torch.optim.SGD, lr=0.1); got {optimizer!r}"
        )
    if kwargs:
        raise TypeError(
            f"Trainer got optimizer keyword arguments {sorted(kwargs)} with an optimizer instance, which already "
            "has its options: pass them to the optimizer's constructor (or pass its class instead)"
        )
    _check_covers(model, optimizer)
    return optimizer


def _check_covers(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    held = set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer's parameter group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model given to the Trainer: build the optimizer over that model's "
                    "parameters (model.parameters() or groups of them)"
                )
            held.add(id(p))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"the optimizer leaves trainable parameters {missing} out of its groups, so they would never be "
            "trained: add them to a parameter group, or freeze them (p.requires_grad_(False)) before building "
            "the Trainer"
        )


def group_options(group: dict) -> dict:
    """A parameter group's options: everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class, its defaults, and per group its options and its parameters' names (None: one
    group of every parameter)."""

    cls: type[torch.optim.Optimizer]
    defaults: dict
    groups: tuple[dict, ...]
    names: tuple[tuple[str, ...], ...] | None

    @classmethod
    def one_group(cls, optimizer_cls: type, kwargs: dict) -> OptimizerSpec:
        """`optimizer_cls(params, **kwargs)` over every parameter it is built with."""
        return cls(optimizer_cls, dict(kwargs), (dict(kwargs),), None)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
        """The spec of `optimizer`, an instance over `model`'s parameters (see `as_optimizer`)."""
        names = {id(p): n for n, p in model.named_parameters()}
        return cls(
            type(optimizer),
            dict(optimizer.defaults),
            tuple(group_options(g) for g in optimizer.param_groups),
            tuple(tuple(names[id(p)] for p in g["params"]) for g in optimizer.param_groups),
        )

    def group_of(self, names) -> dict[str, int]:
        """The group index of each of the parameter `names`."""
        if self.names is None:
            return {n: 0 for n in names}
        return {n: g for g, held in enumerate(self.names) for n in held}

    def build(self, params: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer | None:
        """The optimizer over `params`, (parameter name, tensor: the parameter or a piece of it) pairs, every
        group kept, in order, even where it holds none of them; None without parameters."""
        if not params:
            return None
        group_of = self.group_of(n for n, _ in params)
        groups = [dict(options, params=[]) for options in self.groups]
        for name, tensor in params:
            groups[group_of[name]]["params"].append(tensor)
        accepted = inspect.signature(self.cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            defaults = self.defaults
        else:
            defaults = {k: v for k, v in self.defaults.items() if k in accepted}
        return self.cls(groups, **defaults)

    def check_buildable(self) -> None:
        """Build the optimizer once over stand-in tensors, so that a class the servers could not rebuild from
        its groups and defaults is refused on the worker, before anything is sent."""
        stand_ins = [(n, torch.zeros(1, requires_grad=True)) for names in self.names or [["p"]] for n in names]
        try:
            self.build(stand_ins)
        except Exception as e:
            raise TypeError(
                f"{self.cls.__name__} cannot be rebuilt on the parameter servers as "
                f"{self.cls.__name__}(param_groups, **defaults) ({type(e).__name__}: {e}): its constructor must "
                "take its parameter groups and the keyword arguments it keeps in `defaults`, as torch.optim's "
                "classes do"
            ) from e


def changed_options(groups: list[dict], sent: list[dict]) -> dict[int, dict]:
    """Per group index, the options of `groups` (param_groups) that differ from `sent`; {} when none do."""
    out = {}
    for g, (group, before) in enumerate(zip(groups, sent)):
        diff = {k: v for k, v in group_options(group).items() if k not in before or not same_value(before[k], v)}
        if diff:
            out[g] = diff
    return out


class SentOptions:
    """The optimizer groups' options as the servers last heard them (a worker sends only what changed)."""

    def __init__(self, sent: list[dict]):
        self.sent = sent

    @classmethod
    def of(cls, groups: list[dict]) -> SentOptions:
        """Those of `groups` (param_groups), as the servers hold them."""
        return cls([group_options(g) for g in groups])

    def take(self, groups: list[dict]) -> dict[int, dict]:
        """The `changed_options` of `groups` since the servers last heard them, which they hear now."""
        changes = changed_options(groups, self.sent)
        if changes:
            self.sent = [group_options(g) for g in groups]
        return changes


def same_value(a, b) -> bool:
    """Whether two option values are equal (tensors by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def apply_options(optimizer: torch.optim.Optimizer, changes: dict[int, dict]) -> None:
    """Set the `changed_options` of a worker's schedule on `optimizer`'s groups."""
    for g, options in changes.items():
        optimizer.param_groups[g].update(options)


def state_by_name(optimizer: torch.optim.Optimizer, keys: dict[int, str]) -> dict[str, dict]:
    """`optimizer`'s per-parameter state keyed by `keys[id(tensor)]` (CPU copies)."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state and optimizer.state[p]:
                out[keys[id(p)]] = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
    return out


def load_by_name(
    optimizer: torch.optim.Optimizer, keys: dict[int, str], state: dict[str, dict], groups: list[dict] | None = None
) -> None:
    """Load per-parameter `state` keyed by `keys[id(tensor)]` into `optimizer` (through its own
    `load_state_dict`, which casts the values to each parameter's dtype and device); `groups`: the options of
    each group to take too. A parameter missing from `state` starts with no state."""
    own = optimizer.state_dict()
    index = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[keys[id(p)]] = i
            i += 1
    param_groups = [dict(g) for g in own["param_groups"]]
    for g, options in enumerate(groups or []):
        param_groups[g].update({k: v for k, v in options.items() if k != "params"})
    optimizer.load_state_dict(
        {"state": {index[k]: v for k, v in state.items() if k in index}, "param_groups": param_groups}
    )


def join_state(pieces: dict[str, dict], entries: list[Entry]) -> dict[str, dict]:
    """Per-parameter state by entry key with the pieces of each split parameter joined into one state under
    the parameter's name: elementwise tensors concatenated in element order and shaped like the parameter,
    the rest (a step count) taken from the first piece."""
    split = [e for e in entries if not e.whole]
    out = {k: v for k, v in pieces.items() if k not in {e.key for e in split}}
    for name in dict.fromkeys(e.name for e in split):
        parts = sorted((e for e in split if e.name == name), key=lambda e: e.start)
        if not all(e.key in pieces for e in parts):
            continue
        first = pieces[parts[0].key]
        out[name] = {
            k: (
                torch.cat([pieces[e.key][k].reshape(-1) for e in parts]).view(parts[0].shape)
                if _elementwise(v, parts[0])
                else v
            )
            for k, v in first.items()
        }
    return out


def split_state(state: dict[str, dict], entries: list[Entry]) -> dict[str, dict]:
    """`join_state` undone for `entries` (one server's): each entry's state by its key."""
    out = {}
    for e in entries:
        if e.name not in state:
            continue
        whole = state[e.name]
        out[e.key] = (
            whole
            if e.whole
            else {
                k: (
                    e.piece(v).clone()
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == e.shape and v.dim() > 0
                    else v
                )
                for k, v in whole.items()
            }
        )
    return out


def _elementwise(value, entry: Entry) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == entry.numel
