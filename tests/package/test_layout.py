"""The package layout is the architecture: imports point one way between the layers, no module imports
itself back through others (type-hint imports included), and the top level holds only the public API."""
import ast
import subprocess
import sys
import pathlib

import pytest

import gradsync

PACKAGE = pathlib.Path(gradsync.__file__).parent
LAYERS = ["cuda_ops", "core", "tables", "metrics", "config", "ps", "proto", "membership", "transport", "runtime", "worker",
          "launcher", "compare", "trainer", "client", "cli", "__init__", "testing"]
"""Lowest first: a part may import the parts before it, never one after it."""
TOP_LEVEL = {"__init__.py", "trainer.py", "config.py", "client.py", "testing.py"}
"""The top level's modules; the command line is the package `cli/` (its main and what status and pull print)."""


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(("gradsync",) + p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The gradsync modules `path` imports, at any depth of its code (functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                      for a in node.names}
    return {m for m in found if m in known}


def _part(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_imports_point_down_the_layers():
    modules = _modules()
    upward = sorted(f"{m} imports {i}" for m, p in modules.items() for i in _imports(p, set(modules))
                    if LAYERS.index(_part(i)) > LAYERS.index(_part(m)))
    assert not upward, "imports that point up the layers (" + " < ".join(LAYERS) + "):\n" + "\n".join(upward)


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {m: _imports(p, set(modules)) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_every_part_is_a_known_layer_and_the_top_level_is_the_public_api():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert parts <= set(LAYERS), f"a package that is in no layer: {sorted(parts - set(LAYERS))}"


@pytest.mark.job
def test_import_gradsync_loads_no_optional_stack():
    """`import gradsync` (what a training script does) loads neither gRPC, matplotlib, triton nor tqdm beyond
    what `import torch` loads itself (torch.hub imports tqdm): they load where they are used."""
    probe = ("import sys, torch; before = set(sys.modules); import gradsync; "
             "print(' '.join(sorted(m for m in set(sys.modules) - before "
             "if m.split('.')[0] in ('grpc', 'matplotlib', 'triton', 'tqdm'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == []


def test_grpc_lives_in_one_package():
    """gRPC, both sides and everything around them, is `transport/grpc/`; `proto/` is the schema, its generated
    code and the tensor codec, which alone may import protobuf there."""
    modules = _modules()
    grpc_users = set()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n == "grpc" or n.startswith("grpc.") for n in names):
                grpc_users.add(module)
    assert grpc_users and all(m.startswith("gradsync.transport.grpc.") for m in grpc_users), sorted(grpc_users)
    proto = {p.name for p in (PACKAGE / "proto").iterdir() if p.suffix in (".py", ".proto")}
    assert proto == {"__init__.py", "gradsync.proto", "gradsync_pb2.py", "gradsync_pb2_grpc.py", "generate.py",
                     "tensor_codec.py"}, f"proto/ holds the schema, its generated code and the codec: {sorted(proto)}"


def test_the_in_job_metrics_are_not_part_of_the_offline_compare_tool():
    """`compare/` runs outside the job; what a worker records (`metrics/`) does not import it, nor do the
    trainer, the workers or the servers."""
    modules = _modules()
    inside = [m for m in modules if _part(m) in ("metrics", "worker", "ps", "runtime", "transport", "trainer")]
    offenders = sorted(f"{m} imports {i}" for m in inside for i in _imports(modules[m], set(modules))
                       if _part(i) == "compare")
    assert not offenders, offenders


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's package map is the architecture drawn: every module of the package is named in it
    (its file name), so a module that moves or appears without a place on the map fails here."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawn = page[page.index("## Packages"):page.index("```", page.index("```", page.index("## Packages")) + 3)]
    missing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and "_pb2" not in p.name and p.name not in drawn)
    assert not missing, f"modules docs/architecture.md's package map does not name: {missing}"


WORKER_CONCERNS = {"strategies", "rows", "pipeline", "module", "ddp"}
"""worker/'s folders: the strategies, the tables trained by rows (a folder of layouts), ps's gradients on their way,
the user's module and optimizer, DDP's pieces."""
LAYOUT_HALVES = {"served_tables", "served_dynamic", "sharded_tables", "sharded_dynamic", "pending_rows"}
"""The modules of worker/rows/ that only a layout reaches (a strategy calls the layout's protocol)."""


def test_the_worker_side_is_a_folder_per_concern():
    worker = PACKAGE / "worker"
    assert {p.name for p in worker.iterdir() if p.suffix == ".py"} == {"__init__.py"}
    assert {p.name for p in worker.iterdir() if (p / "__init__.py").exists()} == WORKER_CONCERNS


def test_every_row_layout_implements_the_whole_protocol_and_strategies_call_only_it():
    """A strategy reads as a dense part plus a layout: each layout of worker/rows/ is a `RowLayout` with every
    method of the protocol, and no strategy imports a layout's halves."""
    import inspect

    from gradsync.worker.rows import layout, replicated, served, sharded

    for module, name in ((served, "ServedRows"), (sharded, "ShardedRows"), (replicated, "ReplicatedRows")):
        cls = getattr(module, name)
        assert issubclass(cls, layout.RowLayout) and not inspect.isabstract(cls), name
    modules = _modules()
    reached = sorted(f"{m} imports {i}" for m, p in modules.items() if m.startswith("gradsync.worker.strategies.")
                     for i in _imports(p, set(modules)) if i.rsplit(".", 1)[-1] in LAYOUT_HALVES)
    assert not reached, reached
