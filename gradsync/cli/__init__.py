"""The `gradsync` console command: `run` a job here; `status` and `pull` reach a running job over gRPC."""

# The docstring above is `gradsync --help`'s description. `main` parses the command line and calls the
# subcommand's handler from `COMMANDS`; what status and pull print and write is `job_status`.
from __future__ import annotations

import argparse
import difflib
import functools
import os
import shlex
import signal
import sys
from collections.abc import Callable

from gradsync.compare.options import CompareOptions
from gradsync.config import ConfigError
from gradsync.core import settings
from gradsync.core.errors import JobFailed
from gradsync.core.settings import (
    JOB_CONCERNS,
    JOB_SETTINGS,
    RANK_START,
    RUN_DIR,
    STRAGGLER,
    STRATEGY,
    TIMELINE,
    TLS_CERT,
    Setting,
)
from gradsync.launcher.script_file import check_script


class _Stopped(Exception):
    """`gradsync run` received a signal that ends it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame):
    raise _Stopped(signum)


def _help(setting: Setting) -> str:
    """The setting's help and where its default comes from, as `gradsync run --help` shows it."""
    if setting is STRATEGY:
        return f"{setting.help} (required, except with --join)"
    if setting.default in ("", None) and not setting.default_text:
        return f"{setting.help} (default: {setting.env} if set)"
    return f"{setting.help} (default: {setting.env}, else {setting.shown_default})"


def job_settings(args: argparse.Namespace) -> dict:
    """The job settings of a `gradsync run` command line, by name (None: not given)."""
    return {s.name: getattr(args, s.name) for s in JOB_SETTINGS}


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _counts(text: str) -> list[int]:
    try:
        return [int(n) for n in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2") from None


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an option it does not know is refused with the subcommand's usage (not the top
    level's) and the closest option it has."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, unknown = super().parse_known_args(args, namespace)
        if unknown:
            given = unknown[0].split("=")[0]
            close = difflib.get_close_matches(
                given, [o for o in self._option_string_actions if o.startswith("--")], n=1
            )
            self.error(
                f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else "")
            )
        return namespace, unknown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    run = commands.add_parser("run", help="spawn servers and workers on this machine and run SCRIPT on each")
    run.add_argument(
        "--workers",
        type=int,
        help="number of worker processes (required, except with --join: the workers that join, default 1)",
    )
    run.add_argument(
        "--join",
        metavar="RUN_DIR|HOST:PORT",
        default=None,
        help="start workers that join the running async ps job with this run directory or store "
        "address, with its settings",
    )
    for concern in JOB_CONCERNS:
        group = run.add_argument_group(f"job settings: {concern}")
        for s in settings.of(concern):
            if s in JOB_SETTINGS:
                kind = dict(action="store_const", const=True) if s.type is bool else dict(type=s.type)
                group.add_argument(s.option, dest=s.name, default=None, help=_help(s), **kind)
    run.add_argument("--master-port", type=int, default=0, help="port of the rendezvous store (0: a free one)")
    run.add_argument(RUN_DIR.option, default=None, help=_help(RUN_DIR))
    run.add_argument("--timeout", type=float, default=None, help="seconds before the whole job is killed")
    run.add_argument(
        "--link",
        default=None,
        help="emulate a network: each rank in its own network namespace "
        "behind a link of this tc rate (100mbit, 1gbit, 10gbit...); needs root and iproute2",
    )
    run.add_argument(
        "--server-link",
        default=None,
        help="with --link: the parameter servers' links at this rate instead (a slow server link)",
    )
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    compare = commands.add_parser(
        "compare",
        help="run SCRIPT under a grid of paradigms and write a report",
        description="Run SCRIPT under a grid of paradigms and write a report. Options "
        "go before SCRIPT; what follows SCRIPT goes to the script.",
    )
    compare.add_argument("--workers", type=int, default=2, help="worker processes of every run (default: %(default)s)")
    compare.add_argument(
        "--out",
        default="gradsync-report",
        help="report directory; one an earlier compare "
        "wrote is first renamed to OUT-<its time>, and compare says so (default: %(default)s)",
    )
    compare.add_argument(
        "--force",
        action="store_true",
        help="write the report into --out even when it holds files that gradsync compare did not write",
    )
    compare.add_argument(
        "--copy-limit-mb",
        type=float,
        default=500,
        help="each run works in its own copy of the "
        "directory compare is started in (not its .git, virtual environments or reports): refuse "
        "one whose copy would hold more MB than this (default: %(default)s)",
    )
    compare.add_argument(
        "--strategies",
        type=_names,
        default="allreduce,ps,hybrid,sharded",
        help="comma-separated, of allreduce, ps, hybrid, sharded; hybrid and sharded runs are "
        "skipped when the model has no embedding table to serve (default: %(default)s)",
    )
    compare.add_argument(
        "--servers",
        type=_counts,
        default="1,2",
        help="comma-separated server counts, for ps and hybrid (default: %(default)s)",
    )
    compare.add_argument(
        "--modes",
        type=_names,
        default="sync,async",
        help="comma-separated ps modes: sync, async, ssp (default: %(default)s)",
    )
    compare.add_argument(
        "--compressions",
        type=_names,
        default="none",
        help="comma-separated, of none, fp16, bf16, int8 (default: %(default)s)",
    )
    compare.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="each worker's first steps, left out of the per-step figures (default: %(default)s)",
    )
    compare.add_argument(
        "--timeout", type=float, default=600, help="seconds before one run is stopped (default: %(default)s)"
    )
    compare.add_argument(
        "--log-dir", default=None, help="also write TensorBoard scalars here, a directory per run (default: none)"
    )
    compare.add_argument(
        "--link",
        default=None,
        help="every run over an emulated network of this tc rate "
        "(100mbit, 1gbit, ...), as gradsync run --link; needs root and iproute2 (default: none, "
        "loopback)",
    )
    compare.add_argument(
        "--server-link",
        default=None,
        help="with --link: the parameter servers' links at "
        "this rate instead, in every run (a slow server link; default: none)",
    )
    compare.add_argument(
        STRAGGLER.option,
        default=None,
        metavar="W:F",
        help=f"{STRAGGLER.help} in every run, e.g. 1:2.0 (default: {STRAGGLER.env} if set)",
    )
    compare.add_argument(
        TIMELINE.option,
        action="store_true",
        help="record every step's timeline in every run (GRADSYNC_TIMELINE): report.json gives "
        "each run's median step, timeline.png draws it",
    )
    compare.add_argument(
        "--predict",
        action="store_true",
        help="fit the cost model on the sync runs and predict every paradigm from --workers up to "
        "W=1024 at this link: report.md ends with a verdict (which wins, the crossover, confidence)",
    )
    compare.set_defaults(
        flags={a.dest: a.option_strings[0] for a in compare._actions if a.option_strings and a.dest != "help"}
    )
    compare.add_argument("script", help="the training script (it reports with gradsync.log)")
    compare.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments for the script; write -- before them "
        "when the script takes an option that gradsync compare has too",
    )
    status = commands.add_parser("status", help="print a table of a running job's shards")
    status.add_argument("run_dir", help="the job's run directory (printed at start-up)")
    pull = commands.add_parser("pull", help="save a running job's current weights with torch.save")
    pull.add_argument("run_dir", help="the job's run directory (printed at start-up)")
    pull.add_argument("out", help="where to write the state dict (.pt)")
    for reaching in (status, pull):
        reaching.add_argument(
            TLS_CERT.option,
            metavar="PEM",
            default=None,
            help="the certificate of a job whose endpoints serve TLS (default: GRADSYNC_TLS_CERT "
            "if set, the one they serve with)",
        )
    return parser


def _check_join_flags(args: argparse.Namespace, chosen: dict) -> None:
    """Refuse job settings beside --join: a joining worker takes the running job's."""
    given = [s.option for s in JOB_SETTINGS if chosen[s.name] is not None]
    given += [
        flag
        for flag, value in (("--run-dir", args.run_dir), ("--link", args.link), ("--server-link", args.server_link))
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"--join takes the running job's settings, so {', '.join(given)} cannot be given with it: leave them out"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, as `main` reads it; raises ConfigError for what the parser cannot tell: `run` without
    --strategy and --workers (or --join), and under `compare` an option of compare's own written after the
    script, where it would go to the script (unless `--` right after the script says it is meant for it)."""
    args = _parser().parse_args(argv)
    if args.command == "run" and args.join is None and (args.strategy is None or args.workers is None):
        raise ConfigError("gradsync run needs --strategy and --workers (or --join RUN_DIR to join a running async job)")
    if args.command == "compare":
        kept = args.args[:1] == ["--"]  # argparse drops a leading -- from the script's arguments, or keeps it
        if kept or argv[len(argv) - len(args.args) - 1] == "--":
            args.args = args.args[kept:]
        elif misplaced := [a for a in args.args if a.split("=")[0] in args.flags.values()]:
            flag = misplaced[0].split("=")[0]
            raise ConfigError(
                f"{misplaced[0]} comes after the script {args.script}, so it would go to the script: "
                f"put gradsync compare's options before the script (gradsync compare {flag} ... "
                f"{args.script}), or, if the script takes {flag} itself, write -- after the script "
                f"(gradsync compare {args.script} -- {' '.join(args.args)})"
            )
    return args


def _options(args: argparse.Namespace) -> dict[str, str]:
    """Every option of `gradsync compare` with the value it ran with, by flag."""

    def text(v) -> str:
        if isinstance(v, list):
            return ",".join(map(str, v))
        return "on" if v is True else "off" if v is False else "none" if v is None else str(v)

    return {flag: text(getattr(args, dest)) for dest, flag in args.flags.items()}


def _start_jobs_from_here(args: argparse.Namespace) -> Callable[[], object] | None:
    """`run` and `compare`: check the script before the import of torch; then, unless GRADSYNC_RANK_START is exec,
    what imports torch and forks the ranks' fork server from this process (called once the job's arguments are
    checked), else None."""
    check_script(args.script)
    if RANK_START.read() != "fork":
        return None
    from gradsync.launcher.forked import rank_starter, single_threaded

    return functools.partial(rank_starter, from_here=single_threaded())


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    """`gradsync run`: the job's ranks on this machine, or workers that join a running job (--join)."""
    fork_server = _start_jobs_from_here(args)
    if fork_server is not None:
        fork_server()
    from gradsync.launcher.scripts import join_script, run_script  # torch: not for --help or a bad flag

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # stop every rank, then exit
        signal.signal(sig, _stop)
    chosen = job_settings(args)
    if args.join is not None:
        _check_join_flags(args, chosen)
        join_script(args.join, args.script, args.args, workers=args.workers or 1, timeout=args.timeout)
        return 0
    run_script(
        args.script,
        args.args,
        workers=args.workers,
        master_port=args.master_port,
        run_dir=args.run_dir,
        timeout=args.timeout,
        link=args.link,
        server_link=args.server_link,
        announce=True,
        **chosen,
    )
    return 0


def compare_options(args: argparse.Namespace, argv: list[str]) -> CompareOptions:
    """`gradsync compare`'s flags (`argv`, as `parse_args` read them into `args`) as the options of a comparison."""
    return CompareOptions(
        script=args.script,
        script_args=args.args,
        workers=args.workers,
        out_dir=args.out,
        strategies=args.strategies,
        servers=args.servers,
        modes=args.modes,
        compressions=args.compressions,
        timeout=args.timeout,
        warmup=args.warmup_steps,
        straggler=args.straggler,
        log_dir=args.log_dir,
        link=args.link,
        server_link=args.server_link,
        predict=args.predict,
        force=args.force,
        timeline=args.timeline,
        copy_limit_mb=args.copy_limit_mb,
        command=shlex.join(["gradsync", *argv]),
        flag_values=_options(args),
    )


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    """`gradsync compare`: the script under a grid of paradigms, and the report."""
    fork_server = _start_jobs_from_here(args)
    from gradsync.compare import compare

    report, runs = compare(compare_options(args, argv), checked=fork_server)
    print(f"report: {report} (plots beside it)")
    failed = [r["name"] for r in runs if "error" in r]
    if failed:
        print(
            f"gradsync: {len(failed)} of {len(runs)} runs failed ({', '.join(failed)}): their errors are in {report}",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_run_dir(run_dir: str) -> None:
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(
            f"no run directory {run_dir!r}: give the one gradsync run printed at "
            "start (a temporary one is removed when its job ends; --run-dir keeps it)"
        )


def _status(args: argparse.Namespace, argv: list[str]) -> int:
    """`gradsync status`: a table of the job's shards (of an ended job: its servers' final counters)."""
    from gradsync.cli.job_status import final_status_table, status_table
    from gradsync.transport.grpc.client import Client

    _check_run_dir(args.run_dir)
    final = final_status_table(args.run_dir)
    if final is not None:
        print(final)
        return 0
    with Client(args.run_dir, root_cert=args.tls_cert) as client:
        print(status_table(client))
    return 0


def _pull(args: argparse.Namespace, argv: list[str]) -> int:
    """`gradsync pull`: the job's current weights saved with torch.save."""
    from gradsync.cli.job_status import pull_to_file
    from gradsync.transport.grpc.client import Client

    _check_run_dir(args.run_dir)
    with Client(args.run_dir, root_cert=args.tls_cert) as client:
        versions = pull_to_file(client, args.out)
        print(f"wrote {args.out} (versions by shard: {versions})")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "run": _run,
    "compare": _compare,
    "status": _status,
    "pull": _pull,
}
"""Each subcommand's handler: it takes the parsed command line and the argv it came from, and returns the exit
status."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args, argv)
    except (
        ConfigError,
        FileNotFoundError,
        FileExistsError,
        ValueError,
        ConnectionError,
        TimeoutError,
        PermissionError,
        ImportError,
    ) as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"gradsync: {e}", file=sys.stderr)
        return 1
    except _Stopped as e:
        print(f"gradsync: stopped by {e}: every rank was stopped", file=sys.stderr)
        return 128 + e.signum
