"""The `gradsync` console command: `run` a job here; `status` and `pull` reach a running job over gRPC."""
from __future__ import annotations

import argparse
import sys

from gradsync.config import ConfigError
from gradsync.launch import JobFailed, run_script


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="spawn servers and workers on this machine and run SCRIPT on each")
    run.add_argument("--strategy", required=True, help="ps, allreduce or hybrid")
    run.add_argument("--workers", type=int, required=True, help="number of worker processes")
    run.add_argument("--servers", type=int, default=None, help="parameter servers (default 1 for ps, 0 for allreduce)")
    run.add_argument("--mode", default="sync", help="sync or async (ps only)")
    run.add_argument("--nonfinite", default="raise", help="raise or skip, for NaN/Inf gradients")
    run.add_argument("--compression", default="none", help="none, fp16, bf16 or int8 gradients on the wire")
    run.add_argument("--transport", default="rpc", help="rpc or grpc: how ps workers reach the servers")
    run.add_argument("--server-device", default="cpu", help="where servers keep their shard: cpu, cuda, cuda:N")
    run.add_argument("--master-port", type=int, default=0, help="port of the rendezvous store (0: a free one)")
    run.add_argument("--run-dir", default=None, help="directory for the job's files (default: a new temp dir)")
    run.add_argument("--timeout", type=float, default=None, help="seconds before the whole job is killed")
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    status = commands.add_parser("status", help="print a table of a running job's shards")
    status.add_argument("run_dir", help="the job's run directory (printed at start-up)")
    pull = commands.add_parser("pull", help="save a running job's current weights with torch.save")
    pull.add_argument("run_dir", help="the job's run directory (printed at start-up)")
    pull.add_argument("out", help="where to write the state dict (.pt)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            run_script(
                args.script, args.args, strategy=args.strategy, workers=args.workers, servers=args.servers,
                mode=args.mode, master_port=args.master_port, run_dir=args.run_dir, timeout=args.timeout,
                nonfinite=args.nonfinite, compression=args.compression, server_device=args.server_device,
                transport=args.transport,
            )
        else:
            from gradsync.client import Client, pull_to_file, status_table

            with Client(args.run_dir) as client:
                if args.command == "status":
                    print(status_table(client))
                else:
                    versions = pull_to_file(client, args.out)
                    print(f"wrote {args.out} (versions by shard: {versions})")
    except (ConfigError, FileNotFoundError, ValueError, ConnectionError, TimeoutError, PermissionError) as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"gradsync: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
