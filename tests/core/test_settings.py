"""The settings table: every variable the code reads is declared there, once, and what is generated from it
(JobConfig, the environment, the command line, the keywords of init and launch, the docs) follows it."""
import ast
import dataclasses
import pathlib
import re
import typing

import pytest
import torch

import gradsync
from gradsync import cli
from gradsync.config import Checkpointing, ConfigError, Faults, JobConfig, Placement, Timeouts, Training, settings_from_env
from gradsync.core import settings
from gradsync.core.settings import JOB_CONCERNS, JOB_SETTINGS, TABLE

PACKAGE = pathlib.Path(gradsync.__file__).parent
ROOT = PACKAGE.parent
TABLE_MODULE = PACKAGE / "core" / "settings.py"
VARIABLE = re.compile(r"GRADSYNC_[A-Z0-9_]*")


def _environ_read(node: ast.AST) -> ast.AST | None:
    """The key of `os.environ.get(k)`, `os.getenv(k)`, `os.environ[k]`, `os.environ.pop(k)` or `k in os.environ`."""
    environ = lambda n: isinstance(n, ast.Attribute) and n.attr == "environ"  # noqa: E731
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if (node.func.attr in ("get", "pop") and environ(node.func.value)) or node.func.attr == "getenv":
            return node.args[0]
    if isinstance(node, ast.Subscript) and environ(node.value) and isinstance(node.ctx, ast.Load):
        return node.slice
    if isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
        return node.left
    return None


def _findings(path: pathlib.Path) -> list[str]:
    """Where `path` names a GRADSYNC_ variable in a string, bytes or keyword, or reads os.environ with a key
    that is not a literal (which may be one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        value = node.value if isinstance(node, ast.Constant) else node.arg if isinstance(node, ast.keyword) else None
        text = value.decode() if isinstance(value, bytes) else value
        if isinstance(text, str) and VARIABLE.fullmatch(text):
            found.append(f"{where}: the variable name {text!r}")
        key = _environ_read(node)
        if key is not None and not isinstance(key, ast.Constant):
            found.append(f"{where}: an os.environ read of {ast.unparse(key)}")
    return found


def test_variables_are_read_only_through_the_table():
    found = [f for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE_MODULE and "_pb2" not in path.name
             for f in _findings(path)]
    assert not found, ("read these through gradsync.core.settings (Setting.read, .env), declaring any new "
                       "variable there:\n" + "\n".join(found))


def test_the_scan_finds_a_variable_read_elsewhere(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("import os\nfrom gradsync.core.settings import LINK\n"
                      "a = os.environ.get('GRADSYNC_SNEAKY')\nb = os.environ[LINK.env]\nc = 'HOME' in os.environ\n"
                      "d = dict(GRADSYNC_RUN_DIR='x')\ne = os.getenv(LINK.env)\n")
    assert sorted(_findings(sneaky)) == ["sneaky.py:3: the variable name 'GRADSYNC_SNEAKY'",
                                         "sneaky.py:4: an os.environ read of LINK.env",
                                         "sneaky.py:6: the variable name 'GRADSYNC_RUN_DIR'",
                                         "sneaky.py:7: an os.environ read of LINK.env"]


def test_every_variable_named_in_code_and_docs_is_in_the_table():
    declared = {s.env for s in TABLE}
    texts = [*PACKAGE.rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    named = {m: p.name for p in texts for m in re.findall(r"GRADSYNC_[A-Z0-9_]+", p.read_text())}
    assert not set(named) - declared, {m: p for m, p in named.items() if m not in declared}
    assert len({s.env for s in TABLE}) == len(TABLE) and len({s.name for s in TABLE}) == len(TABLE)


def test_the_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split(settings.BEGIN + "\n", 1)[1].split(settings.END, 1)[0]
    assert block == settings.markdown(), "run `make docs` to regenerate docs/architecture.md"
    for s in TABLE:
        assert f"`{s.env}`" in block


def test_job_config_is_the_five_concerns_with_the_tables_names_types_and_defaults():
    """The fields written out in config.py are the settings table's, concern by concern, in its order."""
    concerns = {"placement": Placement, "training": Training, "timeouts": Timeouts, "checkpointing": Checkpointing,
                "faults": Faults}
    assert tuple(concerns) == JOB_CONCERNS
    for concern, cls in concerns.items():
        hints = typing.get_type_hints(cls)
        declared = settings.of(concern)
        assert [f.name for f in dataclasses.fields(cls)] == [s.name for s in declared], concern
        for f, s in zip(dataclasses.fields(cls), declared):
            assert f.kw_only and f.default == s.default and type(f.default) is type(s.default), s.name
            assert hints[f.name] == (s.type if s.default is not None else s.type | None), s.name
    assert [f.name for f in dataclasses.fields(JobConfig)] == \
        [s.name for c in JOB_CONCERNS for s in settings.of(c)]
    with pytest.raises(TypeError):
        Timeouts(1.0)
    with pytest.raises(ConfigError, match="step_timeout must be > 0, got 0"):
        Timeouts(step_timeout=0)
    with pytest.raises(ConfigError, match="unknown compression 'zip'.* --compression or GRADSYNC_COMPRESSION"):
        Training(compression="zip")
    with pytest.raises(ConfigError, match="bucket_cap_mb must be > 0"):
        JobConfig(bucket_cap_mb=-1.0)


def test_every_job_setting_travels_through_the_environment():
    sync = JobConfig(strategy="ps", servers=2, world_size=4, server_device="cuda:1", nonfinite="skip",
                     bucket_cap_mb=4.5, startup_timeout=5.0, step_timeout=6.0, shutdown_timeout=7.0, stall_report=8.0,
                     checkpoint_dir="c", checkpoint_every=3, checkpoint_full_every=4, resume="r", worker_loss="wait",
                     max_restarts=2, restart_timeout=9.0)
    ssp = JobConfig(strategy="ps", mode="ssp", staleness=2, compression="int8", world_size=2)
    grpc = JobConfig(transport="grpc", world_size=2, pipeline="on")
    allreduce = JobConfig(strategy="allreduce", servers=0, world_size=2, checkpoint_dir="c", checkpoint_every=1,
                          start_over=True)
    changed = set()
    for config in (sync, ssp, grpc, allreduce):
        env = config.to_env()
        assert set(env) == {s.env for s in JOB_SETTINGS if getattr(config, s.name) is not None}  # None: unset
        assert JobConfig.from_env({**env, "WORLD_SIZE": str(config.world_size)}) == config
        changed |= {s.name for s in JOB_SETTINGS if getattr(config, s.name) != s.default}
    assert changed == {s.name for s in JOB_SETTINGS} - {"replicas"}  # replicas=1 is refused until servers keep them
    assert "GRADSYNC_BUCKET_CAP_MB" not in ssp.to_env() and JobConfig.from_env(
        {**ssp.to_env(), "WORLD_SIZE": "2"}).bucket_cap_mb is None  # auto travels as unset
    assert settings_from_env({})["servers"] == 1 and settings_from_env({}, "allreduce")["servers"] == 0


def test_gradsync_run_has_an_option_for_every_job_setting_bucket_cap_mb_included():
    argv = ["run", "--strategy", "ps", "--workers", "2", "--bucket-cap-mb", "5", "--step-timeout", "9", "s.py"]
    chosen = cli.job_settings(cli.parse_args(argv))
    assert set(chosen) == {s.name for s in JOB_SETTINGS}
    assert (chosen["bucket_cap_mb"], chosen["step_timeout"], chosen["strategy"]) == (5.0, 9.0, "ps")
    assert chosen["mode"] is None  # not given: the environment's, else the default
    commands = cli._parser()._subparsers._group_actions[0].choices
    flags = {o for name in ("run", "compare", "status", "pull") for a in commands[name]._actions
             for o in a.option_strings}
    assert {s.flag for s in TABLE if s.flag} <= flags
    run = " ".join(commands["run"].format_help().split())
    assert "(default: GRADSYNC_BUCKET_CAP_MB, else auto)" in run


def test_init_and_launch_refuse_a_keyword_that_is_no_setting(launch):
    def nothing():
        pass

    with pytest.raises(TypeError, match="gradsync.launch\\(\\) got an unknown setting 'step_timeuot'"):
        launch(nothing, strategy="ps", workers=1, step_timeuot=5)
    with pytest.raises(TypeError, match="gradsync.init\\(\\) got an unknown setting 'rank'.*bucket_cap_mb"):
        gradsync.init(strategy="ps", rank=3)


def test_device_is_cuda_or_cpu():
    assert settings.DEVICE.read({}) == "cuda" and settings.DEVICE.read({"GRADSYNC_DEVICE": "cpu"}) == "cpu"
    with pytest.raises(ConfigError, match="unknown device 'gpu': expected one of 'cuda', 'cpu' .*GRADSYNC_DEVICE"):
        settings.DEVICE.read({"GRADSYNC_DEVICE": "gpu"})


@pytest.mark.parametrize("cuda,device,backend", [(True, None, "cpu:gloo,cuda:nccl"), (True, "cpu", "gloo"),
                                                 (False, None, "gloo")])
def test_a_gpu_machine_keeps_gloo_for_cpu_tensors(monkeypatch, cuda, device, backend):
    """On a GPU machine nccl alone failed DDP on a CPU model ("No backend type associated with device type
    cpu", seen on an H200): CPU tensors keep gloo beside it."""
    from gradsync.runtime.start import process_group_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if device is None:
        monkeypatch.delenv("GRADSYNC_DEVICE", raising=False)
    else:
        monkeypatch.setenv("GRADSYNC_DEVICE", device)
    assert process_group_backend() == backend


def test_typed_reads_name_the_variable():
    assert settings.GRPC_PORT.read({}) == 0 and settings.TOKEN.read({}) is None
    assert settings.LAUNCHER_PID.read({"GRADSYNC_LAUNCHER_PID": "42"}) == 42
    assert settings.LAUNCHED.read({"GRADSYNC_LAUNCHED": "1"}) and not settings.LAUNCHED.read({})
    with pytest.raises(ConfigError, match="GRADSYNC_GRPC_PORT='x' is not an integer"):
        settings.GRPC_PORT.read({"GRADSYNC_GRPC_PORT": "x"})


def test_join_refuses_every_job_setting_option_beside_it():
    args = cli.parse_args(["run", "--join", "runs/x", "--bucket-cap-mb", "5", "--servers", "2", "s.py"])
    with pytest.raises(ConfigError, match="so --servers, --bucket-cap-mb cannot be given with it"):
        cli._check_join_flags(args, cli.job_settings(args))
