"""Every `gradsync ...` and `make ...` command in README.md's code blocks runs as written: its flags parse with
the command line's own parser, its make target exists, a script it names in this repository is there."""
import os
import re
import shlex

import pytest

from gradsync import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands(markdown: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each `gradsync` or `make` command in the fenced code blocks, continued lines
    joined and comments left out."""
    out, fenced, pending = [], False, None
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line)
        elif re.match(r"\s*(gradsync|make)( |$)", line):
            pending = (number, line)
        if pending is not None and not pending[1].rstrip().endswith("\\"):
            out.append((pending[0], shlex.split(pending[1].replace("\\", " "), comments=True)))
            pending = None
    return out


README = open(os.path.join(ROOT, "README.md")).read()
FOUND = commands(README)
TARGETS = set(re.findall(r"^([\w.-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.MULTILINE))


def test_the_readme_has_the_commands_this_test_checks():
    names = [argv[0] + " " + argv[1] for _, argv in FOUND]
    expected = {"make run", "make test", "gradsync run", "gradsync compare", "gradsync status", "gradsync pull"}
    assert expected <= set(names)


@pytest.mark.parametrize("line,argv", FOUND, ids=[f"README.md:{n}" for n, _ in FOUND])
def test_readme_command_runs_as_written(line, argv):
    if argv[0] == "make":
        targets = [a for a in argv[1:] if "=" not in a]
        assert set(targets) <= TARGETS, f"README.md:{line}: make {' '.join(targets)}: no such target in the Makefile"
        return
    try:
        args = cli.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"README.md:{line}: {shlex.join(argv)} does not parse (see the usage above)")
    script = getattr(args, "script", None)
    if script and os.path.isdir(os.path.join(ROOT, os.path.dirname(script) or "-")):
        assert os.path.exists(os.path.join(ROOT, script)), f"README.md:{line}: {script} is not in the repository"


def test_the_checker_catches_a_bad_flag_and_an_option_after_the_script():
    bad = commands("```\ngradsync run --strategy ps --wrokers 2 examples/digits.py\n"
                   "gradsync compare examples/digits.py \\\n    --strategies ps   # a comment\n```\n")
    assert bad == [(2, ["gradsync", "run", "--strategy", "ps", "--wrokers", "2", "examples/digits.py"]),
                   (3, ["gradsync", "compare", "examples/digits.py", "--strategies", "ps"])]
    with pytest.raises(SystemExit):
        cli.parse_args(bad[0][1][1:])
    with pytest.raises(ValueError, match="--strategies comes after the script"):
        cli.parse_args(bad[1][1][1:])
