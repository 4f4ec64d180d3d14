"""The `gradsync` command line: compare's options, its report directory, the help texts."""
import os
import subprocess
import sys

import pytest

from gradsync import cli
from gradsync.compare import MARKER, prepare_out_dir
from helpers import REFUSED_SCRIPT


def test_compare_refuses_its_own_option_after_the_script_with_a_hint(capsys):
    assert cli.main(["compare", "train.py", "--strategies", "ps"]) == 2
    err = capsys.readouterr().err
    assert "--strategies comes after the script train.py, so it would go to the script" in err
    assert "gradsync compare --strategies ... train.py" in err and "gradsync compare train.py -- --strategies ps" in err
    assert cli.main(["compare", "train.py", "--workers=3"]) == 2
    assert "--workers=3 comes after the script train.py" in capsys.readouterr().err


def test_compare_passes_what_follows_the_script_to_the_script():
    args = cli.parse_args(["compare", "--workers", "3", "train.py", "--epochs", "3", "--lr=0.1"])
    assert (args.workers, args.script, args.args) == (3, "train.py", ["--epochs", "3", "--lr=0.1"])
    with pytest.raises(ValueError, match="--out=x comes after"):
        cli.parse_args(["compare", "train.py", "--out=x"])
    args = cli.parse_args(["compare", "train.py", "--", "--strategies", "ps"])  # the script's own --strategies
    assert (args.strategies, args.args) == (["allreduce", "ps", "hybrid", "sharded"], ["--strategies", "ps"])


def test_compare_refuses_a_report_directory_it_did_not_write_unless_forced(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["compare", "--out", str(theirs), str(script)]) == 2
    assert f"--out {theirs}: the directory has files that gradsync compare did not write" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]  # nothing written
    prepare_out_dir(str(theirs), force=True)
    assert (theirs / MARKER).exists() and (theirs / "notes.txt").read_text() == "mine"
    (theirs / "report.md").write_text("an earlier report")
    moved = prepare_out_dir(str(theirs))  # marked: compare wrote it, and may again, once it moved the earlier aside
    assert sorted(os.listdir(moved)) == [MARKER, "notes.txt", "report.md"] and os.listdir(theirs) == [MARKER]
    fresh = tmp_path / "new" / "report"
    prepare_out_dir(str(fresh))
    assert (fresh / MARKER).exists()
    earlier = tmp_path / "earlier"  # a report of a compare from before the marker
    earlier.mkdir()
    (earlier / "report.json").write_text("{}")
    prepare_out_dir(str(earlier))
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_out_dir(str(empty))


def test_help_shows_every_default_and_no_empty_one():
    parser = cli._parser()
    commands = parser._subparsers._group_actions[0].choices
    run, compare = (" ".join(commands[name].format_help().split()) for name in ("run", "compare"))
    assert "else )" not in run and "(default: GRADSYNC_CHECKPOINT_DIR if set)" in run
    assert "(default: GRADSYNC_CHECKPOINT_EVERY, else 0)" in run
    for text in ("(default: 2)", "(default: gradsync-report)", "(default: allreduce,ps,hybrid,sharded)",
                 "(default: 1,2)", "(default: sync,async)", "(default: none)", "(default: 600)", "(default: 1)"):
        assert text in compare, text


def test_run_and_compare_refuse_a_script_that_does_not_exist_before_starting_anything(tmp_path, capsys):
    out = tmp_path / "report"
    for command in (["run", "--strategy", "ps", "--workers", "1"], ["compare", "--out", str(out)]):
        assert cli.main([*command, "no/such/train.py"]) == 2
        assert "gradsync: error: no/such/train.py: no such file: give the path of the training script" in \
            capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("command,mistyped,meant", [(["run"], "--stratgy", "--strategy"),
                                                    (["run", "--strategy", "ps"], "--wrkers=2", "--workers"),
                                                    (["compare"], "--modse", "--modes")])
def test_a_mistyped_option_gets_its_commands_usage_and_the_closest_option(command, mistyped, meant, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main([*command, mistyped, "ps", "train.py"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count(f"usage: gradsync {command[0]} [-h]") == 1 and err.count("usage: gradsync [-h]") == 0, err
    assert err.splitlines()[-1] == (f"gradsync {command[0]}: error: unrecognized arguments: {mistyped} (did you "
                                    f"mean {meant}?)")


def test_run_keeps_every_option_it_had_and_adds_the_newer_ones():
    run = cli._parser()._subparsers._group_actions[0].choices["run"]
    options = {o for a in run._actions for o in a.option_strings}
    assert options == {"-h", "--help", "--strategy", "--workers", "--join", "--servers", "--mode", "--staleness",
                       "--nonfinite", "--compression", "--transport", "--server-device", "--bucket-cap-mb",
                       "--pipeline", "--startup-timeout", "--step-timeout", "--stall-report", "--shutdown-timeout",
                       "--checkpoint-dir", "--checkpoint-every", "--checkpoint-full-every", "--resume", "--start-over",
                       "--worker-loss", "--max-restarts", "--restart-timeout", "--replicas", "--master-port",
                       "--run-dir", "--timeout", "--link", "--server-link"}
    chosen = cli.job_settings(cli.parse_args(["run", "--strategy", "ps", "--workers", "1", "--start-over", __file__]))
    assert chosen["start_over"] is True  # a flag without a value


@pytest.mark.job
def test_help_a_bad_flag_and_a_missing_script_answer_without_importing_torch(tmp_path):
    """`gradsync --help`, each command's, a refused flag, a script that does not exist and compare's refused
    arguments answer in a fraction of a second: torch (seconds to import) loads only once a job
    is to run."""
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not compare's")
    script = REFUSED_SCRIPT
    code = ("import contextlib, io, sys\nfrom gradsync import cli\n"
            "for argv in (['--help'], ['run', '--help'], ['compare', '--help'], ['status', '--help'],"
            " ['run', '--workers', 'x', 's.py'], ['run', '--strategy', 'ps', '--workers', '1', 'no/such.py'],"
            f" ['compare', 'no/such.py'], ['compare', '--out', {str(foreign)!r}, {script!r}],"
            f" ['compare', '--straggler', '9', {script!r}], ['compare', '--warmup-steps', '0', {script!r}]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try:\n            print(cli.main(argv), file=sys.__stdout__)\n"
            "        except SystemExit as e:\n            print(e.code, file=sys.__stdout__)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    *codes, torch_modules = done.stdout.split("\n")[:-1]
    assert codes == ["0"] * 4 + ["2"] * 6, done.stdout  # the help texts, then six refusals
    assert torch_modules == "[]"
    assert os.listdir(foreign) == ["notes.txt"]
