"""What a grpc job passes through the rendezvous store: plain data only, the optimizer class by name."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from gradsync.core.optimizer_spec import OptimizerSpec
from gradsync.config import JobConfig
from gradsync.core.job_names import StoreKeys
from gradsync.core.buckets import ModelSpec, plan_buckets
from gradsync.ps.messages import Setup
from gradsync.ps.server import ParameterServer
from gradsync.transport.grpc.job_calls import register_from_store
from gradsync.transport.grpc.plain_data import (STORE_VALUE_BYTES, from_bytes, optimizer_class, optimizer_name, plain_setup, put,
                                       setup_from_plain, take, to_bytes)
from grpc_harness import model_state

RAN: list[str] = []


def _record(what: str) -> None:
    RAN.append(what)


class _Payload:
    """Unpickling it would call `_record`: what a hostile store entry could do with any callable."""

    def __reduce__(self):
        return _record, ("unpickled",)


class Halved(torch.optim.SGD):
    """A user's optimizer class, at the top level of an importable module."""


def _setup(optimizer_cls=torch.optim.SGD):
    params, buffers = model_state()
    spec = ModelSpec.of(params, buffers)
    buckets = plan_buckets(spec.params, 1, cap_bytes=256)
    return spec, Setup.of(buckets, params, buffers, {},
                          OptimizerSpec.one_group(optimizer_cls, {"lr": 0.1, "betas": (0.9, 0.99)}))


def test_spec_and_setup_round_trip_as_plain_data():
    spec, setup = _setup()
    back = from_bytes(to_bytes({"spec": spec, "setup": plain_setup(setup)}), "the test's data")
    assert back["spec"] == spec and back["setup"]["buckets"] == setup.buckets
    assert back["setup"]["optimizer"]["cls"] == "torch.optim.sgd:SGD"
    again = setup_from_plain(back["setup"])
    assert again.optimizer == setup.optimizer and again.buckets == setup.buckets
    for kind in ("params", "buffers"):
        assert all(torch.equal(getattr(again, kind)[n], t) for n, t in getattr(setup, kind).items())


def test_anything_but_plain_data_is_refused_without_running_it():
    with pytest.raises(ValueError, match="the setup of server 0 in the rendezvous store is not plain data"):
        from_bytes(to_bytes({"optimizer": {"defaults": {"lr": _Payload()}}}), "the setup of server 0")
    with pytest.raises(ValueError, match="not plain data"):
        from_bytes(to_bytes(torch.optim.SGD), "a class")
    assert RAN == []


def test_optimizer_classes_travel_by_name_and_resolve_only_to_optimizers():
    for cls in (torch.optim.SGD, torch.optim.Adam, Halved):
        assert optimizer_class(optimizer_name(cls)) is cls

    class Local(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="defined inside a function: define it at the top level"):
        optimizer_name(Local)
    with pytest.raises(ValueError, match="must be a torch.optim.Optimizer subclass, got <built-in function print>"):
        optimizer_name(print)
    for name, match in [
        ("os:system", "'os:system' is not a torch.optim.Optimizer subclass"),
        ("builtins:eval", "is not a torch.optim.Optimizer subclass"),
        ("torch.optim:Optimizer.zero_grad", "is not a torch.optim.Optimizer subclass"),
        ("no_such_module_here:Opt", "cannot be found on this server"),
        ("torch.optim:NoSuchOptimizer", "cannot be found on this server"),
        ("SGD", "is not 'module:qualname'"),
    ]:
        with pytest.raises(ValueError, match=match):
            optimizer_class(name)


@pytest.mark.timeout(60)
def test_server_answers_a_refused_optimizer_in_the_store_and_registers_nothing():
    spec, setup = _setup()
    store = dist.HashStore()
    put(store, StoreKeys.GRPC_SETUP.format(0),
        dict(plain_setup(setup), optimizer=dict(plain_setup(setup)["optimizer"], cls="os:system")))
    put(store, StoreKeys.GRPC_SPEC.format(0, 0), spec)
    server = ParameterServer(0, 1, "sync", "raise")
    register_from_store(server, store, JobConfig(strategy="ps", servers=1, rank=0, world_size=2, transport="grpc"))
    answer = take(store, StoreKeys.GRPC_REGISTERED.format(0), "the answer")
    assert answer == "'os:system' is not a torch.optim.Optimizer subclass: refusing it as the optimizer"
    assert server.shard is None and not server.ready.is_set()


@pytest.mark.parametrize("change,field", [
    (lambda plain: {n: v for n, v in plain.items() if n != "num_servers"}, r"no field \['num_servers'\]"),
    (lambda plain: dict(plain, values={}), r"the unknown fields \['values'\]"),
    (lambda plain: dict(plain, optimizer=dict(plain["optimizer"], lr=0.1)),
     r"optimizer has the unknown fields \['lr'\]"),
])
def test_a_setup_with_a_missing_or_unknown_field_is_refused_naming_it(change, field):
    _, setup = _setup()
    with pytest.raises(ValueError, match=field + r".*expected exactly the fields"):
        setup_from_plain(change(plain_setup(setup)))


@pytest.mark.timeout(60)
def test_a_value_larger_than_the_tcp_store_takes_travels_in_parts():
    """torch's TCPStore refuses a value over 8 MB; a grpc job's setup holds the server's initial values (a 26 MB
    model's did not start): `put` splits it, `take` joins it, bit for bit."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    values = {"w": torch.randn(3 * STORE_VALUE_BYTES // 4 + 5)}
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=20))
    with pytest.raises(dist.DistError):  # the store drops the connection that sent it
        client.set("whole", to_bytes(values))
    put(store, "parts", values)
    assert torch.equal(take(store, "parts", "the values")["w"], values["w"])
