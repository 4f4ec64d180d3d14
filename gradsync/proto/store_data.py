"""What a grpc-transport job passes through the rendezvous store: plain data, loaded with `weights_only=True`.

Workers leave their `ModelSpec`, worker 0 each server's setup, and servers
their answer in the store (`gradsync.transport.grpc`). Everything is saved with
`torch.save` and loaded with torch's weights-only unpickler, which builds
tensors, numbers, strings, containers, dtypes and gradsync's plan dataclasses
(`TensorSpec`, `ModelSpec`, `Bucket`, `Entry`) and nothing else: whoever can
write to the store cannot make a server or a worker run code by unpickling.
The optimizer class travels as its name, `module:qualname`, and is resolved
on the server only to a `torch.optim.Optimizer` subclass (a `torch.optim`
class, or one from a module the server can import).
"""
from __future__ import annotations

import importlib
import io

import torch

from gradsync.core.buckets import Bucket, Entry, ModelSpec, TensorSpec
from gradsync.core.optimizer_spec import OptimizerSpec

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


def plain_setup(setup: dict) -> dict:
    """A server's setup (`ps.server.make_setup`) as plain data: its `OptimizerSpec` with the class by name."""
    spec = setup["optimizer"]
    return dict(setup, optimizer={"cls": optimizer_name(spec.cls), "defaults": spec.defaults,
                                  "groups": spec.groups, "names": spec.names})


def setup_from_plain(plain: dict) -> dict:
    """`plain_setup` undone; the optimizer class resolved by `optimizer_class`."""
    o = plain["optimizer"]
    return dict(plain, optimizer=OptimizerSpec(optimizer_class(o["cls"]), o["defaults"], tuple(o["groups"]), o["names"]))
