"""Installing: `pip install .` declares every module gradsync imports, and `import gradsync` loads no heavy extra."""
import ast
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from helpers import REFUSED_SCRIPT, ROOT

OPTIONAL = {"triton": ("triton", "triton"), "grpc_tools": ("dev", "grpcio-tools"), "pytest": ("dev", "pytest")}
"""Modules imported lazily -> (the extra that installs them, their distribution): named here, since a machine
without them has no metadata that says which distribution provides them (pytest: only pytest loads
gradsync.testing, its plugin)."""

BLOCKER = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, Blocker())
"""


def _setup_kwargs() -> dict:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def _imported() -> set[str]:
    """Top-level modules that gradsync's source imports, wherever the import is."""
    out = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "gradsync")):
        for file in (f for f in files if f.endswith(".py")):
            for node in ast.walk(ast.parse(open(os.path.join(folder, file)).read())):
                if isinstance(node, ast.Import):
                    out |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    out.add(node.module.split(".")[0])
    return out - set(sys.stdlib_module_names) - {"gradsync", "__future__"}


def test_every_module_gradsync_imports_is_declared_in_setup_py():
    kwargs = _setup_kwargs()
    required = {_name(r) for r in kwargs["install_requires"]}
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(_imported()):
        provided_by = {d.lower() for d in distributions.get(module, [module])}
        if module in OPTIONAL:
            extra, distribution = OPTIONAL[module]
            assert distribution in {_name(r) for r in kwargs["extras_require"][extra]}, module
        else:
            assert provided_by & required, f"gradsync imports {module}, which install_requires does not declare"
    assert {"matplotlib", "tqdm"} <= required  # what `gradsync compare` needs, so `pip install gradsync` gives it


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.job
@pytest.mark.timeout(150)
def test_import_gradsync_needs_no_plotting_progress_grpc_or_triton():
    blocked = ("matplotlib", "tqdm", "grpc", "triton")
    done = _python(BLOCKER.format(blocked=blocked) + "import gradsync, gradsync.cli\nprint('imported')")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]


@pytest.mark.job
@pytest.mark.timeout(150)
def test_compare_without_matplotlib_names_the_install_command_before_running_anything(tmp_path):
    out = tmp_path / "report"
    code = BLOCKER.format(blocked=("matplotlib",)) + (
        "from gradsync.cli import main\n"
        f"raise SystemExit(main(['compare', '--out', {str(out)!r}, {REFUSED_SCRIPT!r}]))\n")
    done = _python(code)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "gradsync compare needs matplotlib, which is not installed" in done.stderr
    assert "pip install matplotlib tqdm" in done.stderr
    assert not out.exists()  # refused before any run or report
