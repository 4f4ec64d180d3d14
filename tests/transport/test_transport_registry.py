"""Every transport is registered under a value of the `transport` setting, implements both sides of the ABC
(`gradsync.transport.base`), and what it cannot do is refused from its declared capabilities, with the texts
a user sees."""
import ast
import inspect
import re
import subprocess
import sys
import types

import pytest
import torch

from gradsync.config import ConfigError, JobConfig, default_servers
from gradsync.core import settings
from gradsync.core.transport_capabilities import CAPABILITIES, capabilities
from gradsync.membership.newcomers import joinable
from gradsync.transport.grpc import servicer
from gradsync.ps.server import ParameterServer
from gradsync.transport import registry
from gradsync.transport.base import RankTransport, WorkerTransport
from gradsync.worker.strategies.ps_strategy import PSStrategy

NAMES = registry.names()
STRATEGIES = settings.STRATEGY.choices


def _job(strategy: str, name: str, **more) -> JobConfig:
    """A job of two workers (and the strategy's default servers) over transport `name`."""
    servers = default_servers(strategy)
    return JobConfig(strategy=strategy, servers=servers, world_size=servers + 2, transport=name, **more)


def test_every_value_of_the_setting_is_registered_with_its_capabilities():
    assert NAMES == tuple(CAPABILITIES) == settings.TRANSPORT.choices
    assert settings.TRANSPORT.default == NAMES[0]
    for name in NAMES:
        assert registry.transport(name).capabilities is capabilities(name)
        assert capabilities(name).name == name


def test_the_default_transport_can_do_everything():
    default = capabilities(NAMES[0])
    assert set(default.strategies) == set(STRATEGIES)
    assert default.compression and default.row_tables and default.joining


@pytest.mark.parametrize("name", NAMES)
def test_every_transport_implements_both_sides(name):
    found = registry.transport(name)
    assert issubclass(found.worker, WorkerTransport) and not inspect.isabstract(found.worker)
    assert isinstance(found.rank, RankTransport) and not inspect.isabstract(type(found.rank))
    own_row_calls = [found.worker.pull_rows_many is not WorkerTransport.pull_rows_many,
                     found.worker.table_rows is not WorkerTransport.table_rows]
    assert own_row_calls == [found.capabilities.row_tables] * 2


def test_an_unknown_transport_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"no transport named 'pigeon': expected one of rpc, grpc$"):
        registry.transport("pigeon")


def test_grpc_refusals_keep_their_texts():
    with pytest.raises(ConfigError) as info:
        _job("allreduce", "grpc")
    assert str(info.value) == (
        "the grpc transport serves the ps strategy without compression, got strategy='allreduce', "
        "compression='none': use --strategy ps --compression none, or --transport rpc")
    assert capabilities("grpc").rows_refusal() == (
        "the grpc transport does not serve embedding tables row by row yet: use --transport rpc, or keep the "
        "tables dense with Trainer(..., tables='auto' or 'dense')")


@pytest.mark.parametrize("name,strategy", [(n, s) for n in NAMES for s in STRATEGIES])
def test_a_strategy_runs_exactly_over_the_transports_that_serve_it(name, strategy):
    if strategy in capabilities(name).strategies:
        assert _job(strategy, name).transport == name
    else:
        with pytest.raises(ConfigError, match=f"^the {name} transport serves the .* got strategy='{strategy}'"):
            _job(strategy, name)


@pytest.mark.parametrize("name", NAMES)
def test_compression_needs_a_transport_that_carries_it(name):
    if capabilities(name).compression:
        assert _job("ps", name, compression="int8").compression == "int8"
    else:
        with pytest.raises(ConfigError, match=f"^the {name} transport serves .* without compression, got "
                                              "strategy='ps', compression='int8'"):
            _job("ps", name, compression="int8")


@pytest.mark.parametrize("name", NAMES)
def test_workers_join_exactly_the_async_jobs_whose_transport_takes_them(name):
    assert joinable(_job("ps", name, mode="async")) == capabilities(name).joining
    assert not joinable(_job("ps", name, mode="sync"))


@pytest.mark.parametrize("name", [n for n in NAMES if not capabilities(n).row_tables])
def test_row_tables_are_refused_by_a_transport_without_them(name):
    """The Trainer refuses tables='rows' before it reaches any server; the worker side's row calls say why."""
    config = _job("ps", name, rank=1)
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError) as info:
        PSStrategy(types.SimpleNamespace(config=config), net, torch.optim.SGD(net.parameters(), lr=0.1), tables="rows")
    assert str(info.value) == capabilities(name).rows_refusal()
    worker = registry.transport(name).worker
    unbuilt = worker.__new__(worker)  # the row calls need no connection to refuse
    for call in (lambda: unbuilt.pull_rows_many([("0", {})]), lambda: unbuilt.table_rows("0")):
        with pytest.raises(NotImplementedError, match="^" + re.escape(capabilities(name).rows_refusal()) + "$"):
            call()


@pytest.mark.job
def test_importing_gradsync_loads_no_grpc():
    """The registry imports a transport's module only when that transport is asked for."""
    code = "import sys, gradsync; print(sorted(m for m in ('grpc', 'gradsync.transport.grpc.job_calls') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_grpc_servicer_calls_only_the_parameter_servers_public_methods():
    """No reaching into ShardState or the server's private state: only its methods and its settings."""
    tree = ast.parse(inspect.getsource(servicer.Servicer))
    reached = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and (isinstance(node.value, ast.Name) and node.value.id == "server"
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "server")}
    methods = {n for n, _ in inspect.getmembers(ParameterServer, inspect.isfunction) if not n.startswith("_")}
    assert {"layout", "push", "pull_named"} <= reached
    assert reached - methods == {"ready", "shard_id", "num_workers", "mode", "pipelined"}
