"""The user's module stays an ordinary PyTorch module while gradsync serves parts of it elsewhere.

A strategy that keeps a model's tables away from its module (ps and hybrid: on the servers; sharded: split over
the workers) changes the module in place: a table's weight leaves it, its forward is routed, hooks gather and
load its state. Every such change goes through one `Attachments`, which lists them, so that

- `torch.save(module)`, `pickle.dumps` and `copy.deepcopy(module)` see an ordinary module: each changed module
  reduces to its own class and state without gradsync's attributes and hooks, a table holding its whole rows as
  they are then (`plain`, gathered from where they are trained);
- `module.load_state_dict(...)` (of the model or of any of its modules) takes the values to where they are
  trained once torch has loaded every key without an error (`on_load`), and changes nothing there when it
  raised; every worker loads alike, as under DDP, and a worker's load reaches the servers at once;
- `detach()` (at `gradsync.shutdown`) makes the module itself ordinary again, holding the final values.
"""

from __future__ import annotations

import copyreg
import functools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.ps.table_shard import available_memory

_HOOKS = ("_hooks", "_hooks_with_kwargs", "_hooks_always_called")
"""How the names of an `nn.Module`'s hook dicts end (`_forward_hooks`, `_state_dict_hooks`, ...), each keyed by
its hooks' handle ids."""

PlainState = Callable[[nn.Module], dict]
"""A changed module's plain state: what its `__dict__` takes beside its own (a table's `_parameters` with its whole
weight, a dynamic table's local table holding every row)."""


class _Changed:
    """What gradsync changed of one module: the instance attributes it set, the hooks it registered, its plain
    state (`PlainState`)."""

    def __init__(self):
        self.attributes: set[str] = set()
        self.hooks: list[RemovableHandle] = []
        self.plain: PlainState | None = None


class Attachments:
    """Every change gradsync made to the modules of one model (module docstring)."""

    def __init__(self):
        self._changed: dict[int, tuple[nn.Module, _Changed]] = {}

    def _of(self, module: nn.Module) -> _Changed:
        if id(module) not in self._changed:
            changed = _Changed()
            self._changed[id(module)] = (module, changed)
            object.__setattr__(module, "__reduce_ex__", functools.partial(_reduce, module, changed))
            changed.attributes.add("__reduce_ex__")
        return self._changed[id(module)][1]

    def set(self, module: nn.Module, name: str, value) -> None:
        """Set instance attribute `name` of `module` (its `forward`, say) to `value`."""
        self._of(module).attributes.add(name)
        object.__setattr__(module, name, value)

    def hook(self, module: nn.Module, handle: RemovableHandle) -> None:
        """Keep the handle of a hook registered on `module`: a copy or a detached module has none of it."""
        self._of(module).hooks.append(handle)

    def plain(self, module: nn.Module, state: PlainState) -> None:
        """`module`'s plain state is its own updated by `plain(module)`."""
        self._of(module).plain = state

    def on_load(
        self, modules, holders: tuple, commit: Callable[[], None], refresh: Callable[[], None] = lambda: None
    ) -> None:
        """Each of `modules`' `load_state_dict(...)` is torch's, then `commit()` (the loaded values go where they
        are trained) when torch loaded every key without an error; `holders`: the tables that keep what a load
        took for `commit`, each told to forget it (`discard_load`) before a load and after one that raised, and
        then `refresh()` (the module shown the trained values again)."""
        for module in modules:
            self.set(module, "load_state_dict", functools.partial(_load, module, holders, commit, refresh))

    def detach(self) -> None:
        """Make every changed module ordinary: its plain state, none of gradsync's attributes and hooks."""
        for module, changed in self._changed.values():
            state = _plain_state(module, changed)
            for handle in changed.hooks:
                handle.remove()
            for name in changed.attributes:
                module.__dict__.pop(name, None)
            module.__dict__.update(state)
        self._changed.clear()


def _load(
    module: nn.Module,
    holders: tuple,
    commit: Callable[[], None],
    refresh: Callable[[], None],
    state_dict,
    strict: bool = True,
    assign: bool = False,
):
    """`module.load_state_dict` (`Attachments.on_load`)."""
    for holder in holders:
        holder.discard_load()
    try:
        result = type(module).load_state_dict(module, state_dict, strict=strict, assign=assign)
    except BaseException:
        for holder in holders:
            holder.discard_load()
        refresh()
        raise
    commit()
    return result


def check_gatherable(table: str, shape: tuple, dtype: torch.dtype) -> None:
    """Refuse to gather table `table` whole into this process when it is larger than the memory available here,
    saying what to do instead."""
    nbytes = math.prod(shape) * dtype.itemsize
    available = available_memory()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"table {table!r} ({' x '.join(map(str, shape))} {dtype}, {nbytes / 2**30:.1f} GiB) is larger than the "
            f"memory available to this process ({available / 2**30:.1f} GiB), so it cannot be gathered whole into "
            "the module (torch.save(model), copy.deepcopy(model), model.state_dict()): write a job checkpoint "
            "instead (--checkpoint-dir: each server, or each worker under sharded, writes its own rows)"
        )


def _plain_state(module: nn.Module, changed: _Changed) -> dict:
    """The state `module`'s class pickles (its `__getstate__`: an LSTM's leaves out its weights' weakrefs) without
    gradsync's attributes and hooks, updated by its plain state."""
    state = {k: v for k, v in type(module).__getstate__(module).items() if k not in changed.attributes}
    ours = {handle.id for handle in changed.hooks}  # a hook's id is unique among every module's hooks
    for key, value in state.items():
        if key.endswith(_HOOKS) and isinstance(value, dict) and not ours.isdisjoint(value):
            state[key] = type(value)((k, h) for k, h in value.items() if k not in ours)
    if changed.plain is not None:
        state.update(changed.plain(module))
    return state


def _reduce(module: nn.Module, changed: _Changed, protocol: int):
    """`module.__reduce_ex__`: an ordinary module of its class, with its plain state (no gradsync object inside,
    and nothing of gradsync needed to load it)."""
    # copyreg.__newobj__: what object.__reduce_ex__ returns, missing from typeshed's copyreg
    return copyreg.__newobj__, (type(module),), _plain_state(module, changed)  # type: ignore[attr-defined]
