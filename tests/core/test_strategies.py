"""Every strategy is declared once, in `gradsync.core.strategies`: its traits, and the worker-side class that runs
it. Everything else reads the table (the settings, the job's checks, the trainer, start-up, compare), and no module
of the package names a strategy by its string literal to compare or dispatch on it."""
import ast
import inspect
import pathlib

import pytest

import gradsync
from gradsync.compare import costmodel, grid
from gradsync.compare.runner import TABLE_STRATEGIES
from gradsync.config import ConfigError, JobConfig, default_servers
from gradsync.core import settings
from gradsync.core.strategies import STRATEGIES, Dense, Saved, Tables, traits
from gradsync.core.transport_capabilities import CAPABILITIES
from gradsync.worker.strategies.strategy import Strategy

PACKAGE = pathlib.Path(gradsync.__file__).parent
TABLE_MODULE = PACKAGE / "core" / "strategies.py"
TRAINER_KEYWORDS = {"tables", "table_optimizer", "find_unused_parameters", "clipping"}
"""What the Trainer hands a strategy's class, as keywords, beside the job, the model and the optimizer."""


def _named_strategies(source: str, where: str) -> list[str]:
    """Where `source` (the text of `where`) holds a string literal that is a strategy's name ('ps', "allreduce",
    ...). A name inside a longer text (a docstring, a help or error text, an f-string's text such as f"ps{index}")
    is prose, not a comparison or a dispatch, and is not counted."""
    tree = ast.parse(source)
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    return [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STRATEGIES
            and id(node) not in in_fstrings]


def test_no_module_but_the_table_names_a_strategy_by_its_string():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE_MODULE and "_pb2" not in path.name
             for hit in _named_strategies(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, ("a strategy's name as a string literal outside gradsync/core/strategies.py: read its trait "
                       "there (traits(name), STRATEGIES) instead of comparing the name:\n" + "\n".join(found))


def test_the_scan_sees_a_comparison_and_a_dispatch_not_prose():
    source = ('"""Under the ps strategy."""\nif strategy == "ps":\n    x = {"hybrid": 1}\n'
              'y = f"ps{x}" + "the sharded strategy"\nz = launch(fn, strategy=\'allreduce\')\n')
    assert sorted(_named_strategies(source, "probe.py")) == ["probe.py:2: 'ps'", "probe.py:3: 'hybrid'",
                                                             "probe.py:5: 'allreduce'"]


def test_the_strategy_setting_is_the_table():
    assert settings.STRATEGY.choices == tuple(STRATEGIES)
    assert settings.STRATEGY.default == next(iter(STRATEGIES))
    assert all(f"{name} (" in settings.STRATEGY.help for name in STRATEGIES)
    assert set(CAPABILITIES[settings.TRANSPORT.default].strategies) == set(STRATEGIES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_declares_consistent_traits(name):
    t = traits(name)
    assert t.name == name and t.modes and set(t.modes) <= set(settings.MODE.choices) and "sync" in t.modes
    assert isinstance(t.dense, Dense) and isinstance(t.tables, Tables)
    assert t.checkpoints and all(isinstance(s, Saved) for s in t.checkpoint)
    assert (Saved.SERVER_SHARDS in t.checkpoint) == t.servers  # the servers write their shards
    if t.dense is Dense.DDP or t.tables is Tables.SHARDED:  # DDP and all-to-all exchanges need one
        assert t.process_group
    if t.dense is Dense.SERVERS or t.tables is Tables.SERVED:
        assert t.servers
    assert set(t.keywords) <= TRAINER_KEYWORDS and len(set(t.keywords)) == len(t.keywords)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_loader_names_a_strategy_class_taking_its_keywords(name):
    t = traits(name)
    cls = t.load()
    assert inspect.isclass(cls) and issubclass(cls, Strategy) and f"{cls.__module__}.{cls.__qualname__}" == t.loader
    taken = {p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert taken & TRAINER_KEYWORDS == set(t.keywords), "pass every Trainer argument the class takes"
    if not t.join:
        with pytest.raises(NotImplementedError, match=f"not supported under the {name} strategy"):
            cls.join(object.__new__(cls))


def test_the_trainer_imports_no_strategy_module_itself():
    """The job's strategy's module is imported by its loader when the Trainer is built, the others never."""
    strategy_modules = {t.loader.rpartition(".")[0] for t in STRATEGIES.values()}
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & strategy_modules


def test_an_unknown_strategy_is_refused_naming_the_declared_ones():
    with pytest.raises(ValueError, match=r"^no strategy named 'dp': expected one of ps, allreduce, hybrid, sharded$"):
        traits("dp")
    with pytest.raises(ConfigError, match=r"unknown strategy 'dp': expected one of 'ps', 'allreduce', 'hybrid', "
                                          r"'sharded' \(set it with --strategy or GRADSYNC_STRATEGY\)"):
        JobConfig.from_env({"GRADSYNC_STRATEGY": "dp"})
    assert default_servers("dp") == 1  # the job's checks refuse the name, not the default


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_job_checks_follow_the_traits(name):
    t = traits(name)
    assert default_servers(name) == int(t.servers)
    ok = JobConfig.from_env({"GRADSYNC_STRATEGY": name, "WORLD_SIZE": "3"})
    assert (ok.servers, ok.num_workers) == ((1, 2) if t.servers else (0, 3))
    with pytest.raises(ConfigError, match=f"the {name} strategy (needs at least one server|uses no servers)"):
        JobConfig.from_env({"GRADSYNC_STRATEGY": name, "GRADSYNC_SERVERS": "0" if t.servers else "1",
                            "WORLD_SIZE": "3"})
    for mode in settings.MODE.choices:
        env = {"GRADSYNC_STRATEGY": name, "GRADSYNC_MODE": mode, "WORLD_SIZE": "3"}
        if mode in t.modes:
            config = JobConfig.from_env(env)
            assert config.elastic == (mode != "sync" and not t.process_group)
        else:
            with pytest.raises(ConfigError, match=f"the {name} strategy is synchronous"):
                JobConfig.from_env(env)


def test_compare_reads_the_traits():
    assert TABLE_STRATEGIES == tuple(n for n, t in STRATEGIES.items() if t.needs_tables)
    configs = grid.grid(list(STRATEGIES), [1], ["sync", "async"], ["none"])
    for name, t in STRATEGIES.items():
        mine = [c for c in configs if c.strategy == name]
        assert all(c.servers == int(t.servers) for c in mine)
        assert len(mine) == (2 if t.dense is Dense.SERVERS else 1)
        modelled = costmodel.Config(name, 8, dense=10, servers=int(t.servers))
        assert costmodel.traffic(modelled, 2)[0] > 0
