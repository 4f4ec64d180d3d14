"""What a grpc-transport job passes through the rendezvous store: plain data, loaded with `weights_only=True`.

Workers leave their `ModelSpec`, worker 0 each server's setup, and servers
their answer in the store (`gradsync.transport.grpc.job_calls`). Everything is saved with
`torch.save` and loaded with torch's weights-only unpickler, which builds
tensors, numbers, strings, containers, dtypes and gradsync's plan dataclasses
(`TensorSpec`, `ModelSpec`, `Bucket`, `Entry`) and nothing else: whoever can
write to the store cannot make a server or a worker run code by unpickling.
The optimizer class travels as its name, `module:qualname`, and is resolved
on the server only to a `torch.optim.Optimizer` subclass (a `torch.optim`
class, or one from a module the server can import).
"""

from __future__ import annotations

import dataclasses
import importlib
import io

import torch

from gradsync.core.buckets import Bucket, Entry, ModelSpec, TensorSpec
from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.ps.messages import Setup, TableSetup

torch.serialization.add_safe_globals([TensorSpec, ModelSpec, Bucket, Entry])  # plain frozen dataclasses


def to_bytes(obj) -> bytes:
    """`obj` (plain data, tensors, plan dataclasses) as bytes for the store."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, what: str):
    """The plain data `to_bytes` made; refuses anything else (a class, a function, a reducer).

    Args:
        what: names the value in the error, e.g. "the setup of server 0".
    Raises:
        ValueError: the bytes hold something other than plain data.
    """
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise ValueError(
            f"{what} in the rendezvous store is not plain data (tensors, numbers, strings, tuples, lists, dicts, "
            f"dtypes, gradsync's bucket plan): optimizer keyword arguments must be such values ({e})"
        ) from e


STORE_VALUE_BYTES = 4 << 20
"""The most bytes put in one store value: torch's TCPStore refuses a message over 8 MB (its libuv backend:
"Invalid payload size"), and a setup holds the server's initial values."""


def put(store, key: str, obj) -> None:
    """`obj` (as `to_bytes`) under `key`, in values of at most `STORE_VALUE_BYTES`: the parts first, then `key`
    (their count), so that a reader waits for `key` alone."""
    data = to_bytes(obj)
    parts = range(0, len(data), STORE_VALUE_BYTES)
    for i, at in enumerate(parts):
        store.set(f"{key}/part/{i}", data[at : at + STORE_VALUE_BYTES])
    store.set(key, str(len(parts)))


def take(store, key: str, what: str):
    """What `put` left under `key` (`from_bytes`: plain data only; `what` names it in the error)."""
    count = int(store.get(key).decode())
    return from_bytes(b"".join(store.get(f"{key}/part/{i}") for i in range(count)), what)


def optimizer_name(cls) -> str:
    """The name of an optimizer class, `module:qualname`, which `optimizer_class` resolves.

    Raises:
        ValueError: `cls` is not a torch.optim.Optimizer subclass defined at a module's top level.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"the optimizer must be a torch.optim.Optimizer subclass, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise ValueError(
            f"optimizer class {cls.__qualname__} is defined inside a function: define it at the top level of a "
            "module the servers can import"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def optimizer_class(name: str) -> type:
    """The optimizer class named `module:qualname` (see `optimizer_name`): a torch.optim class, or one from a
    module this process can import; refuses anything that is not a torch.optim.Optimizer subclass.

    Raises:
        ValueError: naming `name` and the fix.
    """
    module_name, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not module_name or not qualname:
        raise ValueError(f"optimizer name {name!r} is not 'module:qualname', e.g. 'torch.optim.sgd:SGD'")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"optimizer {name!r} cannot be found on this server ({e}): install its module where the servers run"
        ) from e
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass: refusing it as the optimizer")
    return obj


def plain_setup(setup: Setup) -> dict:
    """A server's `Setup` as plain data: its fields by name, the `OptimizerSpec` with the class by name and
    each table's setup as its fields."""
    spec = setup.optimizer
    return dict(
        _fields(setup),
        optimizer=dict(_fields(spec), cls=optimizer_name(spec.cls)),
        tables={n: _fields(t) for n, t in setup.tables.items()},
    )


def setup_from_plain(plain: dict) -> Setup:
    """`plain_setup` undone; the optimizer class resolved by `optimizer_class`.

    Raises:
        ValueError: naming a field that is missing or unknown, or an optimizer class that is refused.
    """
    _check_fields(Setup, plain, "the setup")
    o = plain["optimizer"]
    _check_fields(OptimizerSpec, o, "the setup's optimizer")
    for name, table in plain["tables"].items():
        _check_fields(TableSetup, table, f"the setup of table {name!r}")
    optimizer = OptimizerSpec(**dict(o, cls=optimizer_class(o["cls"]), groups=tuple(o["groups"])))
    return Setup(**dict(plain, optimizer=optimizer, tables={n: TableSetup(**t) for n, t in plain["tables"].items()}))


def _fields(obj) -> dict:
    """A dataclass's fields by name, the values as they are (no copies)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _check_fields(cls, plain, what: str) -> None:
    """Refuse `plain` unless it is a dict with exactly the fields of dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(plain, dict):
        raise ValueError(f"{what} is a {type(plain).__name__}, expected a dict with the fields {sorted(names)}")
    missing, unknown = sorted(names - set(plain)), sorted(set(plain) - names)
    if missing or unknown:
        said = [f"no field {missing}"] * bool(missing) + [f"the unknown fields {unknown}"] * bool(unknown)
        raise ValueError(
            f"{what} has {' and '.join(said)}: expected exactly the fields {sorted(names)} (do the "
            "workers and the servers run the same gradsync?)"
        )
