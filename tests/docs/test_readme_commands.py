"""Every `gradsync ...` and `make ...` command in the code blocks of README.md and docs/guide.md runs as written:
its flags parse with the command line's own parser, its make target exists, a script it names in this
repository is there; every link between the pages leads to a file and a heading that exist."""
import os
import re

import pytest

from doc_commands import ROOT, command_problem, commands
from gradsync import cli

PAGES = ("README.md", os.path.join("docs", "guide.md"))
FOUND = [(page, line, argv) for page in PAGES for line, argv in commands(open(os.path.join(ROOT, page)).read())]


def test_the_readme_has_the_commands_this_test_checks():
    names = {argv[0] + " " + argv[1] for page, _, argv in FOUND if page == "README.md"}
    assert {"make run", "make test", "gradsync run", "gradsync compare", "gradsync status", "gradsync pull"} <= names


@pytest.mark.parametrize("page,line,argv", FOUND, ids=[f"{page}:{n}" for page, n, _ in FOUND])
def test_readme_command_runs_as_written(page, line, argv):
    problem = command_problem(f"{page}:{line}", argv)
    assert problem is None, problem


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES + tuple(os.path.join("docs", p) for p in ("architecture.md", "porting.md"))
                         + ("BENCHMARKS.md",))
def test_every_link_between_the_pages_leads_somewhere(page):
    text = open(os.path.join(ROOT, page)).read()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(file):
            broken.append(target)
        elif anchor and file.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", open(file).read(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert broken == []


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
