"""Every `gradsync ...` and `make ...` command in README.md's code blocks runs as written: its flags parse with
the command line's own parser, its make target exists, a script it names in this repository is there."""
import os

import pytest

from doc_commands import ROOT, command_problem, commands
from gradsync import cli

README = open(os.path.join(ROOT, "README.md")).read()
FOUND = commands(README)


def test_the_readme_has_the_commands_this_test_checks():
    names = [argv[0] + " " + argv[1] for _, argv in FOUND]
    expected = {"make run", "make test", "gradsync run", "gradsync compare", "gradsync status", "gradsync pull"}
    assert expected <= set(names)


@pytest.mark.parametrize("line,argv", FOUND, ids=[f"README.md:{n}" for n, _ in FOUND])
def test_readme_command_runs_as_written(line, argv):
    problem = command_problem(f"README.md:{line}", argv)
    assert problem is None, problem


def test_the_checker_catches_a_bad_flag_and_an_option_after_the_script():
    bad = commands("```\ngradsync run --strategy ps --wrokers 2 examples/digits.py\n"
                   "gradsync compare examples/digits.py \\\n    --strategies ps   # a comment\n"
                   "make tset\ngradsync run --strategy ps --workers 2 examples/digit.py\n```\n")
    assert bad[:2] == [(2, ["gradsync", "run", "--strategy", "ps", "--wrokers", "2", "examples/digits.py"]),
                       (3, ["gradsync", "compare", "examples/digits.py", "--strategies", "ps"])]
    with pytest.raises(SystemExit):
        cli.parse_args(bad[0][1][1:])
    with pytest.raises(ValueError, match="--strategies comes after the script"):
        cli.parse_args(bad[1][1][1:])
    problems = [command_problem(f"x.md:{n}", argv) for n, argv in bad]
    assert "--wrokers" in problems[0] and "does not parse" in problems[0]
    assert "--strategies comes after the script" in problems[1]
    assert problems[2] == "x.md:5: make tset: no such target in the Makefile"
    assert problems[3] == "x.md:6: examples/digit.py is not in the repository"
    assert command_problem("x.md:1", ["gradsync", "run", "--strategy", "ps", "--workers", "2", "train.py"]) is None
