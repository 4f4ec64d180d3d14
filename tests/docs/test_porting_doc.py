"""docs/porting.md runs as written: every Python block compiles; every program on the page (a block whose first lines
are `# run: COMMAND`) runs, the DDP ones on two plain torch.distributed processes as torchrun would start them, the
gradsync ones under ps (the command as written) and allreduce through `gradsync.launch`, and the whole script through
`gradsync run` itself; each gradsync program prints on worker 0 only, and the same words and numbers as its
DDP twin (`X.py` and `X_ddp.py`), and so does the whole script under the page's torchrun line; the page's
`gradsync ...` commands parse."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from doc_commands import ROOT, code_blocks, command_problem, commands, run_program
import gradsync
from gradsync import cli
from helpers import SUPPORT, run_cli

PAGE = os.path.join(ROOT, "docs", "porting.md")
TEXT = open(PAGE).read()
BLOCKS = code_blocks(TEXT, "python")
GRADSYNC_PROGRAMS = ["train.py", "groups.py", "clip.py", "accumulate.py", "amp.py", "evaluate.py", "resume.py",
                     "checkpoints.py", "uneven.py"]
TWIN = {"checkpoints.py": "resume_ddp.py"}  # gradsync's own checkpoints print what the DDP script run twice prints
TOLERANCE = {"amp.py": 1e-3}  # float16 gradients summed in another order (matches to 4 decimals here); else rounding
TIMEOUT = 90


def _parse(line: int, text: str) -> dict:
    """A block's header: `# file: NAME` (a module the programs import) or `# run: COMMAND` lines (a program)."""
    block = {"line": line, "text": text, "file": None, "runs": []}
    for first in text.splitlines():
        m = re.match(r"# (file|run): (.+)$", first)
        if m is None:
            break
        if m.group(1) == "file":
            block["file"] = m.group(2).split()[0]
        else:
            block["runs"].append(shlex.split(m.group(2)))
    if block["runs"]:
        argv = block["runs"][0]
        block["file"] = next(a for a in argv if a.endswith(".py"))
        block["kind"] = argv[0]
    return block


PARSED = [_parse(line, text) for line, text in BLOCKS]
FILES = {b["file"]: b for b in PARSED if b["file"]}
PROGRAMS = {name: b for name, b in FILES.items() if b["runs"]}


def twin(name: str) -> str:
    return TWIN.get(name, name[:-3] + "_ddp.py")


def write_page(folder: str) -> None:
    """Every file the page defines, as the page names it, into `folder`."""
    for name, block in FILES.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(block["text"])


def words_and_numbers(text: str) -> tuple[list[str], list[float]]:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return re.sub(r"-?\d+(?:\.\d+)?", "#", text).split(), [float(n) for n in numbers]


def difference(mine: str, reference: str, tolerance: float) -> str | None:
    """How `mine` differs from `reference` beyond the last printed digit (or `tolerance`), or None."""
    (words, numbers), (ref_words, ref_numbers) = words_and_numbers(mine), words_and_numbers(reference)
    if words != ref_words or len(numbers) != len(ref_numbers):
        return f"printed\n{mine}\nwhere the DDP program printed\n{reference}"
    worst = max((abs(a - b) for a, b in zip(numbers, ref_numbers)), default=0.0)
    if worst > tolerance + 1.5e-4:  # two values each rounded to 4 decimals
        return f"differs by {worst:.2g} from the DDP program:\n{mine}\nagainst\n{reference}"
    return None


def test_every_python_block_compiles():
    assert len(BLOCKS) >= 19
    for line, text in BLOCKS:
        compile(text, f"docs/porting.md:{line}", "exec")  # a SyntaxError names the page's line


def test_the_page_has_every_program_and_its_ddp_twin():
    gradsync_programs = sorted(n for n, b in PROGRAMS.items() if b["kind"] == "gradsync")
    assert gradsync_programs == sorted(GRADSYNC_PROGRAMS)
    for name in GRADSYNC_PROGRAMS:
        assert PROGRAMS.get(twin(name), {}).get("kind") == "torchrun", f"{name} has no DDP twin {twin(name)}"
        assert "gradsync.init()" in PROGRAMS[name]["text"] and "gradsync.shutdown()" in PROGRAMS[name]["text"]
    assert "toy.py" in FILES and not FILES["toy.py"]["runs"]
    assert "](porting.md)" not in TEXT and "docs/porting.md" in open(os.path.join(ROOT, "README.md")).read()[:2200]


def test_the_page_commands_run_as_written():
    """The shell blocks' commands and the programs' `# run:` lines parse, and every script they name is on the page."""
    found = commands(TEXT) + [(b["line"], argv) for b in PROGRAMS.values() for argv in b["runs"]
                              if argv[0] == "gradsync"]
    assert {argv[1] for _, argv in found} == {"run"} and len(found) >= 14
    for line, argv in found:
        problem = command_problem(f"docs/porting.md:{line}", argv)
        assert problem is None, problem
        script = cli.parse_args(argv[1:]).script
        assert script in PROGRAMS, f"docs/porting.md:{line}: {script} is not a program on the page"


@pytest.fixture(scope="module")
def ddp_printed(tmp_path_factory) -> dict[str, list[str]]:
    """What rank 0 of each DDP program printed, per `# run:` line, on two processes (gloo, as torchrun starts
    them: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), every program in its own folder."""
    root = tmp_path_factory.mktemp("ddp")
    names = sorted(n for n, b in PROGRAMS.items() if b["kind"] == "torchrun")
    runs = []
    for name in names:
        folder = root / name[:-3]
        folder.mkdir()
        write_page(str(folder))
        for argv in PROGRAMS[name]["runs"]:
            assert argv[:3] == ["torchrun", "--nproc-per-node", "2"] and argv[3] == name, argv
            runs.append((name, [str(folder / name), argv[4:]]))
    spec = root / "spec.json"
    spec.write_text(json.dumps({"runs": [run for _, run in runs], "out": str(root)}))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SUPPORT, ROOT]))
    code = f"import sys, doc_commands; doc_commands.run_ddp_programs({str(spec)!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    said = []
    for p in procs:
        try:
            said.append(p.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            done = [(root / f"rank-{r}.json").read_text() for r in range(2) if (root / f"rank-{r}.json").exists()]
            pytest.fail(f"the DDP programs did not finish in {TIMEOUT} s; finished: {done}")
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"DDP rank {rank} failed:\n{said[rank][-4000:]}"
    printed = {name: [] for name in names}
    by_rank = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(2)]
    for index, (name, _) in enumerate(runs):
        assert by_rank[1][str(index)] == "", f"{name}: DDP rank 1 printed {by_rank[1][str(index)]!r}"
        printed[name].append(by_rank[0][str(index)])
    return printed


def launch_settings(argv: list[str], strategy: str, folder: str) -> dict:
    """`gradsync.launch` arguments for a `gradsync run ...` line, under `strategy` (ps: the line's own servers;
    allreduce: none), with its checkpoint directories in `folder`."""
    args = cli.parse_args(argv[1:])
    settings = {name: value for name, value in cli.job_settings(args).items() if value is not None}
    for name in ("checkpoint_dir", "resume"):
        if name in settings:
            settings[name] = os.path.join(folder, settings[name])
    servers = args.servers if strategy == args.strategy else 0 if strategy == "allreduce" else 1
    return dict(settings, strategy=strategy, workers=args.workers, servers=servers), args.args


@pytest.mark.job
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
@pytest.mark.parametrize("name", GRADSYNC_PROGRAMS)
def test_the_gradsync_program_prints_what_its_ddp_twin_prints(launch, name, strategy, ddp_printed, tmp_path):
    program = PROGRAMS[name]
    write_page(str(tmp_path))
    reference = ddp_printed[twin(name)]
    assert len(program["runs"]) == len(reference) and all(reference)
    for argv, expected in zip(program["runs"], reference):
        settings, script_args = launch_settings(argv, strategy, str(tmp_path))
        assert settings["workers"] == 2
        printed = launch(run_program, args=(str(tmp_path / name), script_args), timeout=TIMEOUT,
                         **settings)
        assert printed[1] == "", f"{name}: worker 1 printed {printed[1]!r}: print on worker 0 only"
        problem = difference(printed[0], expected, TOLERANCE.get(name, 0.0))
        assert problem is None, f"docs/porting.md:{program['line']}: {name} under {strategy} {problem}"


@pytest.mark.job
@pytest.mark.timeout(120)
def test_the_whole_script_runs_with_gradsync_run_as_written(ddp_printed, tmp_path):
    program = PROGRAMS["train.py"]
    write_page(str(tmp_path))
    argv = program["runs"][0]
    done = run_cli(*argv[1:], timeout=TIMEOUT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    problem = difference(done.stdout, ddp_printed["train_ddp.py"][0], 0.0)
    assert problem is None, f"docs/porting.md:{program['line']}: {shlex.join(argv)} {problem}"
    assert (tmp_path / "model.pt").exists()


@pytest.mark.job
@pytest.mark.timeout(120)
def test_the_whole_script_runs_under_torchrun_with_a_server_as_written(ddp_printed, tmp_path):
    """The page's one-machine torchrun line for ps: the server counted in --nproc-per-node."""
    line = next(line for line in TEXT.splitlines() if "GRADSYNC_STRATEGY=ps" in line and "torchrun" in line)
    words = shlex.split(line)
    settings = dict(w.split("=", 1) for w in words[:words.index("torchrun")])
    argv = words[words.index("torchrun") + 1:]
    assert argv[-1] == "train.py" and "--nproc-per-node" in argv
    write_page(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT, env=dict(os.environ, **settings))
    assert done.returncode == 0, done.stderr[-3000:]
    problem = difference(done.stdout, ddp_printed["train_ddp.py"][0], 0.0)
    assert problem is None, f"docs/porting.md: {line} {problem}"


@pytest.mark.job
@pytest.mark.timeout(120)
def test_a_broken_program_fails_this_test(launch, tmp_path):
    """What the tests above catch: a misspelt call fails the job with its traceback, a changed number differs."""
    write_page(str(tmp_path))
    path = tmp_path / "clip.py"
    path.write_text(PROGRAMS["clip.py"]["text"].replace("trainer.step(cid)", "trainer.stpe(cid)"))
    with pytest.raises(gradsync.JobFailed, match="stpe"):
        launch(run_program, args=(str(path), []), strategy="ps", workers=2, servers=1, timeout=TIMEOUT)
    assert difference("step 0 loss 1.2345\n", "step 0 loss 1.2345\n", 0.0) is None
    assert difference("step 0 loss 1.2349\n", "step 0 loss 1.2345\n", 0.0) is not None
    assert difference("step 0 norm 1.2345\n", "step 0 loss 1.2345\n", 0.0) is not None
