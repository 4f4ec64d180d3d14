"""BENCHMARKS.md as a reference: it opens with its table of current figures, each row naming a result file that
exists and a command that runs as written; every result file it cites exists, every file of bench/results is
cited, and each is named by what it measures (no sitting, date, re-run letter or commit hash); every
`BENCHMARKS.md, "Section"` cited from the code and the docs names one of its headings."""
import glob
import os
import re
import shlex

import pytest

from doc_commands import ROOT, command_problem

BENCHMARKS = open(os.path.join(ROOT, "BENCHMARKS.md")).read()
RESULTS = os.path.join(ROOT, "bench", "results")
CURRENT_COLUMNS = ["What is measured", "Figure", "Command", "Result", "Measured"]
SITTING_WORDS = ("session", "sitting", "before", "after", "_main", "_old", "_new")
WHEN = re.compile(r"\d{4}-\d{2}-\d{2}|(?<![0-9a-z])[0-9a-f]{7,40}(?![0-9a-z])")  # a date (and its letter), a hash
CITE = re.compile(r'BENCHMARKS\.md,\s+"([^"]+)"')
LINK = re.compile(r"\[[^\]]*\]\([^)]*BENCHMARKS\.md#[^)]+\)")  # its anchor: test_readme_commands
CITING = sorted(glob.glob(os.path.join(ROOT, "gradsync", "**", "*.py"), recursive=True)
                + glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")])
MUST_NAME_A_SECTION = ("gradsync", "docs")


def expand(name: str) -> list[str]:
    """The names a shell brace pattern stands for: `a_{1,2}.json` -> a_1.json, a_2.json."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [n for part in match.group(1).split(",")
            for n in expand(name[:match.start()] + part + name[match.end():])]


def cited_results(text: str) -> list[str]:
    """Every result file `text` names as bench/results/NAME.json, brace patterns expanded."""
    return [n for pattern in re.findall(r"bench/results/((?:[\w.-]|\{[\w.,-]+\})+\.json)", text)
            for n in expand(pattern)]


def current_figures(text: str) -> tuple[str, list[list[str]]]:
    """The heading above the first table of `text`, and that table's rows as cells (its header first)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    heading = next(line for line in reversed(lines[:first]) if line.startswith("#"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return heading.lstrip("# "), [rows[0]] + rows[2:]


def misnamed(names: list[str]) -> list[str]:
    """The result files among `names` named after when or from what they ran (a sitting, a date with or without a
    re-run letter, a commit hash) rather than by what they measure."""
    return [n for n in names if any(word in n.lower() for word in SITTING_WORDS) or WHEN.search(n.lower())]


def command_problems(command: str) -> list[str]:
    """Why a row's command would not run as written: a script of bench/ that is not there or does not declare a
    flag the command passes, or a `gradsync` command its parser refuses; no problem, an empty list."""
    argv = shlex.split(command)
    if argv[0] == "gradsync":
        problem = command_problem("BENCHMARKS.md", argv)
        return [problem] if problem else []
    if not argv[0].startswith("bench/"):
        return [f"{command}: starts with neither a script of bench/ nor gradsync"]
    script = os.path.join(ROOT, argv[0])
    if not os.path.exists(script):
        return [f"{argv[0]} is not in the repository"]
    declared = set(re.findall(r"[\"'](--[\w-]+)[\"']", open(script).read()))
    return [f"{argv[0]} declares no {flag}" for flag in argv[1:] if flag.startswith("--") and flag not in declared]


def table_problems(text: str) -> list[str]:
    heading, rows = current_figures(text)
    problems = [] if heading == "Current figures" else [f"the first table is under {heading!r}"]
    if rows[0] != CURRENT_COLUMNS:
        return problems + [f"the first table's columns are {rows[0]}, not {CURRENT_COLUMNS}"]
    for what, _, command, result, measured in rows[1:]:
        files = cited_results(result)
        if not files:
            problems.append(f"{what!r}: no bench/results/*.json in its Result cell")
        problems += [f"{what!r}: {f} does not exist" for f in files if not os.path.exists(os.path.join(RESULTS, f))]
        commands = re.findall(r"`([^`]+)`", command)
        problems += command_problems(commands[0]) if commands else [f"{what!r}: no command"]
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", measured):
            problems.append(f"{what!r}: measured {measured!r}, not a date")
    return problems


def cite_problems(path: str, text: str, headings: set[str]) -> list[str]:
    """Cited sections that are not headings of BENCHMARKS.md; where `path` is code or docs, also a mention of
    BENCHMARKS that names no section."""
    where = os.path.relpath(path, ROOT)
    problems = [f"{where}: {name!r} is no heading of BENCHMARKS.md"
                for name in (" ".join(n.split()) for n in CITE.findall(text)) if name not in headings]
    if where.split(os.sep)[0] in MUST_NAME_A_SECTION and "BENCHMARKS" in LINK.sub("", CITE.sub("", text)):
        problems.append(f'{where}: cites BENCHMARKS.md without a section (write BENCHMARKS.md, "Section")')
    return problems


def headings(text: str) -> set[str]:
    return set(re.findall(r"^#+ (.+)$", text, flags=re.M))


def test_the_current_figures_open_the_page_and_each_row_reproduces():
    assert table_problems(BENCHMARKS) == []
    assert len(current_figures(BENCHMARKS)[1]) > 10


def test_every_cited_result_exists():
    cited = cited_results(BENCHMARKS)
    assert len(cited) > 50
    assert [f for f in cited if not os.path.exists(os.path.join(RESULTS, f))] == []


def test_results_are_named_by_what_they_measure_and_each_is_cited():
    assert misnamed(os.listdir(RESULTS)) == []
    assert sorted(set(os.listdir(RESULTS)) - set(cited_results(BENCHMARKS))) == []
    assert [w for w in ("session", "sitting", "kept for the record") if w in BENCHMARKS.lower()] == []


@pytest.mark.parametrize("path", CITING, ids=[os.path.relpath(p, ROOT) for p in CITING])
def test_every_cited_section_is_a_heading(path):
    assert cite_problems(path, open(path).read(), headings(BENCHMARKS)) == []


def test_the_checks_catch_each_broken_rule():
    assert expand("a_{x,y}_{1,2}.json") == ["a_x_1.json", "a_x_2.json", "a_y_1.json", "a_y_2.json"]
    assert misnamed(["dynamic_speed_1e5.json", "dynamic_speed_1e5_2026-11-28i.json", "overhead_ab_054bc4a_1.json",
                     "linkfloor_session_3.json", "cuda_ops-nvidia-h200-k8-256mb.json"]) == [
        "dynamic_speed_1e5_2026-11-28i.json", "overhead_ab_054bc4a_1.json", "linkfloor_session_3.json"]
    page = BENCHMARKS.replace("bench/results/overhead.json", "bench/results/overhead_gone.json", 1)
    assert table_problems(page) == ["'10M-parameter MLP, W = 4, S = 2: ps sync / gradsync allreduce, step and CPU "
                                    "per step': overhead_gone.json does not exist"]
    page = BENCHMARKS.replace("`bench/transport.py --repeat 3`", "`bench/transport.py --repeats 3`", 1)
    assert table_problems(page) == ["bench/transport.py declares no --repeats"]
    page = BENCHMARKS.replace("`bench/link.py --rates", "`python bench/link.py --rates", 1)
    assert table_problems(page) == ["python bench/link.py --rates 100mbit 1gbit 10gbit 100gbit: starts with neither "
                                    "a script of bench/ nor gradsync"]
    page = BENCHMARKS.replace("--link 1gbit examples/digits.py`", "--link 1gbit --wrokers 2 examples/digits.py`", 1)
    assert "does not parse" in table_problems(page)[0]
    page = BENCHMARKS.replace("## Current figures\n", "## Current figures\n\n| a | b |\n|---|---|\n| 1 | 2 |\n", 1)
    assert table_problems(page) == [f"the first table's columns are ['a', 'b'], not {CURRENT_COLUMNS}"]
    code = os.path.join(ROOT, "gradsync", "x.py")
    known = headings(BENCHMARKS)
    assert cite_problems(code, 'BENCHMARKS.md, "Piece\n    sizes"', known) == []
    assert cite_problems(code, 'BENCHMARKS.md, "Pieces"', known) == ["gradsync/x.py: 'Pieces' is no heading of "
                                                                      "BENCHMARKS.md"]
    assert cite_problems(code, "measured (BENCHMARKS.md)", known) == [
        'gradsync/x.py: cites BENCHMARKS.md without a section (write BENCHMARKS.md, "Section")']
    assert cite_problems(os.path.join(ROOT, "README.md"), "[BENCHMARKS.md](BENCHMARKS.md)", known) == []
